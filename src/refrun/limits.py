"""MLflow's limits, declared once: the only module of refrun that states them.

Every writer (the live delivery, complete runs, the MLflow UI's saved views) batches and
cuts with these numbers, and :mod:`refrun.keys` checks names and steps against them where
a point enters, without importing MLflow (``import mlflow`` costs seconds; a training
process and ``refrun accept`` on a local store never pay it).

Each value is MLflow's own constant of ``mlflow.utils.validation`` (named in its
docstring) in the MLflow releases refrun is tested with (3.17.2);
``tests/test_limits.py`` compares every one with the installed MLflow's, so a release
that changes one fails there instead of in a user's store.  Every MLflow 3.x stores run
tags of 8,000 characters (the column was widened from 5,000 in MLflow 2.17); a tracking
server older than that refuses longer than 5,000.
"""

from __future__ import annotations

METRICS_PER_BATCH = 1000
"""``MAX_METRICS_PER_BATCH``: metrics in one ``log_batch`` call."""
TAGS_PER_BATCH = 100
"""``MAX_PARAMS_TAGS_PER_BATCH``: params plus tags in one ``log_batch`` call."""
KEY_LENGTH = 250
"""``MAX_ENTITY_KEY_LENGTH``: characters of a metric name, param or tag key."""
TAG_VALUE_LENGTH = 8000
"""``MAX_TAG_VAL_LENGTH``: characters of a run's tag value."""
PARAM_VALUE_LENGTH = 6000
"""``MAX_PARAM_VAL_LENGTH``: characters of a param value."""
EXPERIMENT_TAG_VALUE_LENGTH = 20000
"""``MAX_EXPERIMENT_TAG_VAL_LENGTH``: characters of an experiment's tag value (a saved
view of MLflow's UI is one)."""
STEP_MIN = -(2**63)
STEP_MAX = 2**63 - 1
"""Steps are stored in a signed 64-bit column (``BigInteger``)."""

MLFLOW_NAMES = {
    "METRICS_PER_BATCH": "MAX_METRICS_PER_BATCH",
    "TAGS_PER_BATCH": "MAX_PARAMS_TAGS_PER_BATCH",
    "KEY_LENGTH": "MAX_ENTITY_KEY_LENGTH",
    "TAG_VALUE_LENGTH": "MAX_TAG_VAL_LENGTH",
    "PARAM_VALUE_LENGTH": "MAX_PARAM_VAL_LENGTH",
    "EXPERIMENT_TAG_VALUE_LENGTH": "MAX_EXPERIMENT_TAG_VAL_LENGTH",
}
"""Each limit above and the name of MLflow's constant it equals (checked by the tests)."""
