"""Outputs only where a user meant them: every file a command writes (``--html``,
``--json``, ``-o``) goes through :func:`check_output` before any work and
:func:`write_output` at the end.

Written: a **new path** (missing parent directories are created) or an existing
**regular file**, which is replaced atomically (a temporary file in the same directory,
then ``os.replace``), so a failure never leaves half a file.  Refused in one line naming
the option and the path, the thing there left as it was: a symbolic link (replacing it
would cut the link; following it would write where the link points, which the user did
not name), a named pipe, a device node, a socket, a directory, and any path on a virtual
file system (``/proc``, ``/sys``, ``/dev``: ``/proc/version`` reads as a regular file).
Before, ``report --html`` onto a FIFO or a symlink turned it into a 5 MB regular file
(exit 0), and as root ``--html /dev/full`` replaced the device node.

A pure helper (``refrun.util`` imports nothing of refrun): it raises
:class:`OutputRefused`, a ``ValueError`` the CLI answers like bad input (one line, exit 2).
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path


class OutputRefused(ValueError):
    """An output path refrun will not write (one line naming the option and the path)."""

# File systems whose "files" are kernel interfaces, never a place for a report.
VIRTUAL_ROOTS = ("/proc", "/sys", "/dev")
_KINDS = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"))


def nearest_existing(path: Path) -> Path:
    """The closest ancestor of ``path`` (or ``path`` itself) that exists (a dangling
    symbolic link counts as existing: it is there)."""
    p = path
    while not os.path.lexists(p) and p != p.parent:
        p = p.parent
    return p


def _refuse(option: str, path: str | os.PathLike[str], why: str) -> OutputRefused:
    return OutputRefused(f"{option} {path}: {why}; refrun writes only a regular file or a "
                            "new path (left as it was)")


def _virtual(p: Path) -> str | None:
    real = os.path.realpath(p)
    return next((r for r in VIRTUAL_ROOTS if real == r or real.startswith(r + "/")), None)


def _kind(mode: int) -> str | None:
    """What a non-regular file is, or None for a regular file."""
    return None if stat.S_ISREG(mode) else next(
        (what for test, what in _KINDS if test(mode)), "not a regular file")


def check_output(path: str | os.PathLike[str], option: str) -> Path:
    """Raise :class:`OutputRefused` (one line naming ``option`` and the path) unless a
    file may be written at ``path`` (see the module docstring); return it as an absolute
    path.  Missing parent directories are fine when they could be created below a
    writable one (they are created only when the file is written)."""
    out = Path(path).expanduser().absolute()
    try:
        st = os.lstat(out)
    except (FileNotFoundError, NotADirectoryError):
        st = None  # nothing there (below a file: refused as such below)
    except OSError as exc:
        raise _refuse(option, path, f"cannot look at it ({exc.strerror or exc})") from exc
    if st is not None:
        kind = _kind(st.st_mode)
        if stat.S_ISLNK(st.st_mode):
            kind = f"a symbolic link (to {os.readlink(out)})"
        if kind is not None:
            raise _refuse(option, path, f"is {kind}")
    root = _virtual(out if st is not None else nearest_existing(out.parent))
    if root is not None:
        raise _refuse(option, path, f"is on the virtual file system {root}")
    base = nearest_existing(out.parent)
    if not base.is_dir():
        raise _refuse(option, path, f"{base} is not a directory")
    try:  # the only test that also holds for root and read-only mounts
        fd, probe = tempfile.mkstemp(prefix=".refrun-write-check-", dir=base)
    except OSError as exc:
        raise OutputRefused(f"{option} {path}: cannot write in {base} "
                               f"({exc.strerror or exc})") from exc
    os.close(fd)
    os.unlink(probe)
    return out


def write_output(path: str | os.PathLike[str], data: str | bytes, option: str) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` after :func:`check_output`: through a
    temporary file in the same directory, renamed over the path only if it is still a
    regular file or nothing.  Returns the absolute path; one-line errors."""
    out = check_output(path, option)
    out.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        with contextlib.suppress(OSError):  # keep the mode an existing file had
            os.chmod(tmp, stat.S_IMODE(os.stat(out).st_mode) if out.exists() else 0o644)
        check_output(out, option)  # still a regular file or nothing, just before the rename
        os.replace(tmp, out)
    except OSError as exc:
        raise OutputRefused(f"{option} {path}: cannot write "
                               f"({exc.strerror or exc})") from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return out
