"""What the probes read from a torch optimizer at every step: each parameter group's
learning rate, and the optimizer's own count of the updates it has applied.

A schedule that is not the reference's (a warmup left out, a scheduler stepped once an
epoch instead of once a step, a rate rescaled for another chip count) changes the
computation while the loss may end where the reference's ends; the rate itself shows it
at the step it happens.  ``torch.optim`` keeps the rate as a Python number in
``param_groups``, where the scheduler writes it, so reading it is a few dict lookups and
never a device read.  A rate held as a tensor (``lr=torch.tensor(...)``, used with
``capturable=True``) is read only where it is a host tensor; on a device, reading it would
be a host sync inside the loop, so it is not read at all and the probe says so once.

**Stays true across a resume.**  ``Optimizer.load_state_dict`` (a checkpoint reload)
*replaces* the ``param_groups`` list, and ``add_param_group`` appends to it, so both are
read from the optimizer at every step, never from a list kept at start: a list kept at
start holds the rates it had when the checkpoint was loaded, forever (docs/torch.md,
"Resuming from a checkpoint").  An optimizer the loop *builds anew* is a different
object: the loop tells the probe with ``probe.observe(optimizer=...)``.

**The update count** (``opt/steps``): Adam, AdamW, RMSprop, Adagrad ... keep
``state[p]["step"]``, the number of updates they applied to ``p``; it is read at the
step's exit (after the step's own update) from the first parameter that has one.  A
checkpoint that restores the optimizer restores it; a fresh optimizer after a reload
starts again from 0, so a replayed step shows a count the first pass did not have
(:mod:`refrun.comparison.restores`).  Like the rate it is a host value (a Python number,
or a CPU tensor read as memory); a count held on a device (``capturable``/``fused``) is
not read.  SGD keeps no count: nothing is recorded.

**A new optimizer over the same parameters** (the loop built a fresh one after a reload,
and perhaps loaded a checkpoint's state into it) is followed without being told: while
the probe is open, a step post-hook common to all optimizers
(``torch.optim.optimizer.register_optimizer_step_post_hook``) sees every
``optimizer.step()``; the first step of an optimizer whose parameters are exactly the
followed one's makes it the one read (the same step's rate is read again from it: the
rate its update used).  Its cost on the followed optimizer's own steps is one Python call
and an identity test.  An optimizer over other parameters (a GAN's second one) is never
followed; a loop that rebuilt the model too says so with ``probe.observe``.

Names: :data:`refrun.schema.M_LR` for group 0, ``opt/lr/pg<i>`` for group ``i >= 1``
(Lightning's ``LearningRateMonitor`` numbers groups the same way);
:data:`refrun.schema.M_OPT_STEPS` for the count.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any

from refrun import schema

Rates = tuple[tuple[str, ...], tuple[float, ...]]


def lr_names(groups: int) -> tuple[str, ...]:
    """The metric names of ``groups`` parameter groups' rates, group 0 first."""
    return (schema.M_LR, *(f"{schema.M_LR}/pg{i}" for i in range(1, groups)))


def host_number(v: Any) -> float | None:
    """``v`` as a float when reading it cannot wait for a device: a Python number, or a
    one-element CPU tensor (a memory load); None for anything else."""
    if type(v) is float:
        return v
    if isinstance(v, int | float) and not isinstance(v, bool):
        return float(v)
    if getattr(v, "is_cpu", False) is True and v.numel() == 1:
        # tolist reads the memory (no operator dispatched, no sync); a 0-d tensor (Adam's
        # count) is read without the reshape, whose dispatch costs ~1.5 us a step
        return float(v.tolist() if v.dim() == 0 else v.reshape(-1).tolist()[0])
    return None


class LearningRates:
    """Reads ``optimizer.param_groups[i]["lr"]`` for every group, as Python floats, and
    the optimizer's update count (see the module doc)."""

    def __init__(self, optimizer: Any) -> None:
        self._optimizer = optimizer  # param_groups is looked up on it at every read
        self._hook: Any = None
        # ids of optimizers not followed: a set of ints is tested in C, so another
        # optimizer's step (a GAN's second one) runs no extra Python call; each id leaves
        # the set when its optimizer is collected, before the id can be reused
        self._others: set[int] = set()
        self._on_switch: Callable[[Any], None] | None = None
        self._names: tuple[str, ...] = ()
        self._with_steps: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
        self.why_not: str | None = None  # set when a rate cannot be read without a sync
        self.counted = False  # the optimizer has shown an update count
        self.count_off = False  # the count lives on a device: never read again
        self.count_why_not: str | None = None  # why, until the probe takes it (once)
        self._cpu_count: Any = None  # the count tensor host_number last read (0-d, CPU)

    def read(self) -> Rates | None:
        """``(names, rates)``; the names tuple is the same object while the number of
        groups stays the same (the probe groups kept rows by it).  None, with
        :attr:`why_not` set, when a group's rate is a device tensor."""
        groups = self._optimizer.param_groups
        if len(groups) == 1 and type(rate := groups[0]["lr"]) is float:
            # the commonest case, at every step's entry: one group, a float rate
            if len(self._names) != 1:
                self._names = lr_names(1)
            return self._names, (rate,)
        rates = [g["lr"] for g in groups]
        if len(rates) != len(self._names):  # add_param_group, or a checkpoint's groups
            self._names = lr_names(len(rates))
        for i, r in enumerate(rates):
            if type(r) is float:
                continue
            v = host_number(r)
            if v is not None:
                rates[i] = v
                continue
            self.why_not = (f"the learning rate of parameter group {i} is a "
                            f"{type(r).__name__} on {getattr(r, 'device', None)}: reading "
                            f"it every step would be a host sync, so {schema.M_LR} is not "
                            "recorded")
            return None
        return self._names, tuple(rates)

    def steps(self) -> float | None:
        """The optimizer's update count: ``state[p]["step"]`` of the first parameter (in
        group order) that has state; a parameter without state (no gradient reached it
        yet) is passed over.  Once a count was seen, an optimizer without state for any
        parameter has applied 0 updates (a fresh one); before, None (SGD keeps none, and
        an optimizer that has not stepped yet says nothing).  None, with
        :attr:`count_why_not` set the first time, when the count lives on a device."""
        if self.count_off:
            return None
        state = self._optimizer.state
        if not state:  # SGD without momentum, or no update yet: no parameter has state
            return 0.0 if self.counted else None
        for g in self._optimizer.param_groups:
            for p in g["params"]:
                st = state.get(p)
                if not st:
                    continue
                s = st.get("step")
                if s is None:
                    return None
                if s is self._cpu_count and s.is_cpu:
                    # the 0-d CPU tensor read last time (updated in place by each update;
                    # a checkpoint's load_state_dict puts a new one in a new state dict)
                    return float(s.tolist())
                v = host_number(s)
                if v is None:
                    self.count_off = True
                    self.count_why_not = (
                        f"the optimizer's update count is a {type(s).__name__} on "
                        f"{getattr(s, 'device', None)}: reading it every step would be a "
                        f"host sync, so {schema.M_OPT_STEPS} is not recorded")
                    return None
                self.counted = True
                if getattr(s, "is_cpu", False) is True and s.dim() == 0:
                    self._cpu_count = s
                return v
        return 0.0 if self.counted else None

    def with_steps(self, names: tuple[str, ...]) -> tuple[str, ...]:
        """``names`` and :data:`~refrun.schema.M_OPT_STEPS` as one tuple, the same object
        for the same ``names`` object (so kept rows group by it)."""
        if self._with_steps[0] is not names:
            self._with_steps = (names, (*names, schema.M_OPT_STEPS))
        return self._with_steps[1]

    @property
    def optimizer(self) -> Any:
        return self._optimizer

    def follow(self, on_switch: Callable[[Any], None]) -> None:
        """Follow a new optimizer over the same parameters (module doc); ``on_switch(new)``
        is called when it takes over.  Only where torch is already imported."""
        mod = sys.modules.get("torch.optim.optimizer")
        register = getattr(mod, "register_optimizer_step_post_hook", None)
        if register is None or self._hook is not None:
            return
        self._on_switch = on_switch
        self._hook = register(self._stepped)

    def unfollow(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if optimizer is self._optimizer or id(optimizer) in self._others:
            return  # the followed optimizer's own step: the hot path
        if not _same_parameters(optimizer, self._optimizer):
            self._others.add(id(optimizer))
            weakref.finalize(optimizer, self._others.discard, id(optimizer))
            return
        self._optimizer = optimizer
        if self._on_switch is not None:
            self._on_switch(optimizer)


def _same_parameters(a: Any, b: Any) -> bool:
    """Whether two optimizers hold the same parameter tensors (by identity, any order)."""
    try:
        pa = [id(p) for g in a.param_groups for p in g["params"]]
        pb = {id(p) for g in b.param_groups for p in g["params"]}
    except (AttributeError, KeyError, TypeError):
        return False
    return bool(pa) and len(pa) == len(pb) and all(i in pb for i in pa)
