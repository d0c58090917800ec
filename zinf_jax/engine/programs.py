"""Compiled unit programs: gather, run, and (backward) recompute + vjp.

One forward and one backward program per distinct unit signature (framework
key of the unit, method, structure and static leaves of the call's inputs,
parameter layouts): 48 identical blocks share one jitted function and
therefore one compilation. Inputs and outputs are pytrees; integer leaves
(RNG counters, token ids) are carried through but not differentiated.

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
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zinf_jax.sharding import ParamLayout, from_stored

__all__ = ["UnitPrograms", "UnitFn", "Penalty", "split_diff"]

UnitFn = Callable[[list[jax.Array], list[Any]], Any]
"""``(full_params, dyn_inputs) -> outputs``: a unit call as a pure function of its array inputs."""

Penalty = Callable[[list[jax.Array]], jax.Array]
"""``(float32 params of a unit) -> scalar``: a parameter-dependent loss term of one unit."""


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

    def _full32(self, layouts: Sequence[ParamLayout], stored: Sequence[jax.Array]) -> list[jax.Array]:
        rep = NamedSharding(self.mesh, P())
        return [from_stored(lay, jax.lax.with_sharding_constraint(p.astype(jnp.float32), rep))
                if jnp.issubdtype(p.dtype, jnp.floating) else p for lay, p in zip(layouts, stored)]

    def forward(self, key: Hashable, layouts: Sequence[ParamLayout], fn: UnitFn,
                penalty: Penalty | None = None) -> Callable:
        """``(stored, dyn) -> out`` (``(out, penalty)`` with a penalty), jitted once per key."""
        key = (key, penalty is not None)
        prog = self._fwd.get(key)
        if prog is None:
            layouts = tuple(layouts)

            def run(stored, dyn):
                out = fn(self._gather(layouts, stored), dyn)
                return out if penalty is None else (out, penalty(self._full32(layouts, stored)))

            prog = self._fwd[key] = jax.jit(run)
        return prog

    def backward(self, key: Hashable, layouts: Sequence[ParamLayout], fn: UnitFn,
                 penalty: Penalty | None = None) -> Callable:
        """``(stored, dyn, g, scale) -> (param_grads_f32, diff_input_grads)``, jitted once per key.

        ``g`` holds the cotangents of the inexact output leaves only (the others
        are integer state such as RNG counters); ``scale`` multiplies the
        penalty's gradient (the loss scale the backward pass was seeded with).
        """
        key = (key, penalty is not None)
        prog = self._bwd.get(key)
        if prog is None:
            layouts = tuple(layouts)
            shardings = [NamedSharding(self.mesh, lay.spec) for lay in layouts]

            def run(stored, dyn, g, scale):
                diff = split_diff(dyn)
                floating = [jnp.issubdtype(p.dtype, jnp.floating) for p in stored]
                p32 = [p.astype(jnp.float32) if f else p for p, f in zip(stored, floating)]

                def f(ps, dleaves):
                    ls = list(dyn)
                    for i, d in zip(diff, dleaves):
                        ls[i] = d
                    return fn(self._gather(layouts, ps), ls)

                out, vjp = jax.vjp(f, p32, [dyn[i] for i in diff])
                outs, tree = jax.tree.flatten(out)
                it = iter(g)
                cts = [next(it) if jnp.issubdtype(o.dtype, jnp.inexact) else np.zeros(o.shape, jax.dtypes.float0)
                       for o in outs]
                gp, gd = vjp(jax.tree.unflatten(tree, cts))
                if penalty is not None:
                    gpen = jax.grad(lambda ps: penalty(self._full32(layouts, ps)))(p32)
                    gp = [a + b * scale if fl else a for a, b, fl in zip(gp, gpen, floating)]
                gp = [
                    jax.lax.with_sharding_constraint(x.astype(jnp.float32), s) if fl else None
                    for x, s, fl in zip(gp, shardings, floating)
                ]
                return gp, gd

            prog = self._bwd[key] = jax.jit(run)
        return prog
