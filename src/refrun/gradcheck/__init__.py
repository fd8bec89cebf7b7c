"""Gradient parity checks and the gate that proves it can fail (docs/gradcheck.md).

Importing this package imports neither torch nor jax; each check imports the framework
it is asked to run.

* :func:`check_known_answer` — loss and gradient against an analytic oracle (seed 000)
* :func:`compare_by_name` — cross-framework parity by named parameter, explicit mapping
* :func:`check_finite_differences` — step-size sweep, V curve, verified/suspect/wrong
* :func:`hunt_nonfinite` — NaN/Inf scan with the framework's debug mode at the first hit
* :func:`precision_drift` — float32 vs float64 gradient drift
* :func:`update_delta_parity` / :func:`compare_updates` — optimizer-step updates by name
* :mod:`~refrun.gradcheck.mutations` — stop_gradient/detach/mean→sum mutants, gate self-test
* :func:`record_gradcheck` — results as an MLflow run with role ``gradcheck``
"""

from refrun.gradcheck.finite_diff import (
    DEFAULT_STEPS,
    FiniteDiffResult,
    check_finite_differences,
    check_objective,
    classify,
)
from refrun.gradcheck.mutations import (
    MEAN_TO_SUM,
    GateSelfTest,
    Mutation,
    detach_mutation,
    detach_on,
    mean_to_sum,
    self_test_gate,
    stop_gradient_mutation,
    stop_gradient_on,
)
from refrun.gradcheck.nans import NanHuntResult, hunt_nonfinite
from refrun.gradcheck.objective import Objective, make_objective, objective_from_callables
from refrun.gradcheck.oracle import KnownAnswerResult, check_known_answer
from refrun.gradcheck.parity import (
    ParamMap,
    ParityResult,
    apply_mapping,
    compare_by_name,
    module_grads,
    relative_error,
)
from refrun.gradcheck.precision import PrecisionResult, precision_drift
from refrun.gradcheck.record import record_gradcheck
from refrun.gradcheck.update_delta import (
    UpdateDeltaResult,
    compare_updates,
    update_delta_parity,
)

__all__ = [
    "DEFAULT_STEPS",
    "MEAN_TO_SUM",
    "FiniteDiffResult",
    "GateSelfTest",
    "KnownAnswerResult",
    "Mutation",
    "NanHuntResult",
    "Objective",
    "ParamMap",
    "ParityResult",
    "PrecisionResult",
    "UpdateDeltaResult",
    "apply_mapping",
    "check_finite_differences",
    "check_known_answer",
    "check_objective",
    "classify",
    "compare_by_name",
    "compare_updates",
    "detach_mutation",
    "detach_on",
    "hunt_nonfinite",
    "make_objective",
    "mean_to_sum",
    "module_grads",
    "objective_from_callables",
    "precision_drift",
    "record_gradcheck",
    "relative_error",
    "self_test_gate",
    "stop_gradient_mutation",
    "stop_gradient_on",
    "update_delta_parity",
]
