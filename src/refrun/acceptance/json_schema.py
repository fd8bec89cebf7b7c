"""The JSON Schema of criteria files, derived from the typed model in
:mod:`refrun.acceptance.criteria` and shipped as ``refrun/schemas/criteria.schema.json``.

Editors and CI tools can validate a criteria file (TOML parsed to JSON) with it; refrun
itself validates with the typed model, which gives located messages.  A test checks that
the shipped file equals :func:`criteria_schema` so the two never drift apart.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from importlib import resources
from pathlib import Path
from typing import Any

from refrun.acceptance.criteria import (
    CRITERION_KINDS,
    SECTIONS,
    STOP_KINDS,
    CriteriaFile,
    model_fields,
    split_optional,
    type_hints,
)

SCHEMA_ID = "https://refrun.dev/schemas/criteria.schema.json"
SCHEMA_RESOURCE = "schemas/criteria.schema.json"


def _value_schema(tp: Any, meta: Any) -> dict[str, Any]:
    inner, optional = split_optional(tp)
    origin = typing.get_origin(inner)
    out: dict[str, Any]
    if origin is list:
        item = typing.get_args(inner)[0]
        items: dict[str, Any] = {"type": {int: "integer", float: "number"}.get(item, "string")}
        if item in (int, float):
            _bounds(items, meta)
        out = {"type": "array", "items": items}
        if meta.get("min_items"):
            out["minItems"] = meta["min_items"]
    elif origin is dict and dataclasses.is_dataclass(typing.get_args(inner)[1]):
        out = {"type": "object",
               "additionalProperties": _object_schema(typing.get_args(inner)[1])}
    elif origin is dict:
        if typing.get_args(inner)[1] is str:
            out = {"type": "object", "additionalProperties": {"type": "string"}}
        else:
            num: dict[str, Any] = {"type": "number"}
            _bounds(num, meta)
            out = {"type": "object", "additionalProperties": num}
    elif dataclasses.is_dataclass(inner):
        out = _object_schema(inner)  # type: ignore[arg-type]
    else:
        out = {"type": {bool: "boolean", str: "string", int: "integer",
                        float: "number"}[inner]}
        if meta.get("enum"):
            out["enum"] = list(meta["enum"])
        _bounds(out, meta)
    if meta.get("doc"):
        out["description"] = meta["doc"]
    del optional  # None is expressed by leaving the key out of the TOML table
    return out


def _bounds(out: dict[str, Any], meta: Any) -> None:
    if meta.get("ge") is not None:
        out["minimum"] = meta["ge"]
    if meta.get("gt") is not None:
        out["exclusiveMinimum"] = meta["gt"]
    if meta.get("le") is not None:
        out["maximum"] = meta["le"]


def _object_schema(cls: type, kind: str | None = None) -> dict[str, Any]:
    hints = type_hints(cls)
    props: dict[str, Any] = {}
    required: list[str] = []
    for f in model_fields(cls):
        if f.name == "kind" and kind is not None:
            props["kind"] = {"const": kind, "description": f.metadata["doc"]}
        else:
            props[f.name] = _value_schema(hints[f.name], f.metadata)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(f.name)
    out: dict[str, Any] = {"type": "object", "properties": props,
                           "additionalProperties": False}
    if required:
        out["required"] = required
    doc = getattr(cls, "DOC", "") or (cls.__doc__ or "").strip().splitlines()[0]
    if doc:
        out["description"] = doc
    groups = [{"anyOf": [{"required": [k]} for k in g]} for g in getattr(cls, "ANY_OF", ())]
    groups += [{"oneOf": [{"required": [k]} for k in g]} for g in getattr(cls, "ONE_OF", ())]
    if groups:
        out["allOf"] = groups
    return out


def criteria_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a criteria file, built from the typed model."""
    top = _object_schema(CriteriaFile)
    defs = {f"criterion.{k}": _object_schema(c, k) for k, c in CRITERION_KINDS.items()}
    defs.update({f"stopping.{k}": _object_schema(c, k) for k, c in STOP_KINDS.items()})
    top["properties"]["criteria"] = {
        "type": "array", "description": top["properties"]["criteria"].get("description", ""),
        "items": {"oneOf": [{"$ref": f"#/$defs/criterion.{k}"} for k in CRITERION_KINDS]},
    }
    top["properties"]["stopping"] = {
        "type": "array", "description": top["properties"]["stopping"].get("description", ""),
        "items": {"oneOf": [{"$ref": f"#/$defs/stopping.{k}"} for k in STOP_KINDS]},
    }
    for name in SECTIONS:
        top["properties"][name].pop("required", None)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": SCHEMA_ID,
            "title": "refrun criteria file", **top, "$defs": defs}


def schema_text() -> str:
    """The canonical text of the shipped schema file."""
    return json.dumps(criteria_schema(), indent=2, sort_keys=True) + "\n"


def shipped_schema_path() -> Path:
    """Path of the schema file shipped inside the package."""
    return Path(str(resources.files("refrun").joinpath(SCHEMA_RESOURCE)))


def write_schema(path: str | Path | None = None) -> Path:
    """Regenerate the shipped schema file (run after changing the model)."""
    p = Path(path) if path else shipped_schema_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(schema_text(), encoding="utf-8")
    return p


if __name__ == "__main__":  # python -m refrun.acceptance.json_schema
    print(write_schema())
