"""The scaling demo: a reference recorded through a trainer callback, a multi-process
candidate with twice the global batch, compared by samples seen.

    python -m pipelines.scaling [--steps 200] [--batch 32] [--ranks 2] [--out FILE]

1. the reference: :mod:`pipelines.scaling.reference` (PyTorch Lightning, one process,
   global batch ``batch``, ``steps`` steps, ``refrun.lightning.RefrunCallback``);
2. the candidate: :mod:`pipelines.scaling.ddp_job` under ``torchrun --standalone`` with
   ``ranks`` processes (DDP, gloo on CPU), global batch ``ranks x batch``, ``steps / ranks``
   steps: the same samples.  The job records ONE run (docs/multiprocess.md);
3. compares them with ``axis="samples"`` (:func:`refrun.comparison.compare`) and prints how
   each run's steps were mapped onto samples, a few aligned rows (candidate step, reference
   step, samples, losses), the job's ranks and straggler measure, and writes the
   comparison JSON to ``--out`` (default ``scaling-comparison.json``).

Records into the default store (``$MLFLOW_TRACKING_URI`` or ``sqlite:///mlflow.db``).
Exit code 0 when both runs were recorded and the loss aligned by samples.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

_RUN_ID = re.compile(r"\] run ([0-9a-f]{32}) ")


def _run(cmd: list[str], what: str) -> str:
    """Run ``cmd``, echo its output, return the run id it printed."""
    print(f"$ {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    found = _RUN_ID.findall(proc.stdout)
    if proc.returncode != 0 or not found:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"scaling demo: the {what} failed (exit code {proc.returncode})")
    for line in proc.stdout.splitlines():
        if line.startswith("[scaling"):
            print("  " + line, flush=True)
    return found[-1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="reference steps")
    p.add_argument("--batch", type=int, default=32, help="reference global batch = per-rank "
                   "batch of the candidate")
    p.add_argument("--ranks", type=int, default=2, help="candidate processes (torchrun)")
    p.add_argument("--out", type=Path, default=Path("scaling-comparison.json"))
    p.add_argument("--candidate-losses", type=Path, default=None,
                   help="also write the candidate ranks' own losses here (tests compare them "
                   "with the store): FILE (rank 0) and FILE.rank<k>")
    a = p.parse_args(argv)
    if a.steps % a.ranks:
        p.error(f"--steps {a.steps} must be a multiple of --ranks {a.ranks}")

    from refrun.comparison import CompareOptions, compare, load_run
    from refrun.comparison.engine import run_axis_map
    from refrun.store.uri import resolve_tracking_uri

    py = sys.executable
    ref_id = _run([py, "-m", "pipelines.scaling.reference", "--steps", str(a.steps),
                   "--batch", str(a.batch)], "reference")
    cand_id = _run([py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                    str(a.ranks), "-m", "pipelines.scaling.ddp_job", "--steps",
                    str(a.steps // a.ranks), "--batch", str(a.batch),
                    *(["--losses", str(a.candidate_losses)] if a.candidate_losses else [])],
                   "candidate")

    ref, cand = (load_run(r, progress=False) for r in (ref_id, cand_id))
    comp = compare(ref, cand, metrics=["loss"], options=CompareOptions(axis="samples"),
                   progress=False)
    loss = comp.metrics["loss"]
    print("\nHow the axes were mapped (samples seen at the end of each step):")
    for m in loss.alignment.axis_mapping:
        print(f"  {m.run:<10} {m.source}: {m.per_step:g} samples/step, "
              f"samples {m.first}..{m.last}")
    frame = loss.frame
    ref_map = run_axis_map(ref, "samples")
    ref_steps = np.rint(np.interp(frame["samples"].to_numpy(np.float64),
                                  ref_map.values.astype(np.float64),
                                  ref_map.steps.astype(np.float64))).astype(int)
    print("\n  cand step  ref step   samples   ref loss  cand loss")
    rows = list(range(min(3, len(frame)))) + list(range(max(3, len(frame) - 2), len(frame)))
    for i in rows:
        r = frame.iloc[i]
        print(f"  {int(r['step']):>9} {ref_steps[i]:>9} {int(r['samples']):>9} "
              f"{r['reference']:>10.4f} {r['candidate']:>10.4f}")
    print(f"\n  {loss.alignment.aligned_steps} points aligned; mean |diff| "
          f"{loss.measures.mean_abs_diff:.4g}, final-window mean |diff| "
          f"{loss.measures.final_window.mean_abs_diff:.4g}")
    if cand.job is not None:
        s = cand.job.straggler
        print(f"  candidate job {cand.job.job_id}: {cand.job.reported}; straggler "
              + ("n/a" if s is None else f"rank {s.slowest_rank} at {s.ratio:.3f}x the "
                 "median rank's steady step time"))
    print(f"\ncomparison JSON: {comp.write_json(a.out)}")
    print(f"MLflow UI: mlflow ui --backend-store-uri {resolve_tracking_uri(None)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
