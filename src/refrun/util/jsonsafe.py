"""Strict-JSON copies of results (shared by the comparison, acceptance and report)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def json_safe(obj: Any) -> Any:
    """Copy of ``obj`` that strict JSON accepts: dict keys as strings, numpy scalars and
    arrays as Python values, and non-finite floats (NaN, ±Inf) as None."""
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return json_safe(obj.tolist())
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj
