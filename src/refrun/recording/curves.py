"""Moved to :mod:`refrun.store.curves` (the artifact's format belongs to the store layer,
which readers use without the recording stack).  This re-export keeps old imports working
for one release."""

from refrun.store.curves import SCHEMA, read_curves, summary_tags, write_curves

__all__ = ["SCHEMA", "read_curves", "summary_tags", "write_curves"]
