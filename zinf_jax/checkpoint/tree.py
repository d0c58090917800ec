"""How the training state maps onto orbax trees: one array per (state, parameter), in the parameter's own shape.

A checkpoint stores every state of a parameter (``"master"``, ``"m"``, ``"v"``...) as one global
float32 array in the parameter's own shape and sharding (a flat-padded one replicated), nested
by its path (``{"master": {"blocks": {"3": {"mlp": {"kernel": ...}}}}}``), so plain orbax reads it
on any device count. Shared by :mod:`~zinf_jax.checkpoint.save` and :mod:`~zinf_jax.checkpoint.restore`.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec as P

from zinf_jax.checkpoint.state import TrainingState
from zinf_jax.plan.partition import ParamLayout, assemble, from_stored

__all__ = ["signature", "nest", "flatten", "sharding_of", "global_state", "rng_tree", "host_value"]


def signature(view: TrainingState) -> dict[str, list]:
    """The parameter table a checkpoint is matched by: path -> [shape, dtype]."""
    return {p: [list(l.shape), l.dtype] for p, l in view.layouts.items()}


def nest(flat: Mapping[str, Any]) -> dict:
    """``{"a/b": x}`` -> ``{"a": {"b": x}}``."""
    return traverse_util.unflatten_dict({tuple(k.split("/")): v for k, v in flat.items()})


def flatten(tree: Mapping) -> dict[str, Any]:
    """``{"a": {"b": x}}`` -> ``{"a/b": x}``."""
    return {"/".join(k): v for k, v in traverse_util.flatten_dict(tree).items()}


def sharding_of(view: TrainingState, lay: ParamLayout) -> NamedSharding:
    """How a parameter is written: its own sharding, or replicated when it is ``flat`` (no dimension divides)."""
    return NamedSharding(view.mesh, P() if lay.kind == "flat" else lay.spec)


def global_state(view: TrainingState, path: str, which: str) -> jax.Array:
    """One state of one parameter as a global array in its own shape."""
    lay = view.layouts[path]
    stored = assemble(lay, view.mesh, {i: view.read(path, i, which) for i in view.local_indices(path)})
    if lay.kind != "flat":
        return stored
    return jax.jit(lambda s: from_stored(lay, s), out_shardings=sharding_of(view, lay))(stored)


def rng_tree(view: TrainingState) -> dict[str, Any]:
    """The model's non-parameter state as a flat tree of arrays (typed PRNG keys as their key data)."""
    leaves = jax.tree.leaves(view.model_state)
    return {f"leaf_{i:04d}": jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
            for i, x in enumerate(leaves)}


def host_value(x: Any) -> np.ndarray:
    """A replicated array's value (of this process's first device: no cross-process fetch)."""
    return np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x)
