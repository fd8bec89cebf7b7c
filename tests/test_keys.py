import pytest
from mlflow.exceptions import MlflowException
from mlflow.utils.validation import _validate_metric, _validate_tag

from refrun.keys import key_problem, step_problem

NAMES = ["loss", "eval/acc", "a//b", "/abs", "trail/", "./dot", "a/../b", "..", "", "x" * 250,
         "x" * 251, "über/größe", "a b:c-d.e_f", "a\nb", "a|b", "日本語"]

@pytest.mark.parametrize("name", NAMES)
def test_key_rules_agree_with_mlflow(name):
    try:
        _validate_metric(name, 1.0, 0, 0); _validate_tag(name, "v"); mlflow_ok = True
    except MlflowException:
        mlflow_ok = False
    assert (key_problem(name) is None) == mlflow_ok

def test_steps():
    assert step_problem(2**63 - 1) is None and step_problem(-(2**63)) is None
    assert step_problem(2**63) and step_problem(-(2**63) - 1) and step_problem(1.5) and step_problem(True)
