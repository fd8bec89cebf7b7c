"""``refrun calibrate``: write a criteria file from N >= 3 reference seeds, or re-measure
one (``--check``).

Exit codes: 0 written / every criterion accepts every held-out seed, 1 (``--check``) a
criterion rejects a held-out seed, 2 bad usage or input (nothing written).
"""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

from refrun.cli import add_tracking_uri

EPILOG = textwrap.dedent("""\
    how it works:
      Each reference seed is held out in turn and judged against groups of --group-size
      of the others, as a benign candidate would be; every threshold is the upper
      tolerance limit of what the held-out seeds needed, so it grows when seeds are few
      or disagree.  The file states, per criterion, the worst held-out value, the margin
      and the smallest shift it detects, plus a [calibration] table (runs, N, method,
      date, refrun version).  Use as many references with `refrun accept` as the group
      size.  Every evaluation metric gets an L3 criterion from its final evaluation,
      however it was logged: log_eval (eval/...), a name that says evaluation
      (val/accuracy, val_loss, eval_loss, Accuracy/test), an evaluation cadence (every
      N steps while training metrics are logged every step) or --eval-metric; the file's
      notes say which were taken.  Without any, --goal states the project's goal (else
      exit 2).
      When the store holds known-good same-seed evidence (a run tagged
      refrun.pair.known_good with the refrun.pair.seed of a reference seed), a `paired`
      criterion on the loss is written from it; otherwise a note says why not.

    examples:
      refrun calibrate --workload digits-mlp -o criteria.toml
      refrun calibrate --workload W --goal eval/accuracy>=0.9 -o criteria.toml
      refrun calibrate --workload W --goal 'throughput>=0.9x' --goal 'cost<=1.2x' \
          --price nvidia-l4=0.71 --price tpu-v5e=1.2 -o criteria.toml
      refrun calibrate --reference ID1 ID2 ID3 ID4 --group-size 3 -o criteria.toml
      refrun calibrate --check criteria.toml --workload digits-mlp
      refrun accept --criteria criteria.toml --reference ID1 ID2 ID3 --candidate CAND
    """)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate", help="write a criteria file from reference seeds (held-out validation)",
        description="Derive every threshold of a criteria file from N >= 3 reference runs "
                    "(seeds) by held-out validation, or re-measure a file with --check.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--reference", nargs="+", action="extend", metavar="ID",
                     help="reference run ids (N >= 3 seeds of one workload)")
    src.add_argument("--workload", metavar="W",
                     help="take every finished run of workload W with role reference")
    p.add_argument("-o", "--output", type=Path, default=None, metavar="FILE",
                   help="write the criteria file here (default: print it)")
    p.add_argument("--check", type=Path, default=None, metavar="FILE",
                   help="re-measure FILE against the references: name every criterion "
                        "that rejects a held-out seed (exit 1 if any)")
    p.add_argument("--false-alarm-rate", type=float, default=0.05, metavar="P",
                   help="target probability that a benign candidate fails any criterion "
                        "of the file (default 0.05)")
    p.add_argument("--confidence", type=float, default=0.9, metavar="C",
                   help="confidence of the tolerance limits (default 0.9)")
    p.add_argument("--group-size", type=int, default=None, metavar="G",
                   help="references per held-out group = references you will pass to "
                        "accept (default N - 1)")
    p.add_argument("--min-fraction", type=float, default=0.9, metavar="F",
                   help="fraction of steps k is calibrated for and the most a per-step "
                        "envelope requires inside; the fraction required is derived from "
                        "the references' leave-one-out shortfalls, at least 2F - 1 "
                        "(default 0.9)")
    p.add_argument("--max-groups", type=int, default=None, metavar="K",
                   help="held-out groups per seed: every combination up to K, else a "
                        "fixed sample of K (default 100; --check: 5)")
    p.add_argument("--metric", nargs="+", action="extend", default=None, metavar="M",
                   help="calibrate only these metrics (default: every shared metric)")
    p.add_argument("--eval-metric", action="append", default=[], metavar="M",
                   help="judge M as an evaluation series (L3, by its final evaluation) "
                        "when neither its name (val/..., eval_..., .../test), log_eval, "
                        "nor its cadence says so (repeatable)")
    p.add_argument("--exclude", nargs="+", action="extend", default=[], metavar="KIND",
                   help="leave out criteria of these kinds, e.g. step_time when the "
                        "references ran on other machines than the candidates will")
    p.add_argument("--step-time-floor", type=float, default=None, metavar="R",
                   help="smallest step-time max_ratio written (default 1.5: medians of "
                        "identical runs on a shared machine vary by up to 1.6x, which "
                        "back-to-back reference runs do not show); lower it on dedicated "
                        "hardware")
    p.add_argument("--keep-outliers", action="store_true",
                   help="keep reference seeds named as outliers in the thresholds "
                        "(default: left out, and named in the output and the file)")
    p.add_argument("--warmup-steps", type=int, default=None, metavar="S",
                   help="warm-up steps for step time and counters (default: 10%% of the run)")
    p.add_argument("--goal", action="append", default=[], metavar="METRIC>=VALUE",
                   help="the project's stated goal, e.g. eval/accuracy>=0.9 or "
                        "eval/val_loss<=1.2 (repeatable): an L3 'claim' criterion each. "
                        "Needed when the references log no evaluation metric: without an "
                        "L3 criterion no candidate reaches L3 and L4 is never judged. "
                        "L4 goals of a migration (other hardware, backend or chip count): "
                        "throughput>=0.9x (steady throughput, ratio to the references'), "
                        "cost<=1.2x (cost per run for the same work, ratio; needs --price), "
                        "utilization>=50%% (the candidate's chips busy): an L4 criterion "
                        "each, applied to migrated candidates only")
    p.add_argument("--price", action="append", default=[], metavar="HARDWARE=PER_HOUR",
                   help="price per hour of a hardware kind, as runs' refrun.hardware tags "
                        "name it, e.g. nvidia-l4=0.71 tpu-v5e=1.2 (repeatable): written as "
                        "the file's [prices] table (cost goals, and the cost a migration's "
                        "L4 figures show)")
    p.add_argument("--require-gradcheck", action="store_true",
                   help="add an L1 'gradcheck' criterion: every candidate needs a passed "
                        "gradient-check run recorded for it (refrun.gradcheck.record with "
                        "candidate_run_id); off by default")
    add_tracking_uri(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from refrun.acceptance.calibration import (
        CalibrationOptions,
        calibrate,
        check_file,
        known_good_runs,
        parse_goal,
        parse_price,
        reference_ids,
        write_file,
    )
    from refrun.acceptance.criteria import CriteriaSettings, Prices, load_criteria
    from refrun.comparison import load_run
    from refrun.errors import RefrunInputError
    from refrun.store.uri import existing_store_uri
    from refrun.util.outputs import check_output

    if args.output is not None:  # before any store is opened
        check_output(args.output, "--output")
    # A bad --check file or --goal is refused before any store is opened (one line, exit 2).
    goals = tuple(parse_goal(g) for g in args.goal)
    hourly: dict[str, float] = {}
    for text in args.price:
        hw, price = parse_price(text)
        if hw in hourly:
            raise RefrunInputError(f"--price {text!r}: {hw} is priced twice")
        hourly[hw] = price
    crit = load_criteria(args.check) if args.check is not None else None
    uri = existing_store_uri(args.tracking_uri)
    ids = list(args.reference or reference_ids(args.workload, uri))
    if args.workload and not ids:
        raise RefrunInputError(f"--workload {args.workload}: no finished reference run in {uri}")
    from refrun.acceptance.criteria import CRITERION_KINDS

    bad = [k for k in args.exclude if k not in CRITERION_KINDS]
    if bad:
        raise RefrunInputError(f"--exclude: {', '.join(bad)} not a criterion kind "
                               f"({', '.join(CRITERION_KINDS)})")
    if args.warmup_steps is not None and args.warmup_steps < 0:
        raise RefrunInputError(f"--warmup-steps: {args.warmup_steps} must be >= 0")
    if args.max_groups is not None and args.max_groups < 1:
        raise RefrunInputError(f"--max-groups: {args.max_groups} must be >= 1")
    runs = [load_run(i, tracking_uri=uri, progress=False) for i in ids]
    if crit is not None:
        report = check_file(crit, runs, args.group_size,
                            max_groups=5 if args.max_groups is None else args.max_groups)
        print(report.text())
        return 0 if report.ok else 1
    opts = CalibrationOptions(
        false_alarm_rate=args.false_alarm_rate, confidence=args.confidence,
        group_size=args.group_size, min_fraction=args.min_fraction,
        **({} if args.max_groups is None else {"max_groups": args.max_groups}),
        metrics=tuple(args.metric) if args.metric else None,
        eval_metrics=tuple(args.eval_metric),
        exclude_kinds=tuple(args.exclude), require_gradcheck=args.require_gradcheck,
        goals=goals, prices=Prices(hourly=hourly), keep_outliers=args.keep_outliers,
        **({} if args.step_time_floor is None else {"step_time_floor": args.step_time_floor}),
        settings=CriteriaSettings(warmup_steps=args.warmup_steps))
    result = calibrate(runs, opts, known_good_runs(runs, uri))
    if args.output is None:
        print(result.text())
        return 0
    write_file(result, str(args.output))
    print(f"wrote {args.output}: {len(result.criteria)} criteria from {len(ids)} reference "
          f"seeds (groups of {result.group_size})")
    print("power (smallest shift each criterion detects):")
    for line in result.power():
        print(f"  {line}")
    for o in result.outliers:
        print(f"outlier: {o.text()}")
    for note in result.notes:
        print(f"note: {note}")
    return 0
