"""``refrun accept --criteria FILE --reference ID... --candidate ID...``: assess one or
many candidates against a workload's criteria, level by level, and record each
assessment as a comparison run.

With several candidates (a sweep) the references are loaded once, every candidate is
assessed before anything is recorded (bad input for one of them: exit 2, nothing
recorded), then each assessment is recorded and printed as one line, followed by a
summary; a warning (something to act on) is printed once after the summary, with the
candidates it concerns, and counted on their lines.  A criterion that does not apply to
a candidate's backend by design is a row of its assessment, not a warning.

Exit codes: 0 every criterion of every candidate passed, 1 one failed or could not be
evaluated, 2 bad usage or input (nothing recorded).

Only argparse and :mod:`refrun.schema` are imported to build the parser: the
assessment stack (MLflow, pandas, Arrow) is imported when the command runs, so
``refrun accept --help`` answers at once.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from refrun import schema
from refrun.cli import add_tracking_uri

if TYPE_CHECKING:
    from refrun.acceptance.assess import Assessed
    from refrun.acceptance.results import Assessment

SWEEP_FORMAT = schema.FORMAT_ACCEPT_SWEEP
SWEEP_FORMAT_VERSION = "1"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("accept", help="assess a candidate run against a criteria file (L0-L4)")
    p.add_argument("--criteria", required=True, type=Path, help="criteria file (TOML)")
    p.add_argument("--reference", required=True, nargs="+", action="extend", metavar="ID",
                   help="reference run id(s); several ids form a group of seeds")
    p.add_argument("--candidate", required=True, nargs="+", action="extend", metavar="ID",
                   help="candidate run id(s); several: each is assessed against the same "
                        "references (loaded once), one line each and a summary")
    p.add_argument("--axis", choices=schema.AXES, default=None,
                   help="align on steps or cumulative samples/tokens seen, when the criteria "
                        "file's [settings] axis does not say (a different one: exit 2)")
    p.add_argument("--pair", default=None, metavar="ID",
                   help="the candidate's same-seed reference run (it starts from that seed's "
                        "initial weights and data order), for `paired` criteria; default: "
                        "what the candidate's refrun.pair.* tags declare")
    p.add_argument("--twin", default=None, metavar="ID",
                   help="the candidate's precision twin: the same port, seed and hardware at "
                        "its pair's numerics (e.g. JAX_DEFAULT_MATMUL_PRECISION=highest), which "
                        "decides a paired failure of a candidate that ran at a platform's "
                        "reduced default precision; default: the run of the same "
                        "refrun.pair.port in the store")
    p.add_argument("--json", type=Path, default=None, metavar="OUT",
                   help="also write the full assessment as JSON to OUT (several "
                        f"candidates: one {SWEEP_FORMAT} document holding every assessment)")
    p.add_argument("--no-record", action="store_true",
                   help="do not record the assessment as a comparison run")
    p.add_argument("--allow-cross-workload", action="store_true",
                   help="assess a candidate of another workload than the criteria file's "
                        "or the references' (refused otherwise; the verdict says so)")
    add_tracking_uri(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from refrun.acceptance.alignment import with_axis
    from refrun.acceptance.assess import assess_many
    from refrun.acceptance.criteria import load_criteria
    from refrun.store.uri import existing_store_uri
    from refrun.util.outputs import check_output

    if args.json is not None:  # before anything is read or recorded
        check_output(args.json, "--json")
    crit = with_axis(load_criteria(args.criteria), args.axis)
    uri = existing_store_uri(args.tracking_uri)
    # Every candidate is assessed before anything is recorded: bad input for any of them
    # (exit 2) leaves the store as it was.  Assessments are small documents; only one
    # candidate's points are in memory at a time.
    done = list(assess_many(crit, args.reference, args.candidate, uri,
                            args.allow_cross_workload, pair_id=args.pair,
                            twin_id=args.twin))
    note = group_note(crit, len(args.reference))
    if len(done) == 1:
        return _one(args, crit, uri, done[0], note)
    if note:
        print(f"WARNING: {note}")
    return _sweep(args, crit, uri, done)


def _record(args: argparse.Namespace, crit: Any, uri: str, item: Assessed) -> str | None:
    if args.no_record:
        return None
    from refrun.acceptance.record import record_assessment

    return record_assessment(item.assessment, crit, item.evidence, tracking_uri=uri,
                             candidate_hardware=item.candidate_hardware,
                             run_names=item.run_names)


def _one(args: argparse.Namespace, crit: Any, uri: str, item: Assessed,
         note: str | None = None) -> int:
    """One candidate: the full table, intervals, calibration digest."""
    from refrun.acceptance.criterion_evidence import Contention, Interval, PairedEvidence

    assessment = item.assessment
    print(assessment.table())
    if note:
        print(f"WARNING: {note}")
    from refrun.acceptance.performance import assessment_lines

    for line in assessment_lines(assessment):  # a migration: throughput, cost, chip busy
        print(line)
    for r in assessment.results:  # paired criteria: the pair and where it first diverged
        pe = PairedEvidence.from_dict(r.evidence) if r.kind == "paired" else None
        if pe is not None and pe.pair_run:
            first = pe.first_divergence_step
            print(f"{r.id}: pair {pe.pair_run} ({pe.pair.get('source')}); "
                  + ("never left the band" if first is None else
                     f"first diverges at step {first}"))
            for line in precision_lines(r.id, pe.numerics or {}):
                print(line)
    for line in numerics_lines(assessment.numerics):
        print(line)
    al = assessment.alignment
    print(f"aligned on {al.get('axis')} (from {al.get('source')})")
    for r in assessment.results:  # statistical criteria: the interval and its seeds
        iv = Interval.from_dict(r.evidence)
        if iv is not None and iv.interval is not None:
            lo, hi = iv.interval
            print(f"{r.id}: interval [{lo}, {hi}] from {iv.n_reference} reference seed(s)")
    for r in assessment.results:  # step time: how busy other processes kept the machine
        cont = Contention.of_result(r.evidence)
        if cont is not None:
            print(f"{r.id}: {cont.summary()}")
    for line in power_lines(crit, assessment):
        print(line)
    if assessment.calibration_sha256:
        print(f"calibration sha256 {assessment.calibration_sha256}")
    if args.json is not None:
        assessment.write_json(args.json)
    run_id = _record(args, crit, uri, item)
    if run_id is not None:
        print(f"recorded on comparison run {run_id} "
              f"(evidence sha256 {assessment.evidence_sha256})")
    return assessment.exit_code


def precision_lines(cid: str, num: dict[str, Any]) -> list[str]:
    """A paired result's numerics (``refrun.acceptance.precision``): the precision it ran
    at when coarser than its pair's, and its precision twin or the rerun that would make
    one."""
    if not num.get("reduced"):
        return []
    out = [f"{cid}: ran at reduced precision: {'; '.join(num.get('coarser') or [])}"]
    twin = num.get("twin") or {}
    j = twin.get("judgement") or {}
    if twin.get("run_id") and j:
        first = j.get("first_divergence_step")
        out.append(f"{cid}: precision twin {twin['run_id']} ({twin.get('source')}; "
                   f"{twin.get('numerics')}): "
                   + ("never left the band" if first is None else
                      f"first diverges at step {first}")
                   + f"; attribution: {num.get('attribution')}")
    elif num.get("attribution") == "undetermined":
        out.append(f"{cid}: no precision twin ({twin.get('problem') or 'none found'}); "
                   f"re-run with {num.get('rerun')} to separate the platform's precision "
                   "from a port defect")
    return out


def numerics_lines(num: dict[str, Any]) -> list[str]:
    """Where the candidate's numerics configuration differs from the references'
    (``Assessment.numerics``), one line per setting; nothing when it does not."""
    diffs = num.get("differences") or []
    if not diffs:
        return []
    out = ["numerics differ from the references' (refrun.numerics.*):"]
    for d in diffs:
        refs = "; ".join(f"{rid}: {v}" for rid, v in (d.get("references") or {}).items())
        if len(set((d.get("references") or {}).values())) == 1:
            refs = f"references: {next(iter(d['references'].values()))}"
        out.append(f"  {d.get('what')}: candidate {d.get('candidate')}; {refs}")
    return out


def group_note(crit: Any, n_references: int) -> str | None:
    """A sentence when the criteria were calibrated for groups of another number of
    references than given: calibrate measured each threshold's false alarms with that
    many (more references widen a range and steady a std, so fewer false alarms and less
    power; fewer, the opposite)."""
    cal = crit.calibration
    g = cal.group_size if cal is not None else 0
    if not g or n_references == g:
        return None
    return (f"{n_references} references given; {crit.path} was calibrated for groups of {g} "
            f"(its false-alarm rate and power lines hold for {g}: pass {g} of them)")


def power_lines(crit: Any, a: Assessment) -> list[str]:
    """What the passes could not see: for each passing criterion, the smallest difference
    it detects with the calibration's seeds (``[calibration.power]``, written by ``refrun
    calibrate``).  A pass says no criterion saw a difference, not that there was none; with
    few seeds a band can be many seed standard deviations wide.  Nothing for a file
    without power lines (hand-written, or calibrated before they were recorded)."""
    from refrun.acceptance.results import PASS

    cal = crit.calibration
    power = cal.power if cal is not None else {}
    passed = [r.id for r in a.results if r.outcome == PASS and r.id in power]
    if not passed:
        return []
    return [f"power: the smallest difference each passing criterion detects ({cal.n} "
            "reference seeds at calibration; a smaller one passes it):"] + [
        f"  {cid}: {power[cid]}" for cid in passed]


def candidate_line(a: Assessment, comparison_run_id: str | None) -> str:
    """``<candidate id>  <VERDICT>  highest <level>  [failed: ...] [not evaluable: ...]
    [-> comparison run <id>]``: one line per candidate of a sweep."""
    failed = [r.id for r in a.results if r.outcome == "fail"]
    # Criteria held back (L4 while L3 has not passed) are not missing evidence.
    missing = [r.id for r in a.results if r.outcome == "not_evaluable" and r.evaluated]
    parts = [a.candidate_id, a.verdict.upper(), f"highest {a.highest_level or 'none'}"]
    if failed:
        parts.append("failed: " + ",".join(failed))
    if missing:
        parts.append("not evaluable: " + ",".join(missing))
    if a.performance:
        parts.append("L4 " + l4_summary(a.performance))
    if a.warnings:
        parts.append(f"{len(a.warnings)} warning(s)")
    if comparison_run_id:
        parts.append(f"comparison run {comparison_run_id}")
    return "  ".join(parts)


def l4_summary(performance: dict[str, Any]) -> str:
    """``throughput 1.45x, cost 7.1x, busy not measured``: a migration's figures in a
    sweep's line (the full lines are in the JSON and the single-candidate output)."""
    tp = (performance.get("throughput") or {}).get("ratio")
    cost = (performance.get("cost") or {}).get("ratio")
    busy = (performance.get("busy") or {}).get("candidate_pct")
    return ", ".join([f"throughput {tp:.3g}x" if tp is not None else
                      "throughput not measured",
                      f"cost {cost:.3g}x" if cost is not None else "cost not measured",
                      f"busy {busy:.0f}%" if busy is not None else "busy not measured"])


def summary(assessments: list[Assessment]) -> dict[str, int]:
    """Candidates per verdict (pass, fail, incomplete), in that order, plus the total."""
    counts = {"candidates": len(assessments), "pass": 0, "fail": 0, "incomplete": 0}
    for a in assessments:
        counts[a.verdict] = counts.get(a.verdict, 0) + 1
    return counts


def grouped_warnings(assessments: list[Assessment], shown: int = 5) -> list[str]:
    """Each distinct warning once, in order of first appearance, with the candidates it
    concerns (all of them, or how many and the first ``shown`` ids)."""
    by: dict[str, list[str]] = {}
    for a in assessments:
        for w in dict.fromkeys(a.warnings):
            by.setdefault(w, []).append(a.candidate_id)
    n = len(assessments)
    out = []
    for w, ids in by.items():
        which = (f"all {n} candidates" if len(ids) == n else
                 f"{len(ids)} of {n} candidates: " + ", ".join(i[:8] for i in ids[:shown])
                 + (", ..." if len(ids) > shown else ""))
        out.append(f"WARNING ({which}): {w}")
    return out


def _sweep(args: argparse.Namespace, crit: Any, uri: str, done: list[Assessed]) -> int:
    """Several candidates: one line each (recorded as it is printed), a summary, then each
    distinct warning once (never hidden behind a verdict: each line counts its own)."""
    rows = []
    for item in done:
        run_id = _record(args, crit, uri, item)
        print(candidate_line(item.assessment, run_id), flush=True)
        rows.append({**item.assessment.to_dict(), "comparison_run_id": run_id})
    assessments = [d.assessment for d in done]
    counts = summary(assessments)
    exit_code = max(a.exit_code for a in assessments)
    print(f"{counts['candidates']} candidates: {counts['pass']} pass, {counts['fail']} fail, "
          f"{counts['incomplete']} incomplete (criteria {Path(crit.path).name}, "
          f"{len(args.reference)} reference(s))")
    for line in grouped_warnings(assessments):
        print(line)
    if args.json is not None:
        doc = {"format": SWEEP_FORMAT, "format_version": SWEEP_FORMAT_VERSION,
               "criteria": {"path": crit.path, "sha256": crit.sha256},
               "reference": list(args.reference), "summary": counts,
               "exit_code": exit_code, "candidates": rows}
        from refrun.util.outputs import write_output

        write_output(args.json, json.dumps(doc, indent=1, allow_nan=False) + "\n", "--json")
    return exit_code
