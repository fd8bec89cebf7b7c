"""What every charlm port's command line shares: options, defect flags, the resume
schedule, and the recorded run.

Each port is run as ``python -m pipelines.charlm.train_<backend> --seed S [--defect NAME]``;
one process per run, so each gets its own framework environment (JAX's device count,
PJRT_DEVICE) and its own probe counters.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import refrun
from pipelines.charlm.config import Config, load_config
from pipelines.pairing import declare
from pipelines.recipe import lr_option
from refrun.recording.session import RunSession

# Silent defects a port can switch on.  Each runs without any error; the study behind
# the project (shared/seeds/004) found half of all failed migrations to be of this kind.
DEFECTS: dict[str, str] = {
    "causal_leak": "causal mask off by one: position i also sees position i+1, the "
                   "character it is asked to predict",
    "no_attn_scale": "attention scores not divided by sqrt(d_head)",
    "double_shift": "labels shifted twice (data and loss both shift): the model learns to "
                    "predict the character after next",
    "no_warmup": "the learning-rate warm-up is skipped (the cosine starts at the peak)",
    "eval_dropout": "dropout left on in evaluation (validation and test)",
    "clip_per_device": "gradients clipped on each device before averaging (JAX, N devices)",
    "host_sync": "a .item() host synchronisation inside every training step",
    "shape_storm": "ragged sequence lengths: 8 lengths, each a new compilation of the step",
    "cpu_fallback": "an operation without an XLA lowering runs on the CPU every step",
    "float_loss": "float(loss) inside every training step (a NaN guard): a host read of a "
                  "device array per step (JAX)",
    "bf16_matmul": "every matmul computed in bfloat16 (float32 accumulation), the rest "
                   "float32 (JAX)",
    "cpu_copy": "loss.cpu() inside every training step (a NaN guard): a device-to-host copy "
                "per step (PyTorch/XLA)",
}

GENERIC = ("causal_leak", "no_attn_scale", "double_shift", "no_warmup", "eval_dropout")
PORT_DEFECTS: dict[str, tuple[str, ...]] = {
    "torch": GENERIC,
    "jax": (*GENERIC, "clip_per_device", "float_loss", "bf16_matmul"),
    "torch_xla": (*GENERIC, "host_sync", "shape_storm", "cpu_fallback", "cpu_copy"),
}


@dataclass(frozen=True)
class Resume:
    """Checkpoint after step ``checkpoint``, stop after step ``interrupt``, restart from
    the checkpoint: steps ``checkpoint+1 .. interrupt`` run and are logged twice."""

    checkpoint: int
    interrupt: int


@dataclass(frozen=True)
class Args:
    """Parsed options of one training run."""

    backend: str
    config: Config
    seed: int
    role: str
    defects: frozenset[str]
    devices: int
    variant: str
    tracking_uri: str | None
    spool_dir: str | None
    quiet: bool
    resume: Resume | None = None
    mlflow_every: int = 1
    pair: bool = False
    known_good: str | None = None

    def has(self, defect: str) -> bool:
        return defect in self.defects

    def step_order(self) -> list[int]:
        """Every step the loop executes, in order (a resumed run repeats some)."""
        steps = list(range(self.config.steps))
        if self.resume is None:
            return steps
        r = self.resume
        return steps[: r.interrupt + 1] + steps[r.checkpoint + 1:]


def _resume(text: str) -> Resume:
    try:
        k, m = (int(p) for p in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--resume {text!r}: expected K,M (two steps)") from None
    if not 0 <= k < m:
        raise argparse.ArgumentTypeError(f"--resume {text!r}: need 0 <= K < M")
    return Resume(k, m)


def parse(argv: list[str] | None, backend: str, description: str) -> Args:
    """Parse a port's command line; unknown defects for this port are a usage error."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--role", choices=("reference", "candidate"), default="candidate")
    ap.add_argument("--defect", action="append", default=[], choices=PORT_DEFECTS[backend],
                    help="switch on a silent defect (repeatable)")
    ap.add_argument("--devices", type=int, default=1, help="data-parallel devices (JAX)")
    ap.add_argument("--quick", action="store_true", help="the reduced run ([quick] table)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--log-every", type=int, default=None)
    ap.add_argument("--eval-every", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None,
                    help="global batch (default: the config's): another batch is another "
                         "amount of data per step (compare it with --axis samples)")
    ap.add_argument("--warmup-steps", type=int, default=None,
                    help="steps of the learning-rate warm-up (default: the config's)")
    ap.add_argument("--lr", type=lr_option, default=None,
                    help="learning rate (default: the config's; recorded as the run's "
                         "`lr` param): e.g. the config's scaled with --batch "
                         "(pipelines.recipe.scaled_lr)")
    ap.add_argument("--resume", type=_resume, default=None, metavar="K,M",
                    help="checkpoint after step K, stop after step M, restart from the "
                         "checkpoint (steps K+1..M are logged again)")
    ap.add_argument("--pair", action="store_true",
                    help="declare a same-seed pair: this run starts from the same initial "
                         "weights and data order as the reference run of --seed")
    ap.add_argument("--known-good", default=None, metavar="WHY",
                    help="with --pair: declare this run known-good pair evidence (why it is "
                         "numerically benign), for refrun calibrate's paired tolerance")
    ap.add_argument("--variant", default=None, help="variant name recorded as a tag")
    ap.add_argument("--tracking-uri", default=None)
    ap.add_argument("--spool-dir", default=None)
    ap.add_argument("--mlflow-every", type=int, default=1,
                    help="send every n-th step of per-step metrics to MLflow (the curves "
                         "artifact and evaluation metrics always keep every point)")
    ap.add_argument("--quiet", action="store_true")
    ns = ap.parse_args(argv)
    if ns.known_good is not None and not ns.pair:
        ap.error("--known-good needs --pair (known-good evidence is a same-seed pair)")
    if ns.warmup_steps is not None and ns.warmup_steps < 0:
        ap.error(f"--warmup-steps {ns.warmup_steps}: expected 0 or more")
    cfg = load_config(quick=ns.quick, steps=ns.steps, log_every=ns.log_every,
                      eval_every=ns.eval_every, batch=ns.batch, lr=ns.lr,
                      warmup_steps=ns.warmup_steps)
    if cfg.batch % ns.devices:
        ap.error(f"--devices {ns.devices} does not divide the global batch {cfg.batch}")
    if ns.resume is not None and ns.resume.interrupt >= cfg.steps:
        ap.error(f"--resume: step {ns.resume.interrupt} is not before the last step")
    return Args(backend=backend, config=cfg, seed=ns.seed, role=ns.role,
                defects=frozenset(ns.defect), devices=ns.devices,
                variant=ns.variant or f"charlm-{backend}-seed{ns.seed}",
                tracking_uri=ns.tracking_uri, spool_dir=ns.spool_dir, quiet=ns.quiet,
                resume=ns.resume, mlflow_every=ns.mlflow_every,
                pair=ns.pair, known_good=ns.known_good)


def start_run(args: Args, hardware: str, corpus_sha256: str) -> RunSession:
    """The refrun run of this training: identity tags, hyperparameters as params, and the
    pipeline's own tags (``pipeline.variant``, ``pipeline.defects``) for the tables.
    Acceptance never reads the ``pipeline.*`` tags."""
    cfg = args.config
    params: dict[str, Any] = {
        "lr": cfg.lr, "warmup_steps": cfg.warmup_steps, "min_lr_fraction": cfg.min_lr_fraction,
        "betas": f"{cfg.beta1},{cfg.beta2}", "clip_norm": cfg.clip_norm, "batch": cfg.batch,
        "steps": cfg.steps, "context": cfg.context, "d_model": cfg.d_model,
        "n_head": cfg.n_head, "n_layer": cfg.n_layer, "dropout": cfg.dropout,
        "eval_every": cfg.eval_every, "log_every": cfg.log_every, "devices": args.devices,
        "corpus_sha256": corpus_sha256[:16],
        "resume": "none" if args.resume is None else
                  f"{args.resume.checkpoint},{args.resume.interrupt}",
    }
    return refrun.start_run(
        workload=cfg.workload, role=args.role, hardware=hardware, backend=args.backend,
        seed=args.seed, chips=args.devices, global_batch=cfg.batch, planned_steps=cfg.steps,
        params=params, tracking_uri=args.tracking_uri, spool_dir=args.spool_dir,
        run_name=args.variant, mlflow_every=args.mlflow_every,
        tags={"pipeline.variant": args.variant,
              "pipeline.defects": ",".join(sorted(args.defects)) or "none",
              **pair_tags(args)},
    )


def pair_tags(args: Args) -> dict[str, str]:
    """The same-seed pair declaration (``refrun.pairing.pair_tags``, with the port's name:
    :mod:`pipelines.pairing`) when ``--pair``: the ports start from the seed's named NumPy
    weights and replay its data order."""
    if not args.pair:
        return {}
    return declare(args.variant, args.seed, args.known_good, args.backend, args.defects,
                   args.devices)


def progress(args: Args, step: int, val_loss: float) -> None:
    """One progress line per evaluation."""
    if not args.quiet:
        print(f"  [{args.variant}] step {step + 1:>4}/{args.config.steps}  "
              f"val loss {val_loss:.4f}", flush=True)
