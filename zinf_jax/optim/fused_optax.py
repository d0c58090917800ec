"""Any optax transform inside the compiled step, for optimizer state kept in device memory.

:class:`~zinf_jax.optim.fused.FusedAdam` runs zinf's Adam inside the step's one XLA program when params
and optimizer state are in device memory; with an optax transform it runs the transform there instead
(:func:`optax_update`), as plain FSDP in JAX does: each parameter's global flat master and tier states
are viewed in the parameter's own shape, the transform updates a one-leaf tree at the parameter's path
(the same tree the host path hands it, so masks and labels see the same thing), and the results go back
to the same flat arrays. Element-wise and whole-tensor transforms alike (the program holds whole
tensors); the state keeps the host path's storage (:mod:`~zinf_jax.optim.optax_rule`), so checkpoints,
restores and a streamed step read and write it exactly as before: states shaped like the parameter as
the tier's flat shards, scalar leaves (step counts) and leaves of other shapes (Adafactor's factored
moments) as extra replicated program inputs and outputs, kept with the optimizer's metadata between
steps.

The global-norm clip at the head of a chain is taken out of the transform's hands as on the host
(:func:`~zinf_jax.optim.optax_rule.leading_global_clip`); its norm is summed in float32 in the program.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from zinf_jax.optim.optax_probe import leaf, nest
from zinf_jax.plan.partition import ParamLayout, from_stored, to_stored

__all__ = ["to_flat", "from_flat", "Shape", "whole_shape", "optax_update", "small_leaves"]


@dataclasses.dataclass(frozen=True)
class Shape:
    """The transform's state for one parameter at its own shape: leaf kinds (``"elem"``, ``"scalar"``,
    ``"odd"``), dtypes and tree structure."""

    keys: tuple[str, ...]
    treedef: Any
    kinds: tuple[str, ...]
    dtypes: tuple[Any, ...]


def to_flat(lay: ParamLayout, x: jax.Array) -> jax.Array:
    """A stored-form array as the optimizer's flat form: shard ``i``'s elements, row-major, at ``i * numel``."""
    if lay.dim is None or lay.kind == "flat":
        return x.reshape(-1)
    s, d, n = lay.stored_shape, lay.dim, lay.num_shards
    x = x.reshape(*s[:d], n, s[d] // n, *s[d + 1:])
    return jnp.moveaxis(x, d, 0).reshape(-1)


def from_flat(lay: ParamLayout, x: jax.Array) -> jax.Array:
    """Inverse of :func:`to_flat`."""
    if lay.dim is None or lay.kind == "flat":
        return x.reshape(lay.stored_shape)
    s, d, n = lay.stored_shape, lay.dim, lay.num_shards
    x = x.reshape(n, *lay.shard_shape)
    return jnp.moveaxis(x, 0, d).reshape(s)


def whole_shape(rule: Any, path: str, layout: ParamLayout) -> Shape:
    """:class:`Shape` of the state of ``rule``'s transform for ``path`` at the parameter's own shape (the leaf
    kinds as the rule stores them: a chunk's leaves are in the same order)."""
    keys = tuple(path.split("/"))
    state = jax.eval_shape(rule.tx.init, nest(keys, jax.ShapeDtypeStruct(tuple(layout.shape), jnp.float32)))
    leaves, treedef = jax.tree.flatten(state)
    return Shape(keys, treedef, tuple(rule._info[path].kinds), tuple(x.dtype for x in leaves))


def _real(lay: ParamLayout, x: jax.Array) -> jax.Array:
    """A global flat array (shard ``i`` at ``i * numel``, :func:`~zinf_jax.optim.fused.to_flat`) in the
    parameter's own shape."""
    return from_stored(lay, from_flat(lay, x))


def _flat(lay: ParamLayout, y: jax.Array) -> jax.Array:
    """Inverse of :func:`_real`."""
    return to_flat(lay, to_stored(lay, y))


def optax_update(tx: Any, clip_norm: float | None, layouts: dict[str, ParamLayout], shapes: dict[str, Shape],
                 paths: Sequence[str], grads: Sequence[jax.Array], rows: Sequence[Sequence[jax.Array]],
                 n_tier: dict[str, int]) -> tuple[list[jax.Array], list[list[jax.Array]], jax.Array, jax.Array]:
    """One optax step inside the program (traced).

    Args:
      tx: the transform.
      clip_norm: ``max_norm`` of a global-norm clip at the head of ``tx`` (applied here across every parameter).
      layouts: parameter path to layout.
      shapes: parameter path to :func:`whole_shape`.
      paths: the parameters, in the order of ``grads`` and ``rows``.
      grads: stored-form gradients.
      rows: per path: the flat master, the tier's flat states, the scalar state leaves, the other-shaped ones
        (:func:`small_leaves`; each group in the order of the state's leaves).
      n_tier: per path, how many of ``rows`` are the master and tier states.

    Returns:
      New stored-form float32 masters, new rows (the same form), the global norm and whether it was finite
      (not finite: everything as it was).
    """
    import optax

    flat_g = [to_flat(layouts[p], g.astype(jnp.float32)) for p, g in zip(paths, grads)]
    norm = jnp.sqrt(sum((jnp.sum(g * g) for g in flat_g), jnp.float32(0)))
    finite = jnp.isfinite(norm)
    mult = jnp.float32(1)
    if clip_norm is not None:
        mult = jnp.where(norm < clip_norm, jnp.float32(1), jnp.float32(clip_norm) / norm)
    mult = jnp.where(finite, mult, jnp.float32(0))
    masters, new_rows = [], []
    for path, g, row in zip(paths, flat_g, rows):
        lay, sh, n = layouts[path], shapes[path], n_tier[path]
        master, tier_states = row[0], list(row[1:n])
        n_scalar = sum(k == "scalar" for k in sh.kinds)
        scalars, odd = list(row[n:n + n_scalar]), list(row[n + n_scalar:])
        it = {"elem": iter(tier_states), "scalar": iter(scalars), "odd": iter(odd)}
        leaves = [_real(lay, next(it[k]).astype(jnp.float32)).astype(dt) if k == "elem" else next(it[k])
                  for k, dt in zip(sh.kinds, sh.dtypes)]
        params = nest(sh.keys, _real(lay, master))
        updates, new_state = tx.update(nest(sh.keys, _real(lay, g * mult)), jax.tree.unflatten(sh.treedef, leaves),
                                       params)
        new_leaves = jax.tree.leaves(new_state)
        by = {k: [x for x, kk in zip(new_leaves, sh.kinds) if kk == k] for k in ("elem", "scalar", "odd")}
        out = [_flat(lay, leaf(sh.keys, optax.apply_updates(params, updates)))]
        out += [_flat(lay, x.astype(jnp.float32)).astype(o.dtype) for x, o in zip(by["elem"], tier_states)]
        out += [x.astype(o.dtype) for x, o in zip(by["scalar"] + by["odd"], scalars + odd)]
        out = [jnp.where(finite, x, o) for x, o in zip(out, [master, *tier_states, *scalars, *odd])]
        new_rows.append(out)
        masters.append(from_flat(lay, out[0]))
    return masters, new_rows, norm, finite


def small_leaves(rule: Any, path: str) -> list[np.ndarray]:
    """The state leaves of ``path`` the rule keeps beside the tier: its scalars, then its other-shaped leaves."""
    return [*rule._scalars.get(path, []), *rule._odd.get(path, [])]
