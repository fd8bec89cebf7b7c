"""The scaling reference: the digits MLP trained by PyTorch Lightning in one process,
recorded through the trainer callback (``refrun.lightning.RefrunCallback``).

::

    python -m pipelines.scaling.reference --steps 200 --batch 32

Same model, initialisation, loss, clipping and optimizer as :mod:`pipelines.digits`; each
step takes ``batch`` samples from the workload's seeded batch order (one process: the
global batch is ``batch``).  Validation runs once, after the last step (``eval/val_*``).
Prints ``[scaling reference] run <id>``.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from pipelines.digits.config import load_config
from pipelines.digits.data import batch_indices, load
from pipelines.digits.model import init_params
from pipelines.digits.train_torch import MLP


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=32, help="global batch (one process)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workload", default="digits-mlp-scaling")
    a = p.parse_args(argv)

    import pytorch_lightning as pl
    from lightning_fabric.accelerators.xla import XLAAccelerator

    import refrun.lightning

    # torch_xla is installed beside Lightning here; off a TPU VM Lightning's TPU query (made
    # when it logs the devices) reads the cloud metadata server and can fail.  No TPU: say so.
    XLAAccelerator.is_available = staticmethod(lambda: False)  # type: ignore[method-assign]
    torch.set_num_threads(1)
    cfg = load_config()
    data = load(cfg.split_seed, cfg.n_train, cfg.n_val)
    train = torch.utils.data.TensorDataset(torch.from_numpy(data.train.x),
                                           torch.from_numpy(data.train.y).long())
    val = torch.utils.data.TensorDataset(torch.from_numpy(data.val.x),
                                         torch.from_numpy(data.val.y).long())
    order = batch_indices(a.seed, a.steps, a.batch, cfg.n_train).tolist()

    class Digits(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = MLP(cfg.sizes)
            self.net.load_state_dict({k: torch.from_numpy(v)
                                      for k, v in init_params(cfg.sizes, a.seed).items()})

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def validation_step(self, batch, batch_idx):
            x, y = batch
            logits = self.net(x)
            self.log("val_loss", F.cross_entropy(logits, y))
            self.log("val_accuracy", (logits.argmax(1) == y).float().mean())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=cfg.lr, momentum=cfg.momentum)

    with refrun.start_run(a.workload, "reference", hardware="cpu", backend="torch",
                          seed=a.seed, chips=1, global_batch=a.batch,
                          params={"lr": cfg.lr, "per_rank_batch": a.batch}) as run:
        trainer = pl.Trainer(
            max_epochs=1, callbacks=[refrun.lightning.RefrunCallback(run)], logger=False,
            accelerator="cpu", devices=1, gradient_clip_val=cfg.clip_norm,
            gradient_clip_algorithm="norm", enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
        trainer.fit(Digits(),
                    torch.utils.data.DataLoader(train, batch_sampler=order),
                    torch.utils.data.DataLoader(val, batch_size=len(val)))
    print(f"[scaling reference] run {run.run_id} (1 process, global batch {a.batch})",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
