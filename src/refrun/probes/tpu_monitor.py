"""TPU utilisation samples for :class:`refrun.probes.base.Probe`, off cleanly without a TPU.

Two sources, each used only when it answers at creation:

* libtpu's monitoring SDK (``from libtpu.sdk import tpumonitoring``, on TPU VMs):
  ``hbm_capacity_usage`` / ``hbm_capacity_total`` (bytes, per chip), the numbers the
  ``tpu-info`` tool shows (its ``duty_cycle_pct`` is read by
  :class:`refrun.probes.chip_busy.ChipBusyMonitor`, with the profiler's device timeline
  where libtpu gives no data);
* ``xm.get_memory_info(device)`` (``bytes_used``, ``bytes_limit``), which PJRT answers on
  TPU and GPU; on PJRT CPU it raises ``UNIMPLEMENTED``, so that source stays off.

Samples are keyed ``sys/tpu<i>_hbm_used_bytes``, ``sys/tpu<i>_hbm_total_bytes`` (per
chip) and ``sys/xla_mem_used_bytes``, ``sys/xla_mem_limit_bytes`` (the probe's device).
The sampler thread calls :meth:`TpuMonitor.sample`; it never touches tensors, so it never
syncs the training step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from refrun.probes.chip_busy import numbers

_LIBTPU_METRICS = {
    "hbm_capacity_usage": "hbm_used_bytes",
    "hbm_capacity_total": "hbm_total_bytes",
}


def libtpu_reader() -> Callable[[], dict[str, float]] | None:
    """A reader of libtpu's runtime metrics, or None where libtpu's SDK is absent/silent."""
    try:
        from libtpu.sdk import tpumonitoring  # type: ignore[import-not-found]
    except Exception:  # not a TPU VM (or an old libtpu): no such source
        return None

    def read() -> dict[str, float]:
        out: dict[str, float] = {}
        for metric, suffix in _LIBTPU_METRICS.items():
            try:
                values = numbers(tpumonitoring.get_metric(metric).data())
            except Exception:  # one metric unsupported on this TPU generation
                continue
            for i, v in enumerate(values):
                out[f"sys/tpu{i}_{suffix}"] = v
        return out

    return read if read() else None


def memory_info_reader(device: Any) -> Callable[[], dict[str, float]] | None:
    """A reader of ``xm.get_memory_info(device)``, or None where the runtime does not
    implement it (PJRT CPU raises UNIMPLEMENTED)."""
    try:
        import torch_xla.core.xla_model as xm

        xm.get_memory_info(device)
    except Exception:
        return None

    def read() -> dict[str, float]:
        info = xm.get_memory_info(device)
        out: dict[str, float] = {}
        for key, name in (("bytes_used", "sys/xla_mem_used_bytes"),
                          ("bytes_limit", "sys/xla_mem_limit_bytes"),
                          ("peak_bytes_used", "sys/xla_mem_peak_bytes")):
            if key in info:
                out[name] = float(info[key])
        return out

    return read


@dataclass
class TpuMonitor:
    """:class:`refrun.probes.base.Monitor` over the sources that answered at creation."""

    readers: list[Callable[[], dict[str, float]]] = field(default_factory=list)
    name: str = "tpu"

    @classmethod
    def create(cls, device: Any) -> TpuMonitor | None:
        """The monitor for ``device``, or None when no source is available (CPU, GPU
        without memory stats ...), so nothing is sampled and nothing is warned."""
        readers = [r for r in (libtpu_reader(), memory_info_reader(device)) if r is not None]
        return cls(readers) if readers else None

    def sample(self) -> Mapping[str, float]:
        out: dict[str, float] = {}
        for read in self.readers:
            out.update(read())
        return out

    def close(self) -> None:
        self.readers = []
