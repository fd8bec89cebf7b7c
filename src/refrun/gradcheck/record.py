"""Recording gradient checks as an MLflow run with role ``gradcheck`` (L1 evidence).

One run holds any number of results (known-answer, parity, finite-difference, NaN,
precision, update-delta, gate self-tests).  What it contains:

* tags ``refrun.gradcheck.passed`` (``true``/``false``), ``refrun.gradcheck.checks``
  (count), ``refrun.gradcheck.failed`` (labels of failing checks, comma-separated) and,
  when a finite-difference check ran, ``refrun.gradcheck.verdict`` (the worst verdict);
* metrics ``gradcheck/<label>/<measure>`` at step 0 (``.../passed`` is 1 or 0);
  finite-difference curves as ``gradcheck/<label>/fd/d<i>/rel_error`` and
  ``gradcheck/<label>/fd/step_size`` indexed by sweep position (step 0 = largest h);
* artifacts ``refrun/gradcheck.json`` (every result in full) and
  ``refrun/gradcheck_fd.html`` (the V curves, self-contained plotly).

Acceptance finds the run by ``refrun.role = gradcheck`` in the workload's experiment and
the tag ``refrun.gradcheck.candidate`` naming the candidate run it checked
(``candidate_run_id``): the ``gradcheck`` criterion (:mod:`refrun.acceptance.gradchecks`)
fails a candidate whose check failed or that has none.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from refrun import limits, schema
from refrun.errors import RefrunInputError
from refrun.identity import RunIdentity, environment_snapshot, environment_tags
from refrun.keys import key_problem

if TYPE_CHECKING:
    import pandas as pd

_BAD_CHARS = re.compile(r"[^A-Za-z0-9_\-. /:]")


def metric_key(*parts: str) -> str:
    """``gradcheck/...`` with characters MLflow rejects replaced by ``_``."""
    return _BAD_CHARS.sub("_", "/".join(("gradcheck", *parts)))[:limits.KEY_LENGTH]


def to_jsonable(result: Any) -> dict[str, Any]:
    """A result dataclass as plain JSON data, with its kind, verdict and summary."""
    data = dataclasses.asdict(result) if dataclasses.is_dataclass(result) else dict(result)
    data = _clean(data)
    data["kind"] = getattr(result, "kind", type(result).__name__)
    data["passed"] = bool(result.passed)
    data["summary"] = result.summary()
    return data


def _clean(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if callable(obj):
        return getattr(obj, "__name__", repr(obj))
    if hasattr(obj, "tolist"):
        return _clean(obj.tolist())
    return obj


def record_gradcheck(results: Sequence[Any], *, workload: str, tracking_uri: str | None = None,
                     spool_dir: str | Path | None = None, backend: str | None = None,
                     hardware: str = "cpu", run_name: str | None = None,
                     tags: dict[str, Any] | None = None, plot: bool = True,
                     candidate_run_id: str | None = None) -> str:
    """Record ``results`` as one MLflow run (role ``gradcheck``); returns its run id.

    Each result needs ``label``, ``kind``, ``passed``, ``summary()`` and
    ``record_metrics()`` (all refrun.gradcheck results have them).
    ``candidate_run_id``: the candidate run these checks were made for (tag
    ``refrun.gradcheck.candidate``), by which ``refrun accept`` finds them.

    The results are known before anything is written, so the run is a complete run
    (:func:`refrun.store.complete.write_complete_run`): written in one pass, FINISHED on
    return, nothing left half-written; no spool (``spool_dir`` is accepted and unused).
    It carries this process's environment tags and ``refrun/environment.json``, as a
    live run does: the checks ran here.

    Raises :class:`RefrunInputError` for no results, a bad identity, candidate id or tag
    key, and :class:`~refrun.errors.RefrunStoreError` when the store cannot be written.
    """
    from refrun.gradcheck.finite_diff import VERDICTS, FiniteDiffResult
    from refrun.store.complete import CompleteRun, now_ms, string_tags, write_complete_run

    del spool_dir  # a complete run needs no spool
    if not results:
        raise RefrunInputError("results: nothing to record")
    labels = _unique_labels(results)
    failed = [lab for lab, r in zip(labels, results, strict=True) if not r.passed]
    fds = [r for r in results if isinstance(r, FiniteDiffResult)]
    run_tags: dict[str, Any] = {schema.TAG_GRADCHECK_PASSED: "false" if failed else "true",
                                schema.TAG_GRADCHECK_CHECKS: len(results),
                                schema.TAG_GRADCHECK_FAILED: ",".join(failed)}
    if fds:
        run_tags[schema.TAG_GRADCHECK_VERDICT] = max((r.verdict for r in fds),
                                                     key=VERDICTS.index)
    if candidate_run_id is not None:
        if not re.fullmatch(r"[0-9a-f]{32}", candidate_run_id):
            raise RefrunInputError(f"candidate_run_id: {candidate_run_id!r} is not an MLflow "
                                   "run id (32 hex digits)")
        run_tags[schema.TAG_GRADCHECK_CANDIDATE] = candidate_run_id
    for key in tags or {}:
        problem = key_problem(key)
        if problem is not None:
            raise RefrunInputError(f"tags: {key!r}: {problem}")
    run_tags.update(tags or {})
    ident = RunIdentity(workload=workload, role="gradcheck", hardware=hardware, backend=backend)
    files: dict[str, bytes] = {}
    if plot and fds:
        from refrun.gradcheck.plot import fd_html

        files[schema.ARTIFACT_GRADCHECK_FD_HTML] = fd_html(fds).encode("utf-8")
    run = CompleteRun(
        experiment=workload,
        tags={**ident.tags(), **environment_tags(), **string_tags(run_tags)},
        table=_points(labels, results, now_ms()), run_name=run_name,
        json_artifacts={
            schema.ARTIFACT_GRADCHECK: {
                "passed": not failed, "failed": failed,
                "results": [dict(to_jsonable(r), label=lab)
                            for lab, r in zip(labels, results, strict=True)]},
            schema.ARTIFACT_ENVIRONMENT: environment_snapshot()},
        file_artifacts=files)
    return write_complete_run(run, tracking_uri)


def _points(labels: Sequence[str], results: Sequence[Any], stamp: int) -> pd.DataFrame:
    """Every metric of the results as the curves table: each result's measures at step 0,
    a finite-difference sweep's curves indexed by sweep position (step 0 = largest h)."""
    from refrun.gradcheck.finite_diff import FiniteDiffResult
    from refrun.store.complete import curves_table

    names: list[str] = []
    steps: list[int] = []
    values: list[float] = []

    def add(name: str, step: int, value: Any) -> None:
        names.append(name)
        steps.append(step)
        values.append(float(value))

    for lab, r in zip(labels, results, strict=True):
        for k, v in r.record_metrics().items():
            add(metric_key(lab, k), 0, v)
        if isinstance(r, FiniteDiffResult):
            for i, h in enumerate(r.steps):
                add(metric_key(lab, "fd", "step_size"), i, h)
                for c in r.curves:
                    add(metric_key(lab, "fd", f"d{c.direction}", "rel_error"), i,
                        c.rel_error[i])
    return curves_table(names, steps, values, stamp)


def _unique_labels(results: Sequence[Any]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for r in results:
        base = str(getattr(r, "label", "") or getattr(r, "kind", "check"))
        seen[base] = seen.get(base, 0) + 1
        out.append(base if seen[base] == 1 else f"{base}_{seen[base]}")
    return out
