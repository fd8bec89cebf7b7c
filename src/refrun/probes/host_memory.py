"""This process's host memory, told apart from the accelerator memory mapped into it.

A process that opens an accelerator maps the device's memory windows (BARs) into its
address space, and the kernel counts their pages in the process's resident set: on a TPU
v5e VM the resident set jumps from 0.4 GB to ~14 GB when JAX opens the chip, 8 GB of it
two ``anon_inode:[vfio-device]`` mappings (the chip's BARs), none of it host RAM.  So the
resident set alone says nothing about the host memory a run needs.

:func:`device_mapped_kib` sums the ``Rss`` of the mappings whose path names a device
(:data:`DEVICE_MAPPINGS`) in ``/proc/self/smaps``; host memory is the resident set less
that.  ``smaps`` is long (21k lines, 663 KB, on that TPU VM), so the monitor reads
``/proc/self/maps`` (one line per mapping, no counters) first and ``smaps`` only when a
device mapping exists, and no more often than :data:`REFRESH_S`: device mappings are made
when a device opens and stay.  The search is a substring search per pattern (C speed),
then one ``Rss:`` lookup per device mapping: 2.5 ms for that 663 KB file (a line-by-line
parse: 11 ms).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

DEVICE_MAPPINGS = (
    "anon_inode:[vfio",  # VFIO device regions: TPU VMs (the chip's BARs)
    "/dev/vfio/",
    "/dev/accel",  # TPU v2-v4 (/dev/accel0 ...)
    "/dev/nvidia",  # NVIDIA BARs and UVM (/dev/nvidia0, /dev/nvidia-uvm)
    "/dev/dri/",  # AMD and Intel GPUs
    "/dev/kfd",  # AMD ROCm
    "/dev/neuron",  # AWS Trainium/Inferentia
)
"""Substrings of a mapping's path that make it device memory, not host RAM."""
REFRESH_S = 60.0
"""Seconds between readings of the device mappings (they change when a device opens)."""
_HEX = frozenset("0123456789abcdef")
_MARKERS = ("anon_inode:[vfio", "/dev/")  # every DEVICE_MAPPINGS entry starts with one


def _header_starts(text: str) -> list[int]:
    """Offsets of the mapping header lines (``addr-addr perms offset dev inode path``)
    whose path names a device.  Two substring searches (``anon_inode:[vfio`` and
    ``/dev/``, which few mappings name) instead of one per pattern (~1 ms each over
    663 KB)."""
    starts: set[int] = set()
    for marker in _MARKERS:
        at = text.find(marker)
        while at >= 0:
            if text.startswith(DEVICE_MAPPINGS, at):
                line = text.rfind("\n", 0, at) + 1
                lo, dash, hi = text[line:text.find(" ", line)].partition("-")
                if dash and lo and hi and set(lo) <= _HEX and set(hi) <= _HEX:
                    starts.add(line)
            at = text.find(marker, at + len(marker))
    return sorted(starts)


def has_device_mappings(maps_text: str) -> bool:
    """Whether ``/proc/<pid>/maps`` text holds a device mapping."""
    return bool(_header_starts(maps_text))


def device_mapped_kib(smaps_text: str) -> int:
    """The summed ``Rss`` (KiB) of the device mappings in ``/proc/<pid>/smaps`` text: for
    each mapping whose header names a device (:data:`DEVICE_MAPPINGS`), the first ``Rss:``
    line after its header (each mapping's fields follow its header).

    Raises:
        ValueError: a device mapping without an ``Rss:`` line (not smaps text).
    """
    total = 0
    for start in _header_starts(smaps_text):
        at = smaps_text.find("\nRss:", start)
        if at < 0:
            raise ValueError("smaps: a device mapping without an Rss line")
        end = smaps_text.find("\n", at + 5)
        value = smaps_text[at + 5:end if end >= 0 else None].split()
        total += int(value[0])
    return total


@dataclass
class DeviceMappedReader:
    """The resident bytes of this process's device mappings, read at most every
    ``refresh_s`` (see the module doc).  :meth:`read` returns the bytes, 0 when the process
    maps no device, None when ``/proc`` cannot say (``why_not`` says why)."""

    pid: str = "self"
    refresh_s: float = REFRESH_S
    why_not: str | None = None
    _value: int | None = None
    _due: float = field(default=0.0, repr=False)

    def read(self) -> int | None:
        now = time.monotonic()
        if now < self._due:
            return self._value
        self._due = now + self.refresh_s
        try:
            with open(f"/proc/{self.pid}/maps", encoding="utf-8", errors="replace") as f:
                if not has_device_mappings(f.read()):
                    self._value, self.why_not = 0, None
                    return 0
            with open(f"/proc/{self.pid}/smaps", encoding="utf-8", errors="replace") as f:
                self._value = device_mapped_kib(f.read()) * 1024
            self.why_not = None
        except (OSError, ValueError) as exc:
            self._value = None
            self.why_not = f"/proc/{self.pid}/smaps unreadable ({type(exc).__name__}: {exc})"
        return self._value
