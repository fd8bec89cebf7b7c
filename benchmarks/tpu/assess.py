"""Assess the runs ``record.py`` made on a TPU, here, against CPU references, with criteria
from ``refrun calibrate`` alone (plus the declared L4 goals).

    .venv/bin/python benchmarks/tpu/assess.py --tpu-store /tmp/tpu-store --store /tmp/tpu-assess
        [--jobs 2] [--markdown table.md] [--goal digits=eval/val_accuracy>=0.9]

For each workload (``plan.WORKLOADS``):

1. trains the detection benchmark's reference seeds (PyTorch on this CPU, ``--quick``:
   the runs the TPU recorded are quick ones) and its known-good same-seed evidence into
   ``--store``/tpu-assess.db (``--reuse``: runs already there are kept);
2. merges the TPU store into it (``refrun merge``: identity, points and artifacts as
   recorded there) and records the pipeline's gradient check for each TPU run whose
   workload requires one (the port's derivative, checked on this CPU);
3. ``refrun calibrate`` over the reference seeds (``--goal`` as given, and the L4 goals of
   :data:`L4_GOALS`), then assesses every TPU run against the first ``group size`` seeds;
4. prints one row per TPU run: the precision it ran at, the verdict, the criteria that
   failed (for a defect: whether one watches what it was built to disturb, its intended
   reason from the detection benchmark), and the L4 measurements (throughput and cost
   against the references, chip busy fraction and HBM as recorded on the chip).

``--json`` holds one object per TPU run: the row's fields, and ``l4_goals``, the result of
each L4 goal in the goals file's assessment (id, kind, outcome, reason, and the evidence it
was decided on: the ratio, the machine's contention, and any CPU-time bound).

Expected outcomes are written in docs/tpu.md before each run of record.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

    from refrun.acceptance.criteria import CriteriaFile
    from refrun.acceptance.results import CriterionResult

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (str(HERE), str(REPO), str(REPO / "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)

import bench_detection as det  # noqa: E402
import plan  # noqa: E402

# The L4 goals of the second table (the migration study's questions: is the port at least
# as fast as the reference, at most 1.2 times as costly per run, and is the chip kept busy)
# and the list prices that cost is reckoned with (USD per hour, on demand, us-central1,
# 2026-12: one TPU v5e chip; the 2-vCPU machine the CPU references run on).  The first
# table is calibrated without goals: L4 is then shown as measurements only.
L4_GOALS = ("throughput>=1.0x", "cost<=1.2x", "utilization>=50%")
PRICES = ("tpu=1.20", "cpu=0.0971")
# The evidence key of the ratio a throughput, cost or step_time result was decided on, as
# those kinds write it (refrun.schema has no EV_ name for it).
RATIO = "ratio"


@dataclass(frozen=True)
class Row:
    variant: plan.TpuVariant
    run_id: str | None
    outcome: det.Outcome | None
    intent: tuple[str, ...]
    chip: dict[str, str]
    error: str | None = None
    l4: dict[str, str] | None = None  # throughput and cost against the references
    goals: det.Outcome | None = None  # the same run judged by the file with L4 goals
    l4_goals: list[dict] | None = None  # that judgement's L4 goal results (goal_results)


def goal_results(crit: CriteriaFile, results: Iterable[CriterionResult]) -> list[dict]:
    """The results of ``crit``'s L4 goals (the L4 ``migration_only`` criteria ``refrun
    calibrate --goal`` writes), each with the evidence that says why: the ratio, the
    machine's contention (null where the result has none) and, where present, the runs'
    CPU-time bounds."""
    from refrun import schema
    from refrun.util.jsonsafe import json_safe

    goals = {c.id for c in crit.criteria if c.level == schema.LEVELS[-1] and c.migration_only}
    always = (RATIO, schema.EV_CONTENTION)
    present = (schema.EV_CPU_RATE_BOUND, schema.EV_CPU_FLOOR, schema.EV_CPU_CEILING,
               schema.EV_CPU_COST_BOUND)
    return [{"id": r.id, "kind": r.kind, "outcome": r.outcome, "reason": r.reason,
             "evidence": json_safe({**{k: r.evidence.get(k) for k in always},
                                    **{k: r.evidence[k] for k in present if k in r.evidence}})}
            for r in results if r.id in goals]


def assess(crit_path: Path, ref_ids: list[str], name: str, v: plan.TpuVariant, run_id: str,
           uri: str) -> tuple[det.Outcome, dict[str, str], list[dict]]:
    """The detection benchmark's outcome of one run, its L4 figures (ratios against the
    references' mean, as ``refrun accept`` prints them) and its L4 goals' results
    (:func:`goal_results`)."""
    from refrun.acceptance.assess import assess_ids
    from refrun.acceptance.criteria import load_criteria

    crit = load_criteria(crit_path)
    watched = {c.id: det._watched(c) for c in crit.criteria}
    a, _ = assess_ids(crit, ref_ids, run_id, uri)
    failing = [(r.id, r.reason, watched.get(r.id, (r.kind,)))
               for r in a.results if r.outcome == "fail"]
    out = det.Outcome(replace(v.base, name=name), a.verdict, a.highest_level or "none",
                      failing, [r.id for r in a.results if r.outcome == "not_evaluable"])
    perf = a.performance or {}
    thr, cost, busy = (perf.get(k) or {} for k in ("throughput", "cost", "busy"))

    def ratio(d: dict, why: str) -> str:
        r = d.get("ratio")
        return f"{r:.3g}x" if isinstance(r, int | float) else \
            f"n/a ({d.get(why) or perf.get('unit_note') or 'not a migration'})"

    return out, {"throughput": ratio(thr, "candidate_why"), "cost": ratio(cost, "candidate_why"),
                 "unit": str(perf.get("unit") or "-"),
                 "busy_pct": f"{busy['candidate_pct']:.1f}"
                 if isinstance(busy.get("candidate_pct"), int | float)
                 else f"n/a ({busy.get('candidate_why') or '-'})"}, \
        goal_results(crit, a.results)


def merge(tpu_db: Path, uri: str) -> str:
    """``refrun merge`` of the TPU store into ``uri``; its output."""
    proc = subprocess.run([sys.executable, "-m", "refrun", "merge", str(tpu_db), "--into", uri],
                          capture_output=True, text=True)
    if proc.returncode not in (0, 1):
        raise SystemExit(f"refrun merge failed (exit {proc.returncode}): "
                         f"{(proc.stderr or proc.stdout).strip()[-2000:]}")
    return proc.stdout


def tpu_ids(uri: str, workload: str) -> dict[str, str]:
    """Variant name -> merged run id, for the TPU runs of ``workload`` (``pipeline.variant``
    tag, newest finished)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(workload)
    out: dict[str, str] = {}
    if exp is None:
        return out
    for r in client.search_runs([exp.experiment_id], "attributes.status = 'FINISHED'",
                                order_by=["attributes.start_time ASC"], max_results=5000):
        name = r.data.tags.get("pipeline.variant", "")
        if name.startswith("tpu-"):
            out[name] = r.info.run_id
    return out


def chip_figures(uri: str, run_id: str) -> dict[str, str]:
    """What the run recorded about the chip: mean busy fraction of its samples, the
    busy-fraction source, peak HBM; "-" where nothing was recorded."""
    from mlflow.tracking import MlflowClient

    from refrun import schema

    run = MlflowClient(uri).get_run(run_id)
    m, t = run.data.metrics, run.data.tags
    busy = [v for k, v in m.items() if k.startswith(schema.SYS_PREFIX) and
            k.endswith("_duty_cycle_pct")]
    hbm = [v for k, v in m.items() if k.startswith(schema.SYS_PREFIX) and
           k.endswith("mem_peak_bytes")]
    src = next((v for k, v in t.items() if k.endswith("busy_source")), "-")
    return {"busy_pct": f"{sum(busy) / len(busy):.1f}" if busy else "-",
            "busy_source": src,
            "hbm_peak_mib": f"{max(hbm) / 2**20:.0f}" if hbm else "-",
            "precision": t.get("refrun.numerics.matmul_precision", "-")}


def run_workload(name: str, tpu_db: Path, store: Path, *, jobs: int, reuse: bool,
                 goal: str | None) -> tuple[list[Row], Path | None, str | None]:
    from pipelines.demo import init_store, train_all

    w = det.WORKLOADS[name](0)
    uri = f"sqlite:///{store / 'tpu-assess.db'}"
    init_store(uri, w.name)
    base = replace(w, candidates=[], held_out=[])
    ids = det.ids_from_store(base, uri, missing_ok=True) if reuse else {}
    todo = replace(base, references=[v for v in base.references if v.name not in ids],
                   evidence=[v for v in base.evidence if v.name not in ids])
    ids |= train_all(todo, quick=True, uri=uri, spool_dir=str(store / "spool"),  # type: ignore[arg-type]
                     jobs=jobs)
    tpu = tpu_ids(uri, w.name)
    # The TPU's known-good evidence is merged with the rest: calibrate finds it in the store
    # (refrun.pair.known_good) and writes the TPU's own band from it; it is not assessed.
    evidence = [v for v in plan.plan(name) if v.kind == "evidence"]
    variants = [v for v in plan.plan(name) if v.kind != "evidence"]
    cands = [v.base for v in variants if v.name in tpu]
    if w.gradcheck and cands:
        # the gradient check of each TPU run: its port's derivative, checked here
        gw = replace(w, candidates=[replace(v.base, name=v.name) for v in variants
                                    if v.name in tpu], held_out=[])
        det.record_gradchecks(gw, {v.name: tpu[v.name] for v in variants if v.name in tpu},
                              uri, quick=True, spool_dir=str(store / "spool"))
    ref_ids = [ids[v.name] for v in w.references]
    crit = store / f"{w.name}.toml"
    crit_goals = store / f"{w.name}-l4-goals.toml"
    for c in (crit, crit_goals):
        c.unlink(missing_ok=True)  # never judge with an earlier run's file
    # prices are facts, not goals: both files carry them, so the first table measures cost
    prices = [a for p in PRICES for a in ("--price", p)]
    error = calibrate(ref_ids, uri, crit, gradcheck=bool(w.gradcheck),
                      extra=(["--goal", goal] if goal else []) + prices)
    if error is not None:
        return [], None, error
    l4 = [a for g in L4_GOALS for a in ("--goal", g)] + prices
    error_goals = calibrate(ref_ids, uri, crit_goals, gradcheck=bool(w.gradcheck),
                            extra=(["--goal", goal] if goal else []) + l4)
    if error_goals is not None:
        print(f"[{name}] the L4-goals file was not written: {error_goals}", flush=True)
    group = ref_ids[: det.group_size(crit, len(ref_ids))]
    rows = [Row(v, tpu.get(v.name), None, (), {}, "known-good evidence on the TPU, used by "
                "calibrate (its hardware band), not assessed" if v.name in tpu else
                "not recorded on the TPU") for v in evidence]
    for v in variants:
        intent = tuple(w.intent.get(v.base.name, ())) if v.kind == "defect" else ()
        rid = tpu.get(v.name)
        if rid is None:
            rows.append(Row(v, None, None, intent, {}, "not recorded on the TPU"))
            continue
        out, figures, _ = assess(crit, group, v.name, v, rid, uri)
        judged, _, goal = assess(crit_goals, group, v.name, v, rid, uri) \
            if error_goals is None else (None, None, None)
        rows.append(Row(v, rid, out, intent, chip_figures(uri, rid), l4=figures,
                        goals=judged, l4_goals=goal))
    return rows, crit, None


def calibrate(ref_ids: list[str], uri: str, out: Path, *, gradcheck: bool,
              extra: list[str]) -> str | None:
    """``refrun calibrate --reference ... -o out`` with ``extra`` options (goals, prices):
    the one source of the criteria; None, or the one-line reason it wrote no file."""
    cmd = [sys.executable, "-m", "refrun", "calibrate", "--reference", *ref_ids,
           "--tracking-uri", uri, "-o", str(out),
           *(["--require-gradcheck"] if gradcheck else []), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not out.exists():
        lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        return f"exit {proc.returncode}: " + (lines[-1] if lines else "no message")
    return None


def short(reason: str, width: int = 90) -> str:
    """A criterion's reason cut to its first clause (the table's cell; the JSON keeps it
    whole)."""
    first = reason.split("; ")[0]
    return first if len(first) <= width else first[: width - 1] + "…"


def as_intended(r: Row) -> bool | None:
    """A benign run accepted; a defect rejected by a criterion watching what it was built
    to disturb (the detection benchmark's intent); None for known-good evidence."""
    o = r.outcome
    if r.variant.kind == "evidence":
        return None
    if o is None:
        return False
    return bool(o.caught_by(r.intent)) if r.variant.kind == "defect" else o.accepted


def as_json(r: Row) -> dict:
    """One run's object in ``--json``."""
    return {
        "variant": r.variant.name, "workload": r.variant.workload,
        "precision": r.variant.precision, "kind": r.variant.kind, "run_id": r.run_id,
        "verdict": r.outcome.verdict if r.outcome else None,
        "as_intended": as_intended(r),
        "failing": [list(f[:2]) for f in r.outcome.failing] if r.outcome else [],
        "intent": list(r.intent), "chip": r.chip, "l4": r.l4,
        "with_goals": (r.goals.verdict, [list(f[:2]) for f in r.goals.failing])
        if r.goals else None, "error": r.error, "l4_goals": r.l4_goals}


def table(rows: list[Row], markdown: bool) -> str:
    head = ("workload", "TPU run", "precision", "kind", "verdict", "as intended",
            "failing criteria (intended reason)", "throughput vs refs", "cost vs refs",
            "chip busy %", "HBM peak MiB", "with L4 goals")
    body = []
    for r in rows:
        o = r.outcome
        if o is None:
            body.append((r.variant.workload, r.variant.name, r.variant.precision, r.variant.kind,
                         "-", "-" if as_intended(r) is None else "NO", r.error or "-", "-", "-",
                         "-", "-", "-"))
            continue
        ok = "yes" if as_intended(r) else "NO"
        failing = "; ".join(f"{cid} ({short(reason)})" for cid, reason, _ in o.failing) or \
            ("not evaluable: " + ", ".join(o.not_evaluable) if o.not_evaluable else "-")
        if r.intent:
            failing += f" [intended: {', '.join(r.intent)}]"
        l4 = r.l4 or {}
        g = r.goals
        added = [cid for cid, _, _ in g.failing if cid not in {c for c, _, _ in o.failing}] \
            if g is not None else []
        unjudged = [cid for cid in g.not_evaluable if cid not in o.not_evaluable] \
            if g is not None else []
        goals = "-" if g is None else g.verdict + (f": {', '.join(added)}" if added else "") \
            + (f"; not judged: {', '.join(unjudged)}" if unjudged else "")
        body.append((r.variant.workload, r.variant.name, r.variant.precision, r.variant.kind,
                     o.verdict, ok, failing, l4.get("throughput", "-"), l4.get("cost", "-"),
                     l4.get("busy_pct", "-"), r.chip.get("hbm_peak_mib", "-"), goals))
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(c.replace("|", "/").replace("\n", " ") for c in row) + " |"
                  for row in body]
        return "\n".join(lines)
    return "\n".join("  ".join(str(c) for c in row) for row in [head, *body])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tpu-store", required=True, type=Path,
                    help="the folder record.py wrote (mlflow.db, mlruns/, manifest.json)")
    ap.add_argument("--store", required=True, type=Path, help="where the CPU runs go")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--reuse", action="store_true", help="keep CPU runs already in --store")
    ap.add_argument("--only", action="append", choices=plan.WORKLOADS, default=[])
    ap.add_argument("--goal", action="append", default=[], metavar="WORKLOAD=GOAL")
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    goals = dict(g.split("=", 1) for g in args.goal)
    args.store.mkdir(parents=True, exist_ok=True)
    tpu_db = args.tpu_store / "mlflow.db"
    if not tpu_db.is_file():
        raise SystemExit(f"{tpu_db}: no TPU store there (unpack record.py's folder)")
    t0 = time.perf_counter()
    uri = f"sqlite:///{args.store / 'tpu-assess.db'}"
    from pipelines.demo import init_store

    for name in plan.WORKLOADS:
        init_store(uri, det.WORKLOADS[name](0).name)
    print(merge(tpu_db, uri), flush=True)
    rows: list[Row] = []
    for name in args.only or plan.WORKLOADS:
        got, _crit, error = run_workload(name, tpu_db, args.store, jobs=args.jobs,
                                        reuse=args.reuse, goal=goals.get(name))
        if error:
            print(f"[{name}] refrun calibrate wrote no criteria: {error}", flush=True)
        rows += got
        print(table(got, markdown=False), flush=True)
    text = table(rows, markdown=True)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps([as_json(r) for r in rows], indent=1))
    print(f"\n{len(rows)} TPU runs assessed in {time.perf_counter() - t0:.0f} s "
          f"(load {os.getloadavg()[0]:.1f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
