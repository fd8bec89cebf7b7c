"""The store layer: everything that meets MLflow's tracking store, in one package.

==============  ============================================================================
module          concept
==============  ============================================================================
``uri``         which store: tracking-URI resolution (argument, ``$MLFLOW_TRACKING_URI``,
                ``sqlite:///mlflow.db``), the local sqlite path of a URI
``health``      checks a store before MLflow opens it (missing, empty, not SQLite,
                truncated, locked, not an MLflow store) and one-line causes of store errors
``client``      the ONE client factory (``client(uri, create=...)``): bounded HTTP, the
                sqlite create lock, a reader never creates a store; ``ensure_experiment``
``complete``    the second way to write a run: a run whose content is known up front
                (imports, comparisons, assessments, gradient checks) written in one pass
``direct``      a local sqlite store of a schema refrun knows, read and written with
                ``sqlite3`` (no MLflow import): what ``client(uri, direct=True)`` may give
``runs``        finding recorded runs by their refrun identity tags
``mlflow_ui``   how runs and experiments present themselves in MLflow's UI (names,
                descriptions, the experiment kind)
==============  ============================================================================

The first way to write a run, live, is the session's spool and delivery
(:mod:`refrun.recording`), which takes its client from here; MLflow's limits are
declared once in the vocabulary (:mod:`refrun.limits`).
Readers (comparison, acceptance, report, the CLI) import ``uri``, ``health`` and
``client`` only; nothing in this package imports the recording stack, and importing the
package itself imports nothing (MLflow is imported by ``client`` on first use).
"""
