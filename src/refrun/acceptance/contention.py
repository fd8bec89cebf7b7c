"""What a machine's load lets a speed or cost judgement say: the contention rules (is the
candidate's machine busier than the references', or theirs than the candidate's), the
most neighbours can inflate a thread's CPU seconds, and :func:`judged`, which turns a
speed or cost result the load can explain into ``not_evaluable`` unless a bound from the
runs' own CPU time (a :class:`SpeedBound`) settles it.  Used by the ``step_time``,
``throughput`` and ``cost`` kinds; docs/acceptance.md, "Step time on a busy machine"."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, ClassVar, Protocol

import numpy as np

from refrun import schema
from refrun.acceptance import runview as rv
from refrun.acceptance.checks import result
from refrun.acceptance.criterion_evidence import Contention
from refrun.acceptance.model import Criterion
from refrun.acceptance.results import FAIL, NOT_EVALUABLE, PASS, CriterionResult
from refrun.comparison import RunData

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
# What contention cannot explain (docs/acceptance.md, "Step time on a busy machine"): a
# thread that waits for a core accrues no CPU time (time.thread_time, the probes'
# ``perf/step_cpu_s``), so neighbours lengthen the training thread's CPU seconds per step
# only through hardware they share with it: a sibling hyperthread, caches, memory
# bandwidth.  Assumed: at most CPU_INFLATION_AT_FULL more (a doubling: two hyperthreads of
# one core each keep at least half of it) when other processes occupy every logical CPU,
# in proportion to the share of the machine they occupy.  A stated assumption, not a
# figure fitted to any measurement; code whose time goes to memory bandwidth a neighbour
# saturates can exceed it, which is why the floor below divides by it rather than being
# compared with a margin.
CPU_INFLATION_AT_FULL = 1.0
# The thread CPU clock must resolve the step: its smallest step between two of the
# candidate's values (a coarse clock's values are multiples of its tick, e.g. in
# gVisor-like sandboxes) at most this fraction of the CPU seconds judged; else the floor
# is not used and the result stays not_evaluable (never a fail read off a coarse clock).
CPU_CLOCK_FRACTION = 0.01


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
    is not applied when a run lacks its own figure, the third without the CPU count.  The
    references' rule (:func:`references_busier`) is read whenever every reference has
    its figures, the candidate's or not."""
    others, own = schema.M_SYS_OTHERS_CPU_CORES, schema.M_SYS_RUN_CPU_CORES
    base: dict[str, Any] = {"metric": others, "margin_cores": CONTENTION_MARGIN_CORES,
                            "saturated_pct": CONTENTION_SATURATED_PCT,
                            "share_margin_cores": CONTENTION_SHARE_MARGIN_CORES,
                            "shared_fraction": CONTENTION_SHARED_FRACTION}
    cand = run_median(candidate, others, keep)
    busy = run_median(candidate, schema.M_SYS_CPU_PCT, keep)
    refs = [run_median(r, others, keep) for r in references]
    ref_pct = [run_median(r, schema.M_SYS_CPU_PCT, keep) for r in references]
    ref_cpus = [run_median(r, schema.M_SYS_LOGICAL_CPUS, keep) for r in references]
    if refs and all(v is not None for v in (*refs, *ref_pct)):
        base.update(reference_cores=tuple(float(v) for v in refs if v is not None),
                    reference_cpu_pct=tuple(float(v) for v in ref_pct if v is not None),
                    reference_logical_cpus=None if any(v is None for v in ref_cpus) else
                    tuple(float(v) for v in ref_cpus if v is not None))
        base["references_busier"] = references_busier(
            base["reference_cores"], base["reference_cpu_pct"], ref_cpus, cand)
    missing = ([] if cand is not None and busy is not None else [candidate.run_id]) + [
        r.run_id for r, v in zip(references, refs, strict=True) if v is None]
    if missing or not refs:
        return Contention(known=False, missing=tuple(missing), **base)
    ref_cores = tuple(float(v) for v in refs if v is not None)
    base.pop("reference_cores", None)
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


def references_busier(ref_cores: tuple[float, ...], ref_pct: tuple[float, ...],
                      ref_cpus: list[float | None], candidate_cores: float | None) -> bool:
    """The references' rule (docs/acceptance.md, "Step time on a busy machine"): some
    reference ran on a machine at least CONTENTION_SATURATED_PCT busy beside other
    processes using at least CONTENTION_MARGIN_CORES and CONTENTION_SHARED_FRACTION of its
    CPUs (the third rule's neighbour, seen from the reference), and at least
    CONTENTION_MARGIN_CORES more than during the candidate, or the candidate's figure is
    not known (a host that reads no system CPU figures, as a TPU VM under gVisor).  Its
    step times may then include what those neighbours cost it, which no recorded figure
    takes back out, so a candidate that looks fast enough against it is not judged: the
    mirror of the candidate's rules, which only ever turn a fail into not_evaluable."""
    for cores, pct, cpus in zip(ref_cores, ref_pct, ref_cpus, strict=True):
        need = CONTENTION_MARGIN_CORES if not cpus else \
            max(CONTENTION_MARGIN_CORES, CONTENTION_SHARED_FRACTION * cpus)
        if pct >= CONTENTION_SATURATED_PCT and cores >= need and (
                candidate_cores is None or cores - candidate_cores >= CONTENTION_MARGIN_CORES):
            return True
    return False


def cpu_inflation_bound(others_cores: float, logical_cpus: float) -> float:
    """The most other processes using ``others_cores`` of ``logical_cpus`` can multiply a
    thread's CPU seconds per step by: ``1 + CPU_INFLATION_AT_FULL * min(1, others/cpus)``
    (see :data:`CPU_INFLATION_AT_FULL`: shared hardware only, since a thread waiting for a
    core accrues no CPU time; Linux ``CLOCK_THREAD_CPUTIME_ID``, clock_gettime(2))."""
    share = min(1.0, max(0.0, others_cores) / logical_cpus) if logical_cpus > 0 else 1.0
    return 1.0 + CPU_INFLATION_AT_FULL * share


def clock_step(values: np.ndarray) -> float:
    """The smallest positive difference between two of ``values`` (inf with fewer than
    two distinct ones): an upper bound on the resolution of the clock they were read
    from, since a clock with tick t yields multiples of t, whose differences are >= t."""
    u = np.unique(values[np.isfinite(values)])
    d = np.diff(u)
    d = d[d > 0]
    return float(d.min()) if len(d) else math.inf


def clock_unresolved(tick: float, cpu_s: float) -> str:
    """Why CPU seconds per step of ``cpu_s`` read off a clock whose values step by up to
    ``tick`` (:func:`clock_step`) cannot bound a ratio (more than
    :data:`CPU_CLOCK_FRACTION` of them, or none); empty when the clock resolves them."""
    if cpu_s > 0 and tick <= CPU_CLOCK_FRACTION * cpu_s:
        return ""
    return (f"the thread CPU clock moves in steps of up to {rv.fnum(tick)} s, more than "
            f"{CPU_CLOCK_FRACTION:.0%} of {rv.fnum(cpu_s)} s")


def per_run(values: Sequence[float | None] | None, n: int) -> Sequence[float | None]:
    """One figure per bounded run: ``values`` when it has ``n`` of them (a
    :class:`Contention`'s per-reference tuple, or the candidate's one), else ``n`` unknowns."""
    return values if values is not None and len(values) == n else (None,) * n


def run_cpu_inflation(run_id: str, others: float | None, cpus: float | None,
                      cpu: np.ndarray, missing: str) -> tuple[float, float, str]:
    """``(B, clock step, why)`` of one run whose CPU seconds per step ``cpu`` are to bound a
    speed or cost result: ``B`` = :func:`cpu_inflation_bound` of its neighbours' ``others``
    cores of ``cpus``; ``why`` (then ``B`` is NaN) when its load or CPU count is unknown,
    it has no values (``missing``, said of the run) or its clock does not resolve their
    median (:func:`clock_unresolved`; the clock step is then known)."""
    if others is None or not cpus:
        return math.nan, math.nan, f"run {run_id}'s machine load or CPU count is not known"
    if not len(cpu):
        return math.nan, math.nan, f"run {run_id} {missing}"
    tick = clock_step(cpu)
    if why := clock_unresolved(tick, float(np.median(cpu))):
        return math.nan, tick, f"run {run_id}: {why}"
    return cpu_inflation_bound(others, cpus), tick, ""


def finite_dict(bound: Any) -> dict[str, Any]:
    """A bound's evidence: its dataclass fields, an infinite or NaN figure as None (JSON)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in asdict(bound).items()}


class SpeedBound(Protocol):
    """What a run's own CPU seconds per step say about a speed ratio the machine's load
    made not judgeable (step time's
    :class:`~refrun.acceptance.kinds.step_time.CpuFloor` and
    :class:`~refrun.acceptance.kinds.step_time.CpuCeiling`, throughput's
    ``CpuRateBound``): :meth:`holds` is true when the bound settles the result whatever
    the neighbours did (a fail stands, or a pass stands, against ``limit``)."""

    evidence_key: ClassVar[str]
    usable: bool

    def holds(self, limit: float) -> bool: ...

    def versus(self, limit: float) -> str: ...

    def summary(self) -> str: ...

    def to_dict(self) -> dict[str, Any]: ...


def contended_references(cont: Contention, floor: SpeedBound | None) -> str:
    """The clause a not-judged result adds when its CPU floor was usable but no higher
    than the limit while the references were themselves recorded beside busy neighbours
    (:attr:`Contention.references_beside_neighbours`): the floor divides by their step
    time, which then may include what those neighbours cost them, and nothing refrun
    records bounds their step time on an idle machine more tightly (their thread CPU
    seconds do not: a step also waits, for a device, I/O or other threads, and no recorded
    figure tells that wait from a wait for a core).  Empty otherwise."""
    top = cont.references_beside_neighbours
    if floor is None or not floor.usable or top is None:
        return ""
    of = f" of {cont.logical_cpus:g} CPUs" if cont.logical_cpus else " cores"
    return (f"; the references were themselves recorded beside other processes (up to "
            f"{top:.2f}{of}): their step times, which the floor divides by, may include "
            "what those neighbours cost them, and no figure refrun records bounds them "
            "more tightly")


def judged(c: Criterion, outcome: str, reason: str, ev: dict[str, object], cont: Contention,
           what: str = "step time", floor: SpeedBound | None = None,
           limit: float | None = None, ceiling: SpeedBound | None = None
           ) -> CriterionResult:
    """A speed or cost result (``what``: step time, throughput, cost) with its contention
    evidence.  A
    fail on a machine that took CPU from the candidate it did not take from the references
    (:attr:`Contention.took_cpu`) is not judged (the ratio cannot tell slower code from
    less CPU), unless the candidate's own CPU time per step (``floor``) settles it against
    ``limit`` whatever the neighbours did (then it fails, the floor in the reason); a pass
    there stands (the code was within the limit even with less CPU).  A pass against
    references the machine slowed more than the candidate (:attr:`Contention.references_busier`)
    is not judged either: the ratio cannot tell a fast candidate from slowed references,
    unless the references' own CPU time per step (``ceiling``) settles it against ``limit``
    whatever their neighbours did."""
    ev = {**ev, schema.EV_CONTENTION: cont.to_dict()}
    if outcome == PASS and cont.references_busier:
        if ceiling is not None:
            ev[ceiling.evidence_key] = ceiling.to_dict()
            if limit is not None and ceiling.holds(limit):
                return result(c, PASS, f"{reason}; busy references cannot explain it: "
                              f"{cont.references_summary()}, but {ceiling.summary()}"
                              f"{ceiling.versus(limit)}", ev)
        tail = "" if ceiling is None else f"; {ceiling.summary()}" + (
            ceiling.versus(limit) if ceiling.usable and limit is not None else "")
        return result(c, NOT_EVALUABLE, f"{cont.references_summary()}: {what} not judged "
                      f"(it would pass: {reason}{tail}); re-record the references on a "
                      "machine as idle as the candidate's", ev)
    if outcome == FAIL and cont.took_cpu:
        if floor is not None:
            ev[floor.evidence_key] = floor.to_dict()
            if limit is not None and floor.holds(limit):
                return result(c, FAIL, f"{reason}; contention cannot explain it: "
                              f"{cont.summary()}, but {floor.summary()}{floor.versus(limit)}",
                              ev)
        tail = "" if floor is None else (
            f"; {floor.summary()}" + (floor.versus(limit) if floor.usable and limit is not None
                                      else ""))
        return result(c, NOT_EVALUABLE, f"{cont.summary()}: {what} not judged (it would "
                      f"fail: {reason}{tail}){contended_references(cont, floor)}; re-run "
                      "the candidate on a machine as idle as the references'", ev)
    return result(c, outcome, reason, ev)
