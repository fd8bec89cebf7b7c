"""Counting host reads of ``jax.Array`` values inside a training step, on every platform.

A host read (``float(x)``, ``int(x)``, ``bool(x)``, ``x.item()``, ``x.tolist()``,
``np.asarray(x)``, printing or formatting ``x``) makes the Python thread wait until the
device has computed ``x`` and copies it to the host.  Inside a training step it serialises
dispatch with execution: the ``.item()`` class of silent slowdowns of the migration study.
``jax.transfer_guard`` does not see these reads on the CPU backend and ``jax.monitoring``
emits no event for them, so while a probe counts, refrun wraps the two entry points every
read of a ``jax.Array`` goes through:

* the ``ArrayImpl._value`` property: ``float``/``int``/``bool``/``complex``/``index``,
  ``tolist``, ``tobytes``, ``format``/``str``/``repr``, ``__array__`` (so ``np.asarray``
  on accelerators, and on the CPU for arrays that export no buffer: sharded ones).  A
  read is counted when the array has no host copy yet (``_npy_value is None``): that read
  waits for the device; a second read of an accelerator array's cached host copy does not;
* the type's buffer-protocol slot (``bf_getbuffer``): ``np.asarray(x)`` and ``x.item()``
  of a single-device CPU array are served zero-copy through the buffer protocol (after
  waiting for the value) and never touch ``_value``.  CPython 3.11 has no Python-level
  ``__buffer__``, so the slot pointer is swapped through :mod:`ctypes` for the lifetime of
  the counting, after checking the type object's layout (basic size, flags, name); where
  that check fails this path is not counted and :func:`coverage` says so.  A successful
  export is counted; a failed one (a sharded or deleted array) returns -1 without a Python
  exception, which numpy answers by falling back to ``__array__`` (counted there, and a
  deleted array raises its usual error there); a direct ``memoryview(x)`` of such an array
  gets a ``SystemError`` instead of the original message while a probe is counting.

Counting is one thread-local attribute read and an integer increment, and only when a read
happens: a step that reads nothing runs no refrun code at all.  The read already waits for
the value; the counter adds no synchronisation, no dispatch and no compilation.  Only the
thread that activated a :class:`ReadCount` (the training thread, between ``begin_step`` and
``end_step``) counts; the probe's own reads of logged values happen on its collector
thread, or at close with counting suspended (:func:`suspended`).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

_TLS = threading.local()  # .sink: the ReadCount of this thread's open step, or absent/None
_LOCK = threading.Lock()


class ReadCount:
    """A per-backend cumulative count of host reads made while it was active."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


@dataclass(frozen=True)
class Coverage:
    """Which read paths are counted (recorded as the ``refrun.jax.host_reads`` tag)."""

    value_property: bool
    buffer_protocol: bool
    detail: str = ""

    def text(self) -> str:
        if not self.value_property:
            return "off" + (f" ({self.detail})" if self.detail else "")
        if self.buffer_protocol:
            return "counted: value reads and buffer-protocol reads"
        return f"counted: value reads only (buffer-protocol reads not counted: {self.detail})"


def _count() -> None:
    sink = getattr(_TLS, "sink", None)
    if sink is not None:
        sink.n += 1


def activate(sink: ReadCount | None) -> ReadCount | None:
    """Count this thread's reads into ``sink`` (None: stop); returns the previous sink."""
    prev = getattr(_TLS, "sink", None)
    _TLS.sink = sink
    return prev


def thread_state() -> threading.local:
    """The thread-local whose ``sink`` attribute is the counting thread's open
    :class:`ReadCount` (None: not counting): what :func:`activate` sets, for a caller that
    sets it on every step without a function call."""
    return _TLS


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """No read of this thread is counted inside (the probe's own reads)."""
    prev = activate(None)
    try:
        yield
    finally:
        _TLS.sink = prev


# --- the _value property ----------------------------------------------------------------------
class _ValueHook:
    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.orig = cls.__dict__["_value"]
        fget = self.orig.fget

        def _value(arr: Any) -> Any:
            if arr._npy_value is None:  # no host copy yet: this read waits for the device
                sink = getattr(_TLS, "sink", None)
                if sink is not None:
                    sink.n += 1
            return fget(arr)

        self.prop = property(_value, doc=self.orig.__doc__)

    def install(self) -> None:
        self.cls._value = self.prop  # type: ignore[attr-defined]

    def remove(self) -> None:
        if self.cls.__dict__.get("_value") is self.prop:
            self.cls._value = self.orig  # type: ignore[attr-defined]


# --- the buffer-protocol slot -----------------------------------------------------------------
class _BufferProcs(ctypes.Structure):
    _fields_ = [("bf_getbuffer", ctypes.c_void_p), ("bf_releasebuffer", ctypes.c_void_p)]


# PyTypeObject on 64-bit CPython 3.8-3.13: ob_refcnt, ob_type, ob_size, tp_name (24),
# tp_basicsize (32), ... tp_as_buffer (160), tp_flags (168).
_OFF_NAME, _OFF_BASICSIZE, _OFF_AS_BUFFER, _OFF_FLAGS = 24, 32, 160, 168
_GETBUFFER_C = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_void_p, ctypes.c_int)
_GETBUFFER_CB = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_void_p, ctypes.c_int)


def layout_problem(cls: type) -> str | None:
    """Why the buffer slot of ``cls`` cannot be hooked safely here; None when it can."""
    if sys.implementation.name != "cpython" or ctypes.sizeof(ctypes.c_void_p) != 8:
        return "not 64-bit CPython"
    if sys.version_info < (3, 8) or sys.version_info >= (3, 14):
        return f"type layout of Python {sys.version_info[:2]} not checked"
    addr = id(cls)
    if ctypes.c_ssize_t.from_address(addr + _OFF_BASICSIZE).value != cls.__basicsize__:
        return "type layout mismatch (tp_basicsize)"
    if ctypes.c_ulong.from_address(addr + _OFF_FLAGS).value != cls.__flags__:
        return "type layout mismatch (tp_flags)"
    name = ctypes.c_char_p.from_address(addr + _OFF_NAME).value or b""
    if name.decode("utf-8", "replace").rsplit(".", 1)[-1] != cls.__name__:
        return "type layout mismatch (tp_name)"
    procs = ctypes.c_void_p.from_address(addr + _OFF_AS_BUFFER).value
    if not procs or not _BufferProcs.from_address(procs).bf_getbuffer:
        return "the type exports no buffer"
    return None


class _BufferHook:
    def __init__(self, cls: type) -> None:
        procs = ctypes.c_void_p.from_address(id(cls) + _OFF_AS_BUFFER).value
        self.procs = _BufferProcs.from_address(procs)
        self.orig_addr = self.procs.bf_getbuffer
        orig = _GETBUFFER_C(self.orig_addr)

        def getbuffer(obj: Any, view: int, flags: int) -> int:
            try:
                rc = orig(obj, view, flags)
            except BaseException:  # no export: numpy falls back to __array__ (counted there)
                return -1
            if rc == 0:
                _count()
            return rc

        # Kept alive for the process: a thread may still be inside it after remove().
        self.callback = _GETBUFFER_CB(getbuffer)
        self.addr = ctypes.cast(self.callback, ctypes.c_void_p).value

    def install(self) -> None:
        self.procs.bf_getbuffer = self.addr

    def remove(self) -> None:
        if self.procs.bf_getbuffer == self.addr:
            self.procs.bf_getbuffer = self.orig_addr


# --- install / remove (reference counted: several probes may count at once) ---------------------
_users = 0
_value_hook: _ValueHook | None = None
_buffer_hook: _BufferHook | None = None
_coverage = Coverage(False, False, "not installed")
_KEEP: list[Any] = []  # every callback ever made (never freed while the process runs)


def _array_type() -> type:
    from jax._src.array import ArrayImpl

    return ArrayImpl


def install(buffer_protocol: bool = True) -> Coverage:
    """Start counting (hooks installed once for all users); returns what is counted."""
    global _users, _value_hook, _buffer_hook, _coverage
    with _LOCK:
        _users += 1
        if _users > 1:
            return _coverage
        cls = _array_type()
        try:
            if not isinstance(cls.__dict__.get("_value"), property):
                raise TypeError("jax.Array has no _value property")
            _value_hook = _ValueHook(cls)
            _value_hook.install()
        except Exception as exc:  # another JAX version: say so, never break the run
            _value_hook = None
            _coverage = Coverage(False, False, f"{type(exc).__name__}: {exc}")
            return _coverage
        why = "disabled" if not buffer_protocol else layout_problem(cls)
        if why is None:
            _buffer_hook = _BufferHook(cls)
            _KEEP.append(_buffer_hook.callback)
            _buffer_hook.install()
        _coverage = Coverage(True, why is None, why or "")
        return _coverage


def remove() -> None:
    """Stop counting for one user; the hooks go when the last user is gone."""
    global _users, _value_hook, _buffer_hook, _coverage
    with _LOCK:
        if _users == 0:
            return
        _users -= 1
        if _users:
            return
        _uninstall()
        _coverage = Coverage(False, False, "not installed")


def _uninstall() -> None:
    global _value_hook, _buffer_hook
    if _buffer_hook is not None:
        _buffer_hook.remove()
        _buffer_hook = None
    if _value_hook is not None:
        _value_hook.remove()
        _value_hook = None


def coverage() -> Coverage:
    """What is counted now."""
    return _coverage


@atexit.register
def _restore_at_exit() -> None:
    # The type's original slot must be back before module globals are torn down.
    with _LOCK:
        _uninstall()


__all__ = ["Coverage", "ReadCount", "activate", "coverage", "install", "layout_problem",
           "remove", "suspended"]
