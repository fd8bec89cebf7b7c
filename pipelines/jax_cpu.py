"""Several JAX devices on one CPU: what the pipelines' stand-in for a TPU slice needs.

``XLA_FLAGS=--xla_force_host_platform_device_count=N`` gives N CPU devices whose
collectives (``psum``/``pmean`` in a ``shard_map``) meet in an in-process rendezvous.
With jax 0.10.2 on a 2-core host, a loop that dispatches the next step of such a program
before the previous one has finished aborts the process after 40 s in that rendezvous
("Termination timeout for `all reduce RendezvousKey{...}` ... only 3 of them arrived"):
a pure-JAX loop of a 4-device ``shard_map`` with two ``pmean``, reading the loss once in
50 steps, aborted in 8 of 8 runs (2 on a quiet machine); reading it every step, it ran
300 steps through.  The digits 4-device runs of ``make demo`` aborted so in 2 of 3 full
runs on 2026-12-05, and the 600-step ``jax-4dev-clip-per-device`` run alone, beside two
CPU-busy processes, in 1 and 3 of two sets of 6 runs; waiting as below, in 0 of 6.

So on the CPU, with more than one device, the pipelines wait for each step's outputs
before dispatching the next (:func:`one_step_in_flight`), outside the probed step (it is
no host read of a value, and the probe's step time is entry to outputs ready either way).
On an accelerator nothing waits: the workload is what its users run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def one_step_in_flight(devices: Sequence[Any]) -> bool:
    """Whether a loop over ``devices`` must let one step finish before the next: several
    CPU devices (see the module doc)."""
    return len(devices) > 1 and devices[0].platform == "cpu"
