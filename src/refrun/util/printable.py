"""Text that comes from a store, a file or a user, made safe to print on one line.

A tag, a file name or a ``--by`` name can carry a newline (a forged second line in
``refrun verify``'s output) or a terminal escape sequence (text hidden or rewritten on the
user's screen).  :func:`escape` shows every character that is not printable as its Python
escape (``\\n``, ``\\x1b``, ``\\u202e``), so what a command prints is what is stored,
visibly, on the line it belongs to.
"""

from __future__ import annotations

# What str.isprintable() calls printable: letters, marks, numbers, punctuation, symbols
# and the ASCII space.  Everything else (C*: controls, format characters such as the
# bidirectional overrides; Z* other than " ": line and paragraph separators) is escaped.


def escape(text: object) -> str:
    """``str(text)`` with every non-printable character replaced by its escape."""
    s = str(text)
    if s.isprintable():
        return s
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in s)


def name_problem(text: str, max_len: int = 200) -> str | None:
    """Why ``text`` cannot be a name shown to people (empty, too long, or holding a
    character that is not printable: a newline, a control or escape character); None when
    it can."""
    if not text.strip():
        return "empty"
    if len(text) > max_len:
        return f"{len(text)} characters (at most {max_len})"
    bad = next((c for c in text if not c.isprintable()), None)
    if bad is not None:
        return (f"contains the non-printable character {escape(bad)} (newlines, control "
                "and escape characters are refused)")
    return None


__all__ = ["escape", "name_problem"]
