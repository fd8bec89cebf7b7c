"""Exercise the CUDA paths of refrun.torch on a real NVIDIA GPU and print what was seen.

Not part of the test suite (CI has no GPU).  Run on a GPU machine:

    python benchmarks/gpu_check_torch.py [--steps 60]

Checks, each printed as ok/FAIL with the numbers behind it:
1. no host synchronisation: the wrapped loop runs under
   ``torch.cuda.set_sync_debug_mode("error")`` (any synchronising CUDA call raises), and
   ``aten::_local_scalar_dense`` is counted by a dispatch mode: 0 wrapped and unwrapped;
2. every logged loss (fp32 and bf16 CUDA tensors) equals the loop's own value;
3. step times come from CUDA events (``refrun.perf.step_time_kind = cuda_event``) and
   agree with an independent measure: the same steps timed with synchronize + wall clock;
4. placement tags say cuda and carry no warning; a CPU copy of the model under
   ``hardware="cuda"`` does warn;
5. NVML sampling: ``sys/gpu<i>_*`` metrics recorded against training steps, values in
   range, sampler cost per sample.
Exit status 1 if any check fails, 0 otherwise (and 0 with a message when there is no GPU).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from mlflow.tracking import MlflowClient
from torch.utils._python_dispatch import TorchDispatchMode

import refrun
import refrun.torch
from refrun import schema
from refrun.probes.monitors import NvmlMonitor
from refrun.store.curves import read_curves

RESULTS: list[tuple[str, bool, str]] = []


def check(name: str, ok: bool, detail: str) -> None:
    RESULTS.append((name, ok, detail))
    print(f"[{'ok' if ok else 'FAIL':>4}] {name}: {detail}", flush=True)


class LocalScalarCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def make(device: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.GELU(),
                                torch.nn.Linear(4096, 2048)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(512, 2048, device=device)
    return model, opt, x


def train_step(model, opt, x) -> tuple[torch.Tensor, torch.Tensor]:
    loss = (model(x) - x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss, loss.detach().to(torch.bfloat16)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device visible: nothing to check here")
        return 0
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    tmp = Path(tempfile.mkdtemp(prefix="refrun-gpu-check-"))
    uri = f"sqlite:///{tmp}/mlflow.db"
    model, opt, x = make("cuda")
    for _ in range(5):  # warm up kernels and the allocator
        train_step(model, opt, x)
    torch.cuda.synchronize()

    # independent timing: synchronize around each step, wall clock
    sync_times = []
    for _ in range(20):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        train_step(model, opt, x)
        torch.cuda.synchronize()
        sync_times.append(time.perf_counter() - t0)

    with LocalScalarCounter() as plain_counter:
        for _ in range(5):
            train_step(model, opt, x)

    run = refrun.start_run("gpu-check", "reference", hardware="cuda", backend="torch",
                           tracking_uri=uri, spool_dir=tmp / "spool")
    probe = refrun.torch.instrument(run, model=model, optimizer=opt, hardware="cuda",
                                    sample_interval_s=0.05)
    own_losses, own_bf16 = [], []
    error = None
    torch.cuda.set_sync_debug_mode("error")
    try:
        with LocalScalarCounter() as counter:
            for n in range(args.steps):
                with probe.step(n):
                    loss, lbf = train_step(model, opt, x)
                    probe.log(loss=loss, loss_bf16=lbf, lr=1e-4)
                own_losses.append(loss.detach().clone())
                own_bf16.append(lbf.clone())
    except RuntimeError as exc:  # a synchronising call under sync_debug_mode("error")
        error = exc
    finally:
        torch.cuda.set_sync_debug_mode("default")
    t0 = time.perf_counter()
    probe.close()
    close_s = time.perf_counter() - t0
    run.close()
    check("no synchronising CUDA call in the wrapped loop", error is None, repr(error))
    check("no aten::_local_scalar_dense", counter.count == plain_counter.count == 0,
          f"wrapped {counter.count}, unwrapped {plain_counter.count}")
    probe_warnings = [w["message"] for w in run.warnings]
    check("no probe warnings", not probe_warnings, str(probe_warnings[:3]))

    client = MlflowClient(uri)
    df = read_curves(Path(client.download_artifacts(run.run_id, schema.ARTIFACT_CURVES,
                                                    str(tmp))))
    tags = client.get_run(run.run_id).data.tags

    def series(metric: str) -> dict[int, float]:
        sub = df[df.metric == metric]
        return dict(zip(sub.step.astype(int), sub.value, strict=True))

    want = [float(t.cpu()) for t in own_losses]
    got = series("loss")
    check("fp32 CUDA losses equal the loop's", [got.get(n) for n in range(args.steps)] == want,
          f"{len(got)} logged, first {want[0]:.6g}")
    want_bf = [float(t.float().cpu()) for t in own_bf16]
    got_bf = series("loss_bf16")
    check("bf16 CUDA losses equal the loop's",
          [got_bf.get(n) for n in range(args.steps)] == want_bf, f"{len(got_bf)} logged")

    times = series(schema.M_STEP_TIME)
    steady = [times[n] for n in range(5, args.steps) if n in times]
    med, ref = statistics.median(steady), statistics.median(sync_times)
    check("step time kind", tags.get("refrun.perf.step_time_kind") == "cuda_event",
          tags.get("refrun.perf.step_time_kind", "missing"))
    check("CUDA-event step time vs synchronized wall time", 0.5 * ref <= med <= 1.5 * ref,
          f"event median {med * 1e3:.3f} ms, synchronized wall median {ref * 1e3:.3f} ms, "
          f"p90 tag {tags.get('refrun.perf.step_time_p90_s')}")
    print(f"       probe.close() took {close_s * 1e3:.1f} ms (drains pending events)")

    check("placement", "cuda" in tags.get(schema.TAG_PLACEMENT, "")
          and schema.TAG_PLACEMENT_WARNING not in tags,
          f"{tags.get(schema.TAG_PLACEMENT)} / hardware {tags.get(schema.TAG_EXEC_HARDWARE)}")

    cpu_model, cpu_opt, cpu_x = make("cpu")
    run2 = refrun.start_run("gpu-check", "reference", hardware="cuda", tracking_uri=uri,
                            spool_dir=tmp / "spool", snapshot_environment=False)
    p2 = refrun.torch.instrument(run2, model=cpu_model, optimizer=cpu_opt,
                                 hardware="cuda", monitors=None)
    with p2.step(0):
        loss, _ = train_step(cpu_model, cpu_opt, cpu_x)
        p2.log(loss=loss)
    p2.close()
    run2.close()
    warning = client.get_run(run2.run_id).data.tags.get(schema.TAG_PLACEMENT_WARNING)
    check("CPU model under hardware=cuda warns", bool(warning), str(warning))

    gpu_metrics = sorted(m for m in df.metric.unique() if m.startswith("sys/gpu"))
    check("NVML metrics recorded", bool(gpu_metrics), ", ".join(gpu_metrics))
    for m in gpu_metrics:
        vals = df[df.metric == m]
        print(f"       {m}: {len(vals)} points, steps {vals.step.min()}..{vals.step.max()}, "
              f"median {vals.value.median():.4g}, max {vals.value.max():.4g}")
    util = df[df.metric.str.match(r"sys/gpu\d+_util_pct")].value
    check("GPU utilisation in [0, 100] and busy at some point",
          bool(len(util)) and util.between(0, 100).all() and util.max() > 0,
          f"max {util.max() if len(util) else 'n/a'}")
    mon = NvmlMonitor.create()
    if mon is not None:
        t0 = time.perf_counter()
        for _ in range(100):
            mon.sample()
        print(f"       NVML sample cost: {(time.perf_counter() - t0) / 100 * 1e6:.1f} us "
              f"for {len(mon.handles)} GPU(s)")
        mon.close()
    failed = [name for name, ok, _ in RESULTS if not ok]
    print(f"\n{len(RESULTS) - len(failed)}/{len(RESULTS)} checks ok; store {uri}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
