"""Every run of the charlm pipeline: reference seeds, benign candidates, silent defects.

A :class:`Variant` (the digits pipeline's, with this workload's modules) is one training
process.  For a defect, ``expect`` names the *metrics or counters* whose criterion must
reject it (``loss``, ``eval/val_loss``, ``grad_norm/block0``, ``compile/graphs``, ...);
which criterion ids those are is for the calibrated criteria file to say, so nothing here
depends on how calibration names its criteria.  A benign candidate must be rejected by
none.  No criterion is written for a variant: they all come from ``refrun calibrate``.

Candidates use seeds outside the reference group (5 and up), so a port is judged against
the seeds' spread, never against its own twin.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipelines.charlm.config import load_config
from pipelines.digits import variants as digits
from pipelines.recipe import batch_scaled

REFERENCE_SEEDS = (0, 1, 2, 3, 4)
HELD_OUT_SEEDS = tuple(range(100, 120))  # false-alarm trials: never used to calibrate
_CFG = load_config()
# The reference recipe at twice the global batch (Adam: square-root rule).
_BATCH2X = batch_scaled(batch=_CFG.batch, lr=_CFG.lr, optimizer="adam",
                        quick_steps=load_config(quick=True).steps, full_steps=_CFG.steps,
                        warmup_steps=_CFG.warmup_steps)
MODULES = {"torch": "pipelines.charlm.train_torch", "jax": "pipelines.charlm.train_jax",
           "torch_xla": "pipelines.charlm.train_xla"}


@dataclass(frozen=True)
class Variant(digits.Variant):
    """One charlm training run (see :class:`pipelines.digits.variants.Variant`)."""

    def module(self) -> str:
        return MODULES[self.backend]


@dataclass(frozen=True)
class Plan:
    references: list[Variant] = field(default_factory=list)
    candidates: list[Variant] = field(default_factory=list)
    held_out: list[Variant] = field(default_factory=list)

    @property
    def all(self) -> list[Variant]:
        return [*self.references, *self.candidates, *self.held_out]


def reference_variants(seeds: tuple[int, ...] = REFERENCE_SEEDS) -> list[Variant]:
    return [Variant(f"charlm-reference-seed{s}", "torch", s, role="reference",
                    mirrors="the GPU reference run (PyTorch)") for s in seeds]


def held_out_variants(seeds: tuple[int, ...] = HELD_OUT_SEEDS) -> list[Variant]:
    """Further seeds of the reference code, recorded as candidates: benign by construction,
    each assessed against the calibrated file (the false-alarm trials)."""
    return [Variant(f"charlm-heldout-seed{s}", "torch", s,
                    mirrors="a held-out seed of the reference code") for s in seeds]


BENIGN = [
    Variant("charlm-torch-seed5", "torch", 5, mirrors="another seed of the reference code"),
    Variant("charlm-jax-1dev", "jax", 6, mirrors="the JAX port on one device"),
    Variant("charlm-jax-4dev", "jax", 7, devices=4,
            mirrors="the JAX port, data parallel on 4 devices (same global batch)"),
    Variant("charlm-xla", "torch_xla", 8, mirrors="the PyTorch/XLA port"),
    Variant("charlm-jax-cadence", "jax", 9, extra_args=("--log-every", "5", "--eval-every", "50"),
            mirrors="another logging cadence: loss every 5 steps, evaluation every 50"),
    Variant("charlm-jax-resume", "jax", 10, extra_args=("--resume", "100,120"),
            mirrors="resumed mid-run: checkpoint at step 100, restart after step 120 "
                    "(steps 101-120 logged twice)"),
    # Added for issue 21 (expected outcome written before the first assessment: accepted).
    Variant("charlm-torch-log10", "torch", 11, extra_args=("--log-every", "10"),
            mirrors="another logging cadence: the reference code logging every 10 steps"),
    Variant("charlm-torch-eval50", "torch", 12, extra_args=("--eval-every", "50"),
            mirrors="another evaluation cadence: validation every 50 steps (not 25)"),
    # The reference recipe at twice the global batch (issue 52, decided 2026-12-06; see
    # docs/acceptance.md "Decided: what a benign 'twice the global batch' is"): Adam, so
    # the peak learning rate scaled by the square root (pipelines.recipe.scaled_lr), half
    # the steps and half the warm-up steps (the schedule is counted in steps: so it warms
    # up and decays at the references' samples); compared at equal samples seen.  Seed
    # 13, as the same-learning-rate run among the DEFECTS: they differ by the recipe only.
    Variant("charlm-torch-batch2x", "torch", 13, extra_args=_BATCH2X.args,
            quick_args=_BATCH2X.quick_args, full_args=_BATCH2X.full_args,
            mirrors=f"twice the global batch (32 for 16) with the peak learning rate scaled "
                    f"by the square root for Adam (Malladi et al. 2022: {_CFG.lr:g} -> "
                    f"{float(_BATCH2X.args[3]):.6g}), half the steps and warm-up, compared "
                    f"at equal samples seen (--axis samples)"),
    Variant("charlm-jax-seed0", "jax", 0, extra_args=("--pair",),
            mirrors="the JAX port of reference seed 0: same initial weights, batches and "
                    "dropout masks (declared pair)"),
    # Added 2026-12-02 11:20 UTC, expected outcomes written before their first assessment:
    # the 4-device data-parallel JAX port of reference seed 0, declaring its pair (same
    # initial weights and global batches; only the reduction order across devices
    # differs) is accepted, its paired divergence inside the known-good band; the same
    # port clipping each device's gradient before averaging is rejected by the same-seed
    # ``paired`` criterion (the pair departs at the first step where a device's local
    # norm exceeds the clip and the global one does not).
    Variant("charlm-jax-4dev-pair-seed0", "jax", 0, devices=4, extra_args=("--pair",),
            mirrors="the JAX port of reference seed 0, data parallel on 4 devices "
                    "(declared pair)"),
]

# Known-good same-seed evidence for ``refrun calibrate``'s ``paired`` tolerance: trained
# before calibration, never assessed (refrun.pairing: a port known to be good).
EVIDENCE = [
    Variant("charlm-knowngood-jax-seed1", "jax", 1,
            extra_args=("--pair", "--known-good", "the JAX port in float32 of reference "
                        "seed 1: the same math, XLA's own summation order")),
]

DEFECTS = [
    # A recipe change, not a code defect (kind ``recipe``): twice the global batch at the
    # same learning rate, steps and warm-up, what a move to more chips does silently when
    # the global batch grows with the chip count.  Until 2026-12-06 this was the benign
    # ``charlm-torch-batch2x``; in both runs of that day it was rejected (by samples) by
    # the loss envelope and two gradient-norm envelopes from samples 160-192 (steps 4-5).
    # Expected: rejected by the loss or gradient-norm criteria.
    Variant("charlm-torch-batch2x-same-lr", "torch", 13, extra_args=("--batch", "32"),
            expect=("loss", "grad_norm/"),
            recipe="twice the global batch at the same learning rate",
            mirrors="twice the global batch (32 for 16) at the same learning rate and "
                    "schedule in steps (a move to more chips growing the global batch), "
                    "compared at equal samples seen (--axis samples)"),
    Variant("charlm-jax-causal-leak", "jax", 5, defects=("causal_leak",),
            expect=("loss",),
            mirrors="causal mask off by one: each position sees the character it predicts"),
    # The defect changes the computation, but its effect on the loss, gradient norms and
    # evaluation metrics after 300 steps is below the seeds' spread (measured: every
    # seed-calibrated envelope accepts it), so no L3 curve criterion can see it; the
    # gradient check (L1: parity of loss and gradients against the PyTorch reference on one
    # batch with shared weights) does, by a factor ~200 over its tolerance.
    Variant("charlm-xla-no-attn-scale", "torch_xla", 5, defects=("no_attn_scale",),
            expect=("gradcheck",), mirrors="attention scores not scaled by 1/sqrt(d_head)"),
    Variant("charlm-jax-double-shift", "jax", 5, defects=("double_shift",),
            expect=("loss",), mirrors="labels shifted twice (data and loss both shift)"),
    Variant("charlm-jax-no-warmup", "jax", 5, defects=("no_warmup",),
            expect=("loss",), mirrors="learning-rate warm-up skipped"),
    # Dropout (rate 0.1, embeddings only) left on in evaluation changes what evaluation
    # computes, but not enough to move the evaluation metrics beyond the seeds: measured
    # on the 300-step runs, its val_loss stays within |z| <= 2.1 of 4 reference seeds
    # while held-out seeds of the reference code reach 4.1, and its test loss lies inside
    # the 20 held-out seeds' range.  The gradient check's evaluation parity (the port's
    # evaluation logits vs the reference's, same weights) sees it: L1, not L3.
    Variant("charlm-xla-eval-dropout", "torch_xla", 5, defects=("eval_dropout",),
            expect=("gradcheck",),
            mirrors="dropout left on in evaluation (validation and test)"),
    Variant("charlm-jax-4dev-clip-per-device", "jax", 5, devices=4,
            defects=("clip_per_device",), expect=("grad_norm/",),
            mirrors="four-chip run: gradients clipped per chip before averaging (§IV-B)"),
    Variant("charlm-xla-host-sync", "torch_xla", 5, defects=("host_sync",),
            expect=("xfer/host_syncs",), mirrors="a .item() host synchronisation per step"),
    Variant("charlm-xla-shape-storm", "torch_xla", 5, defects=("shape_storm",),
            expect=("compile/graphs",),
            mirrors="recompilation storm from ragged sequence lengths (§IV-A RQ2)"),
    Variant("charlm-xla-cpu-fallback", "torch_xla", 5, defects=("cpu_fallback",),
            expect=("fallback",), mirrors="an op without an XLA lowering falls back to the CPU"),
    # Added for issue 21; expected outcomes written before the first assessment
    # (2026-12-01 15:55 UTC): a host read of the JAX loss per step → the host-transfer
    # counters (``xfer/``); ``loss.cpu()`` per PyTorch/XLA step → device-to-host copies
    # (``xfer/d2h``); the bfloat16 port of reference seed 0 → the same-seed ``paired``
    # criterion (the gradient check compares the port with the reference at shared weights
    # too, and may also catch it: that is not its intended reason here).
    Variant("charlm-jax-float-loss", "jax", 5, defects=("float_loss",), expect=("xfer/",),
            mirrors="float(loss) in every JAX step: a host read per step"),
    Variant("charlm-xla-cpu-copy", "torch_xla", 5, defects=("cpu_copy",),
            expect=("xfer/d2h",), mirrors="loss.cpu() in every PyTorch/XLA step"),
    Variant("charlm-jax-bf16", "jax", 0, defects=("bf16_matmul",), expect=("paired",),
            extra_args=("--pair",),
            mirrors="a port computing its matmuls in bfloat16"),
    Variant("charlm-jax-4dev-clip-per-device-pair", "jax", 0, devices=4,
            defects=("clip_per_device",), expect=("paired",), extra_args=("--pair",),
            mirrors="four-chip port of reference seed 0 clipping per chip (§IV-B), "
                    "declared pair"),
]


def plan(held_out: int = len(HELD_OUT_SEEDS), first: int | None = None) -> Plan:
    """The whole pipeline: reference seeds, candidates, and ``held_out`` further seeds
    (``HELD_OUT_SEEDS``, or ``first``, ``first + 1`` ... to draw seeds nobody has looked at)."""
    seeds = HELD_OUT_SEEDS if first is None else tuple(range(first, first + held_out))
    return Plan(reference_variants(), [*BENIGN, *DEFECTS], held_out_variants(seeds[:held_out]))
