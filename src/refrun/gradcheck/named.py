"""Named parameters: flattening PyTorch modules, dicts and JAX pytrees to ``name -> array``.

Every gradient comparison in :mod:`refrun.gradcheck` is made by parameter *name*, never by
position, so two differently structured trees can never be compared element by element
by accident.  Names are dotted paths: ``{"fc1": {"kernel": a}}`` -> ``fc1.kernel``,
``[a, b]`` -> ``0``, ``1``; an ``nn.Module`` uses its own ``named_parameters()`` names;
a bare array is called ``root`` (default ``"params"``).

Nothing here imports torch or jax: a framework is only recognised when the process has
imported it already (it must have, to create the arrays).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from refrun.errors import RefrunInputError

Named = dict[str, np.ndarray]


def _torch() -> Any:
    return sys.modules.get("torch")


def _jax() -> Any:
    return sys.modules.get("jax")


def is_torch_leaf(x: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def is_torch_module(x: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.nn.Module)


def is_jax_leaf(x: Any) -> bool:
    jax = _jax()
    return jax is not None and isinstance(x, jax.Array)


def framework_of(tree: Any) -> str:
    """``"torch"``, ``"jax"`` or ``"numpy"``: the framework of the first array leaf found."""
    if is_torch_module(tree) or is_torch_leaf(tree):
        return "torch"
    if is_jax_leaf(tree):
        return "jax"
    if isinstance(tree, Mapping):
        children: list[Any] = list(tree.values())
    elif isinstance(tree, list | tuple):
        children = list(tree)
    else:
        return "numpy"
    for child in children:
        fw = framework_of(child)
        if fw != "numpy":
            return fw
    return "numpy"


def flatten(tree: Any, root: str = "params") -> dict[str, Any]:
    """``name -> leaf`` for a module, nested dict/list/tuple or bare array (leaves unchanged).

    Custom JAX pytree nodes (flax, equinox ...) are named from their key paths.
    """
    if is_torch_module(tree):
        return dict(tree.named_parameters())
    out: dict[str, Any] = {}
    _flatten_into(tree, "", out, root)
    return out


def _flatten_into(tree: Any, prefix: str, out: dict[str, Any], root: str) -> None:
    if _numeric_list(tree):
        out[prefix or root] = tree
        return
    if isinstance(tree, Mapping):
        items: list[tuple[str, Any]] = [(str(k), v) for k, v in tree.items()]
    elif isinstance(tree, list | tuple) and not _is_namedtuple(tree):
        items = [(str(i), v) for i, v in enumerate(tree)]
    elif _is_custom_jax_node(tree):
        for name, leaf in _jax_named_leaves(tree):
            out[_join(prefix, name) or root] = leaf
        return
    else:
        out[prefix or root] = tree
        return
    for key, child in items:
        _flatten_into(child, _join(prefix, key), out, root)


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _numeric_list(x: Any) -> bool:
    # [1.0, 2.0] or [[1, 2], [3, 4]] is one array literal, not a tree of scalar leaves
    if not isinstance(x, list | tuple) or not x or _is_namedtuple(x):
        return False
    return all((isinstance(v, int | float) and not isinstance(v, bool)) or _numeric_list(v)
               for v in x)


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def _is_custom_jax_node(x: Any) -> bool:
    jax = _jax()
    if jax is None or is_jax_leaf(x) or isinstance(x, np.ndarray | float | int | complex):
        return False
    leaves = jax.tree_util.tree_leaves(x)
    return bool(leaves) and not (len(leaves) == 1 and leaves[0] is x)


def _jax_named_leaves(tree: Any) -> list[tuple[str, Any]]:
    jax = _jax()
    pairs, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(".".join(_key_name(k) for k in path), leaf) for path, leaf in pairs]


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def unflatten(template: Any, named: Mapping[str, Any], root: str = "params") -> Any:
    """Rebuild ``template``'s structure (dict/list/tuple/leaf) with the leaves of ``named``."""
    return _rebuild(template, "", named, root)


def _rebuild(tree: Any, prefix: str, named: Mapping[str, Any], root: str) -> Any:
    if _numeric_list(tree):
        return named[prefix or root]
    if isinstance(tree, Mapping):
        return {k: _rebuild(v, _join(prefix, str(k)), named, root) for k, v in tree.items()}
    if _is_namedtuple(tree):
        return type(tree)(*[_rebuild(v, _join(prefix, str(i)), named, root)
                            for i, v in enumerate(tree)])
    if isinstance(tree, list | tuple):
        return type(tree)(_rebuild(v, _join(prefix, str(i)), named, root)
                          for i, v in enumerate(tree))
    if _is_custom_jax_node(tree):
        jax = _jax()
        pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
        leaves = [named[_join(prefix, ".".join(_key_name(k) for k in p)) or root]
                  for p, _ in pairs]
        return jax.tree_util.tree_unflatten(treedef, leaves)
    return named[prefix or root]


def to_numpy(leaf: Any) -> np.ndarray:
    """A host copy of one array leaf (torch tensors are detached; bfloat16 widened)."""
    if is_torch_leaf(leaf):
        t = leaf.detach().cpu()
        if t.dtype == _torch().bfloat16:
            t = t.float()
        return t.numpy().copy()
    arr = np.asarray(leaf)
    if arr.dtype.kind not in "fciub":
        arr = arr.astype(np.float32)  # ml_dtypes (bfloat16 ...) from JAX
    return np.array(arr, copy=True)


def to_named_numpy(tree: Any, root: str = "params") -> Named:
    """``flatten`` followed by :func:`to_numpy` on every leaf."""
    return {k: to_numpy(v) for k, v in flatten(tree, root).items()}


def check_same_names(expected: Mapping[str, Any], given: Mapping[str, Any], what: str) -> None:
    """Raise :class:`RefrunInputError` naming the first missing or unknown name."""
    missing = [k for k in expected if k not in given]
    extra = [k for k in given if k not in expected]
    if missing:
        raise RefrunInputError(f"{what}: no value for parameter {missing[0]!r}")
    if extra:
        raise RefrunInputError(f"{what}: unknown parameter {extra[0]!r} "
                               f"(parameters are {', '.join(sorted(expected))})")


def map_leaves(fn: Callable[[str, Any], Any], named: Mapping[str, Any]) -> dict[str, Any]:
    """``{name: fn(name, leaf)}``."""
    return {k: fn(k, v) for k, v in named.items()}
