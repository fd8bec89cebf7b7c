"""The project's L4 goals for a migration, as ``refrun calibrate --goal`` takes them:
``throughput>=0.9x`` (the candidate's steady throughput at least 0.9 times the
references'), ``cost<=1.2x`` (its cost per run, for the same work, at most 1.2 times the
references'), ``utilization>=50%`` (its chips busy at least half the time).

A goal is declared, not calibrated: no seed statistic enters it and it takes no share of
the file's false-alarm budget.  Each is written as one L4 criterion with
``migration_only = true`` (:mod:`refrun.acceptance.migration`): it judges a candidate on
other hardware, another backend or another chip count, and is ``not_applicable`` to one
on the references' configuration, whose speed the same-machine ``step_time`` criterion
judges.  The words ``throughput``, ``cost`` and ``utilization`` (``utilisation``) are
reserved for these goals; a metric of that name is named with its prefix
(``--goal perf/throughput>=...``).  ``--price HARDWARE=PER_HOUR`` writes the ``[prices]``
table a cost goal needs.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass
from typing import Any, Literal

from refrun import identity
from refrun.errors import RefrunInputError

GoalName = Literal["throughput", "cost", "utilization"]
NAMES: dict[str, GoalName] = {"throughput": "throughput", "cost": "cost",
                              "utilization": "utilization", "utilisation": "utilization"}
# name: (the comparison it takes, the unit it is written with, what the unit means)
FORMS: dict[GoalName, tuple[str, str, str]] = {
    "throughput": (">=", "x", "a ratio to the references' steady throughput"),
    "cost": ("<=", "x", "a ratio to the references' cost per run"),
    "utilization": (">=", "%", "a percentage of the time the candidate's chips were busy"),
}
_FORM = re.compile(r"^\s*(?P<name>[A-Za-z]+)\s*(?P<op>>=|<=|=>|=<|>|<|=)\s*"
                   r"(?P<value>[^%xX\s]*)\s*(?P<unit>[xX%]?)\s*$")


@dataclass(frozen=True)
class PerformanceGoal:
    """One declared L4 goal: ``name`` and its ``value`` (a ratio for throughput and cost,
    a percentage for utilization)."""

    name: GoalName
    value: float

    def text(self) -> str:
        op, unit, _ = FORMS[self.name]
        return f"{self.name}{op}{self.value:g}{unit}"

    def table(self) -> dict[str, Any]:
        """The ``[[criteria]]`` keys of the goal's L4 criterion."""
        src = (f"the project's L4 goal (refrun calibrate --goal {self.text()}), for a "
               "migrated candidate only (other hardware, backend or chip count than the "
               "references)")
        base = {"id": f"goal-{self.name}", "level": "L4", "migration_only": True}
        if self.name == "throughput":
            return {**base, "kind": "throughput", "min_ratio": self.value,
                    "description": src + "; steady samples (or tokens) per second, "
                    "candidate / mean of the references'", "calibration": {"structural": 1.0}}
        if self.name == "cost":
            return {**base, "kind": "cost", "max_ratio": self.value, "same_work": True,
                    "description": src + "; cost per run for the references' work (wall "
                    "hours x [prices] per hour), candidate / mean of the references'",
                    "calibration": {"structural": 1.0}}
        return {**base, "kind": "utilization", "min_pct": self.value,
                "description": src + "; mean busy fraction of the candidate's chips after "
                "warm-up", "calibration": {"structural": 1.0}}

    def detectable(self) -> str:
        return {"throughput": f"a migrated candidate below {self.value:g} x the references' "
                              "steady throughput",
                "cost": f"a migrated candidate costing more than {self.value:g} x the "
                        "references per run (same work)",
                "utilization": f"a migrated candidate whose chips are busy less than "
                               f"{self.value:g}% of the time"}[self.name]


def parse_performance_goal(text: str) -> PerformanceGoal | None:
    """``"throughput>=0.9x"`` -> :class:`PerformanceGoal`; None when ``text`` does not
    name an L4 goal (a metric's goal: :func:`refrun.acceptance.calibration.derive.
    parse_goal`); a one-line :class:`RefrunInputError` naming ``--goal`` for an L4 goal
    written in another form."""
    m = _FORM.match(text)
    if m is None or m.group("name").lower() not in NAMES:
        return None
    name = NAMES[m.group("name").lower()]
    op, unit, meaning = FORMS[name]
    value = math.nan
    with contextlib.suppress(ValueError):
        value = float(m.group("value"))
    example = f"{name}{op}{0.9 if unit == 'x' else 50:g}{unit}"
    if m.group("op") != op or m.group("unit").lower() != unit or not math.isfinite(value):
        raise RefrunInputError(f"--goal {text!r}: a {name} goal is written {name}{op}VALUE"
                               f"{unit} ({meaning}), e.g. --goal {example}")
    if unit == "x" and value <= 0:
        raise RefrunInputError(f"--goal {text!r}: the ratio must be > 0")
    if unit == "%" and not 0 <= value <= 100:
        raise RefrunInputError(f"--goal {text!r}: the percentage must be within 0..100")
    return PerformanceGoal(name, value)


def parse_price(text: str) -> tuple[str, float]:
    """``"tpu-v5e=1.2"`` -> ``("tpu-v5e", 1.2)``: a hardware name (canonical, as a run's
    ``refrun.hardware`` tag holds it) and its price per hour; a one-line
    :class:`RefrunInputError` naming ``--price`` otherwise."""
    name, sep, price = text.partition("=")
    value = math.nan
    with contextlib.suppress(ValueError):
        value = float(price)
    if not sep or not math.isfinite(value) or value < 0:
        raise RefrunInputError(f"--price {text!r}: expected HARDWARE=PRICE_PER_HOUR with a "
                               "finite number >= 0, e.g. --price tpu-v5e=1.2")
    return identity.normalize_hardware(name, f"--price {text!r}"), value
