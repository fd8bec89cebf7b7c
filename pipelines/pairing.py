"""The same-seed pair every pipeline's port declares with ``--pair`` (one definition for the
digits, markov and charlm command lines): :func:`refrun.pairing.pair_tags` with the port's
name, so that a port recorded at a platform's default precision and again at full
precision (``JAX_DEFAULT_MATMUL_PRECISION=highest``) are each other's precision twins
(docs/acceptance.md, "Reduced precision: precision twins")."""

from __future__ import annotations

from collections.abc import Iterable


def port_name(backend: str, defects: Iterable[str], devices: int) -> str:
    """The code that ran: the backend's port, its switched-on defects and its device count
    (``jax``, ``jax+bf16_matmul``, ``jax+clip_per_device x4``); never the precision, which
    is what twins differ in."""
    name = "+".join([backend, *sorted(defects)])
    return name if devices == 1 else f"{name} x{devices}"


def declare(variant: str, seed: int, known_good: str | None, backend: str,
            defects: Iterable[str], devices: int) -> dict[str, str]:
    """The ``refrun.pair.*`` tags of a port of reference seed ``seed``; {} with a refrun
    that has no same-seed pairs, and without the port's name with one that has no
    precision twins (the pipelines also run against older refrun versions)."""
    try:
        from refrun.pairing import pair_tags
    except ImportError:  # a refrun before same-seed pairs: record the run undeclared
        print(f"[{variant}] this refrun cannot declare a same-seed pair "
              "(no refrun.pairing): recorded without", flush=True)
        return {}
    try:
        return pair_tags(seed=seed, known_good=known_good,
                         port=port_name(backend, defects, devices))
    except TypeError:  # a refrun before precision twins: no port
        return pair_tags(seed=seed, known_good=known_good)
