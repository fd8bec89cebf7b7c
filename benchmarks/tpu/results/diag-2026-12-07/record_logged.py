"""The TPU record with every sampler window logged (time, progress around it, outcome)."""
import json, os, runpy, sys, time
from refrun.probes import chip_busy

LOG = []
orig = chip_busy.ProfilerWindows._window

def logged(self, length=None):
    t0 = time.time()
    p0 = self.progress() if self.progress else None
    L = length if length is not None else self.sampling.window_for(self._step_s)
    counts = (self.empty, self.dropped, self.completed, self.trimmed)
    out = orig(self, length)
    p1 = self.progress() if self.progress else None
    LOG.append(dict(t0=t0, t1=time.time(), id=id(self), length=L, before=p0, after=p1,
                    out=out, counts_before=counts,
                    counts_after=(self.empty, self.dropped, self.completed, self.trimmed),
                    why=self._empty_why, step_s=self._step_s, warmup=self.warmup_steps))
    return out

chip_busy.ProfilerWindows._window = logged
sys.argv = ["record.py", "--store", "/tmp/tpu-store"]
try:
    runpy.run_path("benchmarks/tpu/record.py", run_name="__main__")
finally:
    json.dump(LOG, open(os.path.join(os.environ.get("OUT", "."), "windows.json"), "w"), indent=1)
