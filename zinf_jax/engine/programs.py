"""Compiled unit programs: gather, run, and (backward) recompute + vjp.

One forward and one backward program per distinct unit signature (framework
key of the unit, method, static keyword arguments, parameter layouts): 48
identical blocks share one jitted function and therefore one compilation.

Inside a program the stored, sharded parameters are all-gathered with a
sharding constraint to replicated, padding is removed, and the unit runs. The
backward program recomputes the forward (activation checkpoint at the unit
boundary), takes the vjp with respect to float32 copies of the stored
parameters and to the floating inputs, and constrains parameter gradients back
to the stored sharding, which XLA lowers to a reduce-scatter.
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zinf_jax.sharding import ParamLayout, from_stored

__all__ = ["UnitPrograms", "UnitFn", "split_diff"]

UnitFn = Callable[[list[jax.Array], Any, Any], tuple[Any, Any]]
"""``(full_params, rest, args) -> (out, new_rest)``: a unit as a pure function."""


def split_diff(leaves: Sequence[Any]) -> list[int]:
    """Indices of the leaves that are differentiable (inexact dtypes)."""
    return [i for i, x in enumerate(leaves) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]


class UnitPrograms:
    """Cache of jitted forward/backward programs keyed by unit signature.

    Args:
      mesh: the mesh.
      compute_dtype: dtype the parameters are computed in.
    """

    def __init__(self, mesh: Mesh, compute_dtype: str):
        self.mesh = mesh
        self.compute_dtype = jnp.dtype(compute_dtype)
        self._fwd: dict[Hashable, Callable] = {}
        self._bwd: dict[Hashable, Callable] = {}

    def __len__(self) -> int:
        return len(self._fwd) + len(self._bwd)

    def _gather(self, layouts: Sequence[ParamLayout], stored: Sequence[jax.Array]) -> list[jax.Array]:
        rep = NamedSharding(self.mesh, P())
        out = []
        for lay, p in zip(layouts, stored):
            if jnp.issubdtype(p.dtype, jnp.floating):
                p = p.astype(self.compute_dtype)
            out.append(from_stored(lay, jax.lax.with_sharding_constraint(p, rep)))
        return out

    def forward(self, key: Hashable, layouts: Sequence[ParamLayout], fn: UnitFn) -> Callable:
        """``(stored, rest, args) -> (out, new_rest)``, jitted once per key."""
        prog = self._fwd.get(key)
        if prog is None:
            layouts = tuple(layouts)

            def run(stored, rest, args):
                return fn(self._gather(layouts, stored), rest, args)

            prog = self._fwd[key] = jax.jit(run)
        return prog

    def backward(self, key: Hashable, layouts: Sequence[ParamLayout], fn: UnitFn) -> Callable:
        """``(stored, rest, args, g) -> (param_grads_f32, diff_arg_grads)``, jitted once per key."""
        prog = self._bwd.get(key)
        if prog is None:
            layouts = tuple(layouts)
            shardings = [NamedSharding(self.mesh, lay.spec) for lay in layouts]

            def run(stored, rest, args, g):
                leaves, tree = jax.tree.flatten(args)
                diff = split_diff(leaves)
                floating = [jnp.issubdtype(p.dtype, jnp.floating) for p in stored]
                p32 = [p.astype(jnp.float32) if f else p for p, f in zip(stored, floating)]

                def f(ps, dleaves):
                    ls = list(leaves)
                    for i, d in zip(diff, dleaves):
                        ls[i] = d
                    out, _ = fn(self._gather(layouts, ps), rest, jax.tree.unflatten(tree, ls))
                    return out

                _, vjp = jax.vjp(f, p32, [leaves[i] for i in diff])
                gp, gd = vjp(g)
                gp = [
                    jax.lax.with_sharding_constraint(x.astype(jnp.float32), s) if fl else None
                    for x, s, fl in zip(gp, shardings, floating)
                ]
                return gp, gd

            prog = self._bwd[key] = jax.jit(run)
        return prog
