"""Delivery: the one component that moves a spool into an MLflow tracking store.

It owns everything about delivery that more than one caller needs — the session's
background thread (``delivery="thread"``), the delivery process
(:mod:`refrun.recording.process`) and ``refrun sync`` all go through it:

* the lock files (``lock``: the live session; ``delivery.lock``: the live delivery
  process) and the status file (``delivery.json``) the process reports through;
* the single retry back-off (:class:`Backoff`: 1 s doubling to 30 s,
  ``$REFRUN_DELIVERY_RETRY_MAX_S``);
* one delivery step (:func:`deliver_pending`) and the complete delivery of a closed spool
  (:func:`finalize`), which sends MLflow the bounded view of :mod:`refrun.recording.view`;
* the end-of-run seal (:func:`seal`: curves artifact + summary tags + status);
* :func:`finish_spool`, the single place that decides a spool still ``RUNNING`` with no
  live owner belongs to a process that died: it is sealed as ``KILLED``.

A batch the store refuses permanently (an MLflow error that is not a connection error or a
server error) is split until the offending points are found; those are skipped, counted in
``refrun.skipped`` and named in ``refrun/warnings.json``, so one bad point never blocks a run.
MLflow is imported on first use, so the session and the delivery process start light; on
a local sqlite store whose schema refrun knows (:mod:`refrun.store.direct`) and whose
experiment exists with its artifacts on this machine, a run is created, filled, given its
artifacts and terminated without importing MLflow at all (~2.3 s of CPU a process).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from refrun import limits, schema
from refrun.keys import key_problem, step_problem
from refrun.recording import view
from refrun.recording.spool import (
    Cursor,
    Damage,
    Point,
    RunStatus,
    Spool,
    SpoolMeta,
    atomic_write,
    disk_full,
    unlock,
)
from refrun.settings import delivery_retry_max_s
from refrun.store import mlflow_ui
from refrun.store.client import client as store_client
from refrun.store.client import entities_for, run_writer, transient
from refrun.store.curves import summary_tags, write_curves
from refrun.store.direct import DirectClient, Metric, Param, RunTag, local_path
from refrun.store.surface import StoreClient

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

SESSION_LOCK = "lock"
DELIVERY_LOCK = "delivery.lock"
STATUS_FILE = "delivery.json"
MAX_SKIPPED_REASONS = 20

Outcome = Literal["delivered", "complete", "live", "error", "store"]
"""``store``: not attempted, the spool's store is unusable (``refrun sync`` says why)."""
T = TypeVar("T")


# --- the retry back-off ----------------------------------------------------------------
@dataclass(slots=True)
class Backoff:
    """Retry pacing after store errors: ``first_s`` doubling up to ``cap_s``
    (``$REFRUN_DELIVERY_RETRY_MAX_S``, default 30 s)."""

    first_s: float = 1.0
    cap_s: float = field(default_factory=delivery_retry_max_s)
    delay_s: float = 0.0
    retry_at: float = 0.0

    def ready(self) -> bool:
        return time.monotonic() >= self.retry_at

    def failed(self) -> float:
        """Record a failure; returns the delay before the next try (seconds)."""
        self.delay_s = min(self.cap_s, max(self.first_s, self.delay_s * 2))
        self.retry_at = time.monotonic() + self.delay_s
        return self.delay_s

    def succeeded(self) -> None:
        self.delay_s = 0.0
        self.retry_at = 0.0


# --- locks and the status file ----------------------------------------------------------
def owner(spool: Spool) -> Literal["session", "delivery"] | None:
    """Who is alive and owns ``spool``: its delivery process, its session, or nobody."""
    if spool.locked(DELIVERY_LOCK):
        return "delivery"
    if spool.locked(SESSION_LOCK):
        return "session"
    return None


@dataclass(frozen=True, slots=True)
class DeliveryStatus:
    """What the delivery process last reported (``delivery.json``)."""

    ok: bool
    error: str | None
    changed: float
    """Wall time (s) ``ok``/``error`` last changed."""
    progress: float
    """Wall time (s) of the last successful delivery step (a heartbeat)."""


def write_status(spool: Spool, status: DeliveryStatus) -> None:
    # Not fsynced: a heartbeat, rewritten often; a reader sees the old or the new file.
    atomic_write(spool.path / STATUS_FILE, json.dumps({
        "ok": status.ok, "error": status.error, "changed": status.changed,
        "progress": status.progress}), durable=False)


def read_status(spool: Spool) -> DeliveryStatus | None:
    try:
        raw = json.loads((spool.path / STATUS_FILE).read_text())
        return DeliveryStatus(bool(raw["ok"]), raw.get("error"), float(raw["changed"]),
                              float(raw["progress"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


# --- the store ------------------------------------------------------------------------
def ensure_run(spool: Spool) -> str:
    """The spool's MLflow run id, creating the run (and experiment) the first time.

    Serialised by ``create.lock`` so that the session's start and its delivery process
    never create two runs for one spool.
    """
    meta = spool.read_meta()
    if meta.run_id:
        return meta.run_id
    fd = os.open(spool.path / "create.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        meta = spool.read_meta()
        if meta.run_id:
            return meta.run_id
        client, exp_id = run_writer(meta.tracking_uri, meta.experiment)
        if meta.run_name is None and isinstance(client, DirectClient):
            client = store_client(meta.tracking_uri, create=True)  # MLflow draws a name
        mlflow_ui.prepare_experiment(client, exp_id)  # training kind, saved view
        run = client.create_run(exp_id, start_time=meta.start_ms, tags=meta.tags,
                                run_name=meta.run_name)
        run_id = run.info.run_id

        def record(m: SpoolMeta) -> None:
            m.run_id, m.experiment_id = run_id, exp_id

        spool.update_meta(record)
        return run_id
    finally:
        os.close(fd)


def _send_skipping_refused(send: Callable[[list[T]], None], items: list[T], what: str,
                           refused: list[str]) -> int:
    """``send(items)``; when the store refuses it permanently, halve until the refused
    items are isolated and skip those (their reasons appended to ``refused``).  Returns
    how many items were skipped.  A transient error propagates (the caller retries)."""
    try:
        send(items)
        return 0
    except Exception as exc:
        if transient(exc):
            raise
        if len(items) == 1:
            refused.append(f"{what} {items[0]!r} refused by the store: {str(exc)[:200]}")
            return 1
    mid = len(items) // 2
    return (_send_skipping_refused(send, items[:mid], what, refused)
            + _send_skipping_refused(send, items[mid:], what, refused))


def _record_skipped(spool: Spool, skipped: int, reasons: list[str]) -> None:
    if not skipped:
        return

    def change(m: SpoolMeta) -> None:
        m.skipped += skipped
        m.skipped_reasons = (m.skipped_reasons + reasons)[:MAX_SKIPPED_REASONS]

    spool.update_meta(change)


def deliver_tags_params(spool: Spool, client: StoreClient, run_id: str) -> None:
    """Send every tag and param in the spool metadata (idempotent: values never change)."""
    meta = spool.read_meta()
    version = meta.tags_version
    if meta.tags_delivered >= version:
        return
    items: list[Any] = [RunTag(k, str(v)) for k, v in meta.tags.items()]
    items += [Param(k, str(v)) for k, v in meta.params.items()]

    def send(chunk: list[Any]) -> None:
        client.log_batch(run_id, tags=entities_for(client, [x for x in chunk
                                                            if isinstance(x, RunTag)]),
                         params=entities_for(client, [x for x in chunk
                                                      if isinstance(x, Param)]))

    refused: list[str] = []
    for i in range(0, len(items), limits.TAGS_PER_BATCH):
        _send_skipping_refused(send, items[i:i + limits.TAGS_PER_BATCH], "tag/param", refused)
    # Every later tag change re-sends the whole set, so a value the store refused is
    # refused again each time: counted once (its reason names the item and the value).
    new = [r for r in dict.fromkeys(refused) if r not in meta.skipped_reasons]
    _record_skipped(spool, len(new), new)

    def done(m: SpoolMeta) -> None:
        m.tags_delivered = max(m.tags_delivered, version)

    spool.update_meta(done)


def _send_points(spool: Spool, client: StoreClient, run_id: str, points: list) -> None:
    def send(chunk: list) -> None:
        client.log_batch(run_id, metrics=entities_for(
            client, [Metric(k, v, t, s) for k, s, t, v in chunk]))

    refused: list[str] = []
    skipped = 0
    for i in range(0, len(points), limits.METRICS_PER_BATCH):
        skipped += _send_skipping_refused(send, points[i:i + limits.METRICS_PER_BATCH],
                                          "point", refused)
    _record_skipped(spool, skipped, refused)


def _storable(spool: Spool, batch: list[Point]) -> list[Point]:
    """``batch`` without points MLflow would refuse for their name or step (a spool written
    by something other than the session, or by an older refrun); those are skipped."""
    key_problems: dict[str, str | None] = {}
    reasons: dict[str, None] = {}  # ordered set
    good = []
    for p in batch:
        if p[0] not in key_problems:
            key_problems[p[0]] = key_problem(p[0])
        problem = key_problems[p[0]] or step_problem(p[1])
        if problem is None:
            good.append(p)
        else:
            reasons[problem] = None
    if len(good) < len(batch):
        _record_skipped(spool, len(batch) - len(good),
                        [f"point skipped at delivery: {r}" for r in reasons])
    return good


def deliver_points(spool: Spool, client: StoreClient, run_id: str, every: int = 1,
                   max_batches: int | None = None) -> int:
    """Send the MLflow view of undelivered spool lines; returns how many lines were read.

    The cursor (with the view's state) advances only after the store accepted the batch.
    ``max_batches`` bounds the work of one call (None: everything).
    """
    start = spool.read_cursor()
    state = start.view
    lines = start.lines
    for i, (batch, lines_after, bytes_after) in enumerate(
        spool.iter_undelivered(limits.METRICS_PER_BATCH)
    ):
        if max_batches is not None and i >= max_batches:
            break
        chosen = view.select(_storable(spool, batch), state, every)
        if chosen:
            _send_points(spool, client, run_id, chosen)
        spool.write_cursor(Cursor(lines_after, bytes_after, state))
        lines = lines_after
    return lines - start.lines


def deliver_pending(spool: Spool, max_batches: int | None = None) -> str:
    """Create the run if needed, then send tags, params and the view of undelivered
    points (at most ``max_batches`` batches); returns the MLflow run id.  Raises on a
    store error.  A rank > 0 of a multi-process job sends nothing while it runs (its data
    goes to rank 0's run as one artifact when it ends: :func:`finalize_rank`); returns ""."""
    meta = spool.read_meta()
    if meta.secondary_rank is not None:
        return meta.run_id or ""
    run_id = ensure_run(spool)
    meta = spool.read_meta()
    client = points_client(meta.tracking_uri)
    deliver_tags_params(spool, client, run_id)
    deliver_points(spool, client, run_id, meta.mlflow_every, max_batches)
    return run_id


def points_client(uri: str) -> StoreClient:
    """The client that writes a run's points, tags and params: refrun's own access to a
    local sqlite store where :mod:`refrun.store.direct` may serve it (MLflow's semantics,
    ``tests/test_store_direct.py``), MLflow's client otherwise (a server, another MLflow
    release).  MLflow's SQLAlchemy ``log_batch`` was ~75 % of a delivery process's CPU,
    ~350 us a recorded step of a 1.6 ms PyTorch/XLA MLP step (eleven points a step;
    py-spy, 2026-12-07): on a machine of few cores that CPU is taken from the training
    it records.  The run is created by :func:`refrun.store.client.run_writer`'s client (a new
    store or experiment is made by MLflow, with MLflow's defaults) and uploaded and ended
    by :func:`run_client`'s."""
    return store_client(uri, create=True, direct=True)


def run_client(uri: str, run_id: str) -> StoreClient:
    """The client that uploads a run's artifacts, mends its tags and terminates it:
    :func:`points_client` where that is refrun's own access and the run's artifacts are on
    this machine; MLflow's client otherwise (an object store, a server)."""
    c = points_client(uri)
    if isinstance(c, DirectClient) and local_path(c.get_run(run_id).info.artifact_uri):
        return c
    return store_client(uri, create=True)


def deliver_artifacts(spool: Spool, client: StoreClient, run_id: str) -> None:
    """Upload files in the spool's artifacts/ not yet uploaded (recorded in the meta)."""
    done = set(spool.read_meta().artifacts_delivered)
    for path in sorted(Path(spool.artifacts_dir).rglob("*")):
        if not path.is_file() or path.name.endswith(".tmp"):
            continue
        rel = path.relative_to(spool.artifacts_dir).as_posix()
        stamp = f"{rel}@{path.stat().st_mtime_ns}"
        if stamp in done:
            continue
        parent = str(Path(rel).parent)
        client.log_artifact(run_id, str(path), artifact_path=None if parent == "." else parent)
        done.add(stamp)
        delivered = sorted(done)

        def record(m: SpoolMeta, d: list[str] = delivered) -> None:
            m.artifacts_delivered = d

        spool.update_meta(record)


# --- the end of a run -------------------------------------------------------------------
def seal(spool: Spool, status: RunStatus | None = None, end_ms: int | None = None,
         extra_tags: dict[str, str] | None = None) -> None:
    """End-of-run bookkeeping of a spool: write its curves artifact from every spooled
    point and record the summary tags (plus ``extra_tags``), the status and the end time.

    ``status`` None keeps the recorded one, except that a spool still RUNNING (its process
    died without closing) becomes KILLED.  Writing the artifact may fail (disk full): the
    status, end time and tags are recorded regardless (with ``refrun.curves.missing``) and
    the error is raised afterwards.
    """
    tags = dict(extra_tags or {})
    error: Exception | None = None
    try:
        # A run sealed here after its process died may have a torn last line: lost too.
        df, damage = spool.read_all_checked(torn_is_damage=status is None)
        if damage.lines:
            _note_damage(spool, damage, tags)
        tags.update(summary_tags(df))
        if status is None and spool.read_meta().status == "RUNNING":  # its process died
            tags[schema.TAG_LOST_ESTIMATE] = str(lost_estimate(spool, df))
        write_curves(df, spool.artifacts_dir / curves_artifact(spool.read_meta()))
    except Exception as exc:  # the status and end time are recorded regardless
        error = exc
        tags[schema.TAG_CURVES_MISSING] = f"{type(exc).__name__}: {exc}"[:500]

    def change(m: SpoolMeta) -> None:
        if error is None:  # written now: an earlier failure no longer holds
            m.tags.pop(schema.TAG_CURVES_MISSING, None)
        m.tags.update(tags)
        m.tags_version += 1
        if status is not None:
            m.status = status
        elif m.status == "RUNNING":
            m.status = "KILLED"
        if end_ms is not None:
            m.end_ms = end_ms
        elif m.end_ms is None:
            m.end_ms = _last_point_ms(spool) or time.time_ns() // 1_000_000

    spool.update_meta(change)
    if error is not None:
        raise error


def _note_damage(spool: Spool, damage: Damage, tags: dict[str, str]) -> None:
    """Say what a damaged spool lost: ``refrun.spool.damaged``, the estimated points added
    to ``refrun.dropped`` (so every reader that asks whether a run is whole sees them),
    and a warning in warnings.json.  Idempotent: sealing again replaces, never adds."""
    meta = spool.read_meta()
    if schema.TAG_DROPPED in tags:  # the session's own count, sent with this seal
        base = _int(tags[schema.TAG_DROPPED])
    else:  # an earlier seal's count, without the damage it already added
        earlier = meta.tags.get(schema.TAG_SPOOL_DAMAGED, "")
        base = _int(meta.tags.get(schema.TAG_DROPPED, "0")) - _int(earlier.split(" ", 1)[0])
    tags[schema.TAG_DROPPED] = str(max(0, base) + damage.points)
    tags[schema.TAG_SPOOL_DAMAGED] = damage.describe()[:limits.TAG_VALUE_LENGTH]
    path = spool.artifacts_dir / schema.ARTIFACT_WARNINGS
    with contextlib.suppress(OSError, ValueError):
        doc = json.loads(path.read_text()) if path.exists() else {"warnings": []}
        message = (f"{damage.describe()} ({spool.points_path}); every valid line was "
                   f"delivered; counted in {schema.TAG_DROPPED}")
        warnings = doc.setdefault("warnings", [])
        if not any(w.get("message") == message for w in warnings):
            warnings.append({"time_ms": None, "step": None, "message": message})
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(doc, indent=1, default=str))


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        return 0


def lost_estimate(spool: Spool, df: Any) -> int:
    """Points a hard kill took with the trainer: accepted by ``log()`` but not yet appended
    to the spool (the writer appends every ``flush_interval_s``, so at most one interval).

    With ``n`` the points spooled in the last interval before the last spooled point
    (their timestamps, i.e. the logging rate ``r = n / interval``), ``t_flush`` the spool
    file's last write (its mtime) and ``t_death`` when the delivery process saw the trainer
    die (``died_ms``; unknown after a kill of both: then ``t_flush + interval``, the
    latest the next append would have come)::

        lost ~= r * clamp(t_death - t_flush, 0, interval)

    An estimate: it assumes the trainer kept its recent rate until it died, and is an
    upper bound when the time of death is unknown.
    """
    meta = spool.read_meta()
    interval_ms = max(1.0, meta.flush_interval_s * 1000.0)
    if df is None or not len(df):
        return 0
    ts = df["timestamp_ms"].to_numpy()
    last = int(ts.max())
    recent = int((ts > last - interval_ms).sum())
    try:
        flushed_ms = spool.points_path.stat().st_mtime_ns // 1_000_000
    except OSError:
        return 0
    death_ms = meta.died_ms if meta.died_ms is not None else flushed_ms + interval_ms
    gap = min(max(death_ms - flushed_ms, 0.0), interval_ms)
    return round(recent * gap / interval_ms)


def _last_point_ms(spool: Spool) -> int | None:
    """Timestamp of the last spooled point: the best end time of a run that died."""
    try:
        with open(spool.points_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = [x for x in f.read().split(b"\n") if x.count(b"\t") == 3]
        return int(lines[-1].split(b"\t")[2]) if lines else None
    except (OSError, ValueError):
        return None


def _note_skipped(spool: Spool, meta: SpoolMeta) -> None:
    """Add what delivery skipped to the run's tags and warnings artifact."""
    if not meta.skipped:
        return
    path = spool.artifacts_dir / schema.ARTIFACT_WARNINGS
    with contextlib.suppress(OSError, ValueError):
        doc = json.loads(path.read_text()) if path.exists() else {"warnings": []}
        doc.setdefault("warnings", []).extend(
            {"time_ms": None, "step": None, "message": r} for r in meta.skipped_reasons)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(doc, indent=1, default=str))

    def change(m: SpoolMeta) -> None:
        m.tags[schema.TAG_SKIPPED] = str(m.skipped)
        m.tags_version += 1

    spool.update_meta(change)


def finalize(spool: Spool) -> str:
    """Deliver a sealed spool completely and terminate its MLflow run with its status;
    returns the run id.  Raises on a store error (the spool is unchanged for a retry)."""
    if spool.read_meta().secondary_rank is not None:
        return finalize_rank(spool)
    run_id = deliver_pending(spool)
    meta = spool.read_meta()
    cursor = spool.read_cursor()
    owed = view.owed_at_end(cursor.view)
    points = points_client(meta.tracking_uri)
    if owed:
        _send_points(spool, points, run_id, owed)
        spool.write_cursor(Cursor(cursor.lines, cursor.nbytes, cursor.view))
    _note_skipped(spool, spool.read_meta())
    deliver_tags_params(spool, points, run_id)
    client = run_client(meta.tracking_uri, run_id)
    deliver_artifacts(spool, client, run_id)
    meta = spool.read_meta()
    _clear_stale_tags(client, run_id, meta)
    client.set_terminated(run_id, status=meta.status,
                          end_time=meta.end_ms or time.time_ns() // 1_000_000)

    def done(m: SpoolMeta) -> None:
        m.complete = True

    spool.update_meta(done)
    return run_id


def _clear_stale_tags(client: StoreClient, run_id: str, meta: SpoolMeta) -> None:
    """Delete tags a disk-full end put on the run that no longer hold once the spool is
    delivered: ``refrun.sync.pending`` always, ``refrun.curves.missing`` when the curves
    artifact has been written since (the spool's metadata no longer carries it)."""
    stale = [schema.TAG_SYNC_PENDING]
    if schema.TAG_CURVES_MISSING not in meta.tags:
        stale.append(schema.TAG_CURVES_MISSING)
    tags = client.get_run(run_id).data.tags
    for key in stale:
        if key in tags:
            client.delete_tag(run_id, key)


@dataclass(frozen=True)
class Ending:
    """How the session ended its run (sent to the delivery process with ``close``), so
    the run can be terminated in the store even when the spool can no longer be written."""

    status: RunStatus
    end_ms: int
    tags: dict[str, str]

    def to_line(self) -> bytes:
        return b"close " + json.dumps({"status": self.status, "end_ms": self.end_ms,
                                       "tags": self.tags}).encode("utf-8") + b"\n"

    @classmethod
    def from_line(cls, data: bytes) -> Ending | None:
        """The ending in a ``close {...}`` line; None for a bare ``close`` or garbage."""
        try:
            raw = json.loads(data.split(b"close", 1)[1].strip().split(b"\n", 1)[0])
            return cls(raw["status"], int(raw["end_ms"]),
                       {str(k): str(v) for k, v in raw["tags"].items()})
        except (IndexError, ValueError, KeyError, TypeError, AttributeError):
            return None


def terminate_in_store(spool: Spool, ending: Ending | None, why: BaseException) -> str | None:
    """End the spool's run in the store without writing anything locally (the spool's
    disk is full): the session's status, end time and counts (or KILLED at the last
    point when the trainer died), why the curves artifact is missing, and
    ``refrun.sync.pending`` with the points not delivered yet.  The spool stays for
    ``refrun sync``, which delivers the rest and removes the tags that no longer hold.
    Returns the run id, or None when the run does not exist in the store."""
    meta = spool.read_meta()
    if not meta.run_id or meta.secondary_rank is not None:
        return None
    client = points_client(meta.tracking_uri)
    status = ending.status if ending is not None else (
        "KILLED" if meta.status == "RUNNING" else meta.status)
    end_ms = ending.end_ms if ending is not None else (
        meta.end_ms or _last_point_ms(spool) or time.time_ns() // 1_000_000)
    pending = _count_lines(spool.points_path) - spool.read_cursor().lines
    tags = dict(ending.tags if ending is not None else {})
    reason = getattr(why, "strerror", None) or str(why)
    tags[schema.TAG_SYNC_PENDING] = (f"not fully delivered ({reason}): {max(0, pending)} "
                                     f"spooled points and the run's artifacts wait in "
                                     f"{spool.path}; run `refrun sync`")
    if not (spool.artifacts_dir / curves_artifact(meta)).exists():
        tags.setdefault(schema.TAG_CURVES_MISSING, f"not written: {reason} at {spool.path}")
    client.log_batch(meta.run_id, tags=entities_for(
        client, [RunTag(k, v[:limits.TAG_VALUE_LENGTH]) for k, v in tags.items()]))
    client.set_terminated(meta.run_id, status=status, end_time=end_ms)
    return meta.run_id


def _count_lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except OSError:
        return 0


def _ending_in_store(spool: Spool, meta: SpoolMeta) -> tuple[RunStatus, int] | None:
    """The status and end time :func:`terminate_in_store` gave a run whose spool still
    says RUNNING (its disk was full when the session ended): ``refrun sync`` keeps them
    rather than calling the run KILLED."""
    if not meta.run_id:
        return None
    run = points_client(meta.tracking_uri).get_run(meta.run_id)
    if schema.TAG_SYNC_PENDING not in run.data.tags or run.info.status == "RUNNING":
        return None
    return run.info.status, run.info.end_time  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class SpoolResult:
    """What delivering one spool did."""

    local_id: str
    outcome: Outcome
    run_id: str | None
    points: int
    """Spool lines delivered by this call."""
    detail: str = ""


def delivered_elsewhere(spool: Spool) -> SpoolResult | None:
    """A ``live`` result when the spool's own delivery process is still running (it, not
    the caller, delivers the spool), else None; touches no store."""
    if spool.locked(DELIVERY_LOCK):
        return SpoolResult(spool.local_id, "live", _run_id(spool), 0,
                           "its delivery process is still running")
    return None


def finish_spool(spool: Spool, *, as_delivery_process: bool = False) -> SpoolResult:
    """Deliver one spool whose session has ended, completely; see the module docstring.

    A spool with a live session or delivery process is left alone (``live``), except by
    its own delivery process (``as_delivery_process``).  A spool still RUNNING whose owner
    is gone is sealed as KILLED (its end time: its last point).  Raises only for a full
    disk (:func:`refrun.recording.spool.disk_full`); other errors are an ``error`` result.
    """
    if not as_delivery_process and (owned := delivered_elsewhere(spool)) is not None:
        return owned
    fd = spool.try_lock(SESSION_LOCK)
    if fd is None:
        return SpoolResult(spool.local_id, "live", _run_id(spool), 0,
                           "a running session holds it")
    try:
        meta = spool.read_meta()
        if meta.complete:
            return SpoolResult(spool.local_id, "complete", meta.run_id, 0)
        before = spool.read_cursor().lines
        curves = spool.artifacts_dir / curves_artifact(meta)
        try:
            if meta.status == "RUNNING" or not curves.exists():
                # The owner died without closing (no curves artifact, no end-of-run tags),
                # or its disk was full when it closed: the store then holds its ending.
                ended = _ending_in_store(spool, meta) if meta.status == "RUNNING" else None
                if ended is not None:
                    seal(spool, ended[0], end_ms=ended[1])
                else:
                    seal(spool)
            run_id = finalize(spool)
        except Exception as exc:
            if disk_full(exc):
                raise
            return SpoolResult(spool.local_id, "error", _run_id(spool),
                               spool.read_cursor().lines - before,
                               f"{type(exc).__name__}: {str(exc)[:200]}")
        meta = spool.read_meta()
        return SpoolResult(spool.local_id, "delivered", run_id,
                           spool.read_cursor().lines - before, f"status {meta.status}")
    finally:
        unlock(fd)


def _run_id(spool: Spool) -> str | None:
    with contextlib.suppress(OSError, ValueError):
        return spool.read_meta().run_id
    return None


def shrink_delivered(spool: Spool, keep: bool) -> None:
    """Free a completely delivered spool's bulk (points and artifacts); the small metadata
    stays for its session (the run id) and ``refrun sync`` removes it later."""
    if keep:
        return
    import shutil

    with contextlib.suppress(OSError):
        spool.points_path.unlink()
    shutil.rmtree(spool.artifacts_dir, ignore_errors=True)


# --- ranks > 0 of a multi-process job (docs/multiprocess.md) ------------------------------
class JobRunNotFound(RuntimeError):
    """Rank 0's run of a job is not (yet) in the store; delivery retries with back-off."""


def curves_artifact(meta: SpoolMeta) -> str:
    """Where the spool's full curves go: ``refrun/curves.parquet`` of its own run, or for
    rank k > 0 ``refrun/ranks/rank-<k>.parquet`` on rank 0's run."""
    k = meta.secondary_rank
    return schema.ARTIFACT_CURVES if k is None else schema.rank_curves_artifact(k)


def find_job_run(client: MlflowClient, meta: SpoolMeta) -> str:
    """Id of rank 0's run of ``meta.job`` (tags ``refrun.job.id`` and ``refrun.job.rank=0``
    in the spool's experiment).

    Of several matches (a job id reused), one this rank has not reported to yet, the one
    whose start is closest to this rank's.  Raises :class:`JobRunNotFound` when none exists
    yet (rank 0 still starting, or its store offline): the caller retries.
    """
    k = meta.secondary_rank
    exp = client.get_experiment_by_name(meta.experiment)
    if exp is None:
        raise JobRunNotFound(f"experiment {meta.experiment!r} does not exist yet")
    query = (f"tags.`{schema.TAG_JOB_ID}` = '{meta.job}' and "
             f"tags.`{schema.TAG_JOB_RANK}` = '0'")
    runs = client.search_runs([exp.experiment_id], query, max_results=100)
    reported = schema.TAG_JOB_REPORTED_PREFIX + schema.rank_name(k or 0)
    fresh = [r for r in runs if reported not in r.data.tags]
    if not fresh:
        raise JobRunNotFound(f"no run of job {meta.job!r} from rank 0 in experiment "
                             f"{meta.experiment!r} yet")
    best = min(fresh, key=lambda r: abs((r.info.start_time or 0) - meta.start_ms))
    return best.info.run_id


def rank_summary(spool: Spool, meta: SpoolMeta) -> dict[str, Any]:
    """The small per-rank summary uploaded beside rank k's curves."""
    k = meta.secondary_rank or 0
    return {"rank": k, "world_size": meta.world_size, "job": meta.job,
            "status": meta.status, "start_ms": meta.start_ms, "end_ms": meta.end_ms,
            "host": meta.host, "pid": meta.pid, "curves": schema.rank_curves_artifact(k),
            "skipped": meta.skipped, "tags": dict(meta.tags)}


def finalize_rank(spool: Spool) -> str:
    """Deliver the sealed spool of rank k > 0 onto rank 0's run: its curves artifact
    (``refrun/ranks/rank-<k>.parquet``, every point incl. step time and ``sys/*``), its
    summary and other artifacts under ``refrun/ranks/``, and the tag
    ``refrun.job.reported.rank-<k>`` = its status.  Nothing goes into the run's metric
    history, tags of rank 0 are never changed, and the run is not terminated (rank 0 owns
    it).  Returns the run id; raises :class:`JobRunNotFound` or a store error (retried)."""
    meta = spool.read_meta()
    k = meta.secondary_rank
    assert k is not None
    client = store_client(meta.tracking_uri, create=True)
    run_id = meta.run_id or find_job_run(client, meta)

    def record(m: SpoolMeta) -> None:
        m.run_id = run_id

    meta = spool.update_meta(record)
    path = spool.artifacts_dir / schema.rank_summary_artifact(k)
    if not path.exists():  # written once: a retry must not re-upload an unchanged file
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(rank_summary(spool, meta), indent=1, default=str))
    deliver_artifacts(spool, client, run_id)
    client.set_tag(run_id, schema.TAG_JOB_REPORTED_PREFIX + schema.rank_name(k), meta.status)

    def done(m: SpoolMeta) -> None:
        m.complete = True

    spool.update_meta(done)
    return run_id
