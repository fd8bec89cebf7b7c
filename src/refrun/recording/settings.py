"""Moved to :mod:`refrun.settings` (every ``REFRUN_*`` variable, the store's included).
This re-export keeps old imports working for one release."""

from refrun.settings import (
    DEFAULT_SPOOL_ROOT,
    DELIVERIES,
    Delivery,
    JobIdentity,
    Settings,
    default_job_id,
    job_identity,
    settings,
)

__all__ = ["DEFAULT_SPOOL_ROOT", "DELIVERIES", "Delivery", "JobIdentity", "Settings",
           "default_job_id", "job_identity", "settings"]
