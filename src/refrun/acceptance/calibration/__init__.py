"""Calibration: a criteria file derived from N >= 3 reference seeds by held-out validation.

Every reference seed is held out in turn and judged against groups of ``group_size`` of
the others, as a benign candidate would be judged against the reference group; for every
criterion we record what the held-out seed *needed* (the smallest threshold that accepts
it), take each seed's worst need over its groups, and set the threshold to an upper
tolerance limit of those N worst needs (:func:`refrun.acceptance.statistics.upper_limit`:
``max(worst, mean + k s)``, ``k`` the one-sided normal tolerance factor for N values,
``coverage = 1 - false_alarm_rate / n_criteria`` (Bonferroni over the file) at
``confidence``).  So the margin above the worst held-out value grows when N is small or
the seeds disagree, and no constant of any one workload enters.

What is calibrated, for every metric all references share (any cadence):

* per-step metrics (``loss``, ``grad_norm/...``, ``eval/val_loss`` ...): an ``envelope``
  (std band, ``k`` a tolerance limit on log k for ``min_fraction`` of the steps, capped by
  the Student-t prediction bound of one new seed, :func:`envelope_k`) and, except for
  evaluation metrics and gradient norms (:func:`has_final_window`), a final-window
  ``closeness`` of the window means (``rel_tol``);
* one-point metrics (one value per run, e.g. ``eval/test_accuracy``): a min-max
  ``envelope`` whose ``abs_tol`` is the limit of the signed distance outside the group's
  range (negative inside, so a limit exists even when every seed fell inside);
* ``perf/step_time_s``: ``step_time`` (steady median, compilation steps left out, same
  backend only), ``max_ratio`` from the log ratios of held-out seeds;
* integrity counters (compilations, host syncs and device-to-host copies inside the step,
  CPU fallbacks): from the references' own evidence when their backend records it, else a
  structural default stated as such, scoped to the backends whose probe records it.

``check_file`` re-measures any criteria file with the real checks on held-out seeds.


The package has three layers, each its own module: :mod:`.derive` (thresholds from the
references' data, pure), :mod:`.render` (the TOML file, written atomically) and
:mod:`.check` (re-checking a file on held-out seeds with the assessment's own
comparison); :mod:`.references` loads the runs from a store.
"""

from __future__ import annotations

from refrun.acceptance.calibration.check import CheckReport, Rejection, check_file
from refrun.acceptance.calibration.derive import (
    Calibrated,
    CalibrationOptions,
    Derived,
    Goal,
    Outlier,
    block_bootstrap_sd,
    calibrate,
    envelope_k,
    outliers,
    parse_goal,
)
from refrun.acceptance.calibration.goals import PerformanceGoal, parse_price
from refrun.acceptance.calibration.references import calibrate_ids, known_good_runs, reference_ids
from refrun.acceptance.calibration.render import render, write_file
from refrun.acceptance.criteria import calibration_digest

__all__ = ["Calibrated", "CalibrationOptions", "CheckReport", "Derived", "Goal", "Outlier",
           "PerformanceGoal", "Rejection", "block_bootstrap_sd", "calibrate", "calibrate_ids",
           "calibration_digest", "check_file", "envelope_k", "known_good_runs", "outliers",
           "parse_goal", "parse_price", "reference_ids", "render", "write_file"]
