"""Criterion kind ``step_time``: its TOML model and its check, side by side."""

from __future__ import annotations

import math

import numpy as np

from refrun import identity, schema
from refrun.acceptance import runview as rv
from refrun.acceptance.checks import Context, missing_in, result
from refrun.acceptance.criterion_evidence import Contention
from refrun.acceptance.model import Criterion, key, kind
from refrun.acceptance.results import FAIL, NOT_APPLICABLE, NOT_EVALUABLE, PASS, CriterionResult
from refrun.comparison import RunData, step_time_ratio

# The rule for "the candidate's machine was clearly busier than the references'"
# (docs/acceptance.md, "Step time on a busy machine"): other processes took at least
# CONTENTION_MARGIN_CORES more CPU (medians over each run's samples) during the candidate
# than during any reference, on a machine at least CONTENTION_SATURATED_PCT busy (with idle
# cores, others' work need not take time from the run's).  Half a core: a single-threaded
# neighbour that runs half the time; 90 %: at most a tenth of the CPUs idle.
CONTENTION_MARGIN_CORES = 0.5
CONTENTION_SATURATED_PCT = 90.0
# The second rule (same page): on a machine that saturated, others took more CPU during the
# candidate than during any reference AND the run itself got less than any reference got,
# each by at least CONTENTION_SHARE_MARGIN_CORES.  It needs no large margin because it does
# not infer the run's loss from the others' gain but reads it (``sys/run_cpu_cores``).
# 0.05 core: runs trained alike have medians within a few hundredths of each other (20
# seeds trained alike: own 0.95-1.00, others 0.94-1.01), so both moving by 0.05 at once is
# another condition, not the metrics' noise (two trainers sharing two cores, 1.0 core each,
# against references beside a lighter neighbour, 1.1-1.5).  Each rule only turns a fail
# into not_evaluable, never into a pass.
CONTENTION_SHARE_MARGIN_CORES = 0.05
# The third rule (same page): on a machine that saturated, other processes took at least a
# tenth of its CPUs (and half a core) during the candidate.  Neighbours that busy slow a
# step in ways no CPU share shows (a sibling hyperthread, memory bandwidth, caches):
# identical code at equal shares (the run 1.16 cores, others 0.84 of 2, as during the
# references) measured 1.2x beside one neighbour and 1.6x beside another (the fifteenth
# detection run).  A tenth, as for "saturated": on a 64-core machine a few busy neighbours
# leave the run's step alone.
CONTENTION_SHARED_FRACTION = 0.1


def run_median(run: RunData, metric: str, keep: str) -> float | None:
    """Median of the run's finite ``metric`` values (all its samples); None without."""
    r = rv.resolved(run, metric, keep)
    v = rv.finite(r).values if r is not None else np.empty(0)
    return float(np.median(v)) if len(v) else None


def contention(candidate: RunData, references: list[RunData], keep: str) -> Contention:
    """The contention figures of one judgement and whether each rule holds (see
    :data:`CONTENTION_MARGIN_CORES`, :data:`CONTENTION_SHARE_MARGIN_CORES` and
    :data:`CONTENTION_SHARED_FRACTION`): medians of
    ``sys/others_cpu_cores`` and ``sys/run_cpu_cores`` per run (the candidate's and each
    reference's), the candidate's median ``sys/cpu_pct`` and logical CPU count.  Not known
    when a run lacks the others' figure or the candidate its busy share; the second rule
    is not applied when a run lacks its own figure, the third without the CPU count."""
    others, own = schema.M_SYS_OTHERS_CPU_CORES, schema.M_SYS_RUN_CPU_CORES
    base = {"metric": others, "margin_cores": CONTENTION_MARGIN_CORES,
            "saturated_pct": CONTENTION_SATURATED_PCT,
            "share_margin_cores": CONTENTION_SHARE_MARGIN_CORES,
            "shared_fraction": CONTENTION_SHARED_FRACTION}
    cand = run_median(candidate, others, keep)
    busy = run_median(candidate, schema.M_SYS_CPU_PCT, keep)
    refs = [run_median(r, others, keep) for r in references]
    missing = ([] if cand is not None and busy is not None else [candidate.run_id]) + [
        r.run_id for r, v in zip(references, refs, strict=True) if v is None]
    if missing or not refs:
        return Contention(known=False, missing=tuple(missing), **base)
    ref_cores = tuple(float(v) for v in refs if v is not None)
    assert cand is not None and busy is not None
    saturated = busy >= CONTENTION_SATURATED_PCT
    busier = saturated and cand - max(ref_cores) >= CONTENTION_MARGIN_CORES
    cand_own = run_median(candidate, own, keep)
    refs_own = [run_median(r, own, keep) for r in references]
    ref_own = None if any(v is None for v in refs_own) else \
        tuple(float(v) for v in refs_own if v is not None)
    starved = (saturated and cand_own is not None and ref_own is not None
               and cand - max(ref_cores) >= CONTENTION_SHARE_MARGIN_CORES
               and min(ref_own) - cand_own >= CONTENTION_SHARE_MARGIN_CORES)
    cpus = run_median(candidate, schema.M_SYS_LOGICAL_CPUS, keep)
    shared = (saturated and cpus is not None
              and cand >= max(CONTENTION_MARGIN_CORES, CONTENTION_SHARED_FRACTION * cpus))
    return Contention(known=True, candidate_busier=busier, candidate_cores=cand,
                      reference_cores=ref_cores, candidate_cpu_pct=busy, logical_cpus=cpus,
                      candidate_starved=starved, candidate_run_cores=cand_own,
                      reference_run_cores=ref_own, candidate_shared=shared, **base)


def judged(c: Criterion, outcome: str, reason: str, ev: dict[str, object], cont: Contention,
           what: str = "step time") -> CriterionResult:
    """A speed result (``what``: step time, throughput) with its contention evidence.  A
    fail on a machine that took CPU from the candidate it did not take from the references
    (:attr:`Contention.took_cpu`) is not judged (the ratio cannot tell slower code from
    less CPU); a pass there stands (the code was within the limit even with less CPU)."""
    ev = {**ev, schema.EV_CONTENTION: cont.to_dict()}
    if outcome == FAIL and cont.took_cpu:
        return result(c, NOT_EVALUABLE, f"{cont.summary()}: {what} not judged (it would "
                      f"fail: {reason}); re-run the candidate on a machine as idle as the "
                      "references'", ev)
    return result(c, outcome, reason, ev)


def _backend_key(run: RunData) -> str | None:
    b = run.backend
    # Alias-aware (a stored "torch-xla" is torch_xla): refrun.identity's vocabulary.
    return (identity.canonical_backend(b) or b.strip().lower()) if b and b.strip() else None


@kind("step_time")
class StepTime(Criterion):
    """median (or low_quantile) step time after warm-up, candidate / reference (pooled reference
    runs) <= max_ratio"""

    max_ratio: float = key("largest allowed ratio (> 1: the candidate is slower)", gt=0)
    metric: str = key("step-time metric, seconds", schema.M_STEP_TIME)
    warmup_steps: int | None = key("warm-up steps (default: settings)", None, ge=0)
    compile_metrics: list[str] = key(
        "per-step compilation counters: a step where one of them is > 0 is a compilation "
        "step, left out of the median of every run ([] keeps every step)",
        list(schema.STEP_TIME_COMPILE_METRICS))
    across_backends: bool = key(
        "also judge a candidate whose refrun.backend differs from the references' (default "
        "false: not_applicable, a time ratio between frameworks says nothing about a "
        "migration)", False)
    low_quantile: float | None = key(
        "judge the ratio of this low quantile of the steady step times (e.g. 0.05: the "
        "fastest 5 % of the steps) instead of the medians' (reported too): other processes "
        "on the machine only add time, so the fastest steps measure the code and the "
        "median measures the machine as well. Default: the median", None, gt=0, le=0.5)

    def check(self, ctx: Context) -> CriterionResult:
        return step_time(self, ctx)


def step_time(c: StepTime, ctx: Context) -> CriterionResult:
    """Steady-state median step time, candidate / reference (reference points of all
    reference runs pooled) <= ``max_ratio``.  Steady: steps >= warm-up end that are no
    compilation step (``compile_metrics`` moved).  Same backend only unless
    ``across_backends``: a ratio between frameworks is ``not_applicable``."""
    missing = missing_in(ctx, c.metric)
    if missing:
        return result(c, NOT_EVALUABLE, missing)
    cand_b = _backend_key(ctx.candidate)
    ref_b = sorted({_backend_key(r) or "?" for r in ctx.references})
    scope = {"candidate_backend": ctx.candidate.backend, "reference_backends": ref_b,
             "across_backends": c.across_backends}
    if not c.across_backends:
        if cand_b is None or "?" in ref_b:
            return result(c, NOT_EVALUABLE, f"cannot tell whether the candidate and the "
                          f"references share a backend (a run has no {schema.TAG_BACKEND} "
                          "tag); set across_backends = true to compare anyway", scope)
        if ref_b != [cand_b]:
            return result(c, NOT_APPLICABLE, f"candidate backend {ctx.candidate.backend!r} "
                          f"differs from the references' ({', '.join(ref_b)}): a step-time "
                          "ratio between frameworks says nothing about the migration "
                          "(across_backends = true to judge it anyway)", scope)
    spans = [rv.resolved(r, c.metric, ctx.keep) for r in [*ctx.references, ctx.candidate]]
    all_steps = np.concatenate([rv.finite(s).steps for s in spans if s is not None])
    if not len(all_steps):
        return result(c, NOT_EVALUABLE, f"no finite {c.metric!r} values")
    start = ctx.warmup(np.array([all_steps.min(), all_steps.max()]), c.warmup_steps)
    refs = [rv.steady_step_times(r, c.metric, c.compile_metrics, ctx.keep, start)
            for r in ctx.references]
    cand = rv.steady_step_times(ctx.candidate, c.metric, c.compile_metrics, ctx.keep, start)
    m = step_time_ratio(np.concatenate([s[0] for s in refs]),
                        np.concatenate([s[1] for s in refs]), cand[0], cand[1], start)
    ev = {**scope, "warmup_end_step": start, "reference_median_s": m.reference_median,
          "candidate_median_s": m.candidate_median, "reference_n": m.reference_n,
          "candidate_n": m.candidate_n, "ratio": m.ratio, "max_ratio": c.max_ratio,
          "compile_steps_excluded": {"candidate": cand[2],
                                     "references": int(sum(s[2] for s in refs))}}
    if m.ratio is None:
        return result(c, NOT_EVALUABLE, f"no steady {c.metric!r} value after step {start} "
                      f"(reference n={m.reference_n}, candidate n={m.candidate_n})", ev)
    tail = f"({cand[2]} compilation step(s) of the candidate left out)"
    cont = contention(ctx.candidate, list(ctx.references), ctx.keep)
    if c.low_quantile is None:
        ok = m.ratio <= c.max_ratio
        return judged(c, PASS if ok else FAIL,
                       f"steady median step time {rv.fnum(m.candidate_median)} s vs "
                       f"{rv.fnum(m.reference_median)} s: ratio {m.ratio:.3f} "
                       f"{'<=' if ok else '>'} {c.max_ratio:g} {tail}", ev, cont)
    ref_low = float(np.quantile(np.concatenate([s[1] for s in refs]), c.low_quantile))
    cand_low = float(np.quantile(cand[1], c.low_quantile))
    low = cand_low / ref_low if ref_low > 0 else math.inf
    ok = low <= c.max_ratio
    ev.update(low_quantile=c.low_quantile, reference_low_s=ref_low, candidate_low_s=cand_low,
              low_quantile_ratio=low, judged_ratio=low)
    return judged(c, PASS if ok else FAIL,
                   f"fastest {c.low_quantile:.0%} of the steady steps "
                   f"{rv.fnum(cand_low)} s vs {rv.fnum(ref_low)} s: ratio {low:.3f} "
                   f"{'<=' if ok else '>'} {c.max_ratio:g} (medians "
                   f"{rv.fnum(m.candidate_median)} s vs {rv.fnum(m.reference_median)} s, "
                   f"ratio {m.ratio:.3f}) {tail}", ev, cont)
