"""The device's own timeline, read from a serialized profiler ``XSpace``, without jax.

A profiler session (``jax._src.lib._profiler.ProfilerSession``, or torch_xla's
``_XLAC.profiler.TslProfilerSessionWrapper``) returns what it recorded as the bytes of a
``tensorflow.profiler.XSpace`` protocol buffer (``tsl/profiler/protobuf/xplane.proto``):
one *plane* per device (``/device:TPU:0``) and per host, each with *lines* of timed
*events*.  On a TPU the device plane has a line ``XLA Modules``: one event per executed
program, timed by the chip.  This module reads only what a busy fraction needs -- the
device planes' ``XLA Modules`` events and the session's start time -- straight from the
protobuf wire format, in pure Python, so that the PyTorch/XLA probe can use it where jax
is not installed, and so that a line of thousands of events it does not need (``XLA
Ops``) costs one jump, not a decode.

Times: an event of line ``l`` starts at ``l.timestamp_ns + offset_ps / 1000`` and lasts
``duration_ps / 1000`` ns.  The profiler writes line timestamps relative to the session's
start (the ``profile_start_time`` stat of the ``Task Environment`` plane, nanoseconds
since the Unix epoch: ``time.time_ns()``'s clock), which :func:`read_timeline` adds, so
every interval it returns is on ``time.time_ns()``'s clock.

Wire format (https://protobuf.dev/programming-guides/encoding/): a message is a sequence
of ``(field number << 3 | wire type, value)``; wire type 0 is a varint, 1 eight bytes,
2 a length-prefixed run of bytes (strings, nested messages), 5 four bytes.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

# Field numbers of xplane.proto.
_SPACE_PLANES = 1
_PLANE_NAME, _PLANE_LINES, _PLANE_STAT_METADATA, _PLANE_STATS = 2, 3, 5, 6
_LINE_NAME, _LINE_TIMESTAMP_NS, _LINE_EVENTS = 2, 3, 4
_EVENT_OFFSET_PS, _EVENT_DURATION_PS = 2, 3
_STAT_METADATA_ID = 1
_STAT_VALUE_FIELDS = (2, 3, 4, 5, 6, 7)  # double, uint64, int64, str, bytes, ref
_META_ENTRY_KEY, _META_ENTRY_VALUE, _STAT_META_NAME = 1, 2, 2

MODULES_LINE = "XLA Modules"
"""The device line whose events are the programs the device executed."""
ENVIRONMENT_PLANE = "Task Environment"
START_STAT = "profile_start_time"
DEVICE_PLANE = re.compile(r"^/device:([A-Z]+):(\d+)$")
"""A device plane's name: ``/device:TPU:0`` (platform TPU, index 0); not ``/device:CUSTOM:
Megascale Trace`` (a trace of the runtime, no device)."""


class XSpaceError(ValueError):
    """The bytes are not a readable XSpace."""


@dataclass(frozen=True)
class DeviceTimeline:
    """One device plane of a trace: its platform (``tpu``), index, and the intervals
    ``(start_ns, end_ns)`` of its ``XLA Modules`` events (None when the plane has no such
    line), on ``time.time_ns()``'s clock."""

    platform: str
    index: int
    plane: str
    modules: tuple[tuple[int, int], ...] | None


@dataclass(frozen=True)
class Timeline:
    """What a trace says about its devices: ``devices`` (one per device plane, in plane
    order), ``start_ns`` (the session's start, epoch ns; None when the trace has no
    ``Task Environment`` plane: then intervals are relative to an unknown origin) and the
    names of every plane (to say what a trace without a device plane held)."""

    devices: tuple[DeviceTimeline, ...]
    start_ns: int | None
    planes: tuple[str, ...]


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        try:
            b = buf[pos]
        except IndexError:
            raise XSpaceError("truncated varint") from None
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise XSpaceError("varint longer than 10 bytes")


def _fields(buf: bytes, pos: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """``(field number, wire type, value, end of field)`` of the message in
    ``buf[pos:end]``; for wire type 2 ``value`` is where the bytes start."""
    while pos < end:
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
            yield field, wire, value, pos
        elif wire == 2:
            size, start = _varint(buf, pos)
            pos = start + size
            if pos > end:
                raise XSpaceError("length-delimited field past its message")
            yield field, wire, start, pos
        elif wire == 1:
            pos += 8
            yield field, wire, int.from_bytes(buf[pos - 8:pos], "little"), pos
        elif wire == 5:
            pos += 4
            yield field, wire, int.from_bytes(buf[pos - 4:pos], "little"), pos
        else:
            raise XSpaceError(f"wire type {wire} (field {field}) is not in xplane.proto")
    if pos != end:
        raise XSpaceError("message overruns its length")


def _signed(v: int) -> int:
    """An int64 read as a varint (two's complement in 64 bits)."""
    return v - (1 << 64) if v >= 1 << 63 else v


def _text(buf: bytes, start: int, end: int) -> str:
    return buf[start:end].decode("utf-8", "replace")


def _events(buf: bytes, start: int, end: int, base_ns: int) -> list[tuple[int, int]]:
    """The events of a line as ``(start_ns, end_ns)``; ``base_ns`` the line's timestamp."""
    out: list[tuple[int, int]] = []
    for field, _, value, fend in _fields(buf, start, end):
        if field != _LINE_EVENTS:
            continue
        offset = duration = 0
        for f, _, v, _ in _fields(buf, value, fend):
            if f == _EVENT_OFFSET_PS:
                offset = _signed(v)
            elif f == _EVENT_DURATION_PS:
                duration = _signed(v)
        s = base_ns + offset // 1000
        out.append((s, s + duration // 1000))
    return out


def _line(buf: bytes, start: int, end: int) -> tuple[str, int, int, int]:
    """A line's name, timestamp, and where its fields are (events read on demand)."""
    name, ts = "", 0
    for field, _, value, fend in _fields(buf, start, end):
        if field == _LINE_NAME:
            name = _text(buf, value, fend)
        elif field == _LINE_TIMESTAMP_NS:
            ts = _signed(value)
        elif field == _LINE_EVENTS:
            break  # serialized in field order: name and timestamp come first
    return name, ts, start, end


def _stat_names(buf: bytes, start: int, end: int) -> dict[int, str]:
    """The plane's ``stat_metadata`` map: id -> stat name."""
    names: dict[int, str] = {}
    for field, _, value, fend in _fields(buf, start, end):
        if field != _PLANE_STAT_METADATA:
            continue
        key, meta = 0, ""
        for f, _, v, e in _fields(buf, value, fend):
            if f == _META_ENTRY_KEY:
                key = _signed(v)
            elif f == _META_ENTRY_VALUE:
                for ff, _, vv, ee in _fields(buf, v, e):
                    if ff == _STAT_META_NAME:
                        meta = _text(buf, vv, ee)
        names[key] = meta
    return names


def _int_stat(buf: bytes, start: int, end: int, wanted: str) -> int | None:
    """The integer value of the plane-level stat named ``wanted``; None when absent."""
    names = _stat_names(buf, start, end)
    for field, _, value, fend in _fields(buf, start, end):
        if field != _PLANE_STATS:
            continue
        meta, number = None, None
        for f, wire, v, _ in _fields(buf, value, fend):
            if f == _STAT_METADATA_ID:
                meta = _signed(v)
            elif f in _STAT_VALUE_FIELDS and wire in (0, 1):
                number = _signed(v) if f == 4 else v
        if meta is not None and names.get(meta) == wanted and number is not None:
            return number
    return None


def read_timeline(xspace: bytes) -> Timeline:
    """The device planes' ``XLA Modules`` intervals of a serialized XSpace, on
    ``time.time_ns()``'s clock (see the module doc).

    Raises:
        XSpaceError: bytes that are not an XSpace (a truncated or foreign buffer).
    """
    buf = bytes(xspace)
    planes: list[tuple[str, int, int]] = []
    for field, wire, value, fend in _fields(buf, 0, len(buf)):
        if field == _SPACE_PLANES and wire == 2:
            name = ""
            for f, _, v, e in _fields(buf, value, fend):
                if f == _PLANE_NAME:
                    name = _text(buf, v, e)
                    break
            planes.append((name, value, fend))
    start_ns = next((_int_stat(buf, s, e, START_STAT) for n, s, e in planes
                     if n == ENVIRONMENT_PLANE), None)
    origin = start_ns or 0
    devices = []
    for name, s, e in planes:
        m = DEVICE_PLANE.match(name)
        if m is None:
            continue
        modules = None
        for field, _, value, fend in _fields(buf, s, e):
            if field != _PLANE_LINES:
                continue
            lname, ts, ls, le = _line(buf, value, fend)
            if lname == MODULES_LINE:
                modules = tuple(_events(buf, ls, le, origin + ts))
                break
        devices.append(DeviceTimeline(m.group(1).lower(), int(m.group(2)), name, modules))
    return Timeline(tuple(devices), start_ns, tuple(n for n, _, _ in planes))


def busy_fraction(intervals: tuple[tuple[int, int], ...] | list[tuple[int, int]],
                  window: tuple[int, int]) -> float:
    """The share of ``window`` covered by ``intervals``, in [0, 1].

    ``|(∪_i [s_i, e_i]) ∩ [w_0, w_1]| / (w_1 - w_0)``: the intervals are clipped to the
    window and their union measured (overlapping events -- concurrent programs of one
    device -- count once), divided by the window's length.  This is the "duty cycle" of
    libtpu's ``duty_cycle_pct`` and of xprof's device busy time over a sampled interval:
    the share of wall time in which the device executed a program.

    Raises:
        ValueError: an empty or reversed window.
    """
    w0, w1 = window
    if w1 <= w0:
        raise ValueError(f"busy_fraction: window {window} is empty")
    covered = 0
    reach = w0  # the union so far covers [w0, reach) as far as it reaches
    for s, e in sorted(intervals):
        s, e = max(s, reach), min(e, w1)
        if e > s:
            covered += e - s
            reach = e
    return covered / (w1 - w0)

