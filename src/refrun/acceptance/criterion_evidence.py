"""The typed shape of a criterion result's evidence, where it crosses a module boundary.

A check writes its evidence as a JSON object of named values (``CriterionResult.evidence``;
signed, so its JSON must not change).  The values other modules read are typed here, each a
frozen dataclass with ``to_dict()`` (the exact keys, in the order written) and
``from_dict()`` (the reader, for every evidence format version):

* :class:`FirstDivergence`: where a per-step criterion's candidate first left its band
  (``closeness``, ``envelope``; written by :func:`refrun.acceptance.checks.first_left`,
  read by the report's failing-criteria list and ``refrun accept``);
* :class:`Interval`: the interval a statistical decision rests on and its reference seeds
  (``equivalence``, ``convergence``; read by the report and ``refrun accept``);
* :class:`PairedEvidence`: a same-seed pair and where it first diverged (``paired``; read
  by the report's pair table and ``refrun accept``).
* :class:`Contention`: how busy other processes kept the machine during the candidate and
  the references (``step_time``; read by ``refrun accept``).
* :class:`RestoreEvidence`: each restore of the candidate (a resume that replayed steps)
  and how its replayed values compare with the first pass (``restore``; read by the
  report's restore table).

``schema.EV_FIRST_DIVERGENCE_STEP`` names the same key in every kind (``first_divergence``'s
step, or the pair's ``first_divergence_step``).

:data:`ADDED_IN` says which evidence format version added which result key, so that
``verify`` recomputes an older signed assessment without them
(:mod:`refrun.acceptance.evidence`).  The version of this shape is that format's
(:data:`VERSION`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from refrun import schema
from refrun.acceptance.paired import PairJudgement

VERSION = "10"
# Result evidence keys each evidence format version added (none before 3); a dotted key
# names a key inside one (version 5: the second contention rule's figures; version 6: a
# paired result's numerics, refrun.acceptance.precision; version 7: a step_time result's
# CPU floor on a busy machine, refrun.acceptance.kinds.step_time.CpuFloor; version 8: the
# references' own machine figures and the rule for references busier than the candidate;
# version 9: a throughput result's bound from the runs' CPU time per step,
# refrun.acceptance.kinds.throughput.CpuRateBound, and a cost result's contention figures;
# version 10: a cost fail's floor from the candidate's CPU time, refrun.acceptance.kinds.
# cost.CpuCostFloor; ``KIND:key`` names a key a version added to results of that kind only).
ADDED_IN: dict[str, tuple[str, ...]] = {
    "3": (schema.EV_FIRST_DIVERGENCE, schema.EV_FIRST_DIVERGENCE_STEP),
    "4": (schema.EV_CONTENTION,),
    "5": tuple(f"{schema.EV_CONTENTION}.{k}" for k in (
        "share_margin_cores", "candidate_starved", "candidate_run_cores",
        "reference_run_cores", "shared_fraction", "candidate_shared")),
    "6": ("numerics",),
    "7": (schema.EV_CPU_FLOOR,),
    "8": (*(f"{schema.EV_CONTENTION}.{k}" for k in (
        "reference_cpu_pct", "reference_logical_cpus", "references_busier")),
        schema.EV_CPU_CEILING),
    "9": (schema.EV_CPU_RATE_BOUND, f"cost:{schema.EV_CONTENTION}"),
    "10": (schema.EV_CPU_COST_BOUND,)}

Side = Literal["above", "below"]


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _int_or_none(v: Any) -> int | None:
    return int(v) if _number(v) else None


def _bound(v: Any) -> float | None:
    """An interval end as written (infinite ends included); None for a missing one."""
    return v if isinstance(v, int | float) and not isinstance(v, bool) else None


@dataclass(frozen=True)
class FirstDivergence:
    """Where the candidate first left a criterion's band among the selected aligned
    points (:func:`refrun.comparison.divergence.first_sustained`'s rule).

    ``at``: the axis value there (the step, or samples / tokens seen when aligned on
    them); ``step``: the candidate's own step there; ``first_outside_at``: the first point
    outside at all; ``sustain``: consecutive points outside that count as leaving;
    ``direction``: the side it left on; ``outside_points`` of ``points`` selected."""

    axis: str
    at: int | float
    step: int | None
    first_outside_at: int | float | None
    sustain: int | None
    direction: Side | None
    outside_points: int | None
    points: int | None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> FirstDivergence | None:
        """The typed value of a result's ``first_divergence``; None when there is none
        (the candidate never left the band, or evidence of a format before version 3)."""
        if not isinstance(d, Mapping) or not _number(d.get("at")):
            return None
        direction = d.get("direction")
        return cls(axis=str(d.get("axis") or "step"), at=d["at"],
                   step=_int_or_none(d.get("step")),
                   first_outside_at=d.get("first_outside_at")
                   if _number(d.get("first_outside_at")) else None,
                   sustain=_int_or_none(d.get("sustain")),
                   direction=direction if direction in ("above", "below") else None,
                   outside_points=_int_or_none(d.get("outside_points")),
                   points=_int_or_none(d.get("points")))

    @classmethod
    def of_result(cls, evidence: Any) -> FirstDivergence | None:
        """The first divergence in a result's evidence dict, if any."""
        return cls.from_dict(evidence.get(schema.EV_FIRST_DIVERGENCE)) \
            if isinstance(evidence, Mapping) else None

    def where(self) -> str:
        """``step 42`` or ``samples 1344 (step 42)``."""
        at = f"{self.axis} {self.at:g}"
        return at + (f" (step {self.step})" if self.axis != "step" else "")


@dataclass(frozen=True)
class Interval:
    """The interval a statistical criterion's decision rests on (``interval``: ``[lo,
    hi]``, ``hi`` None for a one-sided limit) and the reference seeds behind it
    (``n_reference``; older assessments name it ``n_references``)."""

    interval: tuple[float | None, float | None] | None
    n_reference: int | None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.interval is not None:
            out[schema.EV_INTERVAL] = list(self.interval)
        if self.n_reference is not None:
            out[schema.EV_N_REFERENCE] = self.n_reference
        return out

    @classmethod
    def from_dict(cls, evidence: Any) -> Interval | None:
        """The interval and seeds of a result's evidence dict (seeds alone for a per-step
        criterion's ``n_references``); None when it names neither."""
        if not isinstance(evidence, Mapping):
            return None
        if not {schema.EV_INTERVAL, schema.EV_N_REFERENCE, "n_references"} & set(evidence):
            return None
        iv = evidence.get(schema.EV_INTERVAL)
        n = evidence.get(schema.EV_N_REFERENCE, evidence.get("n_references"))
        pair = (_bound(iv[0]), _bound(iv[1])) \
            if isinstance(iv, list | tuple) and len(iv) == 2 else None
        return cls(pair, _int_or_none(n))


@dataclass(frozen=True)
class PairedEvidence:
    """A ``paired`` criterion's evidence: the pair lookup (``declared``, ``run_id``,
    ``source``, ``problem``), the band's ratio and span, and, when the pair was compared,
    its run and seed and the judgement (:class:`refrun.acceptance.paired.PairJudgement`,
    whose ``first_divergence_step`` is where the pair first left the band); ``numerics``
    (version 6, when either run recorded its numerics): what the candidate's and the pair's
    configuration meant, whether the candidate ran coarser, the rerun at full precision,
    its precision twin and how it fared, and the attribution (``platform precision``,
    ``port``, ``undetermined``: :func:`refrun.acceptance.precision.decide`)."""

    pair: dict[str, Any]
    max_ratio: float
    band_first_step: int
    band_last_step: int
    pair_run: str | None = None
    pair_seed: int | None = None
    judgement: PairJudgement | None = None
    numerics: dict[str, Any] | None = None
    # The candidate hardware whose own band judged it (``hardware_bands``); None: the
    # references' band.  Written only when set, so earlier assessments verify unchanged.
    band_hardware: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"pair": dict(self.pair), "max_ratio": self.max_ratio,
                               "band_first_step": self.band_first_step,
                               "band_last_step": self.band_last_step}
        if self.band_hardware:
            out["band_hardware"] = self.band_hardware
        if self.judgement is not None:
            out.update(pair_run=self.pair_run, pair_seed=self.pair_seed,
                       **dataclasses.asdict(self.judgement))
        if self.numerics:
            out["numerics"] = dict(self.numerics)
        return out

    @classmethod
    def from_dict(cls, evidence: Any) -> PairedEvidence | None:
        """The typed evidence of a ``paired`` result; None for another kind's."""
        if not isinstance(evidence, Mapping) or not isinstance(evidence.get("pair"), Mapping):
            return None
        judgement = None
        if evidence.get("pair_run"):
            judgement = PairJudgement(**{f.name: evidence.get(f.name)
                                         for f in dataclasses.fields(PairJudgement)})
        return cls(pair=dict(evidence["pair"]), max_ratio=evidence.get("max_ratio"),
                   band_first_step=evidence.get("band_first_step"),
                   band_last_step=evidence.get("band_last_step"),
                   pair_run=evidence.get("pair_run"), pair_seed=evidence.get("pair_seed"),
                   judgement=judgement,
                   numerics=dict(evidence["numerics"]) if isinstance(
                       evidence.get("numerics"), Mapping) else None,
                   band_hardware=evidence.get("band_hardware") or None)

    @property
    def first_divergence_step(self) -> int | None:
        return None if self.judgement is None else self.judgement.first_divergence_step


@dataclass(frozen=True)
class Contention:
    """How busy *other* processes kept the machine (``sys/others_cpu_cores``: system busy
    cores less the run's own process tree) and how much CPU the run itself got
    (``sys/run_cpu_cores``), as a ``step_time`` result records it.

    ``known``: every run has the others' metric (else the rest is None and step time is
    judged as without it).  ``candidate_cores``: the median over the candidate's samples;
    ``reference_cores``: each reference's median, in the references' order;
    ``candidate_cpu_pct``: the candidate's median system CPU busy share, %;
    ``logical_cpus``: the candidate machine's; ``margin_cores``, ``share_margin_cores`` and
    ``saturated_pct``: the rules' settings; ``candidate_busier``: the first rule held
    (others took at least ``margin_cores`` more during the candidate than during any
    reference, on a machine at least ``saturated_pct`` busy); ``candidate_run_cores`` and
    ``reference_run_cores``: medians of the runs' own CPU (None when a run lacks it);
    ``candidate_starved``: the second rule held (on a machine at least ``saturated_pct``
    busy, others took at least ``share_margin_cores`` more than during any reference and
    the run itself got at least ``share_margin_cores`` less than any reference did);
    ``candidate_shared``: the third rule held (on a machine at least ``saturated_pct``
    busy, others took at least ``shared_fraction`` of its CPUs and ``margin_cores``);
    ``missing``: the runs without the others' metric; ``reference_cpu_pct`` and
    ``reference_logical_cpus``: each reference's median system CPU busy share and CPU count
    (None when a reference lacks one); ``references_busier``: the references' rule held
    (known even when the candidate's figures are not: a TPU host that reads no system CPU
    figures): a reference ran on a machine at least ``saturated_pct`` busy beside other
    processes using at least ``margin_cores`` and ``shared_fraction`` of its CPUs, and at
    least ``margin_cores`` more than during the candidate (or the candidate's figure is not
    known), so a pass may be the references' slowness, not the candidate's speed."""

    known: bool
    metric: str
    margin_cores: float
    saturated_pct: float
    candidate_busier: bool = False
    candidate_cores: float | None = None
    reference_cores: tuple[float, ...] | None = None
    candidate_cpu_pct: float | None = None
    logical_cpus: float | None = None
    missing: tuple[str, ...] = ()
    share_margin_cores: float | None = None
    candidate_starved: bool = False
    candidate_run_cores: float | None = None
    reference_run_cores: tuple[float, ...] | None = None
    shared_fraction: float | None = None
    candidate_shared: bool = False
    reference_cpu_pct: tuple[float, ...] | None = None
    reference_logical_cpus: tuple[float, ...] | None = None
    references_busier: bool = False

    @property
    def reference_max(self) -> float | None:
        return max(self.reference_cores) if self.reference_cores else None

    @property
    def reference_run_min(self) -> float | None:
        return min(self.reference_run_cores) if self.reference_run_cores else None

    @property
    def references_beside_neighbours(self) -> float | None:
        """The most CPU other processes took during a reference (its median,
        ``reference_max``) when that is a neighbour of the size the third rule counts as
        busy (at least ``margin_cores`` and ``shared_fraction`` of the candidate machine's
        CPUs; the margin alone when either is not known); else None.  Such references'
        step times may include what the neighbours cost them, which no figure refrun
        records can take back out (docs/acceptance.md, "What contention cannot explain
        fails"), so a CPU floor that divides by them is weak."""
        top = self.reference_max
        if not self.known or top is None:
            return None
        need = self.margin_cores
        if self.shared_fraction is not None and self.logical_cpus:
            need = max(need, self.shared_fraction * self.logical_cpus)
        return top if top >= need else None

    @property
    def took_cpu(self) -> bool:
        """A rule held: the machine took CPU from the candidate that it did not take from
        the references, or neighbours kept a saturated machine busy beside it, so a
        step-time ratio cannot tell slower code from a busier machine."""
        return self.candidate_busier or self.candidate_starved or self.candidate_shared

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in ("reference_cores", "reference_run_cores", "reference_cpu_pct",
                  "reference_logical_cpus"):
            d[k] = None if d[k] is None else list(d[k])
        d["missing"] = list(self.missing)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> Contention | None:
        """The typed value of a result's ``contention``; None when there is none (another
        kind, or evidence of a format before version 4)."""
        if not isinstance(d, Mapping) or not isinstance(d.get("known"), bool):
            return None

        def num(k: str) -> float | None:
            return float(d[k]) if _number(d.get(k)) else None

        def nums(k: str) -> tuple[float, ...] | None:
            v = d.get(k)
            return tuple(float(x) for x in v if _number(x)) if isinstance(v, list) else None

        return cls(known=d["known"], metric=str(d.get("metric") or ""),
                   margin_cores=num("margin_cores") or 0.0,
                   saturated_pct=num("saturated_pct") or 0.0,
                   candidate_busier=d.get("candidate_busier") is True,
                   candidate_cores=num("candidate_cores"),
                   reference_cores=nums("reference_cores"),
                   candidate_cpu_pct=num("candidate_cpu_pct"),
                   logical_cpus=num("logical_cpus"),
                   missing=tuple(str(x) for x in d.get("missing") or ()),
                   share_margin_cores=num("share_margin_cores"),
                   candidate_starved=d.get("candidate_starved") is True,
                   candidate_run_cores=num("candidate_run_cores"),
                   reference_run_cores=nums("reference_run_cores"),
                   shared_fraction=num("shared_fraction"),
                   candidate_shared=d.get("candidate_shared") is True,
                   reference_cpu_pct=nums("reference_cpu_pct"),
                   reference_logical_cpus=nums("reference_logical_cpus"),
                   references_busier=d.get("references_busier") is True)

    @classmethod
    def of_result(cls, evidence: Any) -> Contention | None:
        return cls.from_dict(evidence.get(schema.EV_CONTENTION)) \
            if isinstance(evidence, Mapping) else None

    def busiest_reference(self) -> tuple[float | None, float | None]:
        """``(machine busy %, logical CPUs)`` of the reference whose neighbours used the
        most CPU (None where not known)."""
        top = self.reference_max
        if not self.reference_cores or top is None:
            return None, None
        i = self.reference_cores.index(top)

        def at(v: tuple[float, ...] | None) -> float | None:
            return v[i] if v and i < len(v) else None

        return at(self.reference_cpu_pct), at(self.reference_logical_cpus)

    def references_summary(self) -> str:
        """One line for the references' rule: how busy the busiest reference's machine
        was, against the candidate's (or that the candidate's is not known)."""
        top = self.reference_max
        pct, cpus = self.busiest_reference()
        of = f" of {cpus:g} CPUs" if cpus else " cores"
        busy = f" (machine {pct:.0f} % busy)" if pct is not None else ""
        cand = (f"{self.candidate_cores:.2f} during the candidate"
                if self.candidate_cores is not None else
                f"the candidate's not known (no {self.metric})")
        return (f"other processes used up to {top or 0:.2f}{of} during a reference{busy} "
                f"vs {cand}")

    def summary(self) -> str:
        """One line: the figures, or that contention was not known."""
        if not self.known:
            return (f"contention not known ({', '.join(self.missing) or 'a run'} "
                    f"without {self.metric}): step time judged as recorded")
        of = f" of {self.logical_cpus:g} CPUs" if self.logical_cpus else " cores"
        line = (f"other processes used {self.candidate_cores:.2f}{of} during the candidate "
                f"(machine {self.candidate_cpu_pct:.0f} % busy) vs at most "
                f"{self.reference_max:.2f} during the references")
        if self.candidate_starved and not self.candidate_busier:
            line += (f", and the run itself got {self.candidate_run_cores:.2f} cores vs at "
                     f"least {self.reference_run_min:.2f} during every reference")
        elif self.candidate_shared and not self.candidate_busier:
            line += (": neighbours that busy on a saturated machine slow a step in ways CPU "
                     "shares do not show")
        return line


@dataclass(frozen=True)
class ReplayedState:
    """One ``opt/`` metric (a learning rate, the optimizer's update count) in one restore:
    its first pass's and its replayed value at the restore's first replayed step, and
    where a replayed value first differed (None: identical at every replayed step)."""

    metric: str
    replayed: int
    identical: bool
    at_step: int | None = None  # the first replayed step of this metric
    first_at_restore: float | None = None
    replay_at_restore: float | None = None
    first_difference_step: int | None = None
    first_at_difference: float | None = None
    replay_at_difference: float | None = None


@dataclass(frozen=True)
class RestoreRecord:
    """One restore: the run went back from ``after_step`` to ``step`` and replayed
    ``replayed`` points of the criterion's metric.  ``identical``: every one equal to the
    first pass's; ``max_abs_diff``: the largest |replay - first|; ``first_difference_step``:
    where one first differed; ``band_ratio``: the largest ratio of the divergence to the
    same-seed band (None without a band, or when identical); ``within_band``: the
    divergence stayed inside ``max_ratio`` x the band; ``state``: the ``opt/`` metrics."""

    step: int
    after_step: int
    replayed: int
    unmatched: int
    identical: bool
    max_abs_diff: float | None
    first_difference_step: int | None
    band_ratio: float | None = None
    within_band: bool | None = None
    state: tuple[ReplayedState, ...] = ()

    @property
    def state_differs(self) -> tuple[ReplayedState, ...]:
        return tuple(st for st in self.state if not st.identical)


@dataclass(frozen=True)
class RestoreEvidence:
    """A ``restore`` result's evidence: the metric, whether a same-seed band was given,
    and every restore found (at most :data:`MAX_RESTORES` listed; ``restores_found``
    counts them all)."""

    metric: str
    band: bool
    max_ratio: float | None
    restores_found: int
    restores: tuple[RestoreRecord, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["restores"] = [{**dataclasses.asdict(r), "state": [dataclasses.asdict(s)
                                                                for s in r.state]}
                         for r in self.restores]
        return d

    @classmethod
    def from_dict(cls, evidence: Any) -> RestoreEvidence | None:
        """The typed evidence of a ``restore`` result; None for another kind's."""
        if not isinstance(evidence, Mapping) or not isinstance(evidence.get("restores"),
                                                               list):
            return None
        names = {f.name for f in dataclasses.fields(RestoreRecord)}
        state_names = {f.name for f in dataclasses.fields(ReplayedState)}
        records = []
        for r in evidence["restores"]:
            if not isinstance(r, Mapping):
                continue
            state = tuple(ReplayedState(**{k: v for k, v in st.items() if k in state_names})
                          for st in r.get("state") or () if isinstance(st, Mapping))
            records.append(RestoreRecord(**{k: v for k, v in r.items()
                                            if k in names and k != "state"}, state=state))
        return cls(metric=str(evidence.get("metric") or ""), band=bool(evidence.get("band")),
                   max_ratio=evidence.get("max_ratio"),
                   restores_found=int(evidence.get("restores_found") or len(records)),
                   restores=tuple(records))


MAX_RESTORES = 20  # restores listed in a result's evidence (all are judged)
