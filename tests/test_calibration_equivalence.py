"""The TOST margin calibrate writes for a one-value metric (issue 21, item 3): its floor is
the prediction bound the range criterion uses for the same value (``g - 1`` degrees of
freedom, the spread the check estimates from ``g`` references), so five references that
agree more closely than seeds do leave room for a seed the range criterion accepts.

Pure functions, expected numbers from scipy's t quantiles and one-sided t-tests by hand.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats as sps

from refrun.acceptance.calibration import CalibrationOptions
from refrun.acceptance.calibration.derive import (
    equivalence_margin,
    one_point_tol,
    tost_margin_floor,
)

# Test accuracies (correct examples of 897) of the digits benchmark's five reference
# seeds: within 3 examples, where 40 further seeds spread over 17 (848 to 865).
REFERENCE_COUNTS = np.array([852, 854, 851, 854, 853])
TEST_EXAMPLES = 897


def test_floor_is_the_prediction_bound_of_a_group_plus_the_tost_half_width() -> None:
    values = REFERENCE_COUNTS / TEST_EXAMPLES
    g, cov = 4, 1 - 0.05 / 30
    s = values.std(ddof=1)
    by_hand = s * math.sqrt(1 + 1 / g) * (sps.t.ppf(1 - (1 - cov) / 2, g - 1)
                                          + sps.t.ppf(0.95, g - 1))
    assert tost_margin_floor(values, g, cov) == pytest.approx(by_hand, rel=1e-9)


def _tost_passes(reference: np.ndarray, x: float, margin: float) -> bool:
    """TOST by hand: both one-sided t-tests of x - mean(reference) against +-margin at
    alpha 0.05, one candidate value, the references' std with g - 1 degrees of freedom."""
    g = len(reference)
    se = reference.std(ddof=1) * math.sqrt(1 + 1 / g)
    d = x - reference.mean()
    p_low = sps.t.sf((d + margin) / se, g - 1)
    p_high = sps.t.cdf((d - margin) / se, g - 1)
    return max(p_low, p_high) < 0.05


def test_close_references_leave_room_for_a_seed_the_range_criterion_accepts() -> None:
    values = REFERENCE_COUNTS / TEST_EXAMPLES
    opts = CalibrationOptions(group_size=4)
    g, cov = 4, 1 - 0.05 / 30
    margin, _, _ = equivalence_margin(values, opts, g, cov)
    abs_tol, _, _ = one_point_tol(values, opts, g, cov, resolution=1 / TEST_EXAMPLES)
    far = 865 / TEST_EXAMPLES  # the farthest of the 40 held-out seeds
    for grp in itertools.combinations(range(len(values)), g):
        ref = values[list(grp)]
        assert ref.min() - abs_tol <= far <= ref.max() + abs_tol  # the range accepts it
        assert _tost_passes(ref, far, margin), (grp, margin)
    # ... and TOST still judges: a seed 30 examples away is not equivalent
    assert not _tost_passes(values[:g], far + 18 / TEST_EXAMPLES, margin)
