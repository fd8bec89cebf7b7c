"""Host metrics that do not lie (issue 51, item 3).

* On a TPU VM under gVisor ``/proc/stat`` is all zeros (tests/fixtures/tpu/proc_stat.txt)
  while the process's own CPU times are right: the psutil monitor must not record the
  system's busy share and others' CPU as 0 (an idle machine) but drop them and say why,
  and a step-time judgement then finds contention "not known".  On this machine's real
  ``/proc/stat`` nothing is dropped.
* The resident set of a process that opened a TPU holds the chip's BARs (two 4 GiB
  ``anon_inode:[vfio-device]`` mappings in the recorded smaps): ``sys/rss_bytes`` is host
  memory, the device mappings are ``sys/device_mapped_bytes``.
"""

from __future__ import annotations

import gzip
import mmap
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from acceptance_helpers import GOAL_CLAIM, N, base_loss, record, write_criteria

from refrun import schema
from refrun.acceptance import load_criteria
from refrun.acceptance.assess import assess_ids
from refrun.acceptance.criterion_evidence import Contention
from refrun.probes.host_memory import DeviceMappedReader, device_mapped_kib, has_device_mappings
from refrun.probes.monitors import (
    PsutilMonitor,
    cpu_contradiction,
    proc_stat_times,
)

FIXTURES = Path(__file__).parent / "fixtures" / "tpu"
GVISOR_STAT = (FIXTURES / "proc_stat.txt").read_text()
OTHERS, RUN, CPU = (schema.M_SYS_OTHERS_CPU_CORES, schema.M_SYS_RUN_CPU_CORES,
                    schema.M_SYS_CPU_PCT)


def burn(seconds: float) -> None:
    """Use this much CPU on this thread (the run's own work)."""
    end = time.process_time() + seconds
    x = 0
    while time.process_time() < end:
        x += 1


def smaps_device_kib_by_lines(text: str) -> int:
    """The test's own reading: walk smaps line by line; a header line (``lo-hi perms
    ...``) whose path has ``vfio`` starts a device mapping, whose ``Rss:`` line counts."""
    total, in_device = 0, False
    for line in text.splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            in_device = "vfio" in line
        elif in_device and line.startswith("Rss:"):
            total += int(line.split()[1])
            in_device = False
    return total


# --- /proc/stat ---------------------------------------------------------------------------------
def test_proc_stat_reader_matches_psutil_on_this_machine() -> None:
    mine = proc_stat_times(Path("/proc/stat").read_text())
    theirs = psutil.cpu_times()
    for field in ("user", "system", "idle"):
        # read a moment apart: within a second of CPU time summed over the CPUs
        assert getattr(mine, field) == pytest.approx(getattr(theirs, field),
                                                     abs=psutil.cpu_count())
    assert sum(proc_stat_times(GVISOR_STAT)) == 0.0  # the sandbox's file: all zeros


def test_cpu_readings_that_contradict_the_runs_own_are_named() -> None:
    zeros = proc_stat_times(GVISOR_STAT)
    why = cpu_contradiction(zeros, zeros, own_cpu_s=2.9, interval_s=1.0, logical_cpus=13)
    assert why == ("/proc/stat's CPU times did not advance in 1.00 s (this process used "
                   "2.90 CPU seconds)")
    # time passed and idle advanced, but busy advanced less than the run alone used
    before = proc_stat_times("cpu  100 0 100 1000 0 0 0 0 0 0\n")
    after = proc_stat_times("cpu  110 0 100 2290 0 0 0 0 0 0\n")  # busy +0.1 s, idle +12.9 s
    why = cpu_contradiction(before, after, own_cpu_s=2.0, interval_s=1.0, logical_cpus=13)
    assert why is not None and "busy CPU time advanced 0.10 s" in why
    # a real interval on this machine while this thread burns CPU: consistent
    t0, w0, c0 = psutil.cpu_times(), time.monotonic(), time.process_time()
    burn(0.3)
    t1, w1, c1 = psutil.cpu_times(), time.monotonic(), time.process_time()
    assert cpu_contradiction(t0, t1, c1 - c0, w1 - w0, psutil.cpu_count()) is None


def test_monitor_drops_contradicted_cpu_figures_and_says_why() -> None:
    # /proc/stat as the sandbox served it (zeros, never advancing), this process's own
    # times as psutil reads them: what the monitor saw on the TPU VM
    mon = PsutilMonitor.create(system_times=lambda: proc_stat_times(GVISOR_STAT))
    assert mon is not None
    burn(0.3)
    s = mon.sample()
    assert CPU not in s and OTHERS not in s
    assert s[RUN] > 0 and s[schema.M_SYS_LOGICAL_CPUS] == psutil.cpu_count()
    why = mon.tags()[schema.TAG_SYS_UNAVAILABLE]
    assert why.startswith("sys/cpu_pct, sys/others_cpu_cores: /proc/stat's CPU times did "
                          "not advance in ")
    # the run's own CPU time is what the reading contradicted: the 0.3 s this thread burnt
    used = float(why.split("this process used ")[1].split(" CPU seconds")[0])
    assert used >= 0.29
    burn(0.1)
    assert CPU not in mon.sample()  # dropped for the rest of the run
    # the same monitor on this machine's real /proc/stat: everything recorded, no tag
    real = PsutilMonitor.create()
    assert real is not None
    burn(0.3)
    s = real.sample()
    assert {CPU, OTHERS, RUN} <= set(s) and real.tags() == {}


def test_a_run_without_cpu_figures_has_contention_not_known(store, tmp_path: Path,
                                                            monkeypatch) -> None:
    """The candidate recorded what the monitor gives under gVisor (no sys/cpu_pct, no
    sys/others_cpu_cores): the step-time result says contention was not known, never
    that the machine was idle."""
    monkeypatch.setenv("REFRUN_DELIVERY", "thread")
    mon = PsutilMonitor.create(system_times=lambda: proc_stat_times(GVISOR_STAT))
    assert mon is not None
    burn(0.2)
    sample = mon.sample()
    rng = np.random.default_rng(0)

    def metrics(step_s: float, sys_metrics: dict[str, float]) -> dict[str, np.ndarray]:
        m = {"loss": base_loss() + rng.normal(0, 0.005, N),
             schema.M_STEP_TIME: step_s * (1 + rng.normal(0, 0.01, N))}
        m.update({k: np.full(N, v) for k, v in sys_metrics.items()})
        return m

    ref_sys = {OTHERS: 0.1, RUN: 1.0, CPU: 60.0, schema.M_SYS_LOGICAL_CPUS: 2.0}
    refs = [record(store.tracking_uri, store.spool_dir, "reference", metrics(0.1, ref_sys),
                   seed=s) for s in (0, 1)]
    cand = record(store.tracking_uri, store.spool_dir, "candidate",
                  metrics(0.25, sample), seed=7)
    crit = load_criteria(write_criteria(tmp_path, GOAL_CLAIM + """
[[criteria]]
id = "speed"
level = "L4"
kind = "step_time"
max_ratio = 1.5
"""))
    a, _ = assess_ids(crit, [r.run_id for r in refs], cand.run_id, store.tracking_uri)
    r = a.result("speed")
    cont = Contention.of_result(r.evidence)
    assert cont is not None and not cont.known and cont.missing == (cand.run_id,)
    assert f"contention not known ({cand.run_id} without sys/others_cpu_cores)" in \
        cont.summary()
    assert r.outcome == "fail"  # judged as recorded: 2.5x slower


# --- memory -------------------------------------------------------------------------------------
def test_device_mappings_of_a_tpu_process_are_not_host_memory() -> None:
    smaps = gzip.decompress((FIXTURES / "proc_self_smaps.txt.gz").read_bytes()).decode()
    kib = device_mapped_kib(smaps)
    assert kib == smaps_device_kib_by_lines(smaps) == 2 * 4 * 1024 * 1024  # two 4 GiB BARs
    assert has_device_mappings(smaps)
    status = (FIXTURES / "proc_self_status.txt").read_text()
    vm_rss = int(next(ln for ln in status.splitlines() if ln.startswith("VmRSS:")).split()[1])
    host_kib = vm_rss - kib
    assert 5.0 < host_kib / 2**20 < 6.0  # of 13.3 GiB resident, ~5.3 GiB is host memory


def test_this_processes_maps_read_without_device_and_zero_mapping_is_not_one() -> None:
    # a private mapping of /dev/zero is host memory, not a device's
    with open("/dev/zero", "rb") as f:
        m = mmap.mmap(f.fileno(), 1 << 20, prot=mmap.PROT_READ)
        try:
            maps = Path("/proc/self/maps").read_text()
            assert "/dev/zero" in maps
            assert not has_device_mappings(maps)
            smaps = Path("/proc/self/smaps").read_text()
            assert device_mapped_kib(smaps) == smaps_device_kib_by_lines(smaps) == 0
        finally:
            m.close()
    reader = DeviceMappedReader()
    assert reader.read() == 0 and reader.why_not is None


def test_monitor_reports_host_memory_and_no_device_mapping_metric_without_devices() -> None:
    mon = PsutilMonitor.create()
    assert mon is not None
    s = mon.sample()
    rss = psutil.Process().memory_info().rss
    assert s[schema.M_SYS_RSS_BYTES] == pytest.approx(rss, rel=0.2)  # no device mapped here
    assert schema.M_SYS_DEVICE_MAPPED_BYTES not in s
    unreadable = PsutilMonitor.create()
    assert unreadable is not None
    unreadable._mapped = DeviceMappedReader(pid="0-no-such-process")
    s = unreadable.sample()
    assert schema.M_SYS_DEVICE_MAPPED_BYTES not in s
    assert "sys/device_mapped_bytes: /proc/0-no-such-process/" in \
        unreadable.tags()[schema.TAG_SYS_UNAVAILABLE]
