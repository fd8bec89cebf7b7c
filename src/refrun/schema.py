"""The versioned identity and metric-name schema every refrun run carries.

A run is found and compared later only through these names, so they are the
contract between the run session, the framework probes, the comparison engine
and the report.  Bump :data:`SCHEMA_VERSION` on any incompatible change; readers
check ``refrun.schema`` before trusting a run.

Tags (all strings, prefix ``refrun.``):

========================  ====================================================
``refrun.schema``         schema version of this run ("1")
``refrun.workload``       workload name; also the default experiment name
``refrun.role``           reference | candidate | comparison | gradcheck
``refrun.hardware``       declared hardware, e.g. ``a100``, ``tpu-v5e``, ``cpu``
``refrun.backend``        ``torch``, ``torch_xla``, ``jax``, ``import`` ...
``refrun.chips``          number of accelerator chips (int)
``refrun.seed``           random seed (int)
``refrun.global_batch``   global batch size (int)
``refrun.version``        refrun version that recorded the run
``refrun.fw.<name>``      framework versions (python, torch, torch_xla, jax ...)
``refrun.device``         device description as seen by the process
``refrun.host``           host name
``refrun.git.commit``     commit of the training code, when in a git repository
``refrun.git.dirty``      "true" when that tree had uncommitted changes
``refrun.local_id``       id of the local spool that backs the run
``refrun.steps.*``        written at the end: count, first, last, repeated, backwards
``refrun.nonfinite``      number of NaN/Inf points recorded
``refrun.dropped``        points not kept: in-memory queue full or spool disk full
``refrun.refused``        points, tags and params refused at entry (a name, key or step
                          MLflow refuses, a value that is not a real number or too large
                          for a float, a param logged again with another value); each
                          named in ``refrun/warnings.json`` (``refused``)
``refrun.truncated``      tag/param values cut to MLflow's length limit (each warned)
``refrun.skipped``        points/tags the store refused at delivery (skipped, see warnings)
``refrun.curves.missing`` why the curves artifact could not be written (disk full)
``refrun.sync.pending``   spooled points not yet delivered (disk full): run incomplete
``refrun.lost.estimate``  points a hard kill took before they reached the spool (estimate)
``refrun.warnings``       number of recorded warnings (text in ``refrun/warnings.json``)
========================  ====================================================

Artifacts: ``refrun/curves.parquet`` (every point at full resolution),
``refrun/environment.json`` (packages, Python, OS), ``refrun/warnings.json``.

Metric names shared by every backend's probe are the ``M_*`` constants below.
"""

from __future__ import annotations

SCHEMA_VERSION = "1"
PREFIX = "refrun."

ROLES = ("reference", "candidate", "comparison", "gradcheck")

TAG_SCHEMA = "refrun.schema"
TAG_WORKLOAD = "refrun.workload"
TAG_ROLE = "refrun.role"
TAG_HARDWARE = "refrun.hardware"
TAG_BACKEND = "refrun.backend"
TAG_CHIPS = "refrun.chips"
TAG_SEED = "refrun.seed"
TAG_GLOBAL_BATCH = "refrun.global_batch"
TAG_VERSION = "refrun.version"
TAG_FW_PREFIX = "refrun.fw."
TAG_DEVICE = "refrun.device"
TAG_HOST = "refrun.host"
TAG_GIT_COMMIT = "refrun.git.commit"
TAG_GIT_DIRTY = "refrun.git.dirty"
TAG_LOCAL_ID = "refrun.local_id"
TAG_STEPS_COUNT = "refrun.steps.count"
TAG_STEPS_FIRST = "refrun.steps.first"
TAG_STEPS_LAST = "refrun.steps.last"
TAG_STEPS_REPEATED = "refrun.steps.repeated"
TAG_STEPS_BACKWARDS = "refrun.steps.backwards"
TAG_NONFINITE = "refrun.nonfinite"
TAG_DROPPED = "refrun.dropped"
TAG_WARNINGS = "refrun.warnings"
TAG_PLANNED_STEPS = "refrun.planned_steps"
# Comparison runs link what they compared.
TAG_COMPARED_REFERENCE = "refrun.compared.reference"  # comma-separated run ids
TAG_COMPARED_CANDIDATE = "refrun.compared.candidate"

# --- recording path (refrun.recording; issue 14) --------------------------------------
# Points refused where they entered (bad name/key/step, see refrun.keys); never queued.
TAG_REFUSED = "refrun.refused"
# Tag and param values cut to MLflow's length limit at entry (each warned).
TAG_TRUNCATED = "refrun.truncated"
# Points or tags the store still refused at delivery; skipped (reasons in warnings.json).
TAG_SKIPPED = "refrun.skipped"
# Set when the curves artifact could not be written (e.g. disk full): the reason.
# Removed by `refrun sync` once the artifact is delivered.
TAG_CURVES_MISSING = "refrun.curves.missing"
# Points a hard kill (SIGKILL, OOM) is estimated to have taken with the trainer: accepted
# by log() but not yet written to the spool (refrun.recording.delivery.lost_estimate).
TAG_LOST_ESTIMATE = "refrun.lost.estimate"
# Set when the run was terminated in the store while spooled points could not be delivered
# (the spool's disk full): how many, and where; readers treat the run as incomplete until
# `refrun sync` delivers them and removes the tag.
TAG_SYNC_PENDING = "refrun.sync.pending"
# MLflow's source tag, set on every recorded run.
TAG_MLFLOW_SOURCE = "mlflow.source.name"
SOURCE_NAME = "refrun"

ARTIFACT_DIR = "refrun"
ARTIFACT_CURVES = "refrun/curves.parquet"
ARTIFACT_ENVIRONMENT = "refrun/environment.json"
ARTIFACT_WARNINGS = "refrun/warnings.json"

# Columns of the curves artifact (long format, one row per accepted point).
CURVE_COLUMNS = ("metric", "step", "value", "timestamp_ms", "seq")

# --- metric names shared by every framework probe -------------------------
M_LOSS = "loss"
EVAL_PREFIX = "eval/"
M_STEP_TIME = "perf/step_time_s"  # seconds, device-true where the backend allows
# How perf/step_time_s was measured: cuda_event | wall | ready (see each backend).
TAG_STEP_TIME_KIND = "refrun.perf.step_time_kind"
M_COMPILE_GRAPHS = "compile/graphs"  # new graphs compiled during the step
M_COMPILE_RECOMPILES = "compile/recompiles"  # of which recompilations of a known function
M_COMPILE_GRAPH_BREAKS = "compile/graph_breaks"
M_COMPILE_CACHE_HITS = "compile/cache_hits"  # persistent/cached compilations
M_COMPILE_OTHER = "compile/other"  # compilations outside the step function (eager helpers)
M_COMPILE_TIME = "compile/time_s"
M_EXECUTIONS = "exec/count"
M_EXECUTE_TIME = "exec/time_s"
M_XFER_D2H = "xfer/d2h"  # device-to-host transfers during the step
M_XFER_H2D = "xfer/h2d"
# Host syncs inside the step: .item()-style reads that wait for the device (torch_xla:
# aten::_local_scalar_dense; JAX: host reads of jax.Arrays; PyTorch on CUDA: synchronizing
# CUDA calls seen by torch.cuda.set_sync_debug_mode).
M_HOST_SYNCS = "xfer/host_syncs"
M_FALLBACK_OPS = "fallback/ops"  # CPU-fallback op executions during the step
M_NONFINITE = "health/nonfinite"
SYS_PREFIX = "sys/"  # sys/cpu_pct, sys/rss_bytes, sys/gpu0_util_pct, sys/gpu0_mem_bytes ...
# System and runtime signals (how the run executed, not what it computed): the report ranks
# them in their own group, beside the runtime evidence, after training and evaluation
# signals.  health/* (non-finite counts) is numerical and stays with the training signals.
RUNTIME_PREFIXES = (SYS_PREFIX, "perf/", "xfer/", "compile/", "exec/", "fallback/", "job/")

# Tags written by probes (device truth and placement).
TAG_EXEC_HARDWARE = "refrun.exec.hardware"  # hardware that actually executed
TAG_EXEC_DEVICES = "refrun.exec.devices"  # number of devices used
TAG_EXEC_WORLD_SIZE = "refrun.exec.world_size"
TAG_PLACEMENT = "refrun.placement"  # json summary of where params/state live
TAG_PLACEMENT_WARNING = "refrun.placement.warning"
TAG_MESH = "refrun.exec.mesh"


# --- MLflow UI (area: ui, issue 17; see refrun.mlflow_ui) ---------------------
# MLflow's own tags that refrun writes so the UI shows what a run is.
TAG_RUN_NAME = "mlflow.runName"
TAG_NOTE = "mlflow.note.content"  # the run's Markdown description on its page
# The experiment tag MLflow 3.x's UI reads to choose the experiment page's mode; values
# understood by its UI bundle: genai_development, custom_model_development, finetuning,
# regression, classification, forecasting, automl (the *_inferred ones are its guesses).
TAG_EXPERIMENT_KIND = "mlflow.experimentKind"
EXPERIMENT_KIND_TRAINING = "custom_model_development"
# Saved views of an experiment's runs page (MLflow 3.17's "Views" menu and share links):
# experiment tag <prefix><view id> = {"name", "createdAt", "updatedAt", "state": JSON text}.
TAG_SAVED_VIEW_PREFIX = "mlflow.sharedViewState."
TAG_ACCEPTANCE_VERDICT = "refrun.acceptance.verdict"  # pass | fail | incomplete
TAG_ACCEPTANCE_HIGHEST = "refrun.acceptance.highest_level"  # L0..L4 | none
TAG_IMPORT_SOURCE = "refrun.import.source"  # file name(s) an imported run came from
ARTIFACT_REPORT = "refrun/report.html"  # the comparison run's HTML report


def identity_tag(field: str) -> str:
    """Tag name for an identity field (``workload`` -> ``refrun.workload``)."""
    return PREFIX + field

# --- imports and MLflow views (engineer imp, issue 14) ---------------------
# Where an imported run's points came from (refrun import megatron|torchtitan|csv).
TAG_IMPORT_FORMAT = "refrun.import.format"
TAG_IMPORT_SOURCE = "refrun.import.source"  # file name(s), comma-separated
TAG_IMPORT_SHA256 = "refrun.import.sha256"  # of the imported file(s), in order
TAG_IMPORT_NONFINITE = "refrun.import.nonfinite_points"
# How MLflow's metric history of a run relates to its curves artifact (a bounded view).
TAG_MLFLOW_VIEW = "refrun.mlflow_view"
TAG_COMPARED_METRICS = "refrun.compared.metrics"  # comma-separated metric names
ARTIFACT_COMPARISON = "refrun/comparison.json"
DIFF_PREFIX = "diff/"  # comparison runs: candidate - reference, metric units
RELDIFF_PREFIX = "reldiff/"  # comparison runs: |diff| / max(|cand|, |ref|, eps)

# --- calibration and statistics (acceptance, issue 13: refrun calibrate) ---------------
# Per-step counters whose movement marks a compilation step: such steps are left out of a
# step-time median (their time is the compiler's, not the step's).
STEP_TIME_COMPILE_METRICS = (M_COMPILE_GRAPHS, M_COMPILE_RECOMPILES, M_COMPILE_OTHER)
# Evidence fields of the statistical criteria (equivalence, convergence): the interval
# the decision rests on and the number of reference seeds behind it.
EV_INTERVAL = "interval"
EV_N_REFERENCE = "n_reference"
# Where a per-step criterion's candidate first left the criterion's band (issue 21, calib):
# {axis, at, step, first_outside_at, sustain, direction, outside_points, points} or null,
# and the step alone (the report marks it on the metric's figure).
EV_FIRST_DIVERGENCE = "first_divergence"
EV_FIRST_DIVERGENCE_STEP = "first_divergence_step"
# A failing per-step criterion's reason ends with this, then the axis value and side.
FIRST_LEFT_REASON = "; first left the band at "
# Gradient checks as acceptance evidence (issue 13, cal): a run of role gradcheck names the
# candidate run it checked; the `gradcheck` criterion finds it by this tag.
TAG_GRADCHECK_CANDIDATE = "refrun.gradcheck.candidate"  # run id of the checked candidate
TAG_GRADCHECK_PASSED = "refrun.gradcheck.passed"  # "true" / "false"
TAG_GRADCHECK_FAILED = "refrun.gradcheck.failed"  # labels of failing checks, comma-separated
GRADCHECK_METRIC_PREFIX = "gradcheck/"  # gradcheck/<label>/<measure>; .../passed is 1 or 0

# --- report (issue 16): what `refrun report` adds to a comparison run so that MLflow's own
# run comparison is useful (select comparison runs, chart these per compared metric).
TAG_REPORT_VERDICT = "refrun.report.verdict"  # pass | fail | incomplete | none (no criteria)
TAG_REPORT_HIGHEST_LEVEL = "refrun.report.highest_level"
TAG_REPORT_TOP_DEPARTURE = "refrun.report.top_departure"  # metric that departs most
TAG_REPORT_FAILED = "refrun.report.failed"  # comma-separated failing criterion ids
ARTIFACT_REPORT = "refrun/report.html"
M_REPORT_MEAN_ABS_Z = "report/mean_abs_z/"  # + metric: mean |z| over aligned steps (seed σ)
M_REPORT_MAX_ABS_Z = "report/max_abs_z/"  # + metric
M_REPORT_OUTSIDE = "report/fraction_outside/"  # + metric: fraction of steps outside seeds
M_REPORT_FIRST_OUT = "report/first_step_out/"  # + metric: first step out of band
M_REPORT_MEAN_REL_DIFF = "report/mean_rel_diff/"  # + metric (single reference)
M_REPORT_CRITERIA_PASSED = "report/criteria_passed"
M_REPORT_CRITERIA_FAILED = "report/criteria_failed"
M_REPORT_CRITERIA_NOT_EVALUABLE = "report/criteria_not_evaluable"


# --- probe contract (integ, issue 15): tags and artifacts the probes write ----------------
# Every backend (torch, torch_xla, jax) and every trainer callback writes these names; the
# acceptance checks and the report read them.  Values are strings, as every MLflow tag.
TAG_STEP_TIME_MEDIAN = "refrun.perf.step_time_median_s"  # steady-state median, seconds
TAG_STEP_TIME_P90 = "refrun.perf.step_time_p90_s"
TAG_WARMUP_STEPS = "refrun.perf.warmup_steps"  # step times left out of median/p90
TAG_STEADY_STEPS = "refrun.perf.steady_steps"
TAG_STEP_TIME_WALL_STEPS = "refrun.perf.step_time_wall_steps"  # JAX steps timed by wall
TAG_EXEC_DEVICE_KIND = "refrun.exec.device_kind"
TAG_EXEC_VISIBLE_DEVICES = "refrun.exec.visible_devices"
TAG_EXEC_DEVICE_TYPE = "refrun.exec.device_type"  # torch_xla.runtime.device_type()
TAG_EXEC_XLA_DEVICE = "refrun.exec.xla_device"
TAG_EXEC_MEMORY_PEAK = "refrun.exec.memory_peak_bytes"
TAG_FW_PJRT_DEVICE = "refrun.fw.pjrt_device"
TAG_DECLARED_ACCELERATOR = "refrun.exec.declared_accelerator"  # "true" | "false"
TAG_SUMMARY_PREFIX = "refrun.summary."  # end-of-run summary counts (XLA)
TAG_FALLBACK_OPS = "refrun.fallback.ops"  # JSON {op name: executions}
TAG_JAX_TRANSFER_GUARD = "refrun.jax.transfer_guard"
TAG_JAX_STEP_FUNCTIONS = "refrun.jax.step_functions"
TAG_JAX_FRESH_CACHES = "refrun.jax.fresh_caches"
TAG_JAX_TRANSFERS = "refrun.jax.h2d_transfers"  # total implicit h2d transfers counted
# Which host reads of jax.Arrays inside the step are counted as xfer/host_syncs
# ("counted: ...", or "off (...)"): refrun.probes.host_reads.
TAG_JAX_HOST_READS = "refrun.jax.host_reads"
# Whether the PyTorch probe counts CUDA host syncs inside the step as xfer/host_syncs
# ("counted: ..." on CUDA, "off (...)" elsewhere): refrun.probes.torch.CudaSyncCounter.
TAG_TORCH_CUDA_SYNCS = "refrun.torch.cuda_syncs"
ARTIFACT_XLA_SUMMARY = "refrun/xla_summary.json"
ARTIFACT_FALLBACK_OPS = "refrun/fallback_ops.json"
ARTIFACT_JAX_COMPILATIONS = "refrun/jax_compilations.json"
ARTIFACT_JAX_TRANSFERS = "refrun/jax_transfers.json"  # counts per step, first N sites
# Progress axes (issue 15.4): cumulative samples / tokens seen at the end of each step.
M_PROGRESS_SAMPLES = "progress/samples"
M_PROGRESS_TOKENS = "progress/tokens"
PROGRESS_PREFIX = "progress/"  # axis metrics: never compared as measurements
TAG_TOKENS_PER_SAMPLE = "refrun.tokens_per_sample"  # int; tokens = samples x this
AXES = ("step", "samples", "tokens")  # what comparisons align on
# Hardware names that mean "no accelerator" (the one classification every backend uses).
CPU_HARDWARE_NAMES = ("", "cpu", "host", "none")
# --- end of probe contract block -----------------------------------------------------------

# --- multi-process jobs (engineer mp, issue 15.3; see docs/multiprocess.md) -------------------
# A job of world_size > 1 processes records ONE run, owned by rank 0: its curves are the run's
# curves.  Every rank's run identity carries the job id, its rank and the world size.
TAG_JOB_ID = "refrun.job.id"
TAG_JOB_RANK = "refrun.job.rank"  # "0" on the run (rank 0 owns it)
TAG_JOB_WORLD_SIZE = "refrun.job.world_size"
# Set on the run by rank k's delivery once rank k's data arrived: + "rank-<k>" = its status.
TAG_JOB_REPORTED_PREFIX = "refrun.job.reported."
ARTIFACT_RANKS_DIR = "refrun/ranks"
# Derived per-job values the loader adds to rank 0's curves (one point at its last step), so a
# criteria file can bound them (kind "claim"): slowest rank's steady step time / median over
# ranks, how many of world_size ranks reported, and how many of them FINISHED.
M_JOB_STRAGGLER = "job/straggler_ratio"
M_JOB_RANKS_REPORTED = "job/ranks_reported"
M_JOB_RANKS_FINISHED = "job/ranks_finished"  # ranks whose status is FINISHED (rank 0: the run's)


def rank_name(rank: int) -> str:
    """``rank-<k>``: the name of rank k in artifact paths and reported-tags."""
    return f"rank-{int(rank)}"


def rank_curves_artifact(rank: int) -> str:
    """Rank k's full curves (the curves-artifact format), on rank 0's run."""
    return f"{ARTIFACT_RANKS_DIR}/{rank_name(rank)}.parquet"


def rank_summary_artifact(rank: int) -> str:
    """Rank k's small summary JSON (status, counts, its own tags), on rank 0's run."""
    return f"{ARTIFACT_RANKS_DIR}/{rank_name(rank)}.json"


def rank_artifact(rank: int, name: str) -> str:
    """Where another artifact ``name`` of rank k goes on rank 0's run (its environment,
    warnings ...): ``refrun/ranks/rank-<k>/<file name>``."""
    return f"{ARTIFACT_RANKS_DIR}/{rank_name(rank)}/{name.rsplit('/', 1)[-1]}"
# --- end of multi-process block ---------------------------------------------------------------

# --- legacy-store hygiene (engineer hyg) ---------------------------------------------------
# The candidate's refrun.hardware tag as stored, when it is not (or not written as) a
# canonical hardware name: a store written before hardware validation may hold free text,
# which must neither stop a comparison from being recorded nor be lost.
TAG_COMPARED_CANDIDATE_HARDWARE = "refrun.compared.candidate_hardware"
# --- end of legacy-store hygiene block -----------------------------------------------------

# Candidates of a sweep on one report page are labelled by their run name and by the
# params and tags in which they differ (refrun.report.labels): every param, every tag
# outside the refrun./mlflow. namespaces (a user's own), and these identity tags.  Not
# counters or bookkeeping (step counts, refused points, local ids), which differ between
# any two runs and say nothing about what was run.
LABEL_TAGS = (TAG_HARDWARE, TAG_BACKEND, TAG_CHIPS, TAG_SEED, TAG_GLOBAL_BATCH,
              TAG_EXEC_HARDWARE, TAG_EXEC_DEVICES, TAG_EXEC_WORLD_SIZE, TAG_GIT_COMMIT,
              TAG_IMPORT_SOURCE, TAG_VERSION)
LABEL_TAG_PREFIXES = (TAG_FW_PREFIX,)  # framework versions (refrun.fw.torch ...)
