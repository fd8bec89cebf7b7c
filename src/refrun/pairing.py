"""Declaring a same-seed pair at ``start_run``: the tags a port (or a rerun) of one
reference seed carries so that a ``paired`` criterion compares it with that seed's run
step by step (docs/acceptance.md, "Same-seed paired comparison").

```python
import refrun
from refrun.pairing import pair_tags

with refrun.start_run("digits-mlp", "candidate", backend="jax", seed=3,
                      tags=pair_tags(seed=3)) as run:   # same init and data order as seed 3
    ...
```

A rerun of the reference code with a declared numerical perturbation (known-good
evidence for ``refrun calibrate``) adds ``known_good="why it is benign"``.
"""

from __future__ import annotations

from refrun import schema
from refrun.errors import RefrunInputError


def pair_tags(seed: int, *, reference: str | None = None, known_good: str | None = None
              ) -> dict[str, str]:
    """The ``refrun.pair.*`` tags of a run that starts from the same initial weights and
    the same data order as reference seed ``seed``.

    ``reference``: the reference run id, when known (otherwise the reference run of the
    same workload with ``refrun.seed = seed`` is looked up).  ``known_good``: a non-empty
    sentence saying why this pair is numerically benign (a rerun of the reference with a
    declared perturbation such as a changed summation order, or a port accepted before);
    such a run is evidence for calibrating the paired tolerance, never a seed.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise RefrunInputError(f"pair_tags: seed must be an integer, got {seed!r}")
    tags = {schema.TAG_PAIR_SEED: str(seed)}
    if reference is not None:
        if not isinstance(reference, str) or not reference.strip():
            raise RefrunInputError("pair_tags: reference must be a run id")
        tags[schema.TAG_PAIR_REFERENCE] = reference.strip()
    if known_good is not None:
        if not isinstance(known_good, str) or not known_good.strip():
            raise RefrunInputError("pair_tags: known_good must say why the pair is benign "
                                   "(e.g. 'rerun with the summation order reversed')")
        tags[schema.TAG_PAIR_KNOWN_GOOD] = known_good.strip()
    return tags


def declares_pair(tags: dict[str, str]) -> bool:
    """Whether a run's tags declare a same-seed pair."""
    return bool(tags.get(schema.TAG_PAIR_SEED, "").strip()
                or tags.get(schema.TAG_PAIR_REFERENCE, "").strip())


def is_known_good(tags: dict[str, str]) -> bool:
    """Whether a run is declared known-good pair evidence."""
    return bool(tags.get(schema.TAG_PAIR_KNOWN_GOOD, "").strip()) and declares_pair(tags)
