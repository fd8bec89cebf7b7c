"""Checking that an output file can be written, before anything is computed or recorded.

``refrun report`` records a comparison run and logs the report into it; a report that
cannot be written afterwards would leave that run without its report.  So every output
path (``--html``, ``--json``) is checked first: the nearest existing ancestor must be a
directory in which a file can actually be created (a probe file is created and removed,
which is the only test that also holds for root, read-only mounts and ``/proc``).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from refrun.errors import RefrunInputError


def nearest_existing(path: Path) -> Path:
    """The closest ancestor of ``path`` (or ``path`` itself) that exists."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_writable(path: str | os.PathLike[str], option: str = "--html") -> Path:
    """Raise :class:`RefrunInputError` (one line naming ``option`` and the path) unless a
    file can be written at ``path``; return it as an absolute path.

    Refused: an existing directory; a path below a file; a directory in which no file can
    be created (permissions, read-only or virtual file systems such as ``/proc``).
    Missing parent directories are fine when they could be created below a writable one
    (they are created only when the file is written)."""
    out = Path(path).expanduser().absolute()
    if out.is_dir():
        raise RefrunInputError(f"{option} {path}: is a directory")
    base = nearest_existing(out.parent)
    if not base.is_dir():
        raise RefrunInputError(f"{option} {path}: {base} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".refrun-write-check-", dir=base)
    except OSError as exc:
        raise RefrunInputError(f"{option} {path}: cannot write in {base} "
                               f"({exc.strerror or exc})") from exc
    os.close(fd)
    os.unlink(probe)
    return out
