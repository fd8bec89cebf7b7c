"""The criteria file of a workload: a typed model and its TOML loader.

A criteria file is data (TOML, read with :mod:`tomllib`); nothing in it is executed.  The
dataclasses are the single source of truth: the file-level sections and stopping rules
below, and the criterion kinds of :mod:`refrun.acceptance.kinds` (each kind's model beside
its check, registered once in ``KINDS``).  The loader validates against their fields (type,
bounds, allowed values, documented in each field's metadata; a kind's cross-field rules in
its ``problems()``) and :mod:`refrun.acceptance.json_schema` derives the shipped JSON
Schema from them.

Every validation error is a :class:`RefrunInputError` whose message starts with
``FILE:LINE:`` (the line when it can be found) and names the key path, e.g.
``criteria.toml:14: criteria[2].abs_tol (id 'loss-close'): must be >= 0, got -0.1``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from refrun import identity, schema
from refrun.acceptance.model import LEVELS, MISSING, SELECT_OVER, Criterion, Rule, key, kind
from refrun.errors import RefrunInputError

__all__ = [  # the kinds' models, re-exported where they were defined before
    "CRITERION_KINDS", "LEVELS", "MISSING", "SELECT_OVER", "Claim", "Closeness",
    "Compilation", "Convergence", "Cost", "CriteriaFile", "Criterion", "Envelope",
    "Equivalence", "Fallback", "Gradcheck", "Hardware", "HostTransfers", "Paired",
    "StepTime", "Throughput", "Utilization", "key", "load_criteria", "parse_criteria",
]

FORMAT_VERSION = 1


# --- file-level sections ------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class CriteriaSettings:
    """How runs are aligned and measured (passed to ``refrun.comparison.CompareOptions``)."""

    keep: str = key("value kept when a step is logged twice (a resumed run)", "last",
                    enum=("last", "first"))
    interpolate: str = key("align different cadences by linear interpolation of one side",
                           "none", enum=("none", "candidate", "reference"))
    axis: str = key("align on 'step', or on cumulative 'samples' / 'tokens' seen (runs with "
                    "different global batches)", "step", enum=schema.AXES)
    eps: float = key("floor of the relative-difference denominator", 1e-12, gt=0)
    final_fraction: float = key("final window: the last ceil(fraction * n) aligned steps",
                                0.1, gt=0, le=1)
    final_points: int | None = key("final window: exactly this many last aligned steps "
                                   "(overrides final_fraction)", None, ge=1)
    warmup_steps: int | None = key("steps skipped at the start for step time, counters and "
                                   "utilization", None, ge=0)
    warmup_fraction: float = key("default warm-up: ceil(fraction * step span) steps",
                                 0.1, ge=0, le=1)


@dataclass(frozen=True, kw_only=True)
class Prices:
    """Machine list prices, for cost = wall time x price per hour."""

    currency: str = key("currency of the prices (reported, never converted)", "USD")
    per: str = key("'machine': the price is for the run's hardware as a whole; 'chip': "
                   "multiplied by the run's refrun.chips tag", "machine",
                   enum=("machine", "chip"))
    hourly: dict[str, float] = key("price per hour by hardware kind: the run's "  # noqa: RUF009
                                   "refrun.hardware tag, else refrun.exec.hardware "
                                   "(case-insensitive)", {}, ge=0, names="hardware")


@dataclass(frozen=True, kw_only=True)
class L0Options:
    """The built-in L0 (executability) checks."""

    loss_metric: str = key("metric whose values must all be finite", schema.M_LOSS)
    planned_steps: int | None = key("planned step count; default the candidate's "
                                    "refrun.planned_steps tag, else the reference's last "
                                    "step", None, ge=1)


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Provenance of thresholds written by ``refrun calibrate`` (reported and hashed into
    the assessment; never changes a check)."""

    method: str = key("how the thresholds were derived", "")
    runs: list[str] = key("reference run ids the thresholds rest on", [])  # noqa: RUF009
    n: int = key("number of reference runs (seeds)", 0, ge=0)
    group_size: int = key("reference runs per held-out group (use as many references "
                          "with refrun accept)", 0, ge=0)
    backend: str = key("refrun.backend of the reference runs (comma-separated when they "
                       "differ; each a known backend name)", "", names="backend")
    false_alarm_rate: float = key("target probability that a benign candidate fails one "
                                  "criterion", 0.05, gt=0, le=0.5)
    confidence: float = key("confidence of the tolerance limits", 0.9, gt=0, le=0.999)
    date: str = key("UTC time of the calibration", "")
    refrun_version: str = key("refrun version that calibrated", "")
    require_gradcheck: bool = key("the file requires a passed gradient-check run for every "
                                  "candidate (refrun calibrate --require-gradcheck)", False)
    outliers: list[str] = key("reference runs calibrate named as outliers among the "  # noqa: RUF009
                              "seeds (see the file's comments)", [])
    outliers_excluded: bool = key("whether the outliers were left out of the thresholds "
                                  "(they are not in runs then)", False)
    power: dict[str, str] = key("by criterion id, the smallest difference it detects with "  # noqa: RUF009
                                "these seeds (refrun calibrate's sentence; printed beside a "
                                "verdict, never used by a check)", {})


# --- criteria: the kinds (refrun.acceptance.kinds, each model beside its check) ---------
# Loaded on first use (PEP 562): the kinds' checks import the comparison stack (MLflow,
# pandas), which reading this module for a command's --help or a schema must not pull in.
_FROM_KINDS = ("Claim", "Closeness", "Compilation", "Convergence", "Cost", "Envelope",
               "Equivalence", "Fallback", "Gradcheck", "Hardware", "HostTransfers", "Paired",
               "StepTime", "Throughput", "Utilization")


def __getattr__(name: str) -> Any:
    if name == "CRITERION_KINDS" or name in _FROM_KINDS:
        from refrun.acceptance import kinds

        return kinds.KINDS if name == "CRITERION_KINDS" else getattr(kinds, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:  # static analysis sees the kinds as names of this module
    from refrun.acceptance.kinds import KINDS as CRITERION_KINDS
    from refrun.acceptance.kinds import (
        Claim,
        Closeness,
        Compilation,
        Convergence,
        Cost,
        Envelope,
        Equivalence,
        Fallback,
        Gradcheck,
        Hardware,
        HostTransfers,
        Paired,
        StepTime,
        Throughput,
        Utilization,
    )


# --- stopping rules -------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class StopRule(Rule):
    """Fields every stopping rule has; each kind is a subclass defined with ``@kind``."""

    id: str = key("unique name of the rule")
    kind: str = key("kind of stopping rule")
    description: str = key("why this rule (free text)", "")


@kind("budget", any_of=(("max_hours", "max_cost"),))
class Budget(StopRule):
    """projected total time (elapsed + remaining steps x median step time) and cost against a
    budget"""

    max_hours: float | None = key("time budget of the whole run, hours", None, gt=0)
    max_cost: float | None = key("cost budget of the whole run, [prices] currency", None,
                                 ge=0)
    planned_steps: int | None = key("planned steps (default: refrun.planned_steps tag)",
                                    None, ge=1)
    min_steps: int = key("project only after this many steps after warm-up", 10, ge=1)
    metric: str = key("step-time metric (seconds); without it the wall-clock rate of the "
                      "logged steps is used", schema.M_STEP_TIME)
    warmup_steps: int | None = key("warm-up steps (default: settings)", None, ge=0)


@kind("smoke", any_of=(("abs_tol", "rel_tol"),))
class Smoke(StopRule):
    """difference from the reference over the steps so far beyond a threshold (a reason to look,
    not a verdict)"""

    metric: str = key("metric compared with the reference")
    abs_tol: float = key("absolute threshold", 0.0, ge=0)
    rel_tol: float = key("relative threshold, times |reference|", 0.0, ge=0)
    min_fraction: float = key("investigate when fewer than this fraction of the compared "
                              "steps are within the threshold", 1.0, ge=0, le=1)
    over: str = key("'all' aligned steps so far, or the 'last' window_points of them",
                    "all", enum=("all", "last"))
    window_points: int = key("steps compared by over = 'last'", 1, ge=1)
    min_steps: int = key("compare only once this many steps are aligned", 1, ge=1)


@kind("no_progress", any_of=(("after_hours", "stall_minutes"),))
class NoProgress(StopRule):
    """the run has not reached L0 (finished with its planned steps) after after_hours, or logged
    no new step for stall_minutes"""

    after_hours: float | None = key("hours since start without reaching L0", None, gt=0)
    stall_minutes: float | None = key("minutes without a new logged point", None, gt=0)


STOP_KINDS: dict[str, type[StopRule]] = {
    c.KIND: c for c in (Budget, Smoke, NoProgress)
}


@dataclass(frozen=True, kw_only=True)
class CriteriaFile:
    """A loaded, validated criteria file."""

    version: int = key("format version of the criteria file", FORMAT_VERSION,
                       ge=FORMAT_VERSION, le=FORMAT_VERSION)
    workload: str = key("workload the criteria are for (tag refrun.workload)", "")
    description: str = key("free text", "")
    settings: CriteriaSettings = key("alignment and measuring options",  # noqa: RUF009
                                     CriteriaSettings())
    prices: Prices = key("price table for cost criteria and budgets", Prices())  # noqa: RUF009
    l0: L0Options = key("options of the built-in L0 checks", L0Options())  # noqa: RUF009
    calibration: Calibration | None = key(  # noqa: RUF009
        "provenance of calibrated thresholds (refrun calibrate)", None)
    criteria: list[Criterion] = key("the criteria ([[criteria]] tables)", [])  # noqa: RUF009
    stopping: list[StopRule] = key("stopping rules for runs in progress ([[stopping]])", [])  # noqa: RUF009
    path: str = field(default="", metadata={"internal": True})
    sha256: str = field(default="", metadata={"internal": True})
    text: str = field(default="", repr=False, metadata={"internal": True})

    def criterion(self, cid: str) -> Criterion:
        for c in self.criteria:
            if c.id == cid:
                return c
        raise KeyError(cid)


def calibration_digest(criteria: CriteriaFile) -> str | None:
    """SHA-256 of the calibration a criteria file rests on: canonical JSON (sorted keys, no
    spaces) of its ``[calibration]`` table and every criterion's ``calibration`` data (by
    id); None for a file without ``[calibration]``."""
    if criteria.calibration is None:
        return None
    cal = dataclasses.asdict(criteria.calibration)
    # Keys added later count only when set, so the digest of an older file is unchanged.
    for k, default in (("outliers", []), ("outliers_excluded", False), ("power", {})):
        if cal.get(k) == default:
            cal.pop(k, None)
    doc = {"calibration": cal,
           "criteria": {c.id: c.calibration for c in criteria.criteria}}
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()



SECTIONS: dict[str, type] = {"settings": CriteriaSettings, "prices": Prices,
                             "l0": L0Options, "calibration": Calibration}


# --- loading --------------------------------------------------------------------------
def load_criteria(path: str | Path) -> CriteriaFile:
    """Read and validate a criteria file; raises :class:`RefrunInputError` naming the file,
    the line (when found) and the key path."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise RefrunInputError(f"{p}: cannot read criteria file ({exc.strerror})") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RefrunInputError(f"{p}: not UTF-8 text ({exc.reason} at byte {exc.start})") \
            from exc
    return parse_criteria(text, str(p), sha256=hashlib.sha256(raw).hexdigest())


def parse_criteria(text: str, path: str = "<criteria>", sha256: str | None = None
                   ) -> CriteriaFile:
    """Validate criteria given as TOML text (``path`` is only used in messages)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        m = re.search(r"line (\d+)", str(exc))
        where = f"{path}:{m.group(1)}" if m else path
        raise RefrunInputError(f"{where}: TOML syntax error: {exc}") from exc
    v = _Validator(path, text)
    top = {f.name: f for f in dataclasses.fields(CriteriaFile) if not f.metadata.get("internal")}
    v.unknown(data, top, ())
    kwargs: dict[str, Any] = {}
    for name in ("workload", "description"):
        if name in data:
            kwargs[name] = v.value(data[name], top[name], str, (name,))
    kwargs["version"] = v.value(data.get("version", FORMAT_VERSION), top["version"], int,
                                ("version",))
    for name, cls in SECTIONS.items():
        if name in data:
            kwargs[name] = v.table(data[name], cls, (name,))
    from refrun.acceptance.kinds import KINDS  # the registry (see __getattr__ above)

    kwargs["criteria"] = v.entries(data.get("criteria", []), KINDS, "criteria")
    kwargs["stopping"] = v.entries(data.get("stopping", []), STOP_KINDS, "stopping")
    if not kwargs["criteria"] and not kwargs["stopping"]:
        raise RefrunInputError(f"{path}: no [[criteria]] or [[stopping]] tables (the built-in "
                               "L0 checks alone need no file)")
    digest = sha256 or hashlib.sha256(text.encode("utf-8")).hexdigest()
    return CriteriaFile(**kwargs, path=path, sha256=digest, text=text)


def type_hints(cls: type) -> dict[str, Any]:
    """Resolved field annotations of a model class."""
    return typing.get_type_hints(cls)


def model_fields(cls: type) -> list[dataclasses.Field[Any]]:
    """The user-facing fields of a model class (without internal ones)."""
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("internal")]


def is_required(f: dataclasses.Field[Any]) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


def split_optional(tp: Any) -> tuple[Any, bool]:
    """``(inner type, allows None)`` of an annotation like ``float | None``."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(tp))
    return tp, False


class _Validator:
    """Walks the parsed TOML and builds the model, with located error messages."""

    def __init__(self, path: str, text: str) -> None:
        self.path = path
        self.lines = text.splitlines()

    # --- messages ---------------------------------------------------------------
    def fail(self, keypath: tuple[Any, ...], msg: str, ident: str | None = None) -> None:
        line = locate(self.lines, keypath)
        where = f"{self.path}:{line}" if line else self.path
        kp = format_path(keypath)
        who = f" (id {ident!r})" if ident else ""
        raise RefrunInputError(f"{where}: {kp}{who}: {msg}")

    # --- structure ----------------------------------------------------------------
    def unknown(self, data: dict[str, Any], allowed: dict[str, Any], kp: tuple[Any, ...],
                ident: str | None = None) -> None:
        for k in data:
            if k not in allowed:
                close = ", ".join(sorted(allowed))
                self.fail((*kp, k), f"unknown key (allowed: {close})", ident)

    def table(self, data: Any, cls: type, kp: tuple[Any, ...], ident: str | None = None
              ) -> Any:
        if not isinstance(data, dict):
            self.fail(kp, f"expected a table, got {_tname(data)}", ident)
        fields = {f.name: f for f in model_fields(cls)}
        self.unknown(data, fields, kp, ident)
        for f in fields.values():
            if is_required(f) and f.name not in data:
                self.fail((*kp, f.name), f"required key missing ({f.metadata['doc']})", ident)
        hints = type_hints(cls)
        kwargs = {}
        for name, val in data.items():
            kwargs[name] = self.value(val, fields[name], hints[name], (*kp, name), ident)
        return cls(**kwargs)

    def entries(self, data: Any, kinds: dict[str, type], section: str) -> list[Any]:
        if not isinstance(data, list):
            self.fail((section,), f"expected an array of tables ([[{section}]]), got "
                      f"{_tname(data)}")
        out, seen = [], {}
        for i, item in enumerate(data):
            kp = (section, i)
            if not isinstance(item, dict):
                self.fail(kp, f"expected a table, got {_tname(item)}")
            ident = item.get("id") if isinstance(item.get("id"), str) else None
            kind = item.get("kind")
            if kind is None:
                self.fail((*kp, "kind"), f"missing (one of: {', '.join(kinds)})", ident)
            if kind not in kinds:
                self.fail((*kp, "kind"), f"{kind!r} is not one of: {', '.join(kinds)}", ident)
            cls = kinds[kind]
            fields = {f.name: f for f in model_fields(cls)}
            self.unknown(item, fields, kp, ident)
            for f in fields.values():
                if is_required(f) and f.name not in item:
                    self.fail((*kp, f.name), f"required key missing ({f.metadata['doc']})",
                              ident)
            hints = type_hints(cls)
            kwargs = {n: self.value(v, fields[n], hints[n], (*kp, n), ident)
                      for n, v in item.items()}
            for group in cls.ANY_OF:
                if not any(g in item for g in group):
                    self.fail(kp, f"needs at least one of: {', '.join(group)}", ident)
            for group in cls.ONE_OF:
                if sum(g in item for g in group) != 1:
                    self.fail(kp, f"needs exactly one of: {', '.join(group)}", ident)
            obj = cls(**kwargs)
            if obj.id in seen:
                self.fail((*kp, "id"), f"duplicate id {obj.id!r} (also {section}[{seen[obj.id]}])",
                          ident)
            seen[obj.id] = i
            self.semantic(obj, kp)
            out.append(obj)
        return out

    def semantic(self, obj: Any, kp: tuple[Any, ...]) -> None:
        """Cross-field rules the per-key constraints cannot state: the kind's own
        (:meth:`Criterion.problems`), then those of every criterion."""
        for sub, msg in (obj.problems() if isinstance(obj, Criterion) else []):
            self.fail((*kp, *sub), msg, obj.id)
        if isinstance(obj, Criterion) and not obj.id.strip():
            self.fail((*kp, "id"), "must not be empty")
        if isinstance(obj, Criterion) and obj.backends is not None:
            for j, b in enumerate(obj.backends):
                if not b.strip():
                    self.fail((*kp, "backends", j), "must not be empty (a backend name "
                              "such as 'torch_xla', matched with the refrun.backend tag)",
                              obj.id)

    # --- values -------------------------------------------------------------------
    def value(self, val: Any, f: dataclasses.Field[Any], tp: Any, kp: tuple[Any, ...],
              ident: str | None = None) -> Any:
        inner, _optional = split_optional(tp)
        meta = f.metadata
        origin = typing.get_origin(inner)
        if origin is list and typing.get_args(inner)[0] in (int, float):
            item = typing.get_args(inner)[0]
            if not isinstance(val, list):
                self.fail(kp, f"expected an array of numbers, got {_show(val)}", ident)
            if meta.get("min_items") and len(val) < meta["min_items"]:
                self.fail(kp, f"needs at least {meta['min_items']} item(s)", ident)
            return [self._scalar(x, item, meta, (*kp, j), ident) for j, x in enumerate(val)]
        if origin is list:
            if not isinstance(val, list) or not all(isinstance(x, str) for x in val):
                self.fail(kp, f"expected an array of strings, got {_show(val)}", ident)
            if meta.get("min_items") and len(val) < meta["min_items"]:
                self.fail(kp, f"needs at least {meta['min_items']} item(s)", ident)
            return [self.name(x, meta, (*kp, j), ident) for j, x in enumerate(val)]
        if origin is dict and typing.get_args(inner)[1] is str:
            if not isinstance(val, dict):
                self.fail(kp, f"expected a table of strings, got {_tname(val)}", ident)
            for k, x in val.items():
                if not isinstance(x, str):
                    self.fail((*kp, k), f"expected a string, got {_show(x)}", ident)
            return dict(val)
        if origin is dict and dataclasses.is_dataclass(typing.get_args(inner)[1]):
            if not isinstance(val, dict):
                self.fail(kp, f"expected a table of tables, got {_tname(val)}", ident)
            return {self.name(k, meta, (*kp, k), ident):
                    self.table(x, typing.get_args(inner)[1], (*kp, k), ident)
                    for k, x in val.items()}
        if origin is dict:
            if not isinstance(val, dict):
                self.fail(kp, f"expected a table of numbers, got {_tname(val)}", ident)
            out = {}
            for k, x in val.items():
                out[self.name(k, meta, (*kp, k), ident)] = self._scalar(x, float, meta,
                                                                       (*kp, k), ident)
            return out
        if dataclasses.is_dataclass(inner):
            return self.table(val, inner, kp)  # type: ignore[arg-type]
        return self._scalar(val, inner, meta, kp, ident)

    def name(self, val: str, meta: Any, kp: tuple[Any, ...], ident: str | None) -> str:
        """An identity name (meta ``names``) normalised, or a located error."""
        normalize = {"backend": identity.normalize_backend,
                     "hardware": identity.normalize_hardware}.get(meta.get("names") or "")
        try:
            # An empty name is reported by ``semantic`` (with what the key is for).
            return normalize(val, format_path(kp)) if normalize and val.strip() else val
        except RefrunInputError as exc:
            self.fail(kp, str(exc).split(": ", 1)[1], ident)
            raise  # unreachable: fail raises

    def _scalar(self, val: Any, tp: Any, meta: Any, kp: tuple[Any, ...],
                ident: str | None) -> Any:
        if tp is bool:
            if not isinstance(val, bool):
                self.fail(kp, f"expected true or false, got {_show(val)}", ident)
            return val
        if tp is str:
            if not isinstance(val, str):
                self.fail(kp, f"expected a string, got {_show(val)}", ident)
            if meta.get("enum") and val not in meta["enum"]:
                self.fail(kp, f"{val!r} is not one of: {', '.join(meta['enum'])}", ident)
            if meta.get("names"):
                # A name list in one string ("jax,torch"): each part is an identity name,
                # so a typo fails here instead of being carried as provenance.
                return ",".join(self.name(part.strip(), meta, kp, ident)
                                for part in val.split(",")) if val.strip() else val
            return val
        if tp is int:
            if isinstance(val, bool) or not isinstance(val, int):
                self.fail(kp, f"expected an integer, got {_show(val)}", ident)
        elif tp is float:
            if isinstance(val, bool) or not isinstance(val, int | float):
                self.fail(kp, f"expected a number, got {_show(val)}", ident)
            if val != val or val in (float("inf"), float("-inf")):
                self.fail(kp, f"must be a finite number, got {val}", ident)
            val = float(val)
        else:  # pragma: no cover - the model only uses the types above
            raise TypeError(tp)
        if meta.get("ge") is not None and val < meta["ge"]:
            self.fail(kp, f"must be >= {meta['ge']:g}, got {val}", ident)
        if meta.get("gt") is not None and val <= meta["gt"]:
            self.fail(kp, f"must be > {meta['gt']:g}, got {val}", ident)
        if meta.get("le") is not None and val > meta["le"]:
            self.fail(kp, f"must be <= {meta['le']:g}, got {val}", ident)
        return val


def _tname(v: Any) -> str:
    return {dict: "a table", list: "an array", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number"}.get(type(v), type(v).__name__)


def _show(v: Any) -> str:
    return f"{_tname(v)} {v!r}" if not isinstance(v, dict | list) else _tname(v)


def format_path(kp: tuple[Any, ...]) -> str:
    """``('criteria', 2, 'abs_tol')`` -> ``criteria[2].abs_tol``."""
    out = ""
    for part in kp:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


_HEADER = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?")


def locate(lines: list[str], kp: tuple[Any, ...]) -> int | None:
    """Best-effort 1-based line of a key path in the TOML text (None when not found).

    Finds the ``[table]`` or n-th ``[[array]]`` header, then the ``key = ...`` line in that
    table; dotted keys and inline tables fall back to the enclosing table's header line.
    """
    parts = list(kp)
    start, header_line = 0, None
    if len(parts) >= 2 and isinstance(parts[1], int):
        seen = -1
        for i, ln in enumerate(lines):
            m = _HEADER.match(ln)
            if m and ln.lstrip().startswith("[[") and m.group(1) == parts[0]:
                seen += 1
                if seen == parts[1]:
                    start, header_line = i + 1, i + 1
                    break
        else:
            return None
        parts = parts[2:]
    else:
        for n in range(len(parts) - 1, 0, -1):
            name = ".".join(str(p) for p in parts[:n])
            hit = next((i for i, ln in enumerate(lines)
                        if (m := _HEADER.match(ln)) and m.group(1) == name), None)
            if hit is not None:
                start, header_line, parts = hit + 1, hit + 1, parts[n:]
                break
    if not parts:
        return header_line
    pat = re.compile(rf'^\s*["\']?{re.escape(str(parts[0]))}["\']?\s*=')
    for j in range(start, len(lines)):
        if _HEADER.match(lines[j]):
            break
        if pat.match(lines[j]):
            return j + 1
    return header_line
