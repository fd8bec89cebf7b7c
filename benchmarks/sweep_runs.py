"""Synthetic runs for bench_sweep.py, written fast through the complete-run writer.

Every run logs 5 metrics at every step: ``loss``, ``grad_norm``, ``perf/step_time_s``,
``compile/graphs`` and ``sys/cpu_pct``.  References and candidates draw from the same
process with their own seed (benign), except the candidates given a ``defect``:

* ``loss_shift``: loss + 0.3 from half-way (about 15 seed standard deviations);
* ``recompile``: ``compile/graphs`` = 1 every 1,000 steps after warm-up;
* ``slow``: every step 1.5x slower (an L4 failure only);
* ``grad_scale``: grad_norm x 1.25 throughout (e.g. a loss reduction changed).

:data:`CRITERIA` is the workload's criteria file; what each candidate's verdict must be
is :func:`expected_failures` (written before the benchmark was first run).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from refrun import schema
from refrun.store.complete import CompleteRun, curves_table, identity_tags, now_ms

WORKLOAD = "sweep-bench"
METRICS = ("loss", "grad_norm", "perf/step_time_s", "compile/graphs", "sys/cpu_pct")
DEFECTS = ("loss_shift", "recompile", "slow", "grad_scale")

CRITERIA = f"""\
version = 1
workload = "{WORKLOAD}"
description = "bench_sweep: synthetic runs, 5 metrics at every step."

[settings]
keep = "last"
final_fraction = 0.1
warmup_steps = 10

[[criteria]]
id = "loss-envelope"
level = "L1"
kind = "envelope"
metric = "loss"
band = "std"
k = 4.0
min_fraction = 0.95

[[criteria]]
id = "grad-norm-envelope"
level = "L1"
kind = "envelope"
metric = "grad_norm"
band = "std"
k = 4.0
min_fraction = 0.95

[[criteria]]
id = "no-recompilation"
level = "L2"
kind = "compilation"
max = 0

[[criteria]]
id = "final-loss-claim"
level = "L3"
kind = "claim"
metric = "loss"
statistic = "final_mean"
window_points = 100
at_most = 0.6

[[criteria]]
id = "not-slower"
level = "L4"
kind = "step_time"
max_ratio = 1.2
# The synthetic JAX candidates simulate the same hardware's timing: judge them anyway.
across_backends = true
"""


def expected_failures(defect: str | None) -> set[str]:
    """The criteria a candidate with ``defect`` must fail (none for a benign one)."""
    return {None: set(), "loss_shift": {"loss-envelope", "final-loss-claim"},
            "recompile": {"no-recompilation"}, "slow": {"not-slower"},
            "grad_scale": {"grad-norm-envelope"}}[defect]


@dataclass(frozen=True)
class Spec:
    """One run to write."""

    role: str
    seed: int
    """The run's seed tag."""
    noise: int
    """Seed of its random draws (distinct per run, whatever its tag)."""
    steps: int
    backend: str = "torch"
    hardware: str = "nvidia-h100"
    defect: str | None = None
    params: dict[str, str] = field(default_factory=dict)
    run_name: str | None = None
    tags: dict[str, str] = field(default_factory=dict)
    """The user's own tags (a sweep's variant), beside the identity tags."""


def curves(spec: Spec) -> pd.DataFrame:
    """The run's long table (every metric at every step), deterministic in the spec."""
    n = spec.steps
    rng = np.random.default_rng(spec.noise)
    s = np.arange(n, dtype=np.int64)
    loss = 3 * np.exp(-s / (n / 5)) + 0.5 + rng.normal(0, 0.02, n)
    grad = np.abs(rng.normal(1, 0.05, n)) * (1 + np.exp(-s / (n / 10)))
    step_time = 0.1 + rng.gamma(2, 0.005, n)
    graphs = np.zeros(n)
    graphs[:3] = 1  # compiled during warm-up
    cpu = 50 + 10 * np.sin(s / 500) + rng.normal(0, 1, n)
    if spec.defect == "loss_shift":
        loss[n // 2:] += 0.3
    elif spec.defect == "recompile":
        graphs[max(20, n // 100)::max(1, n // 100)] = 1
    elif spec.defect == "slow":
        step_time *= 1.5
    elif spec.defect == "grad_scale":
        grad *= 1.25
    values = (loss, grad, step_time, graphs, cpu)
    codes = np.repeat(np.arange(len(METRICS), dtype=np.int32), n)
    metric = pd.Categorical.from_codes(codes, categories=list(METRICS))
    return curves_table(metric, np.tile(s, len(METRICS)), np.concatenate(values), now_ms())


def complete_run(spec: Spec) -> CompleteRun:
    tags = identity_tags(WORKLOAD, spec.role, hardware=spec.hardware, backend=spec.backend,
                         seed=spec.seed, chips=1)
    tags[schema.TAG_PLANNED_STEPS] = str(spec.steps)
    tags.update(spec.tags)
    return CompleteRun(experiment=WORKLOAD, tags=tags, table=curves(spec),
                       params=dict(spec.params), run_name=spec.run_name)


def sweep_specs(n_candidates: int, steps: int) -> list[Spec]:
    """``n_candidates`` JAX candidates named ``jax seed S`` (ten share each name) that
    differ by their ``lr`` param and by the user's own ``variant`` tag (``v000`` ...);
    every tenth has one of :data:`DEFECTS`."""
    out = []
    for i in range(n_candidates):
        defect = DEFECTS[(i // 10) % len(DEFECTS)] if i % 10 == 9 else None
        out.append(Spec("candidate", seed=i % 10, noise=100 + i, steps=steps, backend="jax",
                        hardware="tpu-v5e", defect=defect,
                        params={"lr": f"{(1 + i // 10) * 1e-3:g}", "batch": "256"},
                        run_name=f"jax seed {i % 10}", tags={"variant": f"v{i:03d}"}))
    return out
