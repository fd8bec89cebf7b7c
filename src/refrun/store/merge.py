"""Merging the runs of one store into another (``refrun merge``): a store recorded where
the team's store cannot be reached (a TPU VM without network records into a local sqlite
file), brought back and copied into the team's store without losing identity, artifacts
or points.

What is copied, per run (:class:`refrun.store.complete.CopiedRun`, written by the one
complete-run writer): every tag and param, every point of MLflow's metric history with its
step and timestamp, every artifact file byte for byte (``refrun/curves.parquet`` among
them), the status, start and end times and the run name, into the experiment of the same
name (created when missing).  The copy gets one more tag, ``refrun.origin.run_id``: the
run id it had where it was recorded (kept through later merges).

Decided:

* **which runs**: refrun's recorded and imported runs (a ``refrun.schema`` tag; roles
  reference and candidate).  Comparison and gradient-check runs are not copied: they name
  other runs by id inside their evidence and its digest, which a copy could not keep
  true; ``refrun accept`` on the merged runs makes them again.  Plain MLflow runs are not
  refrun's to copy.
* **recognised by identity, idempotent**: a run whose origin id (or own id) is already in
  the target's experiment is not copied again.  A copy found RUNNING there is what an
  interrupted merge left (the writer sets the status last): it is deleted and written anew.
* **only complete runs**: a run still RUNNING, or with points not yet delivered
  (``refrun.sync.pending``), is left out and named (exit 1): ``refrun sync`` where it was
  recorded first.
* **nothing half-written**: every run to copy is checked before the first write (status,
  its artifact folder found); a bad source is one line (exit 2) and nothing is written.  A
  store failure while a run is written deletes that run (the writer's rule).
* **artifacts that moved with the store**: a sqlite store records absolute artifact
  paths of the machine that wrote it.  When that path does not exist here, the run's
  folder is looked for under ``artifacts_root`` (default: the store file's folder) at each
  tail of the recorded path that still names the run (``mlruns/1/<run id>/artifacts``).
* the copy's ``refrun.pair.reference`` (the reference run a same-seed candidate was started
  like) names the reference's id in the target when that reference came from the same
  source store.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from refrun import schema
from refrun.errors import RefrunInputError
from refrun.store.client import client as store_client
from refrun.store.complete import CopiedRun, write_copied_run
from refrun.store.direct import Metric, local_path
from refrun.store.uri import existing_store_uri, resolve_tracking_uri, sqlite_path

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

MERGED_ROLES = ("reference", "candidate")
"""Roles of the runs a merge copies (comparison and gradcheck runs are derived)."""
_TERMINAL = ("FINISHED", "FAILED", "KILLED")
Outcome = Literal["merged", "present", "left out"]


@dataclass(frozen=True)
class MergedRun:
    """What the merge did with one run of the source."""

    source_id: str
    outcome: Outcome
    target_id: str | None
    detail: str


@dataclass(frozen=True)
class MergeResult:
    runs: tuple[MergedRun, ...] = field(default_factory=tuple)

    def count(self, outcome: Outcome) -> int:
        return sum(r.outcome == outcome for r in self.runs)


@dataclass(frozen=True)
class _SourceRun:
    run: Any  # mlflow.entities.Run
    experiment: str
    artifacts: Path | None
    """The run's artifact folder on this machine; None: read through the store."""

    @property
    def key(self) -> str:
        """The id that recognises the run in every store it is merged into."""
        return self.run.data.tags.get(schema.TAG_ORIGIN_RUN_ID) or self.run.info.run_id


def merge(source: str, target: str, artifacts_root: Path | None = None) -> MergeResult:
    """Copy the refrun runs of store ``source`` into store ``target`` (module docstring).

    Raises :class:`RefrunInputError` (nothing written) for a source that cannot be merged
    as a whole: the same store twice, a run whose artifacts are not found.
    """
    src_uri = existing_store_uri(_uri(source))
    dst_uri = resolve_tracking_uri(_uri(target))
    if src_uri == dst_uri:
        raise RefrunInputError(f"refusing to merge {src_uri} into itself")
    src = store_client(src_uri)
    root = artifacts_root or (sqlite_path(src_uri) or Path.cwd()).parent
    if artifacts_root is not None and not artifacts_root.is_dir():
        raise RefrunInputError(f"--artifacts-root {artifacts_root}: no such folder")
    todo, left_out = _plan(src, root)
    out = list(left_out)
    ids: dict[str, str] = {}  # origin id and source id -> the run's id in the target
    for exp_name, runs in _by_experiment(todo):
        present = _present(dst_uri, exp_name)
        for r in runs:  # references first: a candidate's pair reference is then known
            found = present.get(r.key) or present.get(r.run.info.run_id)
            if found is not None and not (found.copy and found.status == "RUNNING"):
                ids[r.key] = ids[r.run.info.run_id] = found.run_id
                out.append(MergedRun(r.run.info.run_id, "present", found.run_id,
                                     f"already in {exp_name}"))
                continue
            if found is not None:  # an interrupted merge's copy
                store_client(dst_uri, create=True).delete_run(found.run_id)
            new_id = _copy(src, r, dst_uri, ids)
            ids[r.key] = ids[r.run.info.run_id] = new_id  # a pair reference names either
            out.append(MergedRun(r.run.info.run_id, "merged", new_id, _describe(r)))
    return MergeResult(tuple(out))


def _uri(text: str) -> str:
    """A store URI, or the path of a sqlite file taken as its URI."""
    if "://" not in text and Path(text).suffix == ".db":
        return f"sqlite:///{Path(text).absolute()}"
    return text


def _all_runs(c: MlflowClient) -> Iterator[tuple[str, Any]]:
    for exp in c.search_experiments():
        page = None
        while True:
            batch = c.search_runs([exp.experiment_id], max_results=1000, page_token=page,
                                  order_by=["attributes.start_time ASC"])
            for run in batch:
                yield exp.name, run
            page = batch.token
            if not page:
                break


def _plan(src: MlflowClient, root: Path) -> tuple[list[_SourceRun], list[MergedRun]]:
    """The runs to copy, every one checked; the runs left out with why."""
    todo: list[_SourceRun] = []
    left: list[MergedRun] = []
    for exp_name, run in _all_runs(src):
        tags = run.data.tags
        rid = run.info.run_id
        if schema.TAG_SCHEMA not in tags or tags.get(schema.TAG_ROLE) not in MERGED_ROLES:
            continue
        if run.info.status not in _TERMINAL:
            left.append(MergedRun(rid, "left out", None, f"{run.info.status}: still being "
                                  "recorded, or its process was killed (`refrun sync` where "
                                  "it was recorded ends it)"))
            continue
        if schema.TAG_SYNC_PENDING in tags:
            left.append(MergedRun(rid, "left out", None, "points not yet delivered "
                                  f"({schema.TAG_SYNC_PENDING}): `refrun sync` where it "
                                  "was recorded first"))
            continue
        todo.append(_SourceRun(run, exp_name, _artifact_folder(run, root)))
    return todo, left


def _artifact_folder(run: Any, root: Path) -> Path | None:
    """The run's artifact folder on this machine (where recorded, else moved under
    ``root``); None for artifacts behind a server or object store.  Raises
    :class:`RefrunInputError` when a local folder is nowhere to be found."""
    recorded = local_path(run.info.artifact_uri)
    if recorded is None:
        return None
    if recorded.is_dir():
        return recorded
    rid = run.info.run_id
    parts = recorded.parts
    if rid in parts:
        first = parts.index(rid)
        for start in range(1, first + 1):  # longest tail first
            moved = root.joinpath(*parts[start:])
            if moved.is_dir():
                return moved
    if schema.TAG_CURVES_MISSING in run.data.tags:
        return None  # it never had its artifacts: copied without them, as it is
    raise RefrunInputError(
        f"run {rid}: its artifact folder {recorded} does not exist, nor under {root} "
        f"(bring the store's artifact folder, e.g. mlruns/, with it and name the folder "
        f"holding it with --artifacts-root)")


def _by_experiment(runs: list[_SourceRun]) -> Iterator[tuple[str, list[_SourceRun]]]:
    order = {role: i for i, role in enumerate(MERGED_ROLES)}
    names = sorted({r.experiment for r in runs})
    for name in names:
        mine = [r for r in runs if r.experiment == name]
        mine.sort(key=lambda r: (order[r.run.data.tags[schema.TAG_ROLE]],
                                 r.run.info.start_time or 0))
        yield name, mine


@dataclass(frozen=True)
class _Present:
    run_id: str
    status: str
    copy: bool  # carries an origin tag: made by a merge


def _present(uri: str, experiment: str) -> dict[str, _Present]:
    """Runs of ``experiment`` in the target, by their origin id and by their own id."""
    c = store_client(uri, create=True)
    exp = c.get_experiment_by_name(experiment)
    if exp is None:
        return {}
    out: dict[str, _Present] = {}
    page = None
    while True:
        batch = c.search_runs([exp.experiment_id], max_results=1000, page_token=page)
        for run in batch:
            origin = run.data.tags.get(schema.TAG_ORIGIN_RUN_ID)
            entry = _Present(run.info.run_id, run.info.status, bool(origin))
            out[run.info.run_id] = entry
            if origin:
                out[origin] = entry
        page = batch.token
        if not page:
            break
    return out


def _copy(src: MlflowClient, r: _SourceRun, target: str, ids: dict[str, str]) -> str:
    run = r.run
    tags = {**run.data.tags, schema.TAG_ORIGIN_RUN_ID: r.key}
    paired = tags.get(schema.TAG_PAIR_REFERENCE)
    if paired in ids:
        tags[schema.TAG_PAIR_REFERENCE] = ids[paired]
    history = [Metric(m.key, m.value, m.timestamp, m.step)
               for key in sorted(run.data.metrics)
               for m in src.get_metric_history(run.info.run_id, key)]
    with tempfile.TemporaryDirectory(prefix="refrun-merge-") as tmp:
        folder = Path(tmp) / "artifacts"
        if r.artifacts is not None:
            shutil.copytree(r.artifacts, folder)
        else:
            folder.mkdir()
            if schema.TAG_CURVES_MISSING not in tags:
                src.download_artifacts(run.info.run_id, "", str(folder))
        return write_copied_run(CopiedRun(
            experiment=r.experiment, run_name=run.info.run_name, tags=tags,
            params=dict(run.data.params), history=history, artifacts=folder,
            status=run.info.status, start_time=run.info.start_time,
            end_time=run.info.end_time), target)


def _describe(r: _SourceRun) -> str:
    tags = r.run.data.tags
    fields: Iterable[tuple[str, str]] = (
        ("", r.experiment), ("", tags.get(schema.TAG_ROLE, "")),
        ("", tags.get(schema.TAG_HARDWARE, "")), ("seed=", tags.get(schema.TAG_SEED, "")),
        ("status=", r.run.info.status))
    return " ".join(f"{k}{v}" for k, v in fields if v)
