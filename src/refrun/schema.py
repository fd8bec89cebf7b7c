"""The names every refrun run carries: the contract between writers and readers.

A run is found and compared later only through these names (tags, metric names, artifact
paths, JSON document formats), so each is defined here once, by concept, and imported
everywhere else; ``tests/test_architecture.py`` fails on a ``"refrun.`` name written
anywhere else in ``src/``.  Bump :data:`SCHEMA_VERSION` on any incompatible change;
readers check ``refrun.schema`` before trusting a run.

Sections, in the order a run's life meets them:

1. vocabulary (schema version, roles, levels, axes);
2. identity: who the run is (tags set when it starts);
3. how the recording went (end-of-run tags);
4. every run's artifacts and the curves format;
5. metric names shared by every framework probe, and the tags probes write;
6. multi-process jobs;
7. imported runs;
8. comparison runs;
9. acceptance (assessment, evidence, sign-off);
10. gradient checks;
11. the report;
12. MLflow's own names that refrun writes;
13. labels of sweep candidates;
14. same-seed pairs;
15. numerics configuration (run identity).

Tag values are strings (MLflow's rule); counts are written as decimal integers.
"""

from __future__ import annotations

# === 1. vocabulary ========================================================================
SCHEMA_VERSION = "1"
PREFIX = "refrun."
ROLES = ("reference", "candidate", "comparison", "gradcheck")
LEVELS = ("L0", "L1", "L2", "L3", "L4")
"""Acceptance levels, lowest first (docs/acceptance.md)."""
AXES = ("step", "samples", "tokens")
"""What comparisons align on."""
CPU_HARDWARE_NAMES = ("", "cpu", "host", "none")
"""Hardware names that mean "no accelerator" (the one classification every backend uses)."""


def identity_tag(field: str) -> str:
    """Tag name for an identity field (``workload`` -> ``refrun.workload``)."""
    return PREFIX + field


# === 2. identity: who the run is (set when it starts; refrun.identity.RunIdentity) ========
TAG_SCHEMA = "refrun.schema"  # schema version of this run
TAG_WORKLOAD = "refrun.workload"  # workload name; also the default experiment name
TAG_ROLE = "refrun.role"  # one of ROLES
TAG_HARDWARE = "refrun.hardware"  # declared hardware: a100, tpu-v5e, cpu ...
TAG_BACKEND = "refrun.backend"  # torch, torch_xla, jax, import ...
TAG_CHIPS = "refrun.chips"  # accelerator chips (int)
TAG_SEED = "refrun.seed"  # random seed (int)
TAG_GLOBAL_BATCH = "refrun.global_batch"  # samples per optimizer step (int)
TAG_PLANNED_STEPS = "refrun.planned_steps"  # steps the run is meant to take (int)
TAG_TOKENS_PER_SAMPLE = "refrun.tokens_per_sample"  # int; tokens = samples x this
TAG_VERSION = "refrun.version"  # refrun version that recorded the run
# Of this process (runs recorded elsewhere, such as imports, have none of these):
TAG_FW_PREFIX = "refrun.fw."  # + python, torch, torch_xla, jax ...: versions
TAG_FW_PJRT_DEVICE = "refrun.fw.pjrt_device"
TAG_DEVICE = "refrun.device"  # device description as the process sees it
TAG_HOST = "refrun.host"
TAG_GIT_COMMIT = "refrun.git.commit"  # of the training code, in a git repository
TAG_GIT_DIRTY = "refrun.git.dirty"  # "true" when that tree had uncommitted changes
TAG_LOCAL_ID = "refrun.local_id"  # the local spool that backs the run
# Of a run copied from another store (`refrun merge`): the MLflow run id it had in the store
# it was recorded in, kept through every later merge; how a merge recognises a run it
# already copied (docs/offline-install.md).
TAG_ORIGIN_RUN_ID = "refrun.origin.run_id"

# === 3. how the recording went (end-of-run tags) =========================================
TAG_STEPS_COUNT = "refrun.steps.count"
TAG_STEPS_FIRST = "refrun.steps.first"
TAG_STEPS_LAST = "refrun.steps.last"
TAG_STEPS_REPEATED = "refrun.steps.repeated"  # points whose step equals the previous one
TAG_STEPS_BACKWARDS = "refrun.steps.backwards"  # points whose step is below the previous
TAG_NONFINITE = "refrun.nonfinite"  # NaN/Inf points recorded
TAG_DROPPED = "refrun.dropped"  # points not kept: in-memory queue full or spool disk full
# Points, tags and params refused at entry (a name, key or step MLflow refuses, a value
# that is not a real number or too large for a float, a param logged again with another
# value); each named in refrun/warnings.json (``refused``).  Never queued.
TAG_REFUSED = "refrun.refused"
TAG_TRUNCATED = "refrun.truncated"  # tag/param values cut to MLflow's length (each warned)
# Points or tags the store still refused at delivery: skipped (reasons in warnings.json).
TAG_SKIPPED = "refrun.skipped"
TAG_CURVES_MISSING = "refrun.curves.missing"  # why the curves artifact is missing (disk full)
# Set when the run was terminated in the store while spooled points could not be delivered
# (the spool's disk full): how many, and where; readers treat the run as incomplete until
# `refrun sync` delivers them and removes the tag.
TAG_SYNC_PENDING = "refrun.sync.pending"
# Points a hard kill (SIGKILL, OOM) is estimated to have taken with the trainer: accepted
# by log() but not yet written to the spool (refrun.recording.delivery.lost_estimate).
TAG_LOST_ESTIMATE = "refrun.lost.estimate"
# Spool lines that were not a point when the run was sealed (a NUL block a crash left, a
# line that is not UTF-8 ...): "<points> points in <lines> lines (<bytes> bytes)"; those
# points are also counted in refrun.dropped.  Every valid line around them is delivered.
TAG_SPOOL_DAMAGED = "refrun.spool.damaged"
TAG_WARNINGS = "refrun.warnings"  # number of warnings (text in refrun/warnings.json)
TAG_MLFLOW_VIEW = "refrun.mlflow_view"  # how MLflow's history relates to the curves artifact

# === 4. every run's artifacts ============================================================
ARTIFACT_DIR = "refrun"
ARTIFACT_CURVES = "refrun/curves.parquet"  # every point at full resolution
ARTIFACT_ENVIRONMENT = "refrun/environment.json"  # packages, Python, OS
ARTIFACT_WARNINGS = "refrun/warnings.json"
CURVE_COLUMNS = ("metric", "step", "value", "timestamp_ms", "seq")
"""Columns of the curves artifact (long format, one row per accepted point)."""

# === 5. metric names shared by every framework probe, and the tags probes write ==========
M_LOSS = "loss"
EVAL_PREFIX = "eval/"
# The learning rate of a torch optimizer's parameter group 0, and of group i >= 1 as
# M_LR + "/pg" + i, read at every step's entry (the rate its update uses) by the PyTorch
# and PyTorch/XLA probes, so by the Lightning and Hugging Face callbacks:
# refrun.probes.optim.  A JAX run records them where its step returns
# refrun.jax.optimizer_metrics(opt_state) (optax's inject_hyperparams): refrun.probes.jax.
OPT_PREFIX = "opt/"
M_LR = "opt/lr"
# The optimizer's own count of the updates it has applied, after the step's update (torch:
# state[p]["step"] of Adam & co.; optax: the state's count).  Compared within a run, where
# a resume replays steps (refrun.comparison.restores); calibrate writes no criterion across
# runs on it (a loss scaler skips updates on one hardware and not on another).
M_OPT_STEPS = "opt/steps"
# The backends whose probes always record opt/lr: calibrate scopes every criterion on an
# opt/ metric to them (and to the references' own backend), so a candidate of another
# framework (a JAX run records the rate only where its step returns it) is not_applicable
# there, never incomplete.
OPT_BACKENDS = ("torch", "torch_xla")
M_STEP_TIME = "perf/step_time_s"  # seconds, device-true where the backend allows
# CPU seconds the training thread used inside the step scope (time.thread_time): a thread
# that waits for a core accrues none, so neighbours that share the machine inflate it only
# through hardware they share, unlike the wall time (refrun.acceptance.kinds.step_time).
M_STEP_CPU = "perf/step_cpu_s"
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
M_SYS_CPU_PCT = "sys/cpu_pct"  # system-wide CPU busy since the previous sample, %
# CPU used since the previous sample, in cores: by this process and its descendants (the
# run's own work: delivery process, DataLoader workers ...), and by every other process on
# the machine (system busy cores minus the run's own).  The step-time criterion reads the
# latter as how busy the machine was (contention), with the logical CPU count.
M_SYS_RUN_CPU_CORES = "sys/run_cpu_cores"
M_SYS_OTHERS_CPU_CORES = "sys/others_cpu_cores"
M_SYS_LOGICAL_CPUS = "sys/logical_cpus"
# This process's host memory: resident set less the device mappings it holds (an
# accelerator's BARs mapped into the process: a TPU's ``anon_inode:[vfio-device]``,
# ``/dev/accel*``, NVIDIA's ``/dev/nvidia*``), and those device mappings' resident bytes
# (refrun.probes.host_memory).
M_SYS_RSS_BYTES = "sys/rss_bytes"
M_SYS_DEVICE_MAPPED_BYTES = "sys/device_mapped_bytes"
# The sys/* readings a monitor found contradicted and no longer records, with why ("sys/
# cpu_pct, sys/others_cpu_cores: /proc/stat did not advance while this process used 2.9
# CPU seconds"): a reading that is not recorded is not known, never zero.
TAG_SYS_UNAVAILABLE = "refrun.sys.unavailable"
# Per-device readings are named sys/<platform><i><suffix>: sys/tpu0_duty_cycle_pct,
# sys/gpu0_util_pct, sys/tpu0_mem_bytes (device_metric below).  Chip utilisation:
# DUTY_CYCLE_SUFFIX, the share of wall time the device executed programs, %, over libtpu's
# sample period or a sampled profiler window (refrun.probes.chip_busy); UTIL_SUFFIX, NVML's
# GPU utilisation, %.  Device memory from the runtime (jax ``memory_stats()``): in use, its
# peak, the limit.
DUTY_CYCLE_SUFFIX = "_duty_cycle_pct"
UTIL_SUFFIX = "_util_pct"
MEM_SUFFIX = "_mem_bytes"
MEM_PEAK_SUFFIX = "_mem_peak_bytes"
MEM_LIMIT_SUFFIX = "_mem_limit_bytes"


def device_metric(platform: str, index: int, suffix: str) -> str:
    """``sys/<platform><index><suffix>``: ``device_metric("tpu", 0, DUTY_CYCLE_SUFFIX)`` is
    ``sys/tpu0_duty_cycle_pct``."""
    return f"{SYS_PREFIX}{platform}{int(index)}{suffix}"


# Per-step counters are deltas for that step; these prefixes name them (compared as counts,
# never as measurements).
COUNTER_PREFIXES = ("compile/", "xfer/", "fallback/", "exec/", "health/")
# System and runtime signals (how the run executed, not what it computed): the report ranks
# them in their own group, beside the runtime evidence, after training and evaluation
# signals.  health/* (non-finite counts) is numerical and stays with the training signals.
RUNTIME_PREFIXES = (SYS_PREFIX, "perf/", "xfer/", "compile/", "exec/", "fallback/", "job/")
# Counters whose movement marks a compilation step: such steps are left out of a step-time
# median (their time is the compiler's, not the step's).
STEP_TIME_COMPILE_METRICS = (M_COMPILE_GRAPHS, M_COMPILE_RECOMPILES, M_COMPILE_OTHER)
# Progress axes: cumulative samples / tokens seen at the end of each step.
M_PROGRESS_SAMPLES = "progress/samples"
M_PROGRESS_TOKENS = "progress/tokens"
PROGRESS_PREFIX = "progress/"  # axis metrics: never compared as measurements
# Step time, as the probes summarise it at the end of a run.
TAG_STEP_TIME_KIND = "refrun.perf.step_time_kind"  # cuda_event | wall | ready | interval
# An interval step time runs from a step's entry to the next step's entry (the last
# step's: to the probe's close), so it holds what ran between the steps.
STEP_TIME_INTERVAL = "interval"
TAG_STEP_TIME_MEDIAN = "refrun.perf.step_time_median_s"  # steady-state median, seconds
TAG_STEP_TIME_P90 = "refrun.perf.step_time_p90_s"
# Seconds from the run's start time to the end of start_run: refrun's own start-up, left
# out of the run's hours (L4 cost).
TAG_RECORDING_START_S = "refrun.perf.recording_start_s"
# Seconds of refrun's own close: from the call of the session's close to the run's end time,
# plus any probe closed before it (its pending values and summaries), left out likewise.
TAG_RECORDING_CLOSE_S = "refrun.perf.recording_close_s"
TAG_WARMUP_STEPS = "refrun.perf.warmup_steps"  # step times left out of median/p90
TAG_STEADY_STEPS = "refrun.perf.steady_steps"
# JAX steps timed by wall: written by refrun 0.1.0 (kind ready); JAX steps are now all timed
# from entry to entry (kind interval).
TAG_STEP_TIME_WALL_STEPS = "refrun.perf.step_time_wall_steps"
# Per-step counters a probe writes only at steps where they are not 0 (and at the run's
# first step), comma-separated: every reader gets them back with a 0 at each other step
# that has a step time (refrun.comparison.loading.dense_counters).  Each point costs a
# host-bound step's probe ~1 us of Python (GIL time the training thread waits for), and
# compile and host-read counters are 0 at almost every step.
TAG_SPARSE_COUNTERS = "refrun.perf.sparse_counters"
# Where it executed (device truth) and where its state lives.
TAG_EXEC_HARDWARE = "refrun.exec.hardware"  # hardware that actually executed
TAG_EXEC_DEVICES = "refrun.exec.devices"  # number of devices used
TAG_EXEC_WORLD_SIZE = "refrun.exec.world_size"
TAG_EXEC_DEVICE_KIND = "refrun.exec.device_kind"
TAG_EXEC_VISIBLE_DEVICES = "refrun.exec.visible_devices"
TAG_EXEC_DEVICE_TYPE = "refrun.exec.device_type"  # torch_xla.runtime.device_type()
TAG_EXEC_XLA_DEVICE = "refrun.exec.xla_device"
TAG_EXEC_MEMORY_PEAK = "refrun.exec.memory_peak_bytes"
# Where a run's chip busy fraction (sys/gpu<i>_util_pct, sys/tpu<i>_duty_cycle_pct) came
# from, or why the chip monitor recorded none: written by the probes' chip monitors
# (refrun.probes.chip_busy, the NVML monitor) as "<source>: <detail>" with <source> one of
# UTILIZATION_SOURCES, or "unavailable: <each source's reason>" (e.g. "unavailable:
# libtpu: returned no data for duty_cycle_pct; profiler: no device plane in the trace (cpu
# devices; ...)"); read by L4 across hardware (refrun.acceptance.performance), which shows
# it in place of a busy fraction the run lacks.  A run without a busy fraction is
# "utilisation not known", never idle.
TAG_UTILIZATION_SOURCE = "refrun.exec.utilization_source"
UTILIZATION_SOURCES = ("libtpu", "profiler", "nvml")
UTILIZATION_UNAVAILABLE = "unavailable"
TAG_UTILIZATION_WINDOWS = "refrun.exec.utilization_windows"  # profiler windows sampled (int)
TAG_DECLARED_ACCELERATOR = "refrun.exec.declared_accelerator"  # "true" | "false"
TAG_MESH = "refrun.exec.mesh"
TAG_PLACEMENT = "refrun.placement"  # JSON summary of where params/state live
TAG_PLACEMENT_WARNING = "refrun.placement.warning"
# Framework-specific summaries.
TAG_SUMMARY_PREFIX = "refrun.summary."  # end-of-run summary counts (XLA)
TAG_FALLBACK_OPS = "refrun.fallback.ops"  # JSON {op name: executions}
TAG_JAX_PREFIX = "refrun.jax."
TAG_JAX_TRANSFER_GUARD = "refrun.jax.transfer_guard"  # level inside the step, or "off"
TAG_JAX_STEP_FUNCTIONS = "refrun.jax.step_functions"  # whose compilations count, comma-separated
TAG_JAX_FRESH_CACHES = "refrun.jax.fresh_caches"  # "true": compilation caches cleared at start
TAG_JAX_TRANSFERS = "refrun.jax.h2d_transfers"  # total implicit h2d transfers counted
# Which host reads of jax.Arrays inside the step are counted as xfer/host_syncs
# ("counted: ...", or "off (...)"): refrun.probes.host_reads.
TAG_JAX_HOST_READS = "refrun.jax.host_reads"
# How the JAX probe reads logged values on this machine: "stacked" or "per value", with
# the microseconds a value each way took when the probe started (jax_blocks.ReadPath).
TAG_JAX_READ_PATH = "refrun.jax.read_path"
# Names logged with probe.log whose arrays the loop donated (or deleted) after logging them;
# their values are copied on the device when logged, so they stay exact (comma-separated).
TAG_JAX_DONATED_LOGGED = "refrun.jax.donated_logged"
# Whether the PyTorch probe counts CUDA host syncs inside the step as xfer/host_syncs
# ("counted: ..." on CUDA, "off (...)" elsewhere): refrun.probes.torch.CudaSyncCounter.
TAG_TORCH_CUDA_SYNCS = "refrun.torch.cuda_syncs"
ARTIFACT_XLA_SUMMARY = "refrun/xla_summary.json"
ARTIFACT_FALLBACK_OPS = "refrun/fallback_ops.json"
ARTIFACT_JAX_COMPILATIONS = "refrun/jax_compilations.json"
ARTIFACT_JAX_TRANSFERS = "refrun/jax_transfers.json"  # counts per step, first N sites
# Tags that describe the device and its execution (the report's device section).
DEVICE_TAG_PREFIXES = ("refrun.exec.", TAG_DEVICE, TAG_PLACEMENT, "refrun.perf.",
                       TAG_SUMMARY_PREFIX, TAG_HOST, TAG_JAX_PREFIX, "refrun.fw.pjrt")

# === 6. multi-process jobs (docs/multiprocess.md) ========================================
# A job of world_size > 1 processes records ONE run, owned by rank 0: its curves are the
# run's curves.  Every rank's run identity carries the job id, its rank and the world size.
TAG_JOB_ID = "refrun.job.id"
TAG_JOB_RANK = "refrun.job.rank"  # "0" on the run (rank 0 owns it)
TAG_JOB_WORLD_SIZE = "refrun.job.world_size"
# Set on the run by rank k's delivery once rank k's data arrived: + "rank-<k>" = its status.
TAG_JOB_REPORTED_PREFIX = "refrun.job.reported."
ARTIFACT_RANKS_DIR = "refrun/ranks"
# Derived per-job values the loader adds to rank 0's curves (one point at its last step),
# so a criteria file can bound them (kind "claim"): slowest rank's steady step time /
# median over ranks, how many of world_size ranks reported, how many FINISHED.
M_JOB_STRAGGLER = "job/straggler_ratio"
M_JOB_RANKS_REPORTED = "job/ranks_reported"
M_JOB_RANKS_FINISHED = "job/ranks_finished"  # ranks whose status is FINISHED


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


# The tags that say who a run is: set by start_run (validated there: RunIdentity, the
# job's place), never changed afterwards.  A session refuses a later value that differs
# from the first (warned, counted in refrun.refused); one not set at start takes its
# first value (a probe records tokens_per_sample that way), as MLflow params do.
IDENTITY_TAGS = frozenset({
    TAG_SCHEMA, TAG_WORKLOAD, TAG_ROLE, TAG_HARDWARE, TAG_BACKEND, TAG_CHIPS, TAG_SEED,
    TAG_GLOBAL_BATCH, TAG_PLANNED_STEPS, TAG_TOKENS_PER_SAMPLE, TAG_VERSION, TAG_LOCAL_ID,
    TAG_JOB_ID, TAG_JOB_RANK, TAG_JOB_WORLD_SIZE,
})

# === 7. imported runs (refrun import ...) =================================================
TAG_IMPORT_FORMAT = "refrun.import.format"  # megatron | torchtitan | csv | ...
TAG_IMPORT_SOURCE = "refrun.import.source"  # file name(s), comma-separated
TAG_IMPORT_SHA256 = "refrun.import.sha256"  # of the imported file(s), in order
TAG_IMPORT_NONFINITE = "refrun.import.nonfinite_points"

# === 8. comparison runs (role comparison) =================================================
TAG_COMPARED_REFERENCE = "refrun.compared.reference"  # comma-separated run ids
TAG_COMPARED_CANDIDATE = "refrun.compared.candidate"
TAG_COMPARED_METRICS = "refrun.compared.metrics"  # comma-separated metric names
# The candidate's refrun.hardware tag as stored, when it is not (or not written as) a
# canonical hardware name: a store written before hardware validation may hold free text,
# which must neither stop a comparison from being recorded nor be lost.
TAG_COMPARED_CANDIDATE_HARDWARE = "refrun.compared.candidate_hardware"
ARTIFACT_COMPARISON = "refrun/comparison.json"
FORMAT_COMPARISON = "refrun.comparison"  # the "format" of comparison.json
DIFF_PREFIX = "diff/"  # candidate - reference, metric units
RELDIFF_PREFIX = "reldiff/"  # |diff| / max(|cand|, |ref|, eps)

# === 9. acceptance: assessment, evidence, sign-off =======================================
TAG_ACCEPTANCE_PREFIX = "refrun.acceptance."  # + a level (L0 ... L4): that level's status
TAG_ACCEPTANCE_VERDICT = "refrun.acceptance.verdict"  # pass | fail | incomplete
TAG_ACCEPTANCE_HIGHEST = "refrun.acceptance.highest_level"  # L0..L4 | none
TAG_ACCEPTANCE_CRITERIA_SHA = "refrun.acceptance.criteria_sha256"
TAG_ACCEPTANCE_EVIDENCE_SHA = "refrun.acceptance.evidence_sha256"
TAG_ACCEPTANCE_CRITERIA_FILE = "refrun.acceptance.criteria_file"
ARTIFACT_ASSESSMENT = "refrun/assessment.json"  # the full assessment
ARTIFACT_EVIDENCE = "refrun/evidence.json"  # the canonical evidence the digest covers
ARTIFACT_CRITERIA = "refrun/criteria.toml"  # the exact bytes of the criteria file used
ARTIFACT_SIGNOFF = "refrun/signoff.json"
TAG_SIGNOFF_PREFIX = "refrun.signoff."  # + decision, by, ...
FORMAT_ASSESSMENT = "refrun.assessment"
FORMAT_EVIDENCE = "refrun.evidence"
FORMAT_ACCEPT_SWEEP = "refrun.accept.sweep"  # `refrun accept` of several candidates, --json
# Evidence fields of the statistical criteria (equivalence, convergence): the interval the
# decision rests on and the number of reference seeds behind it.
EV_INTERVAL = "interval"
EV_N_REFERENCE = "n_reference"
# Where a per-step criterion's candidate first left the criterion's band:
# {axis, at, step, first_outside_at, sustain, direction, outside_points, points} or null,
# and the step alone (the report marks it on the metric's figure).
EV_FIRST_DIVERGENCE = "first_divergence"
EV_FIRST_DIVERGENCE_STEP = "first_divergence_step"
# How busy other processes kept the machine during a step_time judgement
# (refrun.acceptance.criterion_evidence.Contention).
EV_CONTENTION = "contention"
# A step_time result on a busy machine: how far the candidate's own CPU time per step
# bounds its step-time ratio from below, whatever the neighbours took
# (refrun.acceptance.kinds.step_time.CpuFloor).
EV_CPU_FLOOR = "cpu_floor"
# The references' CPU time per step as a ceiling on a pass's ratio (step_time, busy references).
EV_CPU_CEILING = "cpu_ceiling"
# Runs' CPU time per step as a bound on a throughput ratio the machine's load made not
# judgeable: the references' (a pass) or the candidate's (a fail)
# (refrun.acceptance.kinds.throughput.CpuRateBound).
EV_CPU_RATE_BOUND = "cpu_rate_bound"
# The candidate's CPU time in its steps as a floor under a cost fail on a machine that took
# CPU from it (refrun.acceptance.kinds.cost.CpuCostFloor).
EV_CPU_COST_BOUND = "cpu_cost_bound"
# A failing per-step criterion's reason ends with this, then the axis value and side.
FIRST_LEFT_REASON = "; first left the band at "

# === 10. gradient checks (role gradcheck; L1 evidence) ====================================
# A gradcheck run names the candidate run it checked; the `gradcheck` criterion finds it.
TAG_GRADCHECK_CANDIDATE = "refrun.gradcheck.candidate"  # run id of the checked candidate
TAG_GRADCHECK_PASSED = "refrun.gradcheck.passed"  # "true" / "false"
TAG_GRADCHECK_FAILED = "refrun.gradcheck.failed"  # labels of failing checks, comma-separated
TAG_GRADCHECK_CHECKS = "refrun.gradcheck.checks"  # number of checks
TAG_GRADCHECK_VERDICT = "refrun.gradcheck.verdict"  # worst finite-difference verdict
TAG_GRADCHECK_TEST = "refrun.gradcheck.test"  # pytest node id (refrun.testing plugin)
GRADCHECK_METRIC_PREFIX = "gradcheck/"  # gradcheck/<label>/<measure>; .../passed is 1 or 0
ARTIFACT_GRADCHECK = "refrun/gradcheck.json"  # every result in full
ARTIFACT_GRADCHECK_FD_HTML = "refrun/gradcheck_fd.html"  # the V curves

# === 11. the report (what `refrun report` adds to a comparison run) ======================
TAG_REPORT_VERDICT = "refrun.report.verdict"  # pass | fail | incomplete | none
TAG_REPORT_HIGHEST_LEVEL = "refrun.report.highest_level"
TAG_REPORT_TOP_DEPARTURE = "refrun.report.top_departure"  # metric that departs most
TAG_REPORT_FAILED = "refrun.report.failed"  # comma-separated failing criterion ids
ARTIFACT_REPORT = "refrun/report.html"
FORMAT_REPORT_MATRIX = "refrun.report.matrix"
M_REPORT_MEAN_ABS_Z = "report/mean_abs_z/"  # + metric: mean |z| over aligned steps (seed σ)
M_REPORT_MAX_ABS_Z = "report/max_abs_z/"  # + metric
M_REPORT_OUTSIDE = "report/fraction_outside/"  # + metric: fraction of steps outside seeds
M_REPORT_FIRST_OUT = "report/first_step_out/"  # + metric: first step out of band
M_REPORT_MEAN_REL_DIFF = "report/mean_rel_diff/"  # + metric (single reference)
M_REPORT_CRITERIA_PASSED = "report/criteria_passed"
M_REPORT_CRITERIA_FAILED = "report/criteria_failed"
M_REPORT_CRITERIA_NOT_EVALUABLE = "report/criteria_not_evaluable"

# === 12. MLflow's own names that refrun writes (refrun.store.mlflow_ui) ========================
TAG_MLFLOW_SOURCE = "mlflow.source.name"  # set on every recorded run
SOURCE_NAME = "refrun"
TAG_RUN_NAME = "mlflow.runName"
TAG_MLFLOW_USER = "mlflow.user"  # MLflow takes a new run's user_id from it
TAG_NOTE = "mlflow.note.content"  # the run's Markdown description on its page
# The experiment tag MLflow 3.x's UI reads to choose the experiment page's mode; values
# understood by its UI bundle: genai_development, custom_model_development, finetuning,
# regression, classification, forecasting, automl (the *_inferred ones are its guesses).
TAG_EXPERIMENT_KIND = "mlflow.experimentKind"
EXPERIMENT_KIND_TRAINING = "custom_model_development"
# Saved views of an experiment's runs page (MLflow 3.17's "Views" menu and share links):
# experiment tag <prefix><view id> = {"name", "createdAt", "updatedAt", "state": JSON text}.
TAG_SAVED_VIEW_PREFIX = "mlflow.sharedViewState."

# === 13. labels of sweep candidates on one report page (refrun.report.labels) ============
# Candidates are labelled by their run name and by the params and tags in which they
# differ: every param, every tag outside the refrun./mlflow. namespaces (a user's own), and
# these identity tags.  Not counters or bookkeeping (step counts, refused points, local
# ids), which differ between any two runs and say nothing about what was run.
LABEL_TAGS = (TAG_HARDWARE, TAG_BACKEND, TAG_CHIPS, TAG_SEED, TAG_GLOBAL_BATCH,
              TAG_EXEC_HARDWARE, TAG_EXEC_DEVICES, TAG_EXEC_WORLD_SIZE, TAG_GIT_COMMIT,
              TAG_IMPORT_SOURCE, TAG_VERSION)
LABEL_TAG_PREFIXES = (TAG_FW_PREFIX,)  # framework versions (refrun.fw.torch ...)
# ... and the numerics settings (section 15: NUMERICS_SETTING_TAGS).

# === 14. same-seed pairs: a candidate started like a reference seed (docs/acceptance.md) ====
# A run that starts from the same initial weights and the same data order as one reference
# seed (a port of that seed, or a rerun of it) declares its pair with these tags
# (refrun.pairing.pair_tags, passed to start_run(tags=...)); `paired` criteria compare its
# per-step curves with that seed's run directly.  A paired result's first step beyond the
# band is EV_FIRST_DIVERGENCE_STEP.
TAG_PAIR_SEED = "refrun.pair.seed"  # int: the reference seed whose start it shares
TAG_PAIR_REFERENCE = "refrun.pair.reference"  # run id of that reference run (optional)
# Known-good pair evidence: why this pair is known to be numerically benign (e.g. "rerun of
# the reference with the input features permuted (summation order)"); `refrun calibrate`
# derives the paired tolerance from such runs.  Never an independent seed.
TAG_PAIR_KNOWN_GOOD = "refrun.pair.known_good"
# The port's name (the code that ran): runs of one workload that declare the same pair and
# the same port are the same code, so one whose numerics configuration (section 15) is the
# pair's and another that ran at a platform's reduced default are precision twins
# (refrun.acceptance.precision).
TAG_PAIR_PORT = "refrun.pair.port"
PAIR_TAGS = (TAG_PAIR_SEED, TAG_PAIR_REFERENCE, TAG_PAIR_KNOWN_GOOD, TAG_PAIR_PORT)

# === 15. numerics configuration: how the run's float32 arithmetic was carried out ============
# Run identity like the hardware: the same code computes its matmuls in float32 or as one
# bfloat16 pass depending on settings made outside it (JAX's default matmul precision is
# bfloat16 passes on a TPU, TF32 on recent GPUs).  Read from the process by
# refrun.numerics.current() at start_run and by the probes (start, end of the first step,
# every recheck_every steps), one tag per setting, only for frameworks the process imported;
# a setting that changes during the run is recorded in TAG_NUMERICS_CHANGES.  What the
# values mean on the platform that ran them: refrun.numerics.of_run (docs/numerics.md).
NUMERICS_PREFIX = "refrun.numerics."
# JAX: jax_default_matmul_precision as in force ("default" when unset: JAX's default), who
# set it (context manager | JAX_DEFAULT_MATMUL_PRECISION | jax.config.update | unset),
# jax_enable_x64, and the platform that gives "default" its meaning (tpu, gpu, cpu; a GPU's
# compute capability after a space: "gpu 8.0").
TAG_NUMERICS_JAX_MATMUL = "refrun.numerics.jax.matmul_precision"
TAG_NUMERICS_JAX_MATMUL_SET_BY = "refrun.numerics.jax.matmul_precision_set_by"
TAG_NUMERICS_JAX_X64 = "refrun.numerics.jax.enable_x64"
TAG_NUMERICS_JAX_PLATFORM = "refrun.numerics.jax.platform"
# PyTorch: torch.get_float32_matmul_precision(), the TF32 switches of cuBLAS and cuDNN, the
# fp32_precision settings of torch >= 2.9 (space-separated backend.op=value), whether
# bfloat16/float16 matmuls may reduce in reduced precision, the default dtype, and where
# it computes ("cuda 8.0", or "cpu, bf16 matmul kernels" / "cpu" by whether the setting in
# force computes float32 matmuls in bfloat16 there: oneDNN's kernels, asked for, and seen
# rounding like a bfloat16 pass in one measured product; refrun.numerics._cpu_bf16).
TAG_NUMERICS_TORCH_MATMUL = "refrun.numerics.torch.float32_matmul_precision"
TAG_NUMERICS_TORCH_CUDA_TF32 = "refrun.numerics.torch.cuda_matmul_allow_tf32"
TAG_NUMERICS_TORCH_CUDNN_TF32 = "refrun.numerics.torch.cudnn_allow_tf32"
TAG_NUMERICS_TORCH_FP32_PRECISION = "refrun.numerics.torch.fp32_precision"
TAG_NUMERICS_TORCH_REDUCED_REDUCTION = "refrun.numerics.torch.reduced_precision_reduction"
TAG_NUMERICS_TORCH_DEFAULT_DTYPE = "refrun.numerics.torch.default_dtype"
TAG_NUMERICS_TORCH_DEVICE = "refrun.numerics.torch.device"
# PyTorch/XLA: torch_xla.backends.get_mat_mul_precision() and the PJRT device it means it on.
TAG_NUMERICS_TORCH_XLA_MATMUL = "refrun.numerics.torch_xla.mat_mul_precision"
TAG_NUMERICS_TORCH_XLA_DEVICE = "refrun.numerics.torch_xla.device"
# Every process: the numerics-changing flags of XLA_FLAGS and LIBTPU_INIT_ARGS
# ("XLA_FLAGS: --a=1 --b; LIBTPU_INIT_ARGS: --c=0") and the numerics environment variables
# set ("NAME=value ..."), "none" when there are none (refrun.numerics.NUMERICS_ENV, FLAG_PATTERNS).
TAG_NUMERICS_XLA_FLAGS = "refrun.numerics.xla_flags"
TAG_NUMERICS_ENV = "refrun.numerics.env"
# JSON list of the settings that changed after the first reading: {"step", "tag", "from",
# "to", "before_training"} (before_training: seen before any step ran with the old value, as
# when a context manager wraps the loop); at most refrun.numerics.MAX_CHANGES entries.
TAG_NUMERICS_CHANGES = "refrun.numerics.changes"
# Settings (their changes are recorded) and the context that gives them meaning (latest
# value wins: where a framework computes is known only once it does).
NUMERICS_SETTING_TAGS = (
    TAG_NUMERICS_JAX_MATMUL, TAG_NUMERICS_JAX_X64, TAG_NUMERICS_TORCH_MATMUL,
    TAG_NUMERICS_TORCH_CUDA_TF32, TAG_NUMERICS_TORCH_CUDNN_TF32,
    TAG_NUMERICS_TORCH_FP32_PRECISION, TAG_NUMERICS_TORCH_REDUCED_REDUCTION,
    TAG_NUMERICS_TORCH_DEFAULT_DTYPE, TAG_NUMERICS_TORCH_XLA_MATMUL, TAG_NUMERICS_XLA_FLAGS,
    TAG_NUMERICS_ENV)
NUMERICS_CONTEXT_TAGS = (TAG_NUMERICS_JAX_MATMUL_SET_BY, TAG_NUMERICS_JAX_PLATFORM,
                         TAG_NUMERICS_TORCH_DEVICE, TAG_NUMERICS_TORCH_XLA_DEVICE)
NUMERICS_TAGS = (*NUMERICS_SETTING_TAGS, *NUMERICS_CONTEXT_TAGS)
