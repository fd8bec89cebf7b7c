"""The one comparison an assessment rests on: the criteria file's ``[settings]`` as
comparison options, and every metric common to the runs compared once.  Used by the
assessment (:mod:`refrun.acceptance.assess`), by re-checking a calibrated file on
held-out seeds (:func:`refrun.acceptance.calibration.check.check_file`) and by the stopping
rules, so the three judge the same aligned values."""

from __future__ import annotations

from collections.abc import Sequence

from refrun.acceptance.criteria import CriteriaFile
from refrun.comparison import CompareOptions, Comparison, RunData, compare
from refrun.errors import RefrunInputError


def compare_options(crit: CriteriaFile) -> CompareOptions:
    """The comparison options the criteria file's [settings] ask for."""
    s = crit.settings
    return CompareOptions(keep=s.keep, interpolate=s.interpolate, axis=s.axis, eps=s.eps,
                          final_fraction=s.final_fraction, final_points=s.final_points,
                          warmup_steps=s.warmup_steps, warmup_fraction=s.warmup_fraction)


def run_comparison(crit: CriteriaFile, references: Sequence[RunData], candidate: RunData
                   ) -> tuple[Comparison | None, str]:
    """Compare every metric common to all runs; (None, reason) when none can be."""
    try:
        return compare(list(references), candidate, options=compare_options(crit),
                       progress=False), ""
    except RefrunInputError as exc:
        return None, str(exc)
