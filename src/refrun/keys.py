"""MLflow's own rules for metric names, tag keys and steps, checked where a point enters.

MLflow's ``log_batch`` is all-or-nothing: one name the store refuses makes the whole batch
fail for good.  refrun therefore refuses such a point when it is logged or imported, with
MLflow's reason, instead of queueing it.  The rules mirror ``mlflow.utils.validation``
(MLflow 3.x, non-Windows) without importing MLflow, so the training path stays light:

* characters: ``^[/\\w.\\- :]*$`` (``\\w`` is Unicode-aware, so non-ASCII letters pass);
* the name read as a POSIX path must not resolve to another name
  (``a//b``, ``/abs``, ``trail/``, ``./dot``, ``a/../b``, ``..`` are refused);
* at most :data:`refrun.limits.KEY_LENGTH` characters (``MAX_ENTITY_KEY_LENGTH``);
* a step is an integer that fits a signed 64-bit column: -2**63 <= step < 2**63.

Each check returns ``None`` for a valid input, else a one-line reason.
"""

from __future__ import annotations

import numbers
import posixpath
import re

from refrun.limits import KEY_LENGTH, STEP_MAX, STEP_MIN

_NAME_CHARS = re.compile(r"^[/\w.\- :]*$")


def key_problem(name: object, what: str = "metric name") -> str | None:
    """Why MLflow would refuse ``name`` as a metric name, param or tag key, or ``None``."""
    if not isinstance(name, str):
        return f"{what} {name!r} is not a string"
    if not _NAME_CHARS.match(name):
        return (f"{what} {name!r}: names may only contain letters, digits, underscores, "
                "dashes, periods, spaces, colons and slashes")
    norm = posixpath.normpath(name)
    if norm != name or norm == "." or norm.startswith("..") or norm.startswith("/"):
        return (f"{what} {name!r} would resolve to {norm!r} as a path "
                "(no leading, trailing or double slash, no '.' or '..' parts)")
    if len(name) > KEY_LENGTH:
        return (f"{what} {name[:40]!r}... has {len(name)} characters (MLflow's limit: "
                f"{KEY_LENGTH})")
    return None


def step_problem(step: object) -> str | None:
    """Why ``step`` cannot be stored as an MLflow step (a signed 64-bit integer), or ``None``."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        return f"step {step!r} is not an integer"
    if not STEP_MIN <= int(step) <= STEP_MAX:
        digits = len(str(abs(int(step)))) if abs(int(step)) < 10 ** 4000 else 4000
        shown = str(step) if digits <= 24 else f"of {digits:,} digits"  # one short line
        return f"step {shown} does not fit a signed 64-bit integer"
    return None
