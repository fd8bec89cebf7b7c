"""The learning rate of each parameter group of a torch optimizer, read at every step.

A schedule that is not the reference's (a warmup left out, a scheduler stepped once an
epoch instead of once a step, a rate rescaled for another chip count) changes the
computation while the loss may end where the reference's ends; the rate itself shows it
at the step it happens.  ``torch.optim`` keeps the rate as a Python number in
``param_groups``, where the scheduler writes it, so reading it is a few dict lookups and
never a device read.  A rate held as a tensor (``lr=torch.tensor(...)``, used with
``capturable=True``) is read only where it is a host tensor; on a device, reading it would
be a host sync inside the loop, so it is not read at all and the probe says so once.

Names: :data:`refrun.schema.M_LR` for group 0, ``opt/lr/pg<i>`` for group ``i >= 1``
(Lightning's ``LearningRateMonitor`` numbers groups the same way).
"""

from __future__ import annotations

from typing import Any

from refrun import schema


def lr_names(groups: int) -> tuple[str, ...]:
    """The metric names of ``groups`` parameter groups' rates, group 0 first."""
    return (schema.M_LR, *(f"{schema.M_LR}/pg{i}" for i in range(1, groups)))


class LearningRates:
    """Reads ``optimizer.param_groups[i]["lr"]`` for every group, as Python floats."""

    def __init__(self, optimizer: Any) -> None:
        self._groups: list[dict[str, Any]] = optimizer.param_groups  # the optimizer's list
        self._names: tuple[str, ...] = ()
        self.why_not: str | None = None  # set when a rate cannot be read without a sync

    def read(self) -> tuple[tuple[str, ...], tuple[float, ...]] | None:
        """``(names, rates)``; the names tuple is the same object while the number of
        groups stays the same (the probe groups kept rows by it).  None, with
        :attr:`why_not` set, when a group's rate is a device tensor."""
        groups = self._groups
        rates = [g["lr"] for g in groups]
        if len(rates) != len(self._names):  # add_param_group appends to the same list
            self._names = lr_names(len(rates))
        for i, r in enumerate(rates):
            if type(r) is float:
                continue
            if isinstance(r, int | float) and not isinstance(r, bool):
                rates[i] = float(r)
                continue
            device = getattr(r, "device", None)
            if device is not None and getattr(device, "type", None) == "cpu" \
                    and getattr(r, "numel", lambda: 0)() == 1:
                rates[i] = float(r)  # a host tensor: a memory load, not a sync
                continue
            self.why_not = (f"the learning rate of parameter group {i} is a "
                            f"{type(r).__name__} on {device}: reading it every step would "
                            f"be a host sync, so {schema.M_LR} is not recorded")
            return None
        return self._names, tuple(rates)
