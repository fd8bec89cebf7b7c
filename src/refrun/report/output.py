"""Checking that an output file can be written, before anything is computed or recorded.

``refrun report`` records a comparison run and logs the report into it; a report that
cannot be written afterwards would leave that run without its report.  So every output
path (``--html``, ``--json``) is checked first: the nearest existing ancestor must be a
directory in which a file can actually be created (a probe file is created and removed,
which is the only test that also holds for root, read-only mounts and ``/proc``).
"""

from __future__ import annotations

import os
from pathlib import Path

from refrun.util.outputs import check_output, nearest_existing

__all__ = ["check_writable", "nearest_existing"]


def check_writable(path: str | os.PathLike[str], option: str = "--html") -> Path:
    """:func:`refrun.util.outputs.check_output`: one line naming ``option`` and the path
    unless a file may be written there (a new path, or a regular file replaced
    atomically; never a link, pipe, device, directory or a virtual file system)."""
    return check_output(path, option)
