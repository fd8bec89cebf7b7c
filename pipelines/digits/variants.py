"""Every run of the digits pipeline: reference seeds, benign candidates, silent defects.

A :class:`Variant` is one training process (a port, a seed, flags).  ``expect`` names the
criteria (ids in ``pipelines/criteria/digits.toml``, written by ``refrun calibrate``)
that must fail for a defect, and is empty for a benign candidate, which must fail none.
A *recipe change* (``recipe``: e.g. twice the global batch at the same learning rate) runs
correct code with another training recipe: like a defect it names in ``expect`` what
should reject it, but no code is wrong (see :attr:`Variant.kind`).
The criteria are general (envelopes of the reference seeds, compilation and transfer
counters, fallback allowlist); nothing here or there is keyed on a variant's name.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pipelines.digits.config import load_config
from pipelines.recipe import batch_scaled

REFERENCE_SEEDS = (0, 1, 2)
REPO_ROOT = Path(__file__).resolve().parents[2]
_CFG = load_config()
# The reference recipe at twice the global batch (SGD with momentum: linear rule).
_BATCH2X = batch_scaled(batch=_CFG.batch, lr=_CFG.lr, optimizer="sgd",
                        quick_steps=load_config(quick=True).steps, full_steps=_CFG.steps)


@dataclass(frozen=True)
class Variant:
    """One training run of the pipeline."""

    name: str
    backend: str  # torch | jax | torch_xla
    seed: int
    role: str = "candidate"
    devices: int = 1
    defects: tuple[str, ...] = ()
    extra_args: tuple[str, ...] = ()
    # Further arguments for a --quick run and for a full one (a recipe scaled with the
    # batch keeps the references' samples budget: its --steps depend on the run's size).
    quick_args: tuple[str, ...] = ()
    full_args: tuple[str, ...] = ()
    expect: tuple[str, ...] = ()  # criterion ids that must fail (empty: benign)
    mirrors: str = ""  # the failure of seeds/004 it reproduces, or what it shows
    # The recipe change this run makes with correct code (empty: none).  A move to more
    # chips makes one silently when the global batch grows with the chip count and the
    # learning rate stays: expected to be rejected, for the reasons ``expect`` names.
    recipe: str = ""

    @property
    def kind(self) -> str:
        """``reference``; ``defect`` (a silent defect switched on); ``recipe`` (correct
        code, another training recipe: expected rejected, reported apart from the
        defects); else ``benign``."""
        return "reference" if self.role == "reference" else \
            "defect" if self.defects else "recipe" if self.recipe else "benign"

    def module(self) -> str:
        return {"torch": "pipelines.digits.train_torch", "jax": "pipelines.digits.train_jax",
                "torch_xla": "pipelines.digits.train_xla"}[self.backend]

    def command(self, *, quick: bool, tracking_uri: str, spool_dir: str | None,
                mlflow_every: int = 1) -> list[str]:
        """The subprocess command line that trains and records this variant."""
        cmd = [sys.executable, "-m", self.module(), "--seed", str(self.seed), "--role",
               self.role, "--variant", self.name, "--tracking-uri", tracking_uri]
        if self.devices != 1:
            cmd += ["--devices", str(self.devices)]
        for d in self.defects:
            cmd += ["--defect", d]
        if quick:
            cmd.append("--quick")
        if spool_dir:
            cmd += ["--spool-dir", spool_dir]
        if mlflow_every != 1:
            cmd += ["--mlflow-every", str(mlflow_every)]
        return cmd + list(self.extra_args) + list(self.quick_args if quick else self.full_args)

    def environment(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The process environment: JAX's host device count and PJRT's CPU device, set
        before the framework is imported (hence one process per variant)."""
        env = dict(os.environ if base is None else base)
        # `pipelines` is a directory of the clone, not an installed package: make it
        # importable whatever the working directory of the caller.
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
        if self.backend == "jax":
            flags = [f for f in env.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_force_host_platform_device_count")]
            flags.append(f"--xla_force_host_platform_device_count={max(self.devices, 1)}")
            env["XLA_FLAGS"] = " ".join(flags)
            env.setdefault("JAX_PLATFORMS", "cpu")
        if self.backend == "torch_xla":
            env.setdefault("PJRT_DEVICE", "CPU")
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env


@dataclass(frozen=True)
class Plan:
    references: list[Variant] = field(default_factory=list)
    candidates: list[Variant] = field(default_factory=list)

    @property
    def all(self) -> list[Variant]:
        return [*self.references, *self.candidates]


def reference_variants(seeds: tuple[int, ...] = REFERENCE_SEEDS) -> list[Variant]:
    return [Variant(f"reference-seed{s}", "torch", s, role="reference",
                    mirrors="the GPU reference run (PyTorch)") for s in seeds]


BENIGN = [
    Variant("torch-seed3", "torch", 3, mirrors="another seed of the reference code"),
    Variant("jax-1dev", "jax", 0, mirrors="the JAX port on one device"),
    Variant("jax-4dev", "jax", 0, devices=4,
            mirrors="the JAX port, data parallel on 4 devices, clipping once after averaging"),
    Variant("xla", "torch_xla", 0, mirrors="the PyTorch/XLA port"),
    Variant("jax-cadence", "jax", 1, extra_args=("--log-every", "5", "--eval-every", "100"),
            mirrors="another logging cadence: loss every 5 steps, evaluation every 100"),
]

DEFECTS = [
    Variant("jax-4dev-clip-per-device", "jax", 0, devices=4, defects=("clip_per_device",),
            expect=("loss-envelope", "grad_norm-fc1.weight-envelope"),
            mirrors="four-chip run: gradients clipped per chip before averaging (§IV-B)"),
    Variant("xla-stale-eval-copy", "torch_xla", 0, defects=("stale_eval_copy",),
            expect=("val_loss-envelope", "final_val_loss-envelope", "test_accuracy-envelope"),
            mirrors="CoFi: a stale parameter copy (§IV-A RQ2)"),
    Variant("jax-no-best-reload", "jax", 0, defects=("no_best_reload",),
            # The criterion calibrate writes for this failure (best_of: the reported
            # evaluation is the best one).  Until 2026-12-05 the committed criteria
            # predated it and this named final_val_loss-envelope; the criteria calibrated
            # now put the final values' limits at the seeds' range plus a tolerance, which
            # this run's final loss (0.283, best 0.237) stays inside.
            expect=("final_val_loss-is-min-of-val_loss",),
            mirrors="MELoRA: best checkpoint not reloaded (§IV-A RQ2)"),
    Variant("xla-shape-storm", "torch_xla", 0, defects=("shape_storm",),
            expect=("compilations-after-warmup",),
            mirrors="repeated compilation, the most frequent silent failure (§IV-A RQ2)"),
    Variant("xla-host-sync", "torch_xla", 0, defects=("host_sync",),
            expect=("host-syncs-per-step",),
            mirrors="host synchronisation in every lazy-tensor step (§IV-A RQ2)"),
    Variant("xla-cpu-fallback", "torch_xla", 0, defects=("cpu_fallback",),
            expect=("no-cpu-fallback",),
            mirrors="an operator without an XLA lowering falls back to the CPU (§II)"),
    Variant("jax-blocked-grad", "jax", 0, defects=("blocked_grad",),
            expect=("grad_norm-fc1.weight-envelope",),
            mirrors="a blocked gradient (stop_gradient on one layer; seeds 000-003)"),
    Variant("jax-sum-loss", "jax", 0, defects=("sum_loss",),
            expect=("loss-envelope",),
            mirrors="a loss reduction changed from mean to sum"),
]


def plan() -> Plan:
    """The whole pipeline: reference seeds, benign candidates and defect variants."""
    return Plan(reference_variants(), [*BENIGN, *DEFECTS])


# --- runs of the detection benchmark only (benchmarks/bench_detection.py) ---------------
# Not part of :func:`plan` (the demo's hand-written criteria file predates them).  For a
# defect, ``expect`` here names the *metric, counter or criterion kind* whose criterion
# must reject it (prefixes: ``xfer/d2h``, ``paired``), since the benchmark's criteria come
# from ``refrun calibrate``.  Expected outcomes, written before the first assessment
# (2026-12-01 15:55 UTC): the benign runs accepted; ``float_loss`` rejected by a
# host-transfer counter (``xfer/``); ``cpu_copy`` by device-to-host copies (``xfer/d2h``);
# the bfloat16 port, paired with reference seed 0 (same weights, same batches), by the
# same-seed ``paired`` criterion.
DETECTION_BENIGN = [
    Variant("torch-log10", "torch", 4, extra_args=("--log-every", "10"),
            mirrors="another logging cadence: the reference code logging every 10 steps"),
    Variant("torch-eval100", "torch", 5, extra_args=("--eval-every", "100"),
            mirrors="another evaluation cadence: validation every 100 steps (not 50/25)"),
    Variant("torch-resume", "torch", 6, extra_args=("--resume", "150,180"),
            mirrors="resumed mid-run: checkpoint at step 150, restart after step 180 "
                    "(steps 151-180 logged twice)"),
    # The reference recipe at twice the global batch (issue 52, decided 2026-12-06; see
    # docs/acceptance.md "Decided: what a benign 'twice the global batch' is"): SGD with
    # momentum, so the learning rate scaled linearly (pipelines.recipe.scaled_lr), half
    # the steps (the references' samples budget); compared at equal samples seen (the
    # benchmark re-assesses with the axis accept's one-line hint names, --axis samples).
    # Seed 8, as the same-learning-rate run below: the two differ by the recipe only.
    Variant("torch-batch2x", "torch", 8, extra_args=_BATCH2X.args,
            quick_args=_BATCH2X.quick_args, full_args=_BATCH2X.full_args,
            mirrors=f"twice the global batch (128 for 64) with the learning rate scaled "
                    f"linearly for SGD (Goyal et al. 2017: {_CFG.lr:g} -> "
                    f"{_BATCH2X.args[3]}) and half the steps, compared at equal samples "
                    f"seen (--axis samples)"),
    Variant("jax-pair-seed0", "jax", 0, extra_args=("--pair",),
            mirrors="the JAX port of reference seed 0 declaring its same-seed pair"),
    # Added 2026-12-02 11:20 UTC, expected outcomes written before their first assessment:
    # the 4-device data-parallel JAX port of reference seed 0, declaring its pair (same
    # initial weights and global batches; only the reduction order across devices
    # differs) is accepted, its paired divergence inside the known-good band; the same
    # port clipping each device's gradient before averaging is rejected by the same-seed
    # ``paired`` criterion (the pair departs at the first step where a device's local
    # norm exceeds the clip and the global one does not).
    Variant("jax-4dev-pair-seed0", "jax", 0, devices=4, extra_args=("--pair",),
            mirrors="the JAX port of reference seed 0, data parallel on 4 devices "
                    "(declared pair)"),
]

# Known-good same-seed evidence for ``refrun calibrate``'s ``paired`` tolerance: trained
# before calibration, never assessed (refrun.pairing: a port known to be good).
DETECTION_EVIDENCE = [
    Variant("knowngood-jax-seed1", "jax", 1,
            extra_args=("--pair", "--known-good", "the JAX port in float32 of reference "
                        "seed 1: the same math, XLA's own summation order")),
]

DETECTION_DEFECTS = [
    # A recipe change, not a code defect (kind ``recipe``): twice the global batch at the
    # same learning rate and steps, what a move to more chips does silently when the
    # global batch grows with the chip count.  Until 2026-12-06 this was the benign
    # ``torch-batch2x``; in both runs of that day it was rejected (by samples) by the loss
    # envelope (leaving the band at samples 2688, step 20, above), the loss final window
    # and a gradient-norm envelope: half the updates per sample seen.  Expected: rejected
    # by the loss or gradient-norm criteria.
    Variant("torch-batch2x-same-lr", "torch", 8, extra_args=("--batch", "128"),
            expect=("loss", "grad_norm/"),
            recipe="twice the global batch at the same learning rate",
            mirrors="twice the global batch (128 for 64) at the same learning rate: half "
                    "the updates per sample seen (a move to more chips growing the global "
                    "batch), compared at equal samples seen (--axis samples)"),
    Variant("jax-float-loss", "jax", 7, defects=("float_loss",), expect=("xfer/",),
            mirrors="float(loss) in every JAX step: a host read per step"),
    Variant("xla-cpu-copy", "torch_xla", 7, defects=("cpu_copy",), expect=("xfer/d2h",),
            mirrors="loss.cpu() in every PyTorch/XLA step (§IV-A RQ2)"),
    Variant("jax-bf16", "jax", 0, defects=("bf16_matmul",), expect=("paired",),
            extra_args=("--pair",),
            mirrors="a port computing its matmuls in bfloat16"),
    Variant("jax-4dev-clip-per-device-pair", "jax", 0, devices=4,
            defects=("clip_per_device",), expect=("paired",), extra_args=("--pair",),
            mirrors="four-chip port of reference seed 0 clipping per chip (§IV-B), "
                    "declared pair"),
]
