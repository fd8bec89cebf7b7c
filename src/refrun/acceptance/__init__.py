"""Workload acceptance: criteria files, the L0-L4 assessment, stopping rules, sign-off.

See docs/acceptance.md.  Never imports a training framework.
"""

from refrun.acceptance.assess import assess, assess_ids, compare_options
from refrun.acceptance.criteria import CriteriaFile, load_criteria, parse_criteria
from refrun.acceptance.record import load_recorded, record_assessment
from refrun.acceptance.results import Assessment, CriterionResult, LevelResult
from refrun.acceptance.signoff import SignOff, Verification, sign_off, verify
from refrun.acceptance.stopping import StopFinding, StopReport, evaluate_stopping
from refrun.acceptance.watcher import Watcher, watch_run

__all__ = [
    "Assessment", "CriteriaFile", "CriterionResult", "LevelResult", "SignOff", "StopFinding",
    "StopReport", "Verification", "Watcher", "assess", "assess_ids", "compare_options",
    "evaluate_stopping", "load_criteria", "load_recorded", "parse_criteria",
    "record_assessment", "sign_off", "verify", "watch_run",
]
