"""Diagnostic: which profiler windows on the TPU lack the device plane (empty) and why.
Runs one variant per process: python windows.py VARIANT OUTJSON."""
import json, sys, threading, time
import jax, jax.numpy as jnp
from refrun.probes.chip_busy import jax_sessions, window_busy
from refrun.probes.xspace import read_timeline

variant, out = sys.argv[1], sys.argv[2]
src = jax_sessions()
log = []

def window(length, tag):
    t0 = time.perf_counter()
    s = src.open()
    t1 = time.perf_counter(); start_ns = time.time_ns(); n0 = steps[0]
    time.sleep(length)
    end_ns = time.time_ns(); n1 = steps[0]; t2 = time.perf_counter()
    x = s.stop(); t3 = time.perf_counter()
    tl = read_timeline(x); t4 = time.perf_counter()
    busy, why = window_busy(tl, (start_ns, end_ns), "tpu")
    log.append(dict(tag=tag, length=length, open_s=t1 - t0, stop_s=t3 - t2, read_s=t4 - t3,
                    steps=n1 - n0, busy=busy, why=why, planes=list(tl.planes),
                    t=time.perf_counter() - T0))

T0 = time.perf_counter()
steps = [0]
if variant == "primer":
    window(0.001, "primer-before-compile")
w = jnp.ones((512, 512), jnp.float32) * 0.001
x = jnp.ones((256, 512), jnp.float32)
f = jax.jit(lambda x, w: jnp.tanh(x @ w) + x * 0.5)
stop = threading.Event()

def loop():
    global x
    while not stop.is_set():
        x = f(x, w)
        steps[0] += 1
        if steps[0] % 64 == 0:
            x.block_until_ready()

x = f(x, w).block_until_ready()
th = threading.Thread(target=loop); th.start()
while steps[0] < 20:
    time.sleep(0.001)
lengths = [0.01, 0.03, 0.1, 0.2] * 3
if variant == "short":
    lengths = [0.01] * 6 + [0.2] * 2
for i, L in enumerate(lengths):
    window(L, f"w{i}")
    time.sleep(0.2)
stop.set(); th.join()
json.dump(dict(variant=variant, log=log, total_s=time.perf_counter() - T0), open(out, "w"), indent=1)
for r in log:
    print(variant, r["tag"], r["length"], "open %.3f stop %.3f read %.3f" % (r["open_s"], r["stop_s"], r["read_s"]),
          "steps", r["steps"], "busy", {k: round(v, 1) for k, v in r["busy"].items()}, r["why"][:80])
