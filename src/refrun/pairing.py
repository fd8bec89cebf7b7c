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
evidence for ``refrun calibrate``) adds ``known_good="why it is benign"``.  ``port="NAME"``
names the code that ran: runs of the same port and pair whose numerics configuration
differs (a TPU's default matmul precision, and ``highest``) are precision twins, which
tell a platform's reduced precision from a port defect (docs/acceptance.md, "Reduced
precision: precision twins").
"""

from __future__ import annotations

import re

from refrun import schema
from refrun.errors import RefrunInputError

# A port's name goes into a store search filter: no quotes, no backslashes.
PORT_NAME = re.compile(r"[A-Za-z0-9._+\-:/][A-Za-z0-9._+\-:/ ]{0,99}")


def pair_tags(seed: int, *, reference: str | None = None, known_good: str | None = None,
              port: str | None = None) -> dict[str, str]:
    """The ``refrun.pair.*`` tags of a run that starts from the same initial weights and
    the same data order as reference seed ``seed``.

    ``reference``: the reference run id, when known (otherwise the reference run of the
    same workload with ``refrun.seed = seed`` is looked up).  ``known_good``: a non-empty
    sentence saying why this pair is numerically benign (a rerun of the reference with a
    declared perturbation such as a changed summation order, or a port accepted before);
    such a run is evidence for calibrating the paired tolerance, never a seed.  ``port``:
    the name of the code that ran (e.g. ``"gru-jax"``; letters, digits and ``._+-:/ ``):
    a run of the same pair and port at full precision is this run's precision twin when
    this one ran at a platform's reduced default (:mod:`refrun.acceptance.precision`).
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
    if port is not None:
        if not isinstance(port, str) or not PORT_NAME.fullmatch(port.strip()):
            raise RefrunInputError(f"pair_tags: port must name the code that ran (letters, "
                                   f"digits and ._+-:/ or spaces, at most 100), got {port!r}")
        tags[schema.TAG_PAIR_PORT] = port.strip()
    return tags


def declares_pair(tags: dict[str, str]) -> bool:
    """Whether a run's tags declare a same-seed pair."""
    return bool(tags.get(schema.TAG_PAIR_SEED, "").strip()
                or tags.get(schema.TAG_PAIR_REFERENCE, "").strip())


def is_known_good(tags: dict[str, str]) -> bool:
    """Whether a run is declared known-good pair evidence."""
    return bool(tags.get(schema.TAG_PAIR_KNOWN_GOOD, "").strip()) and declares_pair(tags)
