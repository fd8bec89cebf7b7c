"""Workload acceptance: criteria files, the L0-L4 assessment, stopping rules, sign-off.

See docs/acceptance.md.  Never imports a training framework.

The names below are imported on first use (PEP 562): importing one submodule, e.g.
``refrun.acceptance.criteria`` for ``refrun accept --help``, must not pull in MLflow,
pandas and SciPy through every other one.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

# public name -> the submodule that defines it
_EXPORTS = {
    "assess": "assess", "assess_ids": "assess", "compare_options": "assess",
    "CriteriaFile": "criteria", "load_criteria": "criteria", "parse_criteria": "criteria",
    "load_recorded": "record", "record_assessment": "record",
    "Assessment": "results", "CriterionResult": "results", "LevelResult": "results",
    "SignOff": "signoff", "Verification": "signoff", "sign_off": "signoff",
    "verify": "signoff",
    "StopFinding": "stopping", "StopReport": "stopping", "evaluate_stopping": "stopping",
    "Watcher": "watcher", "watch_run": "watcher",
}

__all__ = [
    "Assessment", "CriteriaFile", "CriterionResult", "LevelResult", "SignOff", "StopFinding",
    "StopReport", "Verification", "Watcher", "assess", "assess_ids", "compare_options",
    "evaluate_stopping", "load_criteria", "load_recorded", "parse_criteria",
    "record_assessment", "sign_off", "verify", "watch_run",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    """The package module.  Once a submodule is loaded the import system binds it to its
    name on the package; where a public name is a function of the same name as its
    module (``assess``), the function is kept there, as the eager imports of earlier
    versions left it: ``from refrun.acceptance import assess`` is always the function."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == name:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


if TYPE_CHECKING:  # static analysis sees the eager imports
    from refrun.acceptance.assess import assess, assess_ids, compare_options
    from refrun.acceptance.criteria import CriteriaFile, load_criteria, parse_criteria
    from refrun.acceptance.record import load_recorded, record_assessment
    from refrun.acceptance.results import Assessment, CriterionResult, LevelResult
    from refrun.acceptance.signoff import SignOff, Verification, sign_off, verify
    from refrun.acceptance.stopping import StopFinding, StopReport, evaluate_stopping
    from refrun.acceptance.watcher import Watcher, watch_run
