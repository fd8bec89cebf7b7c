"""Canonical evidence of an assessment and its SHA-256 digest.

The evidence is what a sign-off vouches for: the criteria file's digest, every assessed
value (criterion, outcome, evidence values), and a fingerprint of each run they came
from: status, end time, where its points came from (``source`` and, from format version
2, ``points_from``: curves artifact or MLflow history, and how many), ``refrun.*`` tags,
params, MLflow's latest value of every metric, and a digest of every curve (each
metric's points in logging order: step int64 and value float64 bytes, NaN
canonicalised).  Canonical JSON: sorted keys, no spaces, finite floats by ``repr`` and
non-finite ones as null.  :func:`diff_evidence` says what differs between
two evidence documents, key by key.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from refrun import schema
from refrun.acceptance import criterion_evidence
from refrun.acceptance.results import CriterionResult, clean
from refrun.comparison import RunData

FORMAT = schema.FORMAT_EVIDENCE
FORMAT_VERSION = criterion_evidence.VERSION  # "10"
# Version 2 added each run's ``points_from``; version 3 each per-step result's
# ``first_divergence`` (where the candidate first left the criterion's band); version 4
# each step_time result's ``contention`` (how busy other processes kept the machine);
# version 5 the contention's second rule (the CPU the run itself got); version 6 a paired
# result's numerics (refrun.acceptance.precision) and the precision twin's run (role
# twin); version 7 a step_time result's CPU floor; version 8 the references' own machine
# figures and their rule (a pass against references slowed by neighbours).  Evidence
# recorded in an older version is recomputed in that version, so an older sign-off still
# verifies against unchanged data.
FORMAT_VERSIONS = ("1", "2", "3", "4", "5", "6", "7", "8", "9", "10")
# Result evidence keys each version added (left out when recomputing an older version):
# the typed shape's own record (refrun.acceptance.criterion_evidence).
ADDED_RESULT_KEYS = criterion_evidence.ADDED_IN


def canonical_json(obj: Any) -> str:
    """Deterministic JSON text of ``obj`` (the bytes that are hashed)."""
    return json.dumps(clean(obj), sort_keys=True, separators=(",", ":"), allow_nan=False,
                      ensure_ascii=True)


def sha256_of(obj: Any) -> str:
    """SHA-256 hex digest of :func:`canonical_json` of ``obj``."""
    return hashlib.sha256(canonical_json(obj).encode("ascii")).hexdigest()


def curve_digests(run: RunData) -> dict[str, str]:
    """SHA-256 per metric over its points in logging order (step, value bytes).

    Computed once per loaded run (a :class:`RunData` never changes): a sweep digests its
    references once, not once per candidate."""
    cached = run.__dict__.get("_curve_digests")
    if cached is not None:
        return dict(cached)
    out = {}
    for m in run.metric_names:
        steps, values, seq = run.series(m)
        order = np.argsort(seq, kind="stable")
        v = np.asarray(values, dtype=np.float64)[order]
        v = np.where(np.isnan(v), np.nan, v)  # one NaN bit pattern
        h = hashlib.sha256()
        h.update(np.asarray(steps, dtype="<i8")[order].tobytes())
        h.update(v.astype("<f8").tobytes())
        out[m] = h.hexdigest()
    run.__dict__["_curve_digests"] = dict(out)
    return out


def latest_metrics(run_ids: Sequence[str], tracking_uri: str | None) -> dict[str, dict]:
    """MLflow's latest value of every metric per run (catches points logged to the store
    after the run's curves artifact was written)."""
    from refrun.store.client import client as store_client

    client = store_client(tracking_uri)
    return {rid: dict(client.get_run(rid).data.metrics) for rid in run_ids}


def run_fingerprint(run: RunData, role: str, latest: dict[str, float] | None,
                    format_version: str = FORMAT_VERSION) -> dict[str, Any]:
    """Everything about a run that the assessment could depend on."""
    out = {
        "role": role,
        "status": run.status,
        "end_time_ms": run.end_time_ms,
        "source": run.source,
        "tags": {k: v for k, v in sorted(run.tags.items()) if k.startswith(schema.PREFIX)},
        "params": dict(sorted(run.params.items())),
        "latest_metrics": latest,
        "curves": curve_digests(run),
    }
    if format_version != "1":
        # Named in a verification when the points switch between the curves artifact and
        # MLflow's (bounded) history, e.g. after the artifact was deleted.
        out["points_from"] = run.points_from
    return out


def build_evidence(criteria_sha256: str, results: Sequence[CriterionResult],
                   references: Sequence[RunData], candidate: RunData,
                   latest: dict[str, dict] | None = None,
                   format_version: str = FORMAT_VERSION,
                   pair: RunData | None = None,
                   twin: RunData | None = None) -> dict[str, Any]:
    """The canonical evidence document (see the module docstring); ``format_version``:
    one of :data:`FORMAT_VERSIONS` (an older one to recompute older recorded evidence).
    ``pair``: the candidate's same-seed reference when it is not one of ``references``
    (a ``paired`` criterion read it: its fingerprint is evidence too, role ``pair``);
    ``twin``: the candidate's precision twin, when one was found (role ``twin``)."""
    if format_version not in FORMAT_VERSIONS:
        format_version = FORMAT_VERSION  # unknown: recompute as now (the digest will differ)
    latest = latest or {}
    runs = {r.run_id: run_fingerprint(r, "reference", latest.get(r.run_id), format_version)
            for r in references}
    runs[candidate.run_id] = run_fingerprint(candidate, "candidate",
                                             latest.get(candidate.run_id), format_version)
    if pair is not None and pair.run_id not in runs:
        runs[pair.run_id] = run_fingerprint(pair, "pair", latest.get(pair.run_id),
                                            format_version)
    if twin is not None and twin.run_id not in runs:
        runs[twin.run_id] = run_fingerprint(twin, "twin", latest.get(twin.run_id),
                                            format_version)
    return clean({
        "format": FORMAT, "format_version": format_version,
        "criteria_sha256": criteria_sha256,
        "reference": [r.run_id for r in references], "candidate": candidate.run_id,
        "runs": runs,
        "results": {r.id: {"level": r.level, "kind": r.kind, "outcome": r.outcome,
                           "evaluated": r.evaluated,
                           "evidence": _as_version(r.evidence, format_version, r.kind)}
                    for r in results},
    })


def result_as_version(result: dict[str, Any], format_version: str) -> dict[str, Any]:
    """A stored result (``CriterionResult.to_dict()``) as an assessment of evidence format
    ``format_version`` had it: without later evidence keys, and (before version 3) without
    the first-divergence ending of a failing reason."""
    if int(format_version) >= int(FORMAT_VERSION):
        return result
    out = dict(result)
    if isinstance(out.get("evidence"), dict):
        out["evidence"] = _as_version(out["evidence"], format_version,
                                      str(out.get("kind") or ""))
    if int(format_version) < 3 and isinstance(out.get("reason"), str):
        out["reason"] = out["reason"].split(schema.FIRST_LEFT_REASON)[0]
    return out


def _as_version(evidence: dict[str, Any], format_version: str, kind: str = ""
                ) -> dict[str, Any]:
    """A result's evidence without the keys added after ``format_version`` (a dotted key:
    a key inside one; ``KIND:key``: a key that version added to results of that kind
    only)."""
    drop = set()
    for v, keys in ADDED_RESULT_KEYS.items():
        if int(v) <= int(format_version):
            continue
        for k in keys:
            scope, _, name = k.rpartition(":")
            if not scope or scope == kind:
                drop.add(name)
    if not drop:
        return evidence
    out = {k: v for k, v in evidence.items() if k not in drop}
    for outer, inner in (k.split(".", 1) for k in drop if "." in k):
        if isinstance(out.get(outer), dict):
            out[outer] = {k: v for k, v in out[outer].items() if k != inner}
    return out


def diff_evidence(old: dict[str, Any], new: dict[str, Any]) -> list[dict[str, str]]:
    """What changed from ``old`` to ``new``: a list of ``{"what", "key", "change"}`` with
    ``what`` one of runs, criteria, evidence."""
    changes: list[dict[str, str]] = []
    if old.get("criteria_sha256") != new.get("criteria_sha256"):
        changes.append({"what": "criteria", "key": "criteria_sha256",
                        "change": f"{old.get('criteria_sha256')} -> "
                                  f"{new.get('criteria_sha256')}"})
    for key in ("reference", "candidate"):
        if old.get(key) != new.get(key):
            changes.append({"what": "runs", "key": key,
                            "change": f"{old.get(key)} -> {new.get(key)}"})
    old_runs, new_runs = old.get("runs", {}), new.get("runs", {})
    for rid in sorted(set(old_runs) | set(new_runs)):
        a, b = old_runs.get(rid), new_runs.get(rid)
        if a is None or b is None:
            changes.append({"what": "runs", "key": f"run {rid}",
                            "change": "added" if a is None else "missing"})
            continue
        for path, x, y in _leaf_diffs(a, b, ()):
            changes.append({"what": "runs", "key": f"run {rid} ({a.get('role')}): "
                            + ".".join(path), "change": _change(x, y)})
    old_res, new_res = old.get("results", {}), new.get("results", {})
    for cid in sorted(set(old_res) | set(new_res)):
        a, b = old_res.get(cid), new_res.get(cid)
        if a is None or b is None:
            changes.append({"what": "evidence", "key": f"criterion {cid}",
                            "change": "added" if a is None else "removed"})
            continue
        for path, x, y in _leaf_diffs(a, b, ()):
            changes.append({"what": "evidence", "key": f"criterion {cid}: " + ".".join(path),
                            "change": _change(x, y)})
    return changes


_ABSENT = object()


def _leaf_diffs(a: Any, b: Any, path: tuple[str, ...]) -> list[tuple[tuple[str, ...], Any, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            out += _leaf_diffs(a.get(k, _ABSENT), b.get(k, _ABSENT), (*path, str(k)))
        return out
    return [] if a == b else [(path, a, b)]


def _change(x: Any, y: Any) -> str:
    if x is _ABSENT:
        return f"added ({_short(y)})"
    if y is _ABSENT:
        return f"removed (was {_short(x)})"
    return f"{_short(x)} -> {_short(y)}"


def _short(v: Any) -> str:
    s = json.dumps(clean(v), sort_keys=True) if not isinstance(v, str) else v
    return s if len(s) <= 80 else s[:77] + "..."
