"""The criterion kinds: one module per kind, each holding the kind's TOML model (a frozen
dataclass whose fields carry their documentation, constraints and cross-field rules) and,
right below it, its check.  :data:`KINDS` registers each once, in the order the JSON
Schema and the documentation list them.

Adding a kind is one module here and one entry in :data:`KINDS`: the model is a
:class:`~refrun.acceptance.model.Criterion` subclass defined with
:func:`@kind <refrun.acceptance.model.kind>`; one without its ``check`` cannot be defined
(:meth:`refrun.acceptance.model.Criterion.__init_subclass__`), and the loader, the JSON
Schema, ``refrun calibrate --exclude`` and the assessment take the kinds from this registry
only.
"""

from __future__ import annotations

from refrun.acceptance.kinds.best_of import BestOf
from refrun.acceptance.kinds.claim import Claim
from refrun.acceptance.kinds.closeness import Closeness
from refrun.acceptance.kinds.compilation import Compilation
from refrun.acceptance.kinds.convergence import Convergence
from refrun.acceptance.kinds.cost import Cost
from refrun.acceptance.kinds.envelope import Envelope
from refrun.acceptance.kinds.equivalence import Equivalence
from refrun.acceptance.kinds.fallback import Fallback
from refrun.acceptance.kinds.gradcheck import Gradcheck
from refrun.acceptance.kinds.hardware import Hardware
from refrun.acceptance.kinds.host_transfers import HostTransfers
from refrun.acceptance.kinds.paired import Paired
from refrun.acceptance.kinds.quantile import Quantile
from refrun.acceptance.kinds.restore import Restore
from refrun.acceptance.kinds.step_time import StepTime
from refrun.acceptance.kinds.throughput import Throughput
from refrun.acceptance.kinds.utilization import Utilization
from refrun.acceptance.model import Criterion


def registry(models: tuple[type[Criterion], ...]) -> dict[str, type[Criterion]]:
    """``{kind name: model}``; a model without a name (not defined with ``@kind``) or a
    name registered twice is a programming error."""
    out: dict[str, type[Criterion]] = {}
    for m in models:
        if not m.KIND:
            raise TypeError(f"criterion model {m.__name__} has no kind name (define it with "
                            "@kind, refrun.acceptance.model)")
        if m.KIND in out:
            raise TypeError(f"criterion kind {m.KIND!r} registered twice "
                            f"({out[m.KIND].__name__}, {m.__name__})")
        out[m.KIND] = m
    return out


KINDS: dict[str, type[Criterion]] = registry((
    Closeness, Envelope, Claim, Hardware, Fallback, Compilation, HostTransfers, Utilization,
    StepTime, Throughput, Cost, Equivalence, Convergence, Gradcheck, Paired, BestOf, Quantile,
    Restore))

__all__ = ["KINDS", "BestOf", "Claim", "Closeness", "Compilation", "Convergence", "Cost",
           "Envelope", "Equivalence", "Fallback", "Gradcheck", "Hardware", "HostTransfers",
           "Paired", "Quantile", "Restore", "StepTime", "Throughput", "Utilization",
           "registry"]
