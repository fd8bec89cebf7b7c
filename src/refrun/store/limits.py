"""MLflow's limits, declared once (MLflow 3.x, ``mlflow.utils.validation``).

Every writer (the live delivery, complete runs) batches and truncates with these numbers,
and :mod:`refrun.keys` checks names and steps against them where a point enters, without
importing MLflow.
"""

from __future__ import annotations

METRICS_PER_BATCH = 1000
"""``MAX_METRICS_PER_BATCH``: metrics in one ``log_batch`` call."""
TAGS_PER_BATCH = 100
"""``MAX_PARAMS_TAGS_PER_BATCH``: params plus tags in one ``log_batch`` call."""
KEY_LENGTH = 250
"""``MAX_ENTITY_KEY_LENGTH``: characters of a metric name, param or tag key."""
TAG_VALUE_LENGTH = 5000
"""``MAX_TAG_VAL_LENGTH``: characters of a tag value."""
PARAM_VALUE_LENGTH = 6000
"""``MAX_PARAM_VAL_LENGTH``: characters of a param value."""
STEP_MIN = -(2**63)
STEP_MAX = 2**63 - 1
"""Steps are stored in a signed 64-bit column."""
