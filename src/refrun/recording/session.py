"""The run session: one MLflow run, recorded without ever slowing or breaking training.

``start_run`` returns a :class:`RunSession`, a context manager over one MLflow run::

    with refrun.start_run(workload="digits-mlp", role="reference", hardware="cpu",
                          backend="torch", seed=0, chips=1, global_batch=64) as run:
        for step in range(steps):
            loss = train_step(...)
            run.log(step, loss=loss)          # Python numbers; probes handle device values
        run.log_eval(step, accuracy=acc)

The session only accepts points and warnings and manages the run's life cycle.  Accepting
a point costs a few hundred nanoseconds on the training thread: it is checked (MLflow's
own name and step rules, :mod:`refrun.keys`) and appended to a bounded in-memory queue.
The spool writer (:mod:`refrun.recording.writer`) puts it on disk and the delivery process
(:mod:`refrun.recording.process`) into MLflow.  Bad input (a name or step MLflow would
refuse, a non-finite value, a step that repeats or goes backwards, a log after the run
ended) is counted and recorded as a warning, never raised into the loop.

The run's final status says what happened: FINISHED, FAILED (an exception) or KILLED
(KeyboardInterrupt / SystemExit with a non-zero code).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import math
import numbers
import operator
import os
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from refrun import identity, limits, schema
from refrun.errors import RefrunStoreError
from refrun.identity import RunIdentity
from refrun.keys import key_problem, step_problem
from refrun.limits import STEP_MAX, STEP_MIN
from refrun.recording import delivery, process
from refrun.recording.config import RecordingOptions, RunConfig, from_keywords
from refrun.recording.delivery import SESSION_LOCK
from refrun.recording.spool import PointBlock, RunStatus, Spool, SpoolMeta, disk_full, unlock
from refrun.recording.writer import SpoolWriter
from refrun.settings import settings
from refrun.store import mlflow_ui
from refrun.store.client import bound_store_waits
from refrun.store.client import client as store_client
from refrun.store.uri import database_server, local_store

_INT_ONLY, _FLOAT_ONLY = {int}, {float}  # the one value type of a fast block's steps, values
log = logging.getLogger("refrun")

# MLflow's limits on a tag and a param value (characters), declared in refrun.limits.
TAG_VALUE_MAX = limits.TAG_VALUE_LENGTH
PARAM_VALUE_MAX = limits.PARAM_VALUE_LENGTH
# Distinct (name, reason) refusals listed in warnings.json; further ones are only counted.
MAX_REFUSAL_ENTRIES = 100


@dataclass(slots=True)
class StepStats:
    """Per-metric bookkeeping of steps, kept on the training thread (cheap dict updates)."""

    count: int = 0
    first: int | None = None
    last: int | None = None
    repeated: int = 0
    backwards: int = 0
    nonfinite: int = 0


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class RunSession:
    """One recorded run.  Create with :func:`start_run`; use as a context manager."""

    def __init__(self, config: RunConfig, spool: Spool, lock_fd: int | None) -> None:
        self.config = config
        self.spool = spool
        self.close_timeout_s = config.options.close_timeout_s
        self._lock_fd = lock_fd
        self._stats: dict[str, StepStats] = {}
        self._valid_keys: set[str] = set()
        self._warnings: list[dict[str, Any]] = []
        self._warned: set[str] = set()
        self._wlock = threading.Lock()
        self._close_hooks: list[Callable[[], None]] = []
        self._run_id: str | None = None
        self._closed = False
        self._status: RunStatus | None = None
        self._end_ms = 0
        self._close_ms: int | None = None  # when close() was called: the workload's end
        self._early_close_s = 0.0  # refrun's own close before it (add_own_close_s)
        self._dropped = 0  # queue full
        self._refused = 0  # bad name/key/step/value/param at entry
        # What was refused, by (name, reason): first step and count (refrun/warnings.json).
        self._refusals: dict[tuple[str, str], dict[str, Any]] = {}
        self._truncated = 0  # tag/param values cut to MLflow's limit
        meta = spool.read_meta()
        self._params: dict[str, str] = dict(meta.params)  # as first logged
        # The identity tags as start_run set them: later values that differ are refused.
        self._identity: dict[str, str] = {k: v for k, v in meta.tags.items()
                                          if k in schema.IDENTITY_TAGS}
        self._writer = SpoolWriter(spool, flush_interval_s=config.options.flush_interval_s,
                                   max_queue=config.options.max_queue, on_warning=self.warn_once,
                                   deliver_inline=config.options.delivery == "thread")
        self._process: subprocess.Popen | None = None

    # --- identity -----------------------------------------------------------
    @property
    def tracking_uri(self) -> str:
        return self.config.options.tracking_uri

    @property
    def workload(self) -> str:
        return self.config.identity.workload

    @property
    def role(self) -> str:
        return self.config.identity.role

    @property
    def local_id(self) -> str:
        """Id of the local spool; stable even before the MLflow run exists."""
        return self.spool.local_id

    @property
    def run_id(self) -> str | None:
        """The MLflow run id, or None while the store has not been reached yet."""
        if self._run_id is None:
            with contextlib.suppress(OSError, ValueError):
                self._run_id = self.spool.read_meta().run_id
        return self._run_id

    @property
    def tags(self) -> dict[str, str]:
        """The run's tags as recorded so far (identity, user tags, probe tags)."""
        with contextlib.suppress(OSError, ValueError):
            meta = self.spool.read_meta()
            for change in list(self._writer.meta_changes):  # set, not yet written
                change(meta)
            return dict(meta.tags)
        return {}

    @property
    def status(self) -> RunStatus | None:
        return self._status

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def warnings(self) -> list[dict[str, Any]]:
        """Warnings recorded so far (``{"time_ms", "step", "message"}``), oldest first."""
        with self._wlock:
            return list(self._warnings)

    @property
    def points_dropped(self) -> int:
        """Points accepted but not kept (in-memory queue full, or the spool disk full)."""
        return self._dropped + self._writer.points_dropped

    @property
    def points_refused(self) -> int:
        """Points, tags and params refused at entry (a name, key or step MLflow refuses)."""
        return self._refused

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
                           f"{sorted(map(str, metrics))[:5]}", None)
            return
        try:
            self._accept(step, metrics, timestamp_ms)
        except Exception as exc:  # logging must never crash the loop
            self.warn_once(f"accept:{type(exc).__name__}", f"point not recorded: {exc}", None)

    def log_columns(self, steps: Sequence[int], columns: Mapping[str, Sequence[Any]],
                    timestamps_ms: Sequence[int] | None = None) -> None:
        """Accept a block of steps at once: ``columns[name][i]`` is metric ``name`` at
        training step ``steps[i]`` (logged at ``timestamps_ms[i]``, default now).

        The same as ``log_metrics(steps[i], {name: columns[name][i], ...},
        timestamps_ms[i])`` for each ``i`` in order -- every check, count, warning and the
        points' order in the spool -- at a fraction of the training thread's cost per point
        when the steps increase and the values are floats (a probe's per-step counters,
        handed over a flush interval at a time).  Never blocks and never raises.
        """
        if self._closed:
            self.warn_once("closed", f"metrics logged after the run ended were ignored: "
                           f"{sorted(map(str, columns))[:5]}", None)
            return
        try:
            self._accept_columns(steps, columns, timestamps_ms)
        except Exception as exc:  # logging must never crash the loop
            self.warn_once(f"accept:{type(exc).__name__}", f"point not recorded: {exc}", None)

    def log(self, step: int, **metrics: Any) -> None:
        """Keyword form of :meth:`log_metrics`: ``run.log(step, loss=0.3)``."""
        self.log_metrics(step, metrics)

    def log_eval(self, step: int, **metrics: Any) -> None:
        """Evaluation metrics at ``step``, recorded as ``eval/<name>`` (always all in MLflow)."""
        self.log_metrics(step, {schema.EVAL_PREFIX + k: v for k, v in metrics.items()})

    def _refuse(self, key: str, reason: str, n: int, step: int | None,
                name: str = "", kind: str = "") -> None:
        """Count ``n`` refused items (in ``refrun.refused``), name them (``name``: the
        metric, tag or param; ``kind``: the reason's short form) in warnings.json's
        ``refused`` list, and warn once per ``key``.  Refusals are rare: off the fast path."""
        self._refused += n
        slot = (name, kind or reason)
        entry = self._refusals.get(slot)
        if entry is None and len(self._refusals) < MAX_REFUSAL_ENTRIES:
            entry = self._refusals[slot] = {"name": name, "reason": reason,
                                            "first_step": step, "count": 0}
        if entry is not None:
            entry["count"] += n
        self.warn_once(key, f"{reason}; not recorded (counted in {schema.TAG_REFUSED})", step)

    def refuse(self, name: str, reason: str, step: int | None = None, kind: str = "",
               n: int = 1) -> None:
        """Count ``n`` values refused outside the session (a probe that cannot read or
        record a logged value): in ``refrun.refused``, named in warnings.json, warned once
        per (name, kind).  Never raises."""
        with contextlib.suppress(Exception):  # accounting must never break the loop
            self._refuse(f"refused:{kind}:{name}"[:120], reason, n, step,
                         str(name)[:limits.KEY_LENGTH], kind)

    def drop(self, name: str, message: str, step: int | None = None, n: int = 1) -> None:
        """Count ``n`` values a probe took and could not keep (a device buffer deleted
        before it was read) in ``refrun.dropped``, which readers judge (a run missing
        points is incomplete, never passed), and warn once per ``name`` with ``message``.
        Never raises."""
        with contextlib.suppress(Exception):  # accounting must never break the loop
            self._dropped += n
            self.warn_once(f"dropped:{name}"[:120], message, step)

    def _accept(self, step: Any, metrics: Mapping[str, Any], timestamp_ms: int | None) -> None:
        # The training thread's per-point cost: plain-int steps and float values skip the
        # general checks; a metric name is checked once, then it is a set lookup.
        if type(step) is not int or not STEP_MIN <= step <= STEP_MAX:
            problem = step_problem(step)
            if problem is not None:
                self._refuse(f"step:{type(step).__name__}", problem, len(metrics), None,
                             ",".join(sorted(map(str, metrics)))[:200], "step")
                return
            step = int(step)
        ts = _now_ms() if timestamp_ms is None else int(timestamp_ms)
        q = self._writer.queue
        # what the queue's blocks hold beyond one point each, for the bound below
        max_queue = self._writer.max_queue - (self._writer.queued_points() - len(q))
        valid_keys = self._valid_keys
        stats = self._stats
        isfinite = math.isfinite
        for key, value in metrics.items():
            if key not in valid_keys:
                problem = key_problem(key)
                if problem is not None:
                    self._refuse(f"key:{key!r}"[:80], problem, 1, step,
                                 str(key)[:limits.KEY_LENGTH], "name")
                    continue
                valid_keys.add(key)
            # type() first: the numbers.Real ABC check is the slowest part of accepting.
            if type(value) is float:
                v = value
            elif isinstance(value, bool) or not isinstance(value, numbers.Real):
                kind = type(value).__name__
                self._refuse(f"type:{key}:{kind}", f"metric {key!r} at step {step}: value of "
                             f"type {kind} not accepted by the session (only real numbers; "
                             "a device value could force a sync: use a framework probe)",
                             1, step, key, f"type {kind}")
                continue
            else:
                try:
                    v = float(value)
                except OverflowError:  # an int beyond float's range, e.g. 10**400
                    self._refuse(f"overflow:{key}", f"metric {key!r} at step {step}: value "
                                 f"{type(value).__name__} too large for a float "
                                 f"({len(str(abs(int(value))))} digits)", 1, step, key,
                                 "too large for a float")
                    continue
            st = stats.get(key)
            if st is None:
                st = stats[key] = StepStats(first=step)
            elif step <= st.last:  # type: ignore[operator]  # set on every accepted point
                if step == st.last:
                    st.repeated += 1
                    self.warn_once(f"repeat:{key}", f"metric {key!r}: step {step} repeated",
                                   step)
                else:
                    st.backwards += 1
                    self.warn_once(f"back:{key}", f"metric {key!r}: step went backwards "
                                   f"({st.last} -> {step})", step)
            if not isfinite(v):
                st.nonfinite += 1
                self.warn_once(f"nonfinite:{key}", f"metric {key!r}: non-finite value {v} at "
                               f"step {step} (recorded as is)", step)
            st.count += 1
            st.last = step
            if len(q) >= max_queue:
                self._dropped += 1
                self.warn_once("dropped", "in-memory queue full: points are being dropped "
                               "(the store or disk cannot keep up)", step)
                continue
            q.append((key, step, ts, v))

    def _accept_columns(self, steps: Sequence[int], columns: Mapping[str, Sequence[Any]],
                        timestamps_ms: Sequence[int] | None) -> None:
        n = len(steps)
        steps = list(steps)
        stamps = [_now_ms()] * n if timestamps_ms is None else list(map(int, timestamps_ms))
        if len(stamps) != n:
            raise ValueError(f"{len(stamps)} timestamps for {n} steps")
        cols: dict[str, list[Any]] = {}
        for key, col in columns.items():
            values = list(col)
            if len(values) == n:
                cols[key] = values
            else:  # which step a value belongs to is unknown: none is recorded
                self._refuse(f"columns:{key!r}"[:80], f"metric {key!r}: {len(values)} values "
                             f"for {n} steps", len(values), steps[0] if steps else None,
                             str(key)[:limits.KEY_LENGTH], "column length")
        if n == 0 or not cols:
            return
        if not self._columns_fast(steps, cols):
            # Point by point, with exactly log_metrics' outcome.
            for i, (step, ts) in enumerate(zip(steps, stamps, strict=True)):
                self._accept(step, {k: c[i] for k, c in cols.items()}, ts)
            return
        isfinite = math.isfinite
        for key, values in cols.items():
            st = self._stats.get(key)
            if st is None:
                st = self._stats[key] = StepStats(first=steps[0])
            if not all(map(isfinite, values)):
                for step, v in zip(steps, values, strict=True):
                    if not isfinite(v):
                        st.nonfinite += 1
                        self.warn_once(f"nonfinite:{key}", f"metric {key!r}: non-finite value "
                                       f"{v} at step {step} (recorded as is)", step)
            st.count += n
            st.last = steps[-1]
        # One object for the block; written row by row, in the order log_metrics would
        # have queued the points.
        self._writer.put_block(PointBlock(list(cols), steps, stamps, list(cols.values())))

    def _columns_fast(self, steps: list[Any], cols: dict[str, list[Any]]) -> bool:
        """Whether a block can be accepted column by column: int steps in range that
        increase past every column's last step, valid names, float values, and room in
        the queue for all of it (the point-by-point path counts what it cannot keep)."""
        # C-level checks (map, set): a generator resumed once per value cost the training
        # thread ~15 Python calls a step of a PyTorch/XLA loop (docs/xla.md, 2026-12-06).
        if not (set(map(type, steps)) == _INT_ONLY and steps[0] >= STEP_MIN
                and steps[-1] <= STEP_MAX and all(map(operator.lt, steps, steps[1:]))
                and self._writer.queued_points() + len(steps) * len(cols)
                <= self._writer.max_queue):
            return False
        for key, values in cols.items():
            if key not in self._valid_keys:
                if key_problem(key) is not None:
                    return False
                self._valid_keys.add(key)
            st = self._stats.get(key)
            if (st is not None and steps[0] <= st.last) \
                    or set(map(type, values)) != _FLOAT_ONLY:  # type: ignore[operator]
                return False
        return True

    def warn_once(self, key: str, message: str, step: int | None = None) -> None:
        """Record a warning the first time ``key`` occurs (later ones only count); it goes
        to the run's ``refrun/warnings.json`` and once to stderr (logger ``refrun``)."""
        with self._wlock:
            if key in self._warned:
                return
            self._warned.add(key)
            self._warnings.append({"time_ms": _now_ms(), "step": step, "message": message})
        log.warning("%s", message)  # the logger is "refrun": no second prefix

    # --- tags, params, artifacts ---------------------------------------------
    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Set run tags (delivered in the background; never blocks on the store).

        Identity tags (:data:`refrun.schema.IDENTITY_TAGS`: role, workload, hardware ...)
        keep the value start_run gave them: a different one is refused (warned, counted in
        ``refrun.refused``), the same one is a no-op, and one not set at start takes its
        first value.  Never raises."""
        try:
            self._update_meta(tags=self._unchanged_identity(self._valid(tags, "tag key")))
        except Exception as exc:  # tags must never crash the loop
            self.warn_once(f"tags:{type(exc).__name__}", f"tags not recorded: {exc}")

    def _unchanged_identity(self, tags: Mapping[str, Any]) -> dict[str, Any]:
        """``tags`` without identity tags that would change (each refused)."""
        out: dict[str, Any] = {}
        for k, v in tags.items():
            if k not in schema.IDENTITY_TAGS:
                out[k] = v
                continue
            value = _tag_value(v)[:TAG_VALUE_MAX]
            if self._first_value_wins(
                    self._identity, k, value, "identity", "identity tag changed",
                    lambda old, new, k=k: f"identity tag {k!r} is {old!r} since start_run; "
                    f"the new value {new!r} is refused (who a run is never changes after it "
                    "starts)"):
                out[k] = value
        return out

    def _first_value_wins(self, first: dict[str, str], key: str, value: str, prefix: str,
                          kind: str, said: Callable[[str, str], str]) -> bool:
        """The one rule of immutable values (identity tags, params): whether ``value`` is
        new for ``key`` (then kept in ``first``).  The same value again is a no-op; a
        different one is refused (warned with ``said(old, new)``, each cut to 80
        characters; counted in ``refrun.refused`` as ``kind``)."""
        old = first.get(key)
        if old is None:
            first[key] = value
            return True
        if old != value:
            self._refuse(f"{prefix}:{key}"[:80], said(old[:80], value[:80]), 1, None, key,
                         kind)
        return False

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log params.  MLflow params are immutable, so the first value of a param is
        the one recorded, always: the same value again is a no-op; a different value is
        refused here (warned, counted in ``refrun.refused``, named in warnings.json),
        whether or not the first one reached the store yet."""
        new: dict[str, str] = {}
        for k, v in self._valid(params, "param key").items():
            value = self._fit("param", k, v)
            if self._first_value_wins(
                    self._params, k, value, "param-changed", "param changed",
                    lambda old, new, k=k: f"param {k!r} already logged as {old!r}, the new "
                    f"value {new!r} is refused (MLflow params are immutable: log a value "
                    "that changes as a tag or a metric)"):
                new[k] = value
        if new:
            self._update_meta(params=new)

    def _fit(self, what: str, key: str, value: Any) -> str:
        """``value`` as the string MLflow stores, cut to MLflow's limit for a ``what``
        ("tag" or "param") with a warning and a count (``refrun.truncated``)."""
        text = _tag_value(value)
        limit = TAG_VALUE_MAX if what == "tag" else PARAM_VALUE_MAX
        if len(text) <= limit:
            return text
        self._truncated += 1
        self.warn_once(f"truncated:{what}:{key}"[:80], f"{what} {key!r}: value of "
                       f"{len(text):,} characters cut to MLflow's limit of {limit:,} "
                       f"(counted in {schema.TAG_TRUNCATED})")
        return text[:limit]

    def _valid(self, items: Mapping[str, Any], what: str) -> dict[str, Any]:
        good = {}
        for k, v in items.items():
            problem = key_problem(k, what)
            if problem is None:
                good[k] = v
            else:
                self._refuse(f"{what}:{k!r}"[:80], problem, 1, None,
                             str(k)[:limits.KEY_LENGTH], what)
        return good

    def _update_meta(self, tags: Mapping[str, Any] | None = None,
                     params: Mapping[str, Any] | None = None) -> None:
        tag_values = {k: self._fit("tag", k, v) for k, v in (tags or {}).items()}
        param_values = dict(params or {})  # already fitted by log_params

        def change(meta: SpoolMeta) -> None:
            meta.tags.update(tag_values)
            for k, v in param_values.items():
                meta.params.setdefault(k, v)  # the first value stays (see log_params)
            meta.tags_version += 1

        if self._writer.is_alive():
            self._writer.meta_changes.append(change)  # applied off the training thread
            return
        try:
            self.spool.update_meta(change)
        except Exception as exc:
            self.warn_once("meta", f"tags/params not recorded: {exc}")

    def log_json(self, name: str, obj: Any) -> None:
        """Write ``obj`` as JSON to artifact ``name`` (uploaded with the run's artifacts).

        ``name`` is a relative path inside the run's artifacts: an absolute one, or one
        with a ``..`` part, is refused (warned, counted in ``refrun.refused``) and nothing
        is written.  Never raises."""
        try:
            path = self._artifact_path(name)
            if path is None:
                return
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(obj, indent=1, default=str), encoding="utf-8")
        except Exception as exc:
            self.refuse(str(name), f"artifact {str(name)[:200]!r} not written: "
                        f"{type(exc).__name__}: {exc}", kind="artifact not written")

    def log_artifact(self, local_path: str | os.PathLike[str], name: str | None = None) -> None:
        """Copy a file into the run's artifacts (uploaded at the end of the run).

        A file that cannot be read (missing, a directory, unreadable) or a ``name`` that
        leaves the run's artifacts (absolute, ``..``) is refused: warned, counted in
        ``refrun.refused``, never raised into the loop."""
        try:
            src = Path(local_path)
            dest = self._artifact_path(src.name if name is None else name)
            if dest is None:
                return
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dest)
        except Exception as exc:
            self.refuse(str(local_path), f"artifact {str(local_path)[:200]!r} not copied: "
                        f"{type(exc).__name__}: {exc}", kind="artifact not copied")

    def _artifact_path(self, name: str) -> Path | None:
        """Where artifact ``name`` goes in the spool, or None (refused and counted) when the
        name would leave the run's artifacts."""
        problem = artifact_name_problem(name)
        if problem is not None:
            self.refuse(str(name), f"artifact name {str(name)[:200]!r} refused: {problem}; "
                        "nothing written", kind="artifact name")
            return None
        # A rank > 0 uploads onto rank 0's run: its files go under refrun/ranks/rank-<k>/.
        if self.config.options.secondary_rank:
            name = schema.rank_artifact(self.config.options.rank or 0, name)
        root = self.spool.artifacts_dir
        path = root / name
        # The name's own parts are checked above; a directory inside the artifacts that is
        # a symlink (not one refrun makes) must not lead out either.
        if not path.parent.resolve().is_relative_to(root.resolve()):
            self.refuse(str(name), f"artifact name {str(name)[:200]!r} refused: it leads "
                        "outside the run's artifacts; nothing written", kind="artifact name")
            return None
        return path

    def add_own_close_s(self, seconds: float) -> None:
        """Count ``seconds`` of refrun's own closing work done before the run's close: a
        probe closed inside the ``with`` block (its pending values read, its summaries
        written).  Recorded with the close's own time (``refrun.perf.recording_close_s``),
        which a run's hours leave out; once the run is closing, its window holds it."""
        if self._close_ms is None and seconds > 0:
            self._early_close_s += seconds

    def add_close_hook(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` when the run ends, before the final flush (probes close here)."""
        self._close_hooks.append(hook)

    def step_stats(self) -> dict[str, StepStats]:
        """Per-metric step bookkeeping so far (count, first, last, repeated, backwards)."""
        return dict(self._stats)

    # --- life cycle ------------------------------------------------------------
    def _begin(self) -> None:
        """Create the MLflow run (waiting at most ``start_wait_s``), start the spool writer
        and the delivery process.  A rank > 0 of a multi-process job creates no run (nor
        imports MLflow): its delivery finds rank 0's run when the rank ends."""
        if not self.config.options.secondary_rank:
            self._create_run_briefly()
        if self.config.options.delivery == "process":
            self._process = process.spawn(self.spool, self.config.options.flush_interval_s)
            if self._process is None:
                self._writer.deliver_inline()
        self._writer.start()
        atexit.register(self._atexit)

    def _create_run_briefly(self) -> None:
        # The run is created now when the store answers, so run_id is known at once; a store
        # that is down or silent must not hold training: the delivery side creates it later
        # (ensure_run is serialised per spool, so the two never create two runs).
        failure: list[BaseException] = []

        def create() -> None:
            try:
                delivery.ensure_run(self.spool)
            except BaseException as exc:
                failure.append(exc)

        uri = self.config.options.tracking_uri
        try:  # local work only (import MLflow; create a new sqlite store once)
            if database_server(uri):
                # Opening a database server's store is a connection (MLflow's client
                # connects when it is built): the thread below does it, within the wait.
                import mlflow.tracking  # noqa: F401
            else:  # a sqlite store refrun's own access serves is opened without MLflow
                store_client(uri, create=True, direct=True)
        except Exception as exc:
            failure.append(exc)
        t = threading.Thread(target=create, name="refrun-create-run", daemon=True)
        if not failure:
            t.start()
            # A local database answers or fails by itself; a server may stay silent.
            t.join(None if local_store(uri) else self.config.options.start_wait_s)
        if t.is_alive():
            wait = self.config.options.start_wait_s
            self.warn_once("offline-start", f"tracking store {uri} did not answer within "
                           f"{wait:g} s; recording to {self.spool.path}")
        elif failure:
            exc = failure[0]  # a store error is one line that says why; others, their type
            why = str(exc).removeprefix(f"tracking store {uri}: ") \
                if isinstance(exc, RefrunStoreError) else type(exc).__name__
            self.warn_once("offline-start", f"tracking store {uri} unreachable at start "
                           f"({why}); recording to {self.spool.path}")

    def __enter__(self) -> RunSession:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        status: RunStatus
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

    def close(self, status: RunStatus = "FINISHED") -> bool:
        """End the run: spool everything, seal it (curves artifact, summary tags, status,
        end time) and let delivery finish it.

        Waits while delivery makes progress, and at most ``close_timeout_s`` (default 5 s,
        ``$REFRUN_CLOSE_TIMEOUT_S``) without progress; then the delivery process finishes
        in the background (or ``refrun sync`` later).  Returns True when the run is complete
        in the store.  Safe to call twice.
        """
        if self._closed:
            return True
        self._close_ms = _now_ms()
        for hook in self._close_hooks:  # probes: resolve pending values while we accept
            try:
                hook()
            except Exception as exc:
                self.warn_once(f"close-hook:{exc!r}"[:60], f"closing a probe failed: {exc}")
        self._closed = True
        self._status = status
        with contextlib.suppress(Exception):
            atexit.unregister(self._atexit)
        end_ms = self._end_ms = _now_ms()
        self._writer.stop(timeout=self.close_timeout_s + 30)
        if not self._writer.is_alive():
            self._writer.apply_meta_changes()  # any queued after its last iteration
        try:
            self._seal(end_ms, status)
        except Exception as exc:
            self.warn_once("summary", f"end-of-run record not (fully) written: {exc}")
        _ = self.run_id  # known to the session from here on, even once the spool is gone
        proc = self._process
        if proc is not None and proc.poll() is None:
            ok = self._close_through_process(proc)
        else:
            ok = self._finalize_here()
        if ok:
            self._remove_spool()
        return ok

    def _finalize_here(self) -> bool:
        try:
            delivery.finalize(self.spool)
            return True
        except Exception as exc:
            if disk_full(exc):  # the run must not stay RUNNING in the store: end it there
                with contextlib.suppress(Exception):
                    delivery.terminate_in_store(self.spool, delivery.Ending(
                        self._status or "FINISHED", self._end_ms, self._end_tags()), exc)
            self._undelivered(f"{type(exc).__name__}: {str(exc)[:200]}")
            return False
        finally:
            self._release_lock()

    def _close_through_process(self, proc: subprocess.Popen) -> bool:
        # The delivery process finishes the spool once it reads "close" and can take the
        # session lock.  Wait while it makes progress (its heartbeat), and at most
        # close_timeout_s without: a store that is down or silent never holds the trainer.
        self._release_lock()
        ending = delivery.Ending(self._status or "FINISHED", self._end_ms,
                                 self._end_tags())
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.write(ending.to_line())
            proc.stdin.flush()
            proc.stdin.close()
        last_beat: float | None = None
        last_progress = time.monotonic()
        while True:
            try:
                rc = proc.wait(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                pass
            st = delivery.read_status(self.spool)
            if st is not None and st.ok and st.progress != last_beat:
                last_beat, last_progress = st.progress, time.monotonic()
            if time.monotonic() - last_progress > self.close_timeout_s:
                self._undelivered(f"no delivery progress for {self.close_timeout_s:g} s "
                                  f"(pid {proc.pid}); it goes on in the background")
                return False
        if rc != 0:
            self._undelivered(f"delivery process exited with {rc} "
                              f"(see {self.spool.path / process.LOG_FILE})")
        return rc == 0

    def _undelivered(self, why: str) -> None:
        log.warning("refrun: run %s not fully delivered (%s); its points are safe in %s; "
                    "deliver them with `refrun sync`", self.local_id, why, self.spool.path)

    def _remove_spool(self) -> None:
        # Delivered: the store and the curves artifact hold everything now.
        _ = self.run_id  # cache it before meta.json goes
        if settings().keep_spool:
            return
        shutil.rmtree(self.spool.path, ignore_errors=True)

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            unlock(self._lock_fd)
            self._lock_fd = None

    def _atexit(self) -> None:
        self.close("FINISHED")

    def _seal(self, end_ms: int, status: RunStatus) -> None:
        self.log_json(schema.ARTIFACT_WARNINGS, {
            "warnings": self.warnings,
            "refused": list(self._refusals.values()),
            "metrics": {k: dataclasses.asdict(v) for k, v in self._stats.items()},
        })
        delivery.seal(self.spool, status, end_ms=end_ms, extra_tags=self._end_tags())

    def _end_tags(self) -> dict[str, str]:
        """The session's counts at the end of the run (also sent to the delivery process
        with ``close``: they reach the store even when the spool's disk is full)."""
        return {
            schema.TAG_DROPPED: str(self.points_dropped),
            schema.TAG_REFUSED: str(self._refused),
            schema.TAG_TRUNCATED: str(self._truncated),
            schema.TAG_WARNINGS: str(len(self._warnings)),
            **self._close_tag(),
        }

    def _close_tag(self) -> dict[str, str]:
        # The run's end time is taken after the probes' close (pending values read, summary
        # artifacts written): refrun's own work, said so that a run's hours are the
        # workload's (refrun.acceptance.runview.run_hours), as the start-up tag is.
        if self._close_ms is None or not self._end_ms:
            return {}
        own_s = (self._end_ms - self._close_ms) / 1e3 + self._early_close_s
        return {schema.TAG_RECORDING_CLOSE_S: f"{own_s:.3f}"}


def artifact_name_problem(name: Any) -> str | None:
    """Why ``name`` is not an artifact path inside a run (None when it is): it must be a
    non-empty relative path without ``..`` parts (MLflow's own rule for artifact paths) or
    NUL characters; a name that leaves the run could overwrite any file the process may
    write."""
    if not isinstance(name, str) or not name:
        return "not a non-empty string"
    if "\0" in name:
        return "contains a NUL character"
    if name.startswith(("/", "\\")) or (name[:1].isalpha() and name[1:2] == ":"):
        return "an absolute path"
    parts = name.replace("\\", "/").split("/")
    if ".." in parts:
        return "a '..' part leaves the run's artifacts"
    if all(p in ("", ".") for p in parts) or parts[-1] in ("", "."):
        return "names no file"
    return None


def _tag_value(v: Any) -> str:
    """A tag or param value as the string MLflow stores (uncut: see ``RunSession._fit``)."""
    return v if isinstance(v, str) else json.dumps(v, default=str) if isinstance(
        v, dict | list | tuple) else str(v)


def start_run(
    workload: str | RunIdentity,
    role: str | None = None,
    *,
    options: RecordingOptions | None = None,
    params: Mapping[str, Any] | None = None,
    tags: Mapping[str, Any] | None = None,
    run_name: str | None = None,
    **keywords: Any,
) -> RunSession:
    """Start recording one training run into MLflow and return its :class:`RunSession`.

    Two typed values describe the run: who it is, a :class:`~refrun.identity.RunIdentity`
    (workload, role, hardware, backend, seed, chips, global_batch, planned_steps), and how
    it is recorded, a :class:`~refrun.recording.config.RecordingOptions` (store, spool,
    flush interval, delivery, timeouts, the process's place in a job); each field is
    documented and validated there::

        start_run(RunIdentity(workload="w", role="reference", seed=0),
                  options=RecordingOptions(flush_interval_s=0.5), params={"lr": 1e-3})

    The flat keyword form builds the same two values (one keyword per field of either)::

        start_run("w", "reference", seed=0, flush_interval_s=0.5, params={"lr": 1e-3})

    Identity is written as ``refrun.*`` tags (with framework versions, device and git
    commit; see :mod:`refrun.schema`).  If the store cannot be reached the run still
    starts: points are spooled and delivered when it comes back, or by ``refrun sync``.
    Every point goes into the run's ``refrun/curves.parquet`` artifact; MLflow's metric
    history gets a bounded, spike-preserving view (:mod:`refrun.recording.view`).  With
    ``world_size > 1`` the job records ONE run, owned by rank 0 (docs/multiprocess.md).

    Raises :class:`RefrunInputError` for bad values and :class:`TypeError` for a keyword
    that is no field (or a value given twice), before anything is written.
    """
    identity_, options_ = from_keywords(workload, role, options, keywords)
    config = RunConfig(identity=identity_, options=options_, params=dict(params or {}),
                       tags=dict(tags or {}), run_name=run_name)
    bound_store_waits(settings())
    meta = _spool_meta(config)
    spool = Spool.create(config.options.spool_root, meta)
    session = RunSession(config, spool, spool.try_lock(SESSION_LOCK))
    user_tags = session._unchanged_identity(session._valid(config.tags, "tag key"))
    for what, items in (("tag", user_tags),
                        ("param", session._valid(config.params, "param key"))):
        for k, v in items.items():
            session._fit(what, k, v)  # warns about and counts a value cut in _spool_meta
    if config.options.snapshot_environment:
        session.log_json(schema.ARTIFACT_ENVIRONMENT, identity.environment_snapshot())
    session._begin()
    # The run starts (its MLflow start time) before refrun's own start-up: the spool, the
    # environment snapshot, the store's opening (an MLflow import where refrun's own sqlite
    # access does not serve it) and the run's creation.  Said, so that a run's hours are
    # the workload's and not how it was recorded (refrun.acceptance.runview.run_hours).
    session.set_tags({schema.TAG_RECORDING_START_S: f"{(_now_ms() - meta.start_ms) / 1e3:.3f}"})
    return session


def _spool_meta(config: RunConfig) -> SpoolMeta:
    opts = config.options
    tags = _run_tags(config)
    # Cut to MLflow's limits here; start_run warns about and counts each cut afterwards.
    # A user tag never replaces an identity tag start_run set (start_run refuses it).
    tags.update({k: _tag_value(v)[:TAG_VALUE_MAX] for k, v in config.tags.items()
                 if key_problem(k) is None
                 and not (k in schema.IDENTITY_TAGS and k in tags)})
    tags.setdefault(schema.TAG_NOTE, mlflow_ui.run_description(tags))
    local_id = time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:12]
    tags[schema.TAG_LOCAL_ID] = local_id
    return SpoolMeta(
        local_id=local_id, tracking_uri=opts.tracking_uri,
        experiment=opts.experiment or config.identity.workload, start_ms=_now_ms(), tags=tags,
        params={k: _tag_value(v)[:PARAM_VALUE_MAX] for k, v in config.params.items()
                if key_problem(k) is None},
        run_name=config.run_name or mlflow_ui.default_run_name(tags),
        mlflow_every=opts.mlflow_every, pid=os.getpid(),
        flush_interval_s=opts.flush_interval_s,
        host=socket.gethostname(),
        **({"rank": opts.rank, "world_size": opts.world_size, "job": opts.job}
           if opts.multi_process else {}),
    )


def _run_tags(config: RunConfig) -> dict[str, str]:
    """The ``refrun.*`` identity tags of a run, its job's and, for runs of this process,
    the environment's (:func:`refrun.identity.environment_tags`)."""
    tags = config.identity.tags()
    opts = config.options
    if opts.multi_process:
        tags.update({schema.TAG_JOB_ID: str(opts.job), schema.TAG_JOB_RANK: str(opts.rank),
                     schema.TAG_JOB_WORLD_SIZE: str(opts.world_size)})
    if opts.snapshot_environment:  # not for e.g. an imported run: this machine did not run it
        tags.update(identity.environment_tags())
    return tags


__all__ = ["RecordingOptions", "RunIdentity", "RunSession", "StepStats", "start_run"]
