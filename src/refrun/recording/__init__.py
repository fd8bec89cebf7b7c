"""The recording path: from ``run.log(...)`` on the training thread to a complete MLflow run.

=============  ===========================================================================
module         concept
=============  ===========================================================================
``settings``   every ``REFRUN_*`` environment variable, read in one place
``config``     :class:`RunConfig`, the typed, validated configuration of one run
``session``    ``start_run`` → :class:`RunSession`: accepts points and warnings, life cycle
``writer``     the spool writer thread: in-memory queue → spool file (disk-full safe)
``spool``      the spool directory and its typed, versioned :class:`SpoolMeta` record
``view``       the bounded, spike-preserving view of each metric that MLflow receives
``delivery``   the one delivery component: locks, status, back-off, finalize, seal
``process``    the delivery process (``python -m refrun.recording.process``)
``sync``       ``refrun sync``: spools left by killed processes or an unreachable store
``curves``     the full-resolution ``refrun/curves.parquet`` artifact
=============  ===========================================================================

Imports flow one way: settings/config/spool/curves/view ← delivery ← writer/process/sync ←
session.  Importing this package imports nothing else.
"""
