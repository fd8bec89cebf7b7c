"""Where the shared real reference curves are (../shared/reference-data beside the clone).

CI lays shared/ beside the clone, so there a missing folder is an error, not a skip.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

_CANDIDATES = [
    Path(os.environ["REFRUN_REFERENCE_DATA"]) if os.environ.get("REFRUN_REFERENCE_DATA") else None,
    Path(__file__).resolve().parents[2] / "shared" / "reference-data",
    Path("/work/shared/reference-data"),
]
DATA = next((p for p in _CANDIDATES if p is not None and p.is_dir()), _CANDIDATES[1])

if not DATA.is_dir() and os.environ.get("CI"):
    raise RuntimeError(f"reference data not found (looked in {[str(p) for p in _CANDIDATES]})")

needs_data = pytest.mark.skipif(not DATA.is_dir(),
                                reason=f"shared reference data not present at {DATA}")
