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

from zinf_jax.engine.adapters import EngineError
from zinf_jax.sharding import ParamLayout, from_stored

__all__ = ["UnitPrograms", "UnitFn", "Penalty", "split_diff", "split_inputs", "join_inputs"]

UnitFn = Callable[[list[jax.Array], list[Any]], Any]
"""``(full_params, dyn_inputs) -> outputs``: a unit call as a pure function of its array inputs."""

Penalty = Callable[[list[jax.Array]], jax.Array]
"""``(float32 params of a unit) -> scalar``: a parameter-dependent loss term of one unit."""


def split_diff(leaves: Sequence[Any]) -> list[int]:
    """Indices of the leaves that are differentiable (inexact dtypes)."""
    return [i for i, x in enumerate(leaves) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.core.Tracer))


def split_inputs(where: str, inputs: Any) -> tuple[list[Any], tuple[Any, tuple[tuple[int, Any], ...]]]:
    """Array leaves of a unit call's inputs, and the rest as a static (hashable) signature.

    Arrays (and pytrees of arrays: masks, positions, caches, RNG state) are
    program inputs; Python values (``train=True``, ``num_heads``, strings) are
    static and select program variants, as they would under ``jax.jit``.
    """
    leaves, treedef = jax.tree.flatten(inputs)
    fixed = tuple((i, v) for i, v in enumerate(leaves) if not _is_array(v))
    try:
        hash((treedef, fixed))
    except TypeError:
        bad = next(v for _, v in fixed if not _hashable(v))
        raise EngineError(
            f"unit call {where}: an argument of type {type(bad).__name__} is neither an array nor hashable; "
            "pass arrays (or pytrees of arrays) and hashable Python values (bool, int, float, str, tuples)"
        ) from None
    return [v for v in leaves if _is_array(v)], (treedef, fixed)


def _hashable(v: Any) -> bool:
    try:
        hash(v)
    except TypeError:
        return False
    return True


def join_inputs(sig: tuple[Any, tuple[tuple[int, Any], ...]], dyn: Sequence[Any]) -> Any:
    """Inverse of :func:`split_inputs`: the call's inputs from its signature and array leaves."""
    treedef, fixed = sig
    leaves = list(dyn)
    for pos, value in fixed:
        leaves.insert(pos, value)
    return jax.tree.unflatten(treedef, leaves)


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
                 penalty: Penalty | None = None, trainable: Sequence[bool] | None = None) -> Callable:
        """``(stored, dyn, g, scale) -> (param_grads_f32, diff_input_grads)``, jitted once per key.

        ``g`` holds the cotangents of the inexact output leaves only (the others
        are integer state such as RNG counters); ``scale`` multiplies the
        penalty's gradient (the loss scale the backward pass was seeded with).
        Parameters that ``trainable`` marks False (frozen) are not differentiated
        at all: their gradient is ``None``, like that of an integer parameter.
        """
        trainable = tuple(True for _ in layouts) if trainable is None else tuple(trainable)
        key = (key, penalty is not None, trainable)
        prog = self._bwd.get(key)
        if prog is None:
            layouts = tuple(layouts)
            shardings = [NamedSharding(self.mesh, lay.spec) for lay in layouts]

            def run(stored, dyn, g, scale):
                diff = split_diff(dyn)
                floating = [jnp.issubdtype(p.dtype, jnp.floating) for p in stored]
                p32 = [p.astype(jnp.float32) if f else p for p, f in zip(stored, floating)]
                wrt = [i for i, (fl, t) in enumerate(zip(floating, trainable)) if fl and t]

                def with_params(ps):
                    full = list(p32)
                    for i, x in zip(wrt, ps):
                        full[i] = x
                    return full

                def f(ps, dleaves):
                    ls = list(dyn)
                    for i, d in zip(diff, dleaves):
                        ls[i] = d
                    return fn(self._gather(layouts, with_params(ps)), ls)

                out, vjp = jax.vjp(f, [p32[i] for i in wrt], [dyn[i] for i in diff])
                outs, tree = jax.tree.flatten(out)
                it = iter(g)
                cts = [next(it) if jnp.issubdtype(o.dtype, jnp.inexact) else np.zeros(o.shape, jax.dtypes.float0)
                       for o in outs]
                gw, gd = vjp(jax.tree.unflatten(tree, cts))
                if penalty is not None:
                    gpen = jax.grad(lambda ps: penalty(self._full32(layouts, with_params(ps))))([p32[i] for i in wrt])
                    gw = [a + b * scale for a, b in zip(gw, gpen)]
                gp: list[Any] = [None] * len(layouts)
                for i, x in zip(wrt, gw):
                    gp[i] = jax.lax.with_sharding_constraint(x.astype(jnp.float32), shardings[i])
                return gp, gd

            prog = self._bwd[key] = jax.jit(run)
        return prog
