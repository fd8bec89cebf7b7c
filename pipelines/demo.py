"""The main job: train a small real PyTorch model on the CPU and record it as a reference run.

    make demo            # or: .venv/bin/python -m pipelines.demo [--steps N]

Records into MLflow's default store (``sqlite:///mlflow.db`` in the working directory, or
``$MLFLOW_TRACKING_URI``), then prints where the run is and the command that opens it in
the MLflow UI.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits

import refrun
from refrun.session import resolve_tracking_uri


def train_reference(steps: int, seed: int, tracking_uri: str | None) -> str:
    """Train an MLP on scikit-learn's bundled digits (no download) and record it."""
    digits = load_digits()
    rng = np.random.default_rng(0)
    order = rng.permutation(len(digits.target))
    x = torch.tensor(digits.data[order] / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target[order], dtype=torch.long)
    x_train, y_train, x_val, y_val = x[:1400], y[:1400], x[1400:], y[1400:]
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    batch = 64
    g = torch.Generator().manual_seed(seed)
    with refrun.start_run(workload="digits-mlp", role="reference", hardware="cpu",
                          backend="torch", seed=seed, chips=1, global_batch=batch,
                          planned_steps=steps, tracking_uri=tracking_uri,
                          params={"lr": 0.1, "momentum": 0.9, "steps": steps}) as run:
        for step in range(steps):
            idx = torch.randint(0, len(x_train), (batch,), generator=g)
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            opt.step()
            run.log(step, loss=loss.item())
            if step % 50 == 49 or step == steps - 1:
                with torch.no_grad():
                    acc = (model(x_val).argmax(1) == y_val).float().mean().item()
                run.log_eval(step, accuracy=acc)
                print(f"  step {step + 1:>5}/{steps}  loss {loss.item():.4f}  val acc {acc:.3f}",
                      flush=True)
    return run.run_id or run.local_id


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tracking-uri", default=None)
    args = ap.parse_args(argv)
    uri = resolve_tracking_uri(args.tracking_uri)
    print(f"refrun demo: training a digits MLP on the CPU, recording into {uri}")
    t0 = time.perf_counter()
    run_id = train_reference(args.steps, args.seed, uri)
    print(f"\nreference run {run_id} recorded in {time.perf_counter() - t0:.1f} s")
    print(f"  store:      {uri}")
    print(f"  list runs:  {Path(sys.executable).parent / 'refrun'} runs --workload digits-mlp"
          f" --tracking-uri {shlex.quote(uri)}")
    mlflow_bin = Path(sys.executable).parent / "mlflow"
    print(f"  MLflow UI:  {mlflow_bin} ui --backend-store-uri {shlex.quote(uri)} --port 5000")
    print("              then open http://127.0.0.1:5000 (experiment 'digits-mlp')")
    return 0


if __name__ == "__main__":
    sys.exit(main())
