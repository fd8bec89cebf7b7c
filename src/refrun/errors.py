"""Exceptions that mean "bad input": the CLI turns them into one line and exit code 2."""

from __future__ import annotations


class RefrunInputError(ValueError):
    """Bad usage or input: a message naming the file, line or key; never a traceback."""


class RefrunResourceError(RefrunInputError):
    """A resource ran out (e.g. the disk is full): one line naming the path, exit code 2."""


class RefrunStoreError(RefrunInputError):
    """The tracking store cannot be used as asked (missing, not a store, corrupt, truncated,
    locked, unreachable): one line naming the store and the cause, exit code 2."""
