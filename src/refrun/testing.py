"""pytest plugin and fixtures for gradient gates in a migration's CI (see docs/gradcheck.md)."""
