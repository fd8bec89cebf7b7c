"""What the TPU benchmark records on the chip: every pipeline's JAX port, derived from the
detection benchmark's own variants (``pipelines/<workload>/variants.py``), never listed by
hand here.

Per workload (digits, charlm, markov), on one TPU chip:

* the exact port of reference seed 0 declaring its same-seed pair (``--pair``), at JAX's
  default matmul precision (on a TPU: float32 matmuls as bfloat16 passes) and at
  ``highest``;
* every silent defect of the JAX port that runs on one device, at ``highest`` (so that a
  defect is judged for itself, not for the platform's precision), with its intended
  reason from the variants module (``expect``: the metric, counter or criterion kind it
  must disturb); the bfloat16-matmul port also at the default precision;
* ``float_loss`` (a host read of the loss in every step) among those defects: rejected by
  the host-read counter, its throughput cost read from L4;
* the pipeline's known-good same-seed evidence (its JAX port of reference seed 1, declared
  ``--known-good``), at ``highest``: recorded on the chip, it is the TPU's own known-good
  evidence, from which ``refrun calibrate`` writes the band candidates on the TPU are
  judged by (``hardware_bands``: refrun.acceptance.paired.derive_band).  It is evidence,
  never assessed; the exact port judged is seed 0's, another seed.

The four-device defect (``clip_per_device``) needs four chips: left out on one chip.
Imports nothing but the pipelines' variant lists (no JAX, no MLflow): the TPU machine and
this machine build the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pipelines.charlm import variants as charlm
from pipelines.digits import variants as digits
from pipelines.markov import variants as markov

WORKLOADS = ("digits", "charlm", "markov")
PRECISIONS = ("default", "highest")


@dataclass(frozen=True)
class TpuVariant:
    """One run on the chip: a pipeline variant (its module, seed, defects, arguments) and
    the matmul precision set with ``jax.config.update`` before it starts."""

    workload: str
    base: digits.Variant
    precision: str  # "default" | "highest"

    @property
    def name(self) -> str:
        return f"tpu-{self.base.name}-{self.precision}"

    @property
    def kind(self) -> str:
        """``evidence`` (known-good, for calibrate), else the base variant's kind."""
        return "evidence" if "--known-good" in self.base.extra_args else self.base.kind

    def argv(self, *, tracking_uri: str, spool_dir: str | None) -> list[str]:
        """The port's ``main(argv)`` arguments (``--quick``: the runs the CPU references
        of the assessment are)."""
        v = replace(self.base, name=self.name)
        return v.command(quick=True, tracking_uri=tracking_uri, spool_dir=spool_dir)[3:]


def _candidates(workload: str) -> list[digits.Variant]:
    """The JAX single-device candidates of a workload (the detection benchmark's; their
    intended reasons are read there too: ``bench_detection.WORKLOADS``)."""
    if workload == "digits":
        cands = [*digits.BENIGN, *digits.DETECTION_BENIGN, *digits.DEFECTS,
                 *digits.DETECTION_DEFECTS]
    else:
        cands = {"charlm": charlm, "markov": markov}[workload].plan(0).candidates
    return [v for v in cands if v.backend == "jax" and v.devices <= 1]


def _evidence(workload: str) -> list[digits.Variant]:
    """The workload's known-good same-seed evidence of the JAX port (one device)."""
    ev = digits.DETECTION_EVIDENCE if workload == "digits" else \
        {"charlm": charlm, "markov": markov}[workload].EVIDENCE
    return [v for v in ev if v.backend == "jax" and v.devices <= 1]


def plan(workload: str) -> list[TpuVariant]:
    """The runs of ``workload`` on the chip (module doc)."""
    cands = _candidates(workload)
    paired = [v for v in cands if v.kind == "benign" and "--pair" in v.extra_args
              and v.seed == 0]
    if len(paired) != 1:
        raise SystemExit(f"{workload}: expected one paired exact JAX port of seed 0, "
                         f"found {[v.name for v in paired]}")
    out = [TpuVariant(workload, paired[0], p) for p in PRECISIONS]
    out += [TpuVariant(workload, v, "highest") for v in _evidence(workload)]
    for v in cands:
        if v.kind != "defect":
            continue
        precisions = PRECISIONS if "bf16_matmul" in v.defects else ("highest",)
        out += [TpuVariant(workload, v, p) for p in precisions]
    return out
