"""refrun.keys agrees with MLflow's own validator on every name it is given."""

import pytest
from mlflow.exceptions import MlflowException
from mlflow.utils.validation import _validate_metric, _validate_tag

from refrun.keys import key_problem, step_problem

NAMES = ["loss", "eval/acc", "a//b", "/abs", "trail/", "./dot", "a/../b", "..", "", "x" * 250,
         "x" * 251, "über/größe", "a b:c-d.e_f", "a\nb", "a|b", "日本語"]


def _mlflow_accepts(name: str) -> bool:
    try:
        _validate_metric(name, 1.0, 0, 0)
        _validate_tag(name, "v")
    except MlflowException:
        return False
    return True


@pytest.mark.parametrize("name", NAMES)
def test_key_rules_agree_with_mlflow(name):
    assert (key_problem(name) is None) == _mlflow_accepts(name)


def test_steps_must_fit_int64():
    assert step_problem(2**63 - 1) is None
    assert step_problem(-(2**63)) is None
    for bad in (2**63, -(2**63) - 1, 1.5, True, "3"):
        assert step_problem(bad)
