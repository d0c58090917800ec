"""Any optax transform inside the compiled step, for optimizer state kept in device memory.

:class:`~zinf_jax.optim.fused.FusedAdam` runs zinf's Adam inside the step's one XLA program when params
and optimizer state are in device memory; with an optax transform it runs the transform there instead
(:func:`optax_update`), as plain FSDP in JAX does: each parameter's global flat master and tier states
are viewed in the parameter's own shape, the transform updates a one-leaf tree at the parameter's path
(the same tree the host path hands it, so masks and labels see the same thing; every parameter in one
tree for a tree-coupled transform, :meth:`~zinf_jax.optim.optax_rule.OptaxRule.apply`), and the results
go back to the same flat arrays. Element-wise and whole-tensor transforms alike (the program holds whole
tensors); the state keeps the host path's storage (:mod:`~zinf_jax.optim.optax_rule`), so checkpoints,
restores and a streamed step read and write it exactly as before: states shaped like the parameter as
the tier's flat shards, scalar leaves (step counts) and leaves of other shapes (Adafactor's factored
moments) as extra replicated program inputs and outputs, kept with the optimizer's metadata between
steps.

The global-norm clip at the head of a chain is taken out of the transform's hands as on the host
(:func:`~zinf_jax.optim.optax_rule.leading_global_clip`); its norm is summed in float32 in the program.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from zinf_jax.optim.state_moves import Resident
from zinf_jax.plan.partition import ParamLayout, from_stored, to_stored

__all__ = ["to_flat", "from_flat", "optax_update", "small_leaves"]


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


def _real(lay: ParamLayout, x: jax.Array) -> jax.Array:
    """A global flat array (shard ``i`` at ``i * numel``, :func:`~zinf_jax.optim.fused.to_flat`) in the
    parameter's own shape."""
    return from_stored(lay, from_flat(lay, x))


def _flat(lay: ParamLayout, y: jax.Array) -> jax.Array:
    """Inverse of :func:`_real`."""
    return to_flat(lay, to_stored(lay, y))


def optax_update(rule: Any, layouts: dict[str, ParamLayout], paths: Sequence[str], grads: Sequence[jax.Array],
                 rows: Sequence[Sequence[jax.Array]], n_tier: dict[str, int], value: jax.Array | None,
                 value_fn: Any = None, moves: Any = None, nbytes: dict[str, int] | None = None
                 ) -> tuple[list[jax.Array], list[list[jax.Array]], jax.Array, jax.Array]:
    """One optax step inside the program (traced).

    Args:
      rule: the :class:`~zinf_jax.optim.optax_rule.OptaxRule` (its transform, head clip and split).
      layouts: parameter path to layout.
      paths: the parameters, in the order of ``grads`` and ``rows``.
      grads: stored-form gradients.
      rows: per path: the flat master, the tier's flat states, the scalar state leaves, the other-shaped ones
        (:func:`small_leaves`; each group in the order of the state's leaves).
      n_tier: per path, how many of ``rows`` are the master and tier states.
      value: the step's loss (``value=`` of a ``GradientTransformationExtraArgs``).
      value_fn: the step's loss as a function of ``{path: param}`` in the parameters' own shapes (a line
        search's ``value_fn=``; see :meth:`~zinf_jax.optim.optax_rule.OptaxRule.apply`).
      moves: how the master and tier states come into device memory and go back
        (:mod:`~zinf_jax.optim.state_moves`; default: they are in device memory); ``nbytes``: per path, their
        bytes per device.

    Returns:
      New stored-form float32 masters, new rows (the same form), the global norm and whether it was finite
      (not finite: everything as it was).
    """
    flat_g = [to_flat(layouts[p], g.astype(jnp.float32)) for p, g in zip(paths, grads)]
    norm = jnp.sqrt(sum((jnp.sum(g * g) for g in flat_g), jnp.float32(0)))
    finite = jnp.isfinite(norm)
    mult = jnp.float32(1)
    if rule.clip_norm is not None:
        mult = jnp.where(norm < rule.clip_norm, jnp.float32(1), jnp.float32(rule.clip_norm) / norm)
    mult = jnp.where(finite, mult, jnp.float32(0))
    moves = moves or Resident()
    loss = jnp.float32(0) if value is None else value
    parts: dict[str, tuple] = {}

    def item(path: str, g: jax.Array, row: Sequence[jax.Array]) -> tuple:
        lay, n = layouts[path], n_tier[path]
        n_scalar = len(rule._scalars.get(path, []))
        moved = moves.into(path, row[:n], (nbytes or {}).get(path, 0))
        parts[path] = (moved[0], moved[1:], list(row[n:n + n_scalar]), list(row[n + n_scalar:]))
        master, tier_states, scalars, odd = parts[path]
        leaves = rule.leaves(path, tier_states, scalars, odd, lambda x: _real(lay, x.astype(jnp.float32)))
        return _real(lay, master), _real(lay, g * mult), leaves

    def result(path: str, new_p: jax.Array, new: Sequence[jax.Array]) -> list[jax.Array]:
        lay, n = layouts[path], n_tier[path]
        master, tier_states, scalars, odd = parts[path]
        by = rule.split_kinds(path, new)
        res = [_flat(lay, new_p)]
        res += [_flat(lay, x.astype(jnp.float32)).astype(o.dtype) for x, o in zip(by["elem"], tier_states)]
        res += [x.astype(o.dtype) for x, o in zip(by["scalar"] + by["odd"], scalars + odd)]
        res = [jnp.where(finite, x, o) for x, o in zip(res, [master, *tier_states, *scalars, *odd])]
        return [*moves.out(path, res[:n]), *res[n:]], res[0]

    out: dict[str, tuple] = {}
    if rule.tree is not None:  # every parameter in one update: every state in device memory at once
        out = rule.apply({p: item(p, g, row) for p, g, row in zip(paths, flat_g, rows)}, loss, value_fn)
        done = {p: result(p, *out[p]) for p in paths}
    else:  # one parameter at a time, each moved in as the window allows
        done = {}
        for path, g, row in zip(paths, flat_g, rows):
            done[path] = result(path, *rule.apply({path: item(path, g, row)}, loss, value_fn)[path])
    new_rows = [done[p][0] for p in paths]
    masters = [from_flat(layouts[p], done[p][1]) for p in paths]
    return masters, new_rows, norm, finite


def small_leaves(rule: Any, path: str) -> list[np.ndarray]:
    """The state leaves of ``path`` the rule keeps beside the tier: its scalars, then its other-shaped leaves."""
    return [*rule._scalars.get(path, []), *rule._odd.get(path, [])]
