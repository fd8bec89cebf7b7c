"""Moved to :mod:`refrun.store.uri`; this re-export keeps old imports working for one
release (remove it once nothing imports ``refrun.tracking``)."""

from refrun.store.uri import existing_store_uri, resolve_tracking_uri

__all__ = ["existing_store_uri", "resolve_tracking_uri"]
