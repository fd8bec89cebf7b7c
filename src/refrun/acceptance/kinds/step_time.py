"""Criterion kind ``step_time``: its TOML model and its check, side by side."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from refrun import identity, schema
from refrun.acceptance import runview as rv
from refrun.acceptance.checks import Context, missing_in, result
from refrun.acceptance.contention import (
    CPU_CLOCK_FRACTION,
    clock_step,
    clock_unresolved,
    contention,
    cpu_inflation_bound,
    finite_dict,
    judged,
)
from refrun.acceptance.criterion_evidence import Contention
from refrun.acceptance.model import Criterion, key, kind
from refrun.acceptance.results import FAIL, NOT_APPLICABLE, NOT_EVALUABLE, PASS, CriterionResult
from refrun.comparison import RunData, step_time_ratio


def cpu_floor_ratio(candidate_cpu_s: float, inflation: float, reference_time_s: float
                    ) -> float:
    """A lower bound on the candidate's step-time ratio on a machine as idle as the
    references': ``(candidate CPU seconds / inflation) / reference step seconds``.  The
    training thread runs its CPU seconds one after the other inside the step, so its step
    takes at least those seconds, less what the neighbours' shared hardware added
    (:func:`cpu_inflation_bound`); the same quantile on both sides (a quantile of step
    times >= the quantile of their CPU parts).  The references' wall time includes what
    contention they met, so the bound errs low."""
    return (candidate_cpu_s / inflation) / reference_time_s if reference_time_s > 0 \
        else math.inf


@dataclass(frozen=True)
class CpuFloor:
    """What the candidate's own CPU seconds per step (``metric``) say about a step-time
    ratio that contention made not judgeable: ``lower_ratio`` (:func:`cpu_floor_ratio`)
    from ``candidate_cpu_s`` and ``reference_time_s`` (the criterion's statistic:
    ``statistic``, of the steady steps), ``inflation_bound`` (:func:`cpu_inflation_bound`
    of ``others_cores`` and ``logical_cpus``).  ``usable``: the figures exist and the clock
    resolved them (``clock_step_s`` <= ``CPU_CLOCK_FRACTION`` of ``candidate_cpu_s``);
    ``why``: why not, when not."""

    evidence_key: ClassVar[str] = schema.EV_CPU_FLOOR
    usable: bool
    metric: str
    statistic: str
    why: str = ""
    candidate_cpu_s: float | None = None
    candidate_n: int = 0
    reference_time_s: float | None = None
    others_cores: float | None = None
    logical_cpus: float | None = None
    inflation_bound: float | None = None
    clock_step_s: float | None = None
    clock_fraction: float = CPU_CLOCK_FRACTION
    lower_ratio: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return finite_dict(self)

    def holds(self, limit: float) -> bool:
        """The fail stands: even on an idle machine the ratio would exceed ``limit``."""
        return self.usable and self.lower_ratio is not None and self.lower_ratio > limit

    def versus(self, limit: float) -> str:
        return f" > {limit:g}" if self.holds(limit) else f" <= {limit:g}"

    def summary(self) -> str:
        if not self.usable:
            return f"the candidate's CPU time per step cannot bound it ({self.why})"
        return (f"the candidate's own CPU time per step ({self.statistic} "
                f"{rv.fnum(self.candidate_cpu_s)} s) over the most {self.others_cores:.2f} "
                f"busy of {self.logical_cpus:g} CPUs can inflate it "
                f"({self.inflation_bound:.2f}x) puts its step-time ratio at >= "
                f"{self.lower_ratio:.3f}")


def cpu_floor(candidate: RunData, c: StepTime, keep: str, start: int, ref_time: float,
              cont: Contention, per_step: float = 1.0) -> CpuFloor:
    """The :class:`CpuFloor` of a candidate whose step time contention made not
    judgeable: its steady ``perf/step_cpu_s`` (same steps as its step times, the
    criterion's statistic; divided by ``per_step`` where times are per sample or token)
    against the references' ``ref_time``."""
    q = c.low_quantile
    stat = "median" if q is None else f"fastest {q:.0%}"
    base: dict[str, Any] = {"metric": schema.M_STEP_CPU, "statistic": stat,
                            "reference_time_s": ref_time,
                            "others_cores": cont.candidate_cores,
                            "logical_cpus": cont.logical_cpus}
    cpu = rv.steady_step_times(candidate, schema.M_STEP_CPU, c.compile_metrics, keep,
                               start)[1] / per_step
    if not len(cpu):
        return CpuFloor(False, why=f"no steady {schema.M_STEP_CPU} values", **base)
    if cont.candidate_cores is None or not cont.logical_cpus:
        return CpuFloor(False, why="the machine's CPU count is not known",
                        candidate_n=len(cpu), **base)
    got = float(np.median(cpu) if q is None else np.quantile(cpu, q))
    tick = clock_step(cpu)
    infl = cpu_inflation_bound(cont.candidate_cores, cont.logical_cpus)
    base.update(candidate_cpu_s=got, candidate_n=len(cpu), inflation_bound=infl,
                clock_step_s=tick)
    if why := clock_unresolved(tick, got):
        return CpuFloor(False, why=why, **base)
    return CpuFloor(True, lower_ratio=cpu_floor_ratio(got, infl, ref_time), **base)


@dataclass(frozen=True)
class CpuCeiling:
    """What the references' own CPU seconds per step (``metric``) say about a pass against
    references recorded beside busy neighbours (:attr:`Contention.references_busier`):
    ``upper_ratio`` = (candidate's step-time statistic x ``inflation_bound``) / the
    references' CPU statistic, an upper bound on the ratio against the references on an idle
    machine, since an idle reference step takes at least its CPU seconds, which the
    neighbours inflated by at most :func:`cpu_inflation_bound`.  ``usable`` and ``why`` as
    :class:`CpuFloor`'s (the clock must resolve the references' CPU seconds)."""

    evidence_key: ClassVar[str] = schema.EV_CPU_CEILING
    usable: bool
    metric: str
    statistic: str
    why: str = ""
    reference_cpu_s: float | None = None
    reference_n: int = 0
    candidate_time_s: float | None = None
    others_cores: float | None = None
    logical_cpus: float | None = None
    inflation_bound: float | None = None
    clock_step_s: float | None = None
    clock_fraction: float = CPU_CLOCK_FRACTION
    upper_ratio: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return finite_dict(self)

    def holds(self, limit: float) -> bool:
        """The pass stands: even against idle references the ratio is within ``limit``."""
        return self.usable and self.upper_ratio is not None and self.upper_ratio <= limit

    def versus(self, limit: float) -> str:
        return f" <= {limit:g}" if self.holds(limit) else f" > {limit:g}"

    def summary(self) -> str:
        if not self.usable:
            return f"the references' CPU time per step cannot bound it ({self.why})"
        return (f"the references' own CPU time per step ({self.statistic} "
                f"{rv.fnum(self.reference_cpu_s)} s), which neighbours of up to "
                f"{self.others_cores:.2f} of {self.logical_cpus:g} CPUs inflate at most "
                f"{self.inflation_bound:.2f}x, puts the ratio on an idle machine at <= "
                f"{self.upper_ratio:.3f}")


def cpu_ceiling(references: list[RunData], c: StepTime, keep: str, start: int,
                cand_time: float, cont: Contention,
                per_step: tuple[int, ...] | None = None) -> CpuCeiling:
    """The :class:`CpuCeiling` of a pass against busy references: their steady
    ``perf/step_cpu_s`` pooled (divided by each reference's data per step where times are
    per sample or token), the criterion's statistic, against the candidate's
    ``cand_time``; the inflation of the busiest reference's neighbours."""
    q = c.low_quantile
    stat = "median" if q is None else f"fastest {q:.0%}"
    cpus = cont.busiest_reference()[1]
    base: dict[str, Any] = {"metric": schema.M_STEP_CPU, "statistic": stat,
                            "candidate_time_s": cand_time, "others_cores": cont.reference_max,
                            "logical_cpus": cpus}
    parts = [rv.steady_step_times(r, schema.M_STEP_CPU, c.compile_metrics, keep, start)[1]
             / (per_step[k] if per_step else 1) for k, r in enumerate(references)]
    if any(not len(p) for p in parts):
        return CpuCeiling(False, why=f"a reference has no steady {schema.M_STEP_CPU} values",
                          **base)
    cpu = np.concatenate(parts)
    if cont.reference_max is None or not cpus:
        return CpuCeiling(False, why="the references' CPU count is not known",
                          reference_n=len(cpu), **base)
    got = float(np.median(cpu) if q is None else np.quantile(cpu, q))
    tick = max(clock_step(p) for p in parts)  # the coarsest of their clocks
    infl = cpu_inflation_bound(cont.reference_max, cpus)
    base.update(reference_cpu_s=got, reference_n=len(cpu), inflation_bound=infl,
                clock_step_s=tick)
    if why := clock_unresolved(tick, got):
        return CpuCeiling(False, why=why, **base)
    return CpuCeiling(True, upper_ratio=cand_time * infl / got, **base)


def data_per_step(axis: str, candidate: RunData, references: list[RunData]
                  ) -> tuple[int, tuple[int, ...], str] | None:
    """``(candidate's, references' data per step, unit)`` when runs aligned on samples
    (tokens) process different amounts of it per step, else None: then step time is
    judged per sample (token), what a user comparing a run with twice the global batch by
    samples means (issue 52).  Data per step: ``refrun.global_batch`` (times
    ``refrun.tokens_per_sample`` for tokens); None when a run lacks a tag or on the step
    axis (a ratio of step times, as before)."""
    if axis not in ("samples", "tokens"):
        return None

    def per(run: RunData) -> int | None:
        b = rv.tag_int(run, schema.TAG_GLOBAL_BATCH)
        t = rv.tag_int(run, schema.TAG_TOKENS_PER_SAMPLE) if axis == "tokens" else 1
        return b * t if b and t else None

    cand, refs = per(candidate), [per(r) for r in references]
    if cand is None or any(r is None for r in refs) or set(refs) == {cand}:
        return None
    return cand, tuple(int(r) for r in refs if r is not None), axis.rstrip("s")


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
    per = data_per_step(ctx.criteria.settings.axis, ctx.candidate, list(ctx.references))
    if per is not None:  # seconds per sample (token): the runs do different work per step
        refs = [(s[0], s[1] / n, s[2]) for s, n in zip(refs, per[1], strict=True)]
        cand = (cand[0], cand[1] / per[0], cand[2])
        scope = {**scope, "per": per[2], "candidate_per_step": per[0],
                 "reference_per_step": list(per[1])}
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
    tail = (f"({cand[2]} step(s) of the candidate left out: compilations, and an "
            "interval step time's between-step work)")
    if per is not None:
        tail += (f"; per {per[2]}: the candidate processes {per[0]} per step, the "
                 f"references {', '.join(map(str, sorted(set(per[1]))))}")
    cont = contention(ctx.candidate, list(ctx.references), ctx.keep)
    if c.low_quantile is None:
        ok = m.ratio <= c.max_ratio
        floor = None if ok or not cont.took_cpu or m.reference_median is None else \
            cpu_floor(ctx.candidate, c, ctx.keep, start, m.reference_median, cont,
                      per[0] if per is not None else 1.0)
        ceiling = None if not ok or not cont.references_busier or \
            m.candidate_median is None else \
            cpu_ceiling(list(ctx.references), c, ctx.keep, start, m.candidate_median, cont,
                        per[1] if per is not None else None)
        return judged(c, PASS if ok else FAIL,
                       f"steady median step time {rv.fnum(m.candidate_median)} s vs "
                       f"{rv.fnum(m.reference_median)} s: ratio {m.ratio:.3f} "
                       f"{'<=' if ok else '>'} {c.max_ratio:g} {tail}", ev, cont,
                      floor=floor, limit=c.max_ratio, ceiling=ceiling)
    ref_low = float(np.quantile(np.concatenate([s[1] for s in refs]), c.low_quantile))
    cand_low = float(np.quantile(cand[1], c.low_quantile))
    low = cand_low / ref_low if ref_low > 0 else math.inf
    ok = low <= c.max_ratio
    ev.update(low_quantile=c.low_quantile, reference_low_s=ref_low, candidate_low_s=cand_low,
              low_quantile_ratio=low, judged_ratio=low)
    floor = None if ok or not cont.took_cpu else \
        cpu_floor(ctx.candidate, c, ctx.keep, start, ref_low, cont,
                  per[0] if per is not None else 1.0)
    ceiling = None if not ok or not cont.references_busier else \
        cpu_ceiling(list(ctx.references), c, ctx.keep, start, cand_low, cont,
                    per[1] if per is not None else None)
    return judged(c, PASS if ok else FAIL,
                   f"fastest {c.low_quantile:.0%} of the steady steps "
                   f"{rv.fnum(cand_low)} s vs {rv.fnum(ref_low)} s: ratio {low:.3f} "
                   f"{'<=' if ok else '>'} {c.max_ratio:g} (medians "
                   f"{rv.fnum(m.candidate_median)} s vs {rv.fnum(m.reference_median)} s, "
                   f"ratio {m.ratio:.3f}) {tail}", ev, cont, floor=floor,
                  limit=c.max_ratio, ceiling=ceiling)
