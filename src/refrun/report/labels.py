"""Labels that tell the candidates of a sweep apart on one page.

Eight candidates named ``jax seed 0`` read the same in a matrix.  Each candidate is
labelled by its run name followed by the params and tags in which the candidates differ
from each other, e.g. ``jax seed 0 · lr=0.002``: the user's own first (what they varied:
their variant tag, a learning rate), refrun's infrastructure tags (backend, devices,
versions) last, since a sweep differs in those by accident as often as by intent.
Considered: every param, every tag outside MLflow's and refrun's namespaces (the user's
own), and refrun's identity tags (:data:`refrun.schema.LABEL_TAGS`, framework versions,
the numerics settings such as ``numerics.jax.matmul_precision``); never per-run
bookkeeping (step counts, local ids), which differs between any two runs.  A key one candidate lacks
counts as differing (shown as ``key=—``).  Labels that are still equal get the run id's
first 8 characters, so every label is distinct.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from refrun import schema

MISSING = "—"
MAX_VALUE = 40  # characters of a value shown in a label
MAX_KEYS = 4  # differing keys shown per label (the rest: "+N more")


@dataclass(frozen=True)
class Labelled:
    """What a label is made of: run id, run name and the properties that tell it apart."""

    run_id: str
    name: str
    properties: dict[str, str]


def _labelling_tag(key: str) -> bool:
    if key in schema.LABEL_TAGS or key.startswith(schema.LABEL_TAG_PREFIXES) \
            or key in schema.NUMERICS_SETTING_TAGS:
        return True
    return not key.startswith((schema.PREFIX, "mlflow."))


def properties(params: Mapping[str, str], tags: Mapping[str, str]) -> dict[str, str]:
    """The params and tags a label may use: ``param`` keys as they are, tags shortened
    (``refrun.`` dropped)."""
    out = {k: str(v) for k, v in params.items()}
    for k, v in tags.items():
        if _labelling_tag(k):
            short = k[len(schema.PREFIX):] if k.startswith(schema.PREFIX) else k
            out.setdefault(short, str(v))
    return out


def infrastructure(key: str) -> bool:
    """A key refrun recorded about where and how the run executed (an identity tag such as
    ``backend`` or ``exec.devices``, a framework version), as :func:`properties` shortens
    it: not one the user chose."""
    identity = {t[len(schema.PREFIX):] for t in schema.LABEL_TAGS}
    prefixes = tuple(p[len(schema.PREFIX):] for p in schema.LABEL_TAG_PREFIXES)
    return key in identity or key.startswith(prefixes)


def differing(props: Sequence[Mapping[str, str]]) -> list[str]:
    """Keys whose value is not the same in every mapping (missing counts as a value): the
    user's own params and tags first (what they varied, e.g. their variant tag), then
    refrun's infrastructure tags; each part in alphabetical order."""
    keys = sorted({k for p in props for k in p})
    diff = [k for k in keys if len({p.get(k, MISSING) for p in props}) > 1]
    return sorted(diff, key=lambda k: (infrastructure(k), k))


def _short(v: str) -> str:
    v = " ".join(v.split())
    return v if len(v) <= MAX_VALUE else v[:MAX_VALUE - 1] + "…"


def distinct_labels(runs: Sequence[Labelled]) -> list[str]:
    """One distinct label per run: ``name · k=v, k=v`` with the keys that differ."""
    keys = differing([r.properties for r in runs]) if len(runs) > 1 else []
    labels = []
    for r in runs:
        shown = [f"{k}={_short(r.properties.get(k, MISSING))}" for k in keys[:MAX_KEYS]]
        if len(keys) > MAX_KEYS:
            shown.append(f"+{len(keys) - MAX_KEYS} more")
        labels.append(f"{r.name} · {', '.join(shown)}" if shown else r.name)
    counts: dict[str, int] = {}
    for lab in labels:
        counts[lab] = counts.get(lab, 0) + 1
    return [f"{lab} ({r.run_id[:8]})" if counts[lab] > 1 else lab
            for lab, r in zip(labels, runs, strict=True)]
