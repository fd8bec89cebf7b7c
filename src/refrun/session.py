"""The run session: one MLflow run, recorded without ever slowing or breaking training.

``start_run`` returns a :class:`RunSession`, a context manager over one MLflow run::

    with refrun.start_run(workload="digits-mlp", role="reference", hardware="cpu",
                          backend="torch", seed=0, chips=1, global_batch=64) as run:
        for step in range(steps):
            loss = train_step(...)
            run.log(step, loss=loss)          # Python numbers; probes handle device values
        run.log_eval(step, accuracy=acc)

Accepting a point costs a few hundred nanoseconds on the training thread: it is appended
to a bounded in-memory queue and nothing else.  A background writer spools it to disk and
delivers it to the store (see :mod:`refrun.writer`, :mod:`refrun.spool`).  Bad input
(a non-finite value, a step that repeats or goes backwards, a bad metric name, a log
after the run ended) is counted and recorded as a warning, never raised into the loop.

The run's final status says what happened: FINISHED, FAILED (an exception) or KILLED
(KeyboardInterrupt / SystemExit with a non-zero code).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import math
import numbers
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from refrun import forwarder, identity, schema
from refrun._version import __version__
from refrun.curves import seal
from refrun.delivery import client_for, ensure_run, finalize
from refrun.errors import RefrunInputError
from refrun.spool import Spool, default_root
from refrun.tracking import resolve_tracking_uri
from refrun.writer import BackgroundWriter

log = logging.getLogger("refrun")

# MLflow's metric-name rule: alphanumerics, underscores, dashes, periods, spaces, slashes.
_VALID_KEY = re.compile(r"^[A-Za-z0-9_\-. /:]{1,250}$")

# refrun retries delivery itself; MLflow's own default (7 retries, exponential back-off,
# 120 s timeout) would stall start_run for minutes on a dead server.  Only set when the
# user has not chosen values.
_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}


@dataclass
class _StepStats:
    """Per-metric bookkeeping of steps, kept on the training thread (cheap dict updates)."""

    count: int = 0
    first: int | None = None
    last: int | None = None
    repeated: int = 0
    backwards: int = 0
    nonfinite: int = 0


@dataclass
class RunSession:
    """One recorded run.  Create with :func:`start_run`; use as a context manager."""

    spool: Spool
    tracking_uri: str
    workload: str
    role: str
    flush_interval_s: float = 1.0
    mlflow_every: int = 1
    close_timeout_s: float = 120.0
    _writer: BackgroundWriter = field(init=False, repr=False)
    _stats: dict[str, _StepStats] = field(default_factory=dict, repr=False)
    _valid_keys: set[str] = field(default_factory=set, repr=False)
    _warnings: list[dict[str, Any]] = field(default_factory=list, repr=False)
    _warned: set[str] = field(default_factory=set, repr=False)
    _lock_fd: int | None = field(default=None, repr=False)
    _forwarder: subprocess.Popen | None = field(default=None, repr=False)
    _run_id: str | None = None
    _close_hooks: list[Callable[[], None]] = field(default_factory=list, repr=False)
    _closed: bool = False
    _dropped: int = 0
    _status: str | None = None
    _wlock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    # --- identity -----------------------------------------------------------
    @property
    def local_id(self) -> str:
        """Id of the local spool; stable even before the MLflow run exists."""
        return self.spool.local_id

    @property
    def run_id(self) -> str | None:
        """The MLflow run id, or None while the store has not been reached yet."""
        if self._run_id is None and self.spool.path.exists():
            with contextlib.suppress(OSError, ValueError):
                self._run_id = self.spool.read_meta().get("run_id")
        return self._run_id

    @property
    def tags(self) -> dict[str, str]:
        """The run's tags as recorded so far (identity, user tags, probe tags)."""
        with contextlib.suppress(OSError, ValueError):
            return dict(self.spool.read_meta().get("tags", {}))
        return {}

    @property
    def status(self) -> str | None:
        return self._status

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def warnings(self) -> list[dict[str, Any]]:
        """Warnings recorded so far (``{"time", "step", "message"}``), oldest first."""
        with self._wlock:
            return list(self._warnings)

    @property
    def points_dropped(self) -> int:
        return self._dropped

    # --- logging (training thread) --------------------------------------------
    def log_metrics(
        self, step: int, metrics: Mapping[str, Any], timestamp_ms: int | None = None
    ) -> None:
        """Accept ``metrics`` (name -> Python/NumPy real number) for training ``step``.

        Never blocks and never raises.  Device values (torch/jax arrays) are not accepted
        here because reading them would synchronise the host; use a framework probe
        (``refrun.torch.instrument`` ...) which fetches them after the step completes.
        """
        if self._closed:
            self.warn_once("closed", f"metrics logged after the run ended were ignored: "
                           f"{sorted(metrics)[:5]}", step)
            return
        try:
            self._accept(step, metrics, timestamp_ms)
        except Exception as exc:  # logging must never crash the loop
            self.warn_once(f"accept:{type(exc).__name__}", f"point not recorded: {exc}", step)

    def log(self, step: int, **metrics: Any) -> None:
        """Keyword form of :meth:`log_metrics`: ``run.log(step, loss=0.3)``."""
        self.log_metrics(step, metrics)

    def log_eval(self, step: int, **metrics: Any) -> None:
        """Evaluation metrics at ``step``, recorded as ``eval/<name>`` (never thinned)."""
        self.log_metrics(step, {schema.EVAL_PREFIX + k: v for k, v in metrics.items()})

    def _accept(self, step: Any, metrics: Mapping[str, Any], timestamp_ms: int | None) -> None:
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            self.warn_once("step-type", f"step must be an int, got {type(step).__name__}; "
                           "points not recorded", None)
            return
        step = int(step)
        ts = time.time_ns() // 1_000_000 if timestamp_ms is None else int(timestamp_ms)
        writer = self._writer
        q = writer.queue
        for key, value in metrics.items():
            if key not in self._valid_keys:
                if not isinstance(key, str) or not _VALID_KEY.match(key):
                    self.warn_once(f"key:{key!r}", f"invalid metric name {key!r} (MLflow "
                                   "allows letters, digits, _ - . / space); ignored", step)
                    continue
                self._valid_keys.add(key)
            # type() first: the numbers.Real ABC check is the slowest part of accepting.
            if type(value) is not float and (isinstance(value, bool)
                                             or not isinstance(value, numbers.Real)):
                self.warn_once(f"type:{key}", f"metric {key!r}: value of type "
                               f"{type(value).__name__} not accepted by the session (it could "
                               "force a device sync); use a framework probe", step)
                continue
            v = float(value)
            st = self._stats.get(key)
            if st is None:
                st = self._stats[key] = _StepStats(first=step)
            elif step == st.last:
                st.repeated += 1
                self.warn_once(f"repeat:{key}", f"metric {key!r}: step {step} repeated", step)
            elif st.last is not None and step < st.last:
                st.backwards += 1
                self.warn_once(f"back:{key}", f"metric {key!r}: step went backwards "
                               f"({st.last} -> {step})", step)
            if not math.isfinite(v):
                st.nonfinite += 1
                self.warn_once(f"nonfinite:{key}", f"metric {key!r}: non-finite value {v} at "
                               f"step {step} (recorded as is)", step)
            st.count += 1
            st.last = step
            if len(q) >= writer.max_queue:
                self._dropped += 1
                self.warn_once("dropped", "in-memory queue full: points are being dropped "
                               "(the store or disk cannot keep up)", step)
                continue
            q.append((key, step, ts, v))

    def warn_once(self, key: str, message: str, step: int | None = None) -> None:
        """Record a warning the first time ``key`` occurs (later ones only count)."""
        with self._wlock:
            if key in self._warned:
                return
            self._warned.add(key)
            self._warnings.append({"time_ms": time.time_ns() // 1_000_000, "step": step,
                                   "message": message})
        log.warning("refrun: %s", message)

    # --- tags, params, artifacts ---------------------------------------------
    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Set run tags (delivered by the writer; never blocks on the store)."""
        self._update_meta(tags=tags)

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log params (immutable in MLflow: a second, different value is an error there)."""
        self._update_meta(params=params)

    def _update_meta(self, tags: Mapping[str, Any] | None = None,
                     params: Mapping[str, Any] | None = None) -> None:
        def change(meta: dict[str, Any]) -> None:
            meta["tags"].update({k: _tag_value(v) for k, v in (tags or {}).items()})
            meta["params"].update({k: _tag_value(v)[:6000] for k, v in (params or {}).items()})
            meta["tags_version"] = meta.get("tags_version", 0) + 1

        try:
            self.spool.update_meta(change)
        except Exception as exc:
            self.warn_once("meta", f"tags/params not recorded: {exc}")

    def log_json(self, name: str, obj: Any) -> None:
        """Write ``obj`` as JSON to artifact ``name`` (uploaded with the run's artifacts)."""
        try:
            path = self.spool.artifacts_dir / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(obj, indent=1, default=str), encoding="utf-8")
        except Exception as exc:
            self.warn_once(f"artifact:{name}", f"artifact {name} not written: {exc}")

    def log_artifact(self, local_path: str | os.PathLike[str], name: str | None = None) -> None:
        """Copy a file into the run's artifacts (uploaded by the writer at the end)."""
        src = Path(local_path)
        dest = self.spool.artifacts_dir / (name or src.name)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)

    def add_close_hook(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` when the run ends, before the final flush (probes close here)."""
        self._close_hooks.append(hook)

    def step_stats(self) -> dict[str, _StepStats]:
        """Per-metric step bookkeeping so far (count, first, last, repeated, backwards)."""
        return dict(self._stats)

    # --- ending ---------------------------------------------------------------
    def __enter__(self) -> RunSession:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        if et is None:
            status = "FINISHED"
        elif issubclass(et, KeyboardInterrupt) or (
            issubclass(et, SystemExit) and ev is not None and ev.code not in (0, None)
        ):
            status = "KILLED"
        elif issubclass(et, SystemExit):
            status = "FINISHED"
        else:
            status = "FAILED"
            if ev is not None:
                self.warn_once("exception", f"run failed: {type(ev).__name__}: {ev}")
        self.close(status)

    def close(self, status: str = "FINISHED") -> bool:
        """End the run: spool everything, write the curves artifact, deliver, set status.

        Returns True when everything reached the store; False leaves the spool for
        ``refrun sync`` (a warning says so).  Safe to call twice.
        """
        if self._closed:
            return True
        for hook in self._close_hooks:  # probes: resolve pending values while we accept
            try:
                hook()
            except Exception as exc:
                self.warn_once(f"close-hook:{exc!r}"[:60], f"closing a probe failed: {exc}")
        self._closed = True
        self._status = status
        with contextlib.suppress(Exception):
            atexit.unregister(self._atexit)
        end_ms = time.time_ns() // 1_000_000
        self._writer.stop(timeout=self.close_timeout_s)
        try:
            self._write_summary(end_ms, status)
        except Exception as exc:
            self.warn_once("summary", f"end-of-run summary not written: {exc}")
        fwd = self._forwarder
        if fwd is not None and fwd.poll() is None:
            ok = self._close_through_forwarder(fwd)
        else:
            ok = False
            try:
                ok = finalize(self.spool)
            except Exception as exc:
                self._undelivered(f"{type(exc).__name__}: {exc}")
            finally:
                self._release_lock()
        if ok:
            self._remove_spool()
        return ok

    def _remove_spool(self) -> None:
        # Delivered: the store and the curves artifact hold everything now.  Keep it with
        # REFRUN_KEEP_SPOOL=1 (debugging).
        _ = self.run_id  # cache it before meta.json goes
        if os.environ.get("REFRUN_KEEP_SPOOL", "") not in ("", "0"):
            return
        shutil.rmtree(self.spool.path, ignore_errors=True)

    def _close_through_forwarder(self, fwd: subprocess.Popen) -> bool:
        # The delivery process finishes the spool once it sees end-of-file on its stdin and
        # can take the session lock; waiting for it is what "flushed at exit" means.
        self._release_lock()
        with contextlib.suppress(OSError):
            fwd.stdin.write(b"close\n")
            fwd.stdin.flush()
            fwd.stdin.close()
        try:
            rc = fwd.wait(timeout=self.close_timeout_s)
        except subprocess.TimeoutExpired:
            self._undelivered(f"delivery still running after {self.close_timeout_s:.0f} s "
                              f"(pid {fwd.pid}); it goes on in the background")
            return False
        if rc != 0:
            self._undelivered(f"delivery process exited with {rc} "
                              f"(see {self.spool.path / 'forwarder.log'})")
        return rc == 0

    def _undelivered(self, why: str) -> None:
        log.warning("refrun: run %s not fully delivered (%s); its points are safe in %s; "
                    "deliver them with `refrun sync`", self.local_id, why, self.spool.path)

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            Spool.unlock(self._lock_fd)
            self._lock_fd = None

    def _atexit(self) -> None:
        self.close("FINISHED")

    def _write_summary(self, end_ms: int, status: str) -> None:
        self.log_json(schema.ARTIFACT_WARNINGS, {
            "warnings": self.warnings,
            "metrics": {k: vars(v) for k, v in self._stats.items()},
        })
        seal(self.spool, status, end_ms=end_ms, extra_tags={
            schema.TAG_DROPPED: str(self._dropped),
            schema.TAG_WARNINGS: str(len(self._warnings)),
        })


def _tag_value(v: Any) -> str:
    s = v if isinstance(v, str) else json.dumps(v, default=str) if isinstance(
        v, dict | list | tuple) else str(v)
    return s[:5000]


def start_run(
    workload: str,
    role: str,
    *,
    hardware: str | None = None,
    backend: str | None = None,
    seed: int | None = None,
    chips: int | None = None,
    global_batch: int | None = None,
    params: Mapping[str, Any] | None = None,
    tags: Mapping[str, Any] | None = None,
    run_name: str | None = None,
    experiment: str | None = None,
    tracking_uri: str | None = None,
    planned_steps: int | None = None,
    spool_dir: str | os.PathLike[str] | None = None,
    flush_interval_s: float = 1.0,
    mlflow_every: int = 1,
    max_queue: int = 2_000_000,
    snapshot_environment: bool = True,
    delivery: str | None = None,
) -> RunSession:
    """Start recording one training run into MLflow and return its :class:`RunSession`.

    Identity (workload, role, hardware, backend, seed, chips, global_batch, framework
    versions, device, git commit) is written as ``refrun.*`` tags (see :mod:`refrun.schema`).
    The experiment defaults to the workload name.  If the store cannot be reached the run
    still starts: points are spooled under ``spool_dir`` (default ``$REFRUN_SPOOL_DIR`` or
    ``./.refrun/spool``) and delivered when it comes back, or by ``refrun sync``.

    ``mlflow_every``: send only every n-th step of per-step metrics to MLflow (evaluation
    metrics and the Parquet curves artifact are never thinned).
    ``flush_interval_s``: how often queued points reach the spool file; a SIGKILL loses
    at most this much.
    ``delivery``: ``"process"`` (default; ``$REFRUN_DELIVERY`` overrides) delivers to MLflow
    from a separate process so that MLflow's client never holds this process's GIL;
    ``"thread"`` delivers from the background thread (for short bursts such as imports).
    ``snapshot_environment``: describe this process (framework versions, device, host, git
    commit, installed packages); False for runs recorded elsewhere, such as imports.

    Raises :class:`RefrunInputError` for a missing workload or an unknown role.
    """
    if not workload or not isinstance(workload, str):
        raise RefrunInputError("workload: a non-empty name is required")
    role, backend, hardware = identity.validate_identity(role, backend, hardware)
    for name, val in (("seed", seed), ("chips", chips), ("global_batch", global_batch),
                      ("planned_steps", planned_steps), ("mlflow_every", mlflow_every)):
        if val is not None and (isinstance(val, bool) or not isinstance(val, numbers.Integral)):
            raise RefrunInputError(f"{name}: expected an integer, got {val!r}")
    if flush_interval_s <= 0:
        raise RefrunInputError("flush_interval_s: must be > 0")
    delivery = delivery or os.environ.get("REFRUN_DELIVERY") or "process"
    if delivery not in ("process", "thread"):
        raise RefrunInputError(f"delivery: {delivery!r} is not 'process' or 'thread'")
    uri = resolve_tracking_uri(tracking_uri)
    for k, v in _HTTP_DEFAULTS.items():
        os.environ.setdefault(k, v)

    all_tags = _identity_tags(workload, role, hardware, backend, seed, chips, global_batch,
                              planned_steps, snapshot_environment)
    all_tags.update({k: _tag_value(v) for k, v in (tags or {}).items()})
    local_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:12]
    all_tags[schema.TAG_LOCAL_ID] = local_id
    meta = {
        "local_id": local_id,
        "tracking_uri": uri,
        "experiment": experiment or workload,
        "run_name": run_name,
        "tags": all_tags,
        "params": {k: _tag_value(v)[:6000] for k, v in (params or {}).items()},
        "tags_version": 1,
        "start_ms": time.time_ns() // 1_000_000,
        "status": "RUNNING",
        "mlflow_every": mlflow_every,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "run_id": None,
    }
    root = Path(spool_dir).absolute() if spool_dir else default_root()
    spool = Spool.create(root, local_id, meta)
    session = RunSession(spool=spool, tracking_uri=uri, workload=workload, role=role,
                         flush_interval_s=flush_interval_s, mlflow_every=mlflow_every)
    session._lock_fd = spool.try_lock()
    if snapshot_environment:
        session.log_json(schema.ARTIFACT_ENVIRONMENT, identity.environment_snapshot())
    # Create the MLflow run now when the store answers, so run_id is known; otherwise the
    # writer keeps trying in the background and training starts regardless.
    try:
        session._run_id = ensure_run(spool, client_for(meta))
    except Exception as exc:
        session.warn_once("offline-start", f"tracking store {uri} unreachable at start "
                          f"({type(exc).__name__}); recording to {spool.path}")
    session._writer = BackgroundWriter(
        spool, flush_interval_s=flush_interval_s, max_queue=max_queue,
        on_warning=lambda m: session.warn_once(m[:60], m),
        deliver_inline=delivery == "thread",
    )
    if delivery == "process":
        session._forwarder = forwarder.spawn(spool, flush_interval_s)
        if session._forwarder is None:
            session._writer.deliver_inline()
    session._writer.start()
    atexit.register(session._atexit)
    return session


def _identity_tags(workload: str, role: str, hardware: str | None, backend: str | None,
                   seed: int | None, chips: int | None, global_batch: int | None,
                   planned_steps: int | None, this_process: bool) -> dict[str, str]:
    tags = {
        schema.TAG_SCHEMA: schema.SCHEMA_VERSION,
        schema.TAG_WORKLOAD: workload,
        schema.TAG_ROLE: role,
        schema.TAG_VERSION: __version__,
        "mlflow.source.name": "refrun",
    }
    optional = {
        schema.TAG_HARDWARE: hardware, schema.TAG_BACKEND: backend, schema.TAG_SEED: seed,
        schema.TAG_CHIPS: chips, schema.TAG_GLOBAL_BATCH: global_batch,
        schema.TAG_PLANNED_STEPS: planned_steps,
    }
    tags.update({k: str(v) for k, v in optional.items() if v is not None})
    if not this_process:  # e.g. an imported run: this machine did not run it
        return tags
    tags[schema.TAG_DEVICE] = identity.device_description()
    tags[schema.TAG_HOST] = socket.gethostname()
    tags.update({schema.TAG_FW_PREFIX + k: v for k, v in identity.framework_versions().items()})
    git = identity.git_state()
    if git:
        tags[schema.TAG_GIT_COMMIT] = git["commit"]
        tags[schema.TAG_GIT_DIRTY] = git["dirty"]
    return tags


__all__ = ["RefrunInputError", "RunSession", "finalize", "start_run"]
