"""The model every criterion kind is built on: documented, constrained fields (``key``),
the :func:`kind` decorator that defines a kind's model, and the :class:`Criterion` base,
whose subclasses (one per kind, each beside its check in :mod:`refrun.acceptance.kinds`)
the criteria loader validates against.  Stopping rules
(:class:`refrun.acceptance.criteria.StopRule`) share the :class:`Rule` base and the
decorator."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, dataclass_transform

from refrun import identity, schema

if TYPE_CHECKING:  # annotations only: checks import this module
    from refrun.acceptance.checks import Context
    from refrun.acceptance.results import CriterionResult

LEVELS = schema.LEVELS
MISSING = dataclasses.MISSING
SELECT_OVER = ("all", "final_window", "last", "eval_points")


def key(doc: str, default: Any = MISSING, *, enum: tuple[str, ...] | None = None,
        ge: float | None = None, gt: float | None = None, le: float | None = None,
        min_items: int | None = None, names: str | None = None) -> Any:
    """A documented, constrained field of the criteria model (metadata drives validation
    and the JSON Schema).  ``names``: "backend" or "hardware": the strings (list items,
    table keys) are identity names, normalised by :mod:`refrun.identity`."""
    meta = {"doc": doc, "enum": enum, "ge": ge, "gt": gt, "le": le, "min_items": min_items,
            "names": names}
    if isinstance(default, list | dict | tuple):
        frozen = default
        return field(default_factory=lambda: type(frozen)(frozen), metadata=meta)
    return field(default=default, metadata=meta)


class Rule:
    """What every kind of entry of a criteria file's ``[[criteria]]`` and ``[[stopping]]``
    arrays has: its kind's name and documentation and its groups of keys (set by
    :func:`kind`), and the metrics it names."""

    KIND: ClassVar[str] = ""
    DOC: ClassVar[str] = ""
    # Groups of keys of which at least one (ANY_OF) or exactly one (ONE_OF) is required.
    ANY_OF: ClassVar[tuple[tuple[str, ...], ...]] = ()
    ONE_OF: ClassVar[tuple[tuple[str, ...], ...]] = ()

    def used_metrics(self) -> tuple[str, ...]:
        """Metrics this entry names (for the 'no run has it' check)."""
        m = getattr(self, "metric", None)
        return (m,) if m else tuple(getattr(self, "metrics", ()))


_Model = TypeVar("_Model", bound=type[Rule])


@dataclass_transform(kw_only_default=True, frozen_default=True, field_specifiers=(key, field))
def kind(name: str, *, any_of: tuple[tuple[str, ...], ...] = (),
         one_of: tuple[tuple[str, ...], ...] = (), needs: Iterable[str] = ()
         ) -> Callable[[_Model], _Model]:
    """Defines the model of the kind ``name`` of criterion or stopping rule: the decorated
    :class:`Rule` subclass becomes a frozen, keyword-only dataclass whose ``KIND`` is
    ``name``, ``DOC`` its docstring with white space folded (the kind's description in the
    JSON Schema), ``ANY_OF`` / ``ONE_OF`` the groups of keys of which at least one / exactly
    one is required, and (criteria only) ``NEEDS`` what the assessment looks up for its
    check (see :class:`Criterion`)."""
    def define(cls: _Model) -> _Model:
        doc = cls.__dict__.get("__doc__") or ""  # read before dataclass() writes one
        cls.KIND, cls.DOC, cls.ANY_OF, cls.ONE_OF = name, " ".join(doc.split()), any_of, one_of
        if needs:
            cls.NEEDS = frozenset(needs)  # type: ignore[attr-defined]
        return dataclass(frozen=True, kw_only=True)(cls)
    return define


@dataclass(frozen=True, kw_only=True)
class Criterion(Rule):
    """Fields every criterion has; each kind is a subclass defined with :func:`kind`,
    holding its own check."""

    # What the assessment must look up in the store before this kind's check runs (the
    # check reads it from the context): "gradchecks" (the candidate's gradient-check runs,
    # Context.gradchecks), "pair" (its same-seed reference, Context.pair).
    NEEDS: ClassVar[frozenset[str]] = frozenset()

    id: str = key("unique name of the criterion (reported, used by sign-off diffs)")
    kind: str = key("kind of criterion")
    level: str = key("consistency level the criterion belongs to", enum=LEVELS)
    description: str = key("why this criterion and threshold (free text)", "")
    backends: list[str] | None = key(  # noqa: RUF009
        "apply only to candidates whose refrun.backend tag is one of these "
        "(case-insensitive), e.g. ['torch_xla'] for evidence only one probe records; for "
        "any other backend the outcome is not_applicable. Default: every backend",
        None, min_items=1, names="backend")

    migration_only: bool = key(
        "apply only to a candidate that ran on other hardware, another backend or another "
        "chip count than the references (a migration: refrun.hardware, refrun.backend, "
        "refrun.chips); for a candidate on the references' configuration the outcome is "
        "not_applicable (the same-machine step_time criterion judges its speed)", False)

    calibration: dict[str, float] | None = key(  # noqa: RUF009
        "provenance written by refrun calibrate (reported, never used by the check): "
        "worst held-out value, margin, held-out seeds, detectable shift ...", None)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # A kind without its check cannot exist: defining one fails at import (with or
        # without @kind, which runs once the class exists).
        super().__init_subclass__(**kwargs)
        if "check" not in cls.__dict__:
            raise TypeError(f"criterion kind {cls.__name__} needs its own check(self, ctx) "
                            "method (refrun.acceptance.kinds)")

    def check(self, ctx: Context) -> CriterionResult:
        """This kind's verdict on the candidate in ``ctx`` (every kind defines it)."""
        raise NotImplementedError  # pragma: no cover - __init_subclass__ enforces it

    def problems(self) -> list[tuple[tuple[str | int, ...], str]]:
        """Cross-field rules of this kind the per-key constraints cannot state: ``(key
        path below the criterion, message)`` for each broken one (the loader reports the
        first with the file, line and key)."""
        return []

    def applies_to(self, backend: str | None) -> bool | None:
        """Whether the criterion applies to a candidate recorded with ``backend`` (its
        ``refrun.backend`` tag): always without ``backends``; otherwise case-insensitive
        membership; None when the criterion is scoped and the backend is unknown."""
        if self.backends is None:
            return True
        if not backend or not backend.strip():
            return None
        mine = identity.canonical_backend(backend) or backend.strip().lower()
        return mine in {identity.canonical_backend(b) or b for b in self.backends}
