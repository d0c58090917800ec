"""Compiled unit programs: gather, run, and (backward) recompute + vjp.

One forward and one backward program per distinct unit signature (framework
key of the unit, method, structure and static leaves of the call's inputs,
parameter layouts): 48 identical blocks share one jitted function and
therefore one compilation. Inputs and outputs are pytrees; integer leaves
(RNG counters, token ids) are carried through but not differentiated.

Inside a program the stored, sharded parameters are all-gathered with a
sharding constraint to replicated (to the model's own tensor-parallel spec where
it has one), padding is removed, and the unit runs. The
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

from jax.ad_checkpoint import checkpoint_name

from zinf_jax.engine.adapters import EngineError
from zinf_jax.plan.model_mesh import ModelMesh
from zinf_jax.plan.partition import ParamLayout, from_stored

__all__ = ["UnitPrograms", "UnitFn", "Penalty", "split_diff", "split_inputs", "join_inputs", "gather", "model_call"]

UnitFn = Callable[[list[jax.Array], list[Any]], Any]
"""``(full_params, dyn_inputs) -> outputs``: a unit call as a pure function of its array inputs."""

Penalty = Callable[[list[jax.Array]], jax.Array]
"""``(float32 params of a unit) -> scalar``: a parameter-dependent loss term of one unit."""

GATHERED = "zinf_gathered_param"
"""Name of a gathered parameter inside a unit program: never kept as an activation (see :meth:`UnitPrograms.forward_saving`)."""


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


def join_inputs(sig: tuple, dyn: Sequence[Any]) -> Any:
    """Inverse of :func:`split_inputs`: the call's inputs from its signature and array leaves.

    A unit call's signature may carry its inputs' specs as a third member (see :func:`model_call`).
    """
    treedef, fixed = sig[0], sig[1]
    leaves = list(dyn)
    for pos, value in fixed:
        leaves.insert(pos, value)
    return jax.tree.unflatten(treedef, leaves)


def gather(lay: ParamLayout, x: jax.Array, mesh: Mesh) -> jax.Array:
    """A stored parameter inside a program, gathered: all-gathered over the zero axes, padding removed, and
    split as the model's own code expects it (:attr:`~zinf_jax.plan.partition.ParamLayout.gathered`)."""
    if lay.kind != "flat":  # straight to the model's spec: a split it keeps is never gathered (an expert axis)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, lay.gathered_spec))
    x = from_stored(lay, jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P())))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, lay.gathered_spec)) if lay.gathered else x


def model_call(fn: Callable[[list[jax.Array], Any], Any], sig: tuple, layouts: Sequence[ParamLayout],
               model_mesh: ModelMesh | None) -> UnitFn:
    """A unit call ``fn(full_params, inputs)`` as a function of the gathered parameters and the array inputs,
    run as a region of the model's code: the parameters typed with their gathered specs, the inputs with the
    specs the call recorded in ``sig`` (see [Note: model regions]; as it is without Explicit axes)."""
    def call(full, dyn):
        return fn(full, join_inputs(sig, dyn))

    if model_mesh is None:
        return call
    specs = list(sig[2]) if len(sig) > 2 else []
    return model_mesh.region(call, ([lay.gathered_spec for lay in layouts], specs))


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
        out = []
        for lay, p in zip(layouts, stored):
            if jnp.issubdtype(p.dtype, jnp.floating):
                p = p.astype(self.compute_dtype)
            out.append(checkpoint_name(gather(lay, p, self.mesh), GATHERED))
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

    def forward_saving(self, key: Hashable, layouts: Sequence[ParamLayout], fn: UnitFn,
                       penalty: Penalty | None = None, trainable: Sequence[bool] | None = None) -> Callable:
        """``(stored, dyn) -> (out, penalty, saved)``: a forward that keeps what its backward needs.

        ``saved`` holds every activation of the unit's vjp except the gathered
        parameters (recomputed from the shards it also holds, by all-gather in
        :meth:`backward_saved`): no forward recompute, no second fetch.
        ``penalty`` is 0 without one.
        """
        trainable = tuple(True for _ in layouts) if trainable is None else tuple(trainable)
        key = (key, "saving", penalty is not None, trainable)
        prog = self._fwd.get(key)
        if prog is None:
            layouts = tuple(layouts)

            def run(stored, dyn):
                diff, p32, wrt, with_params = _wrt(stored, dyn, trainable)

                def f(ps, dleaves):
                    full = with_params(ps)
                    out = fn(self._gather(layouts, full), _with_diff(dyn, diff, dleaves))
                    return out, (penalty(self._full32(layouts, full)) if penalty is not None else jnp.float32(0))

                f = jax.checkpoint(f, policy=jax.checkpoint_policies.save_anything_except_these_names(GATHERED))
                (out, pen), vjp = jax.vjp(f, [p32[i] for i in wrt], [dyn[i] for i in diff])
                return out, pen, vjp

            prog = self._fwd[key] = jax.jit(run)
        return prog

    def backward_saved(self, key: Hashable, layouts: Sequence[ParamLayout], out_spec: Any,
                       trainable: Sequence[bool] | None = None) -> Callable:
        """``(saved, g, scale) -> (param_grads_f32, diff_input_grads)`` after :meth:`forward_saving`.

        ``out_spec``: the forward output's structure and, per leaf, its shape
        and whether it is inexact (``g`` holds cotangents of those only).
        """
        trainable = tuple(True for _ in layouts) if trainable is None else tuple(trainable)
        key = (key, "saved", out_spec, trainable)
        prog = self._bwd.get(key)
        if prog is None:
            shardings = [NamedSharding(self.mesh, lay.spec) for lay in layouts]
            tree, leaves = out_spec

            wrt = [i for i, (lay, t) in enumerate(zip(layouts, trainable))
                   if t and jnp.issubdtype(jnp.dtype(lay.dtype), jnp.floating)]

            def run(vjp, g, scale):
                it = iter(g)
                cts = [next(it) if inexact else np.zeros(shape, jax.dtypes.float0) for shape, inexact in leaves]
                gw, gd = vjp((jax.tree.unflatten(tree, cts), jnp.asarray(scale, jnp.float32)))
                return _reduce_scattered(len(layouts), wrt, gw, shardings), gd

            prog = self._bwd[key] = jax.jit(run)
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
                diff, p32, wrt, with_params = _wrt(stored, dyn, trainable)

                def f(ps, dleaves):
                    return fn(self._gather(layouts, with_params(ps)), _with_diff(dyn, diff, dleaves))

                out, vjp = jax.vjp(f, [p32[i] for i in wrt], [dyn[i] for i in diff])
                outs, tree = jax.tree.flatten(out)
                it = iter(g)
                cts = [next(it) if jnp.issubdtype(o.dtype, jnp.inexact) else np.zeros(o.shape, jax.dtypes.float0)
                       for o in outs]
                gw, gd = vjp(jax.tree.unflatten(tree, cts))
                if penalty is not None:
                    gpen = jax.grad(lambda ps: penalty(self._full32(layouts, with_params(ps))))([p32[i] for i in wrt])
                    gw = [a + b * scale for a, b in zip(gw, gpen)]
                return _reduce_scattered(len(layouts), wrt, gw, shardings), gd

            prog = self._bwd[key] = jax.jit(run)
        return prog


def _wrt(stored: Sequence[jax.Array], dyn: Sequence[Any], trainable: Sequence[bool]) -> tuple:
    """``(diff, p32, wrt, with_params)``: differentiable input leaves, float32 params, the params
    differentiated (floating and trainable), and a function putting their values back among the rest."""
    floating = [jnp.issubdtype(p.dtype, jnp.floating) for p in stored]
    p32 = [p.astype(jnp.float32) if f else p for p, f in zip(stored, floating)]
    wrt = [i for i, (fl, t) in enumerate(zip(floating, trainable)) if fl and t]

    def with_params(ps: Sequence[jax.Array]) -> list[jax.Array]:
        full = list(p32)
        for i, x in zip(wrt, ps):
            full[i] = x
        return full

    return split_diff(dyn), p32, wrt, with_params


def _with_diff(dyn: Sequence[Any], diff: Sequence[int], dleaves: Sequence[Any]) -> list[Any]:
    leaves = list(dyn)
    for i, d in zip(diff, dleaves):
        leaves[i] = d
    return leaves


def _reduce_scattered(n: int, wrt: Sequence[int], grads: Sequence[jax.Array], shardings: Sequence[Any]) -> list[Any]:
    """float32 parameter gradients constrained to their stored sharding (XLA: a reduce-scatter); None elsewhere."""
    out: list[Any] = [None] * n
    for i, x in zip(wrt, grads):
        out[i] = jax.lax.with_sharding_constraint(x.astype(jnp.float32), shardings[i])
    return out
