"""Parity gradient check of a charlm port against the PyTorch reference, recorded for a
candidate run (role ``gradcheck``, tag ``refrun.gradcheck.candidate``).

    python -m pipelines.charlm.gradcheck --backend jax --seed 6 --candidate RUN_ID \\
        --tracking-uri sqlite:///store.db

On one fixed batch (the first training batch of seed 0, its dropout mask, and the first
validation windows), with the same named initial weights on both sides
(:func:`pipelines.charlm.model.init_params` of the candidate's seed; every port starts
from these arrays), it compares by parameter name (:func:`refrun.gradcheck.parity.
compare_by_name`, relative L2 error ≤ ``TOL``):

* ``parity/loss``: the port's training loss with the candidate's defects vs the
  reference's;
* ``parity/grads``: the gradient of every parameter;
* ``parity/eval_logits``: the logits the port's *evaluation* computes (its own choice of
  dropout mask, :func:`pipelines.charlm.data.eval_keep`) vs the reference evaluation's.

A defect that changes the computation (a missing attention scale, dropout left on in
evaluation) fails here whatever its effect on the loss curve; a benign port agrees to
float32 rounding (the ports match a NumPy model to 2e-5).  The port code is the port's own
(``train_jax.make_loss`` / ``forward``; the XLA port's model on the XLA device), never a
copy.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from pipelines import gradcheck_cli
from pipelines.charlm.cli import PORT_DEFECTS
from pipelines.charlm.config import Config, load_config
from pipelines.charlm.data import (
    VOCAB,
    batch_starts,
    dropout_mask,
    eval_keep,
    eval_starts,
    load,
    windows,
)
from pipelines.charlm.model import init_params

TOL = 1e-4  # relative L2 error; float32 ports agree to ~1e-6, a changed computation >> 1e-3
EVAL_WINDOWS = 8  # validation windows of the eval-logits check


def fixed_batch(cfg: Config) -> dict[str, np.ndarray]:
    """The batch every check uses: training windows and dropout mask of seed 0's first
    step, and the first validation windows."""
    corpus = load(cfg.files, cfg.val_fraction, cfg.test_fraction)
    x, y = windows(corpus.train,
                   batch_starts(0, 1, cfg.batch, len(corpus.train), cfg.context)[0],
                   cfg.context)
    keep = dropout_mask(0, 0, (*x.shape, cfg.d_model), cfg.dropout)
    xv, _ = windows(corpus.val, eval_starts(len(corpus.val), cfg.context, EVAL_WINDOWS),
                    cfg.context)
    return {"x": x, "y": y, "keep": keep, "x_val": xv}


def _eval_mask(defects: frozenset[str], cfg: Config, shape: tuple[int, ...]
               ) -> np.ndarray | None:
    return eval_keep(defects, "val", 0, (*shape, cfg.d_model), cfg.dropout)


def torch_side(cfg: Config, seed: int, defects: frozenset[str], b: dict[str, np.ndarray],
               device: Any = None) -> dict[str, Any]:
    """Loss, named gradients and evaluation logits of the PyTorch model (the reference
    with no defects; the XLA port with ``device`` an XLA device)."""
    import torch

    from pipelines.charlm.train_torch import build_model, lm_loss

    model = build_model(cfg, seed, defects)
    if device is not None:
        model = model.to(device)

    def t(a: np.ndarray, long: bool = False):
        x = torch.from_numpy(a)
        x = x.long() if long else x
        return x if device is None else x.to(device)

    loss = lm_loss(model(t(b["x"], True), t(b["keep"])), t(b["y"], True),
                   "double_shift" in defects)
    loss.backward()
    with torch.no_grad():
        mask = _eval_mask(defects, cfg, b["x_val"].shape)
        logits = model(t(b["x_val"], True), None if mask is None else t(mask))
    grads = {n: p.grad.detach().cpu().numpy() for n, p in model.named_parameters()}
    return {"loss": np.asarray(loss.detach().cpu().numpy()), "grads": grads,
            "eval_logits": logits.detach().cpu().numpy()}


def jax_side(cfg: Config, seed: int, defects: frozenset[str], b: dict[str, np.ndarray]
             ) -> dict[str, Any]:
    """The same three quantities computed by the JAX port's own functions."""
    import jax
    import jax.numpy as jnp

    from pipelines.charlm.train_jax import forward, make_loss

    w = init_params(VOCAB, cfg.context, cfg.d_model, cfg.n_layer, cfg.mlp_ratio, seed)
    params = {k: jnp.asarray(v) for k, v in w.items()}
    loss, grads = jax.value_and_grad(make_loss(cfg, defects))(params, b["x"], b["y"],
                                                             b["keep"])
    mask = _eval_mask(defects, cfg, b["x_val"].shape)
    logits = forward(params, jnp.asarray(b["x_val"]), None if mask is None else
                     jnp.asarray(mask), cfg)
    return {"loss": np.asarray(loss), "grads": {k: np.asarray(g) for k, g in grads.items()},
            "eval_logits": np.asarray(logits)}


def port_side(backend: str, cfg: Config, seed: int, defects: frozenset[str],
              b: dict[str, np.ndarray]) -> dict[str, Any]:
    if backend == "jax":
        return jax_side(cfg, seed, defects, b)
    if backend == "torch_xla":
        import torch_xla

        return torch_side(cfg, seed, defects, b, device=torch_xla.device())
    return torch_side(cfg, seed, defects, b)


def check(backend: str, cfg: Config, seed: int, defects: Sequence[str]) -> list[Any]:
    """The three parity results of the port ``backend`` with ``defects`` against the
    reference (PyTorch, CPU, no defect), same weights, same batch."""
    from refrun.gradcheck.parity import compare_by_name

    b = fixed_batch(cfg)
    if backend == "torch_xla":  # the XLA device must exist before autograd's first use
        import torch_xla

        torch_xla.device()
    ref = torch_side(cfg, seed, frozenset(), b)
    port = port_side(backend, cfg, seed, frozenset(defects), b)
    lab = (backend, "reference (torch)")
    return [compare_by_name({"loss": port["loss"]}, {"loss": ref["loss"]}, tol=TOL,
                            label="parity/loss", label_a=lab[0], label_b=lab[1]),
            compare_by_name(port["grads"], ref["grads"], tol=TOL, label="parity/grads",
                            label_a=lab[0], label_b=lab[1]),
            compare_by_name({"eval_logits": port["eval_logits"]},
                            {"eval_logits": ref["eval_logits"]}, tol=TOL,
                            label="parity/eval_logits", label_a=lab[0], label_b=lab[1])]


def record(backend: str, cfg: Config, seed: int, defects: Sequence[str], candidate: str,
           tracking_uri: str | None, spool_dir: str | None = None) -> tuple[str | None, bool]:
    """Run :func:`check` and record it for the candidate run; ``(run id, passed)``."""
    from refrun.gradcheck.record import record_gradcheck

    results = check(backend, cfg, seed, defects)
    rid = record_gradcheck(results, workload=cfg.workload, tracking_uri=tracking_uri,
                           spool_dir=spool_dir, backend=backend, candidate_run_id=candidate,
                           run_name=f"gradcheck-{backend}-seed{seed}", plot=False)
    return rid, all(r.passed for r in results)


def main(argv: list[str] | None = None) -> int:
    ns = gradcheck_cli.parse(argv, __doc__.splitlines()[0], PORT_DEFECTS,
                             "the candidate's device count (accepted; this check runs on one "
                             "device: a step defect is the seed bands' or the pair's business)")
    cfg = load_config(quick=ns.quick)
    rid, ok = record(ns.backend, cfg, ns.seed, ns.defect, ns.candidate, ns.tracking_uri,
                     ns.spool_dir)
    return gradcheck_cli.report(ns.candidate, rid, ok)


if __name__ == "__main__":
    sys.exit(main())
