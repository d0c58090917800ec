"""A stored parameter brought into the compiled step, and its gradient sent out, with no compute on host memory.

The compiled engine (:mod:`zinf_jax.engine.compiled`) reads each unit's stored shards inside its one
program: moved to device memory (from ``pinned_host`` on the cpu tier), cast to the compute dtype and
all-gathered. Differentiating that read with respect to the stored array itself goes wrong on an
accelerator; see [Note: gradient taps].

# [Note: gradient taps]
# JAX types an array's memory space: the cotangent of a ``pinned_host`` argument is a ``pinned_host``
# value (the transpose of a host -> device move is a device -> host move), and the cotangent of a bfloat16
# argument is bfloat16. Differentiated with respect to the stored shards, a step would cast, reshard and
# sum (a tied parameter's two reads) gradients *after* they reached host memory: on a GPU that is host
# compute ("device compute in host memory space ... very slow") or an abort, on a TPU it runs on the host,
# and the reduction over the data-parallel devices runs in the stored dtype. (On the CPU backend the moves
# are no-ops, so a CPU mesh never shows it: tests lower the step for cuda and tpu and walk it, see
# zinf_jax.engine.hostcheck.)
# So the step differentiates with respect to *taps* instead: a float32 placeholder per trained argument,
# shaped and sharded like the stored shards, that the forward never reads (XLA drops it). The read
# ``staged_read(tap, stored)`` is a custom VJP: forward, move -> cast -> gather from ``stored``; backward,
# the gathered cotangent is cast to float32, reduce-scattered to the stored sharding in device memory, and
# only then moved to the tap's memory. A tap lives in ``pinned_host`` when the gradient goes to a host
# optimizer and its parameter is read once in the step (each layer's gradient leaves the device as soon as
# it is formed; in a scanned run it is written into the host stack, XLA's offload pattern); a parameter
# read more than once (a tied embedding, a parameter loss) has a device tap, so its reads' gradients are
# summed in device memory, and it is moved out once at the end.
# A read is also never a residual: with ``activation_checkpointing=False`` the unit keeps its activations
# but not the gathered parameters nor their device copies (:func:`keep_all_but_params`); the backward
# reads again.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zinf_jax.engine.programs import GATHERED, gather
from zinf_jax.plan.partition import ParamLayout, to_stored

__all__ = ["STAGED", "gather_in", "keep_all_but_params", "move_in", "read", "scatter_out", "staged_read", "tap"]

STAGED = "zinf_staged_param"
"""The name (``checkpoint_name``) on a staged read's value inside its custom VJP: how
:func:`keep_all_but_params` tells a parameter read from a model's own custom VJPs."""


def _floating(dtype: Any) -> bool:
    return bool(jnp.issubdtype(jnp.dtype(dtype), jnp.floating))


def move_in(lay: ParamLayout, stored: jax.Array, mesh: Mesh) -> jax.Array:
    """Host-memory shards of ``lay`` moved to device memory (sharded as stored)."""
    return jax.device_put(stored, NamedSharding(mesh, lay.spec, memory_kind="device"))


def gather_in(lay: ParamLayout, x: jax.Array, mesh: Mesh, dtype: Any) -> jax.Array:
    """Shards in device memory gathered for the unit: cast to ``dtype``, all-gathered.

    The optimization barrier on the device copy keeps the gather after a scanned run's slice (see
    [Note: scanned runs] in :mod:`zinf_jax.engine.compiled`).
    """
    x = jax.lax.optimization_barrier(x)
    if _floating(x.dtype):
        x = x.astype(dtype)
    return gather(lay, x, mesh)


def read(lay: ParamLayout, stored: jax.Array, mesh: Mesh, dtype: Any, host: bool) -> jax.Array:
    """``stored`` gathered for the unit: moved to device memory (``host``), cast to ``dtype``, all-gathered."""
    return gather_in(lay, move_in(lay, stored, mesh) if host else stored, mesh, dtype)


def scatter_out(lay: ParamLayout, ct: jax.Array, mesh: Mesh) -> jax.Array:
    """The transpose of :func:`read`'s gather, in float32: the gathered cotangent reduce-scattered to the
    stored sharding (padding and flattening of a ``flat`` parameter undone), in device memory."""
    g = ct.astype(jnp.float32)
    if lay.gathered and lay.kind != "flat":  # reduced where it was computed: a split the model keeps stays
        g = jax.lax.with_sharding_constraint(g, NamedSharding(mesh, lay.gathered_spec))
    g = to_stored(lay, g)
    return jax.lax.with_sharding_constraint(g, NamedSharding(mesh, lay.spec, memory_kind="device"))


@functools.lru_cache(maxsize=None)
def staged_read(lay: ParamLayout, mesh: Mesh, dtype: str, host: bool, tap_kind: str) -> Callable:
    """``f(tap, stored)``: :func:`read` of ``stored``, differentiated with respect to ``tap`` (see
    [Note: gradient taps]).

    Args:
      lay: the parameter's layout.
      mesh: the mesh.
      dtype: the compute dtype the unit reads it in.
      host: ``stored`` is in ``pinned_host``.
      tap_kind: the tap's memory kind (``"device"`` or ``"pinned_host"``): where the gradient goes.

    Returns:
      The read; its VJP gives the tap a float32 cotangent of the stored shape and sharding in
      ``tap_kind`` memory, every operation before the final move in device memory, and ``stored`` none.
    """
    out = NamedSharding(mesh, lay.spec, memory_kind=tap_kind)

    @jax.custom_vjp
    def f(tap_value: jax.Array, stored: jax.Array) -> jax.Array:
        del tap_value
        return checkpoint_name(read(lay, stored, mesh, dtype, host), STAGED)

    def fwd(tap_value: jax.Array, stored: jax.Array) -> tuple[jax.Array, None]:
        del tap_value
        return checkpoint_name(read(lay, stored, mesh, dtype, host), STAGED), None

    def bwd(_: None, ct: jax.Array) -> tuple[jax.Array, None]:
        g = scatter_out(lay, ct, mesh)
        return (g if tap_kind == "device" else jax.device_put(g, out)), None

    f.defvjp(fwd, bwd)
    return f


def tap(shape: tuple[int, ...], spec: P, mesh: Mesh, kind: str) -> jax.Array:
    """A float32 zero placeholder of ``shape`` in ``kind`` memory, sharded as ``spec``, inside a program."""
    zeros = jax.lax.with_sharding_constraint(jnp.zeros(shape, jnp.float32), NamedSharding(mesh, spec))
    return zeros if kind == "device" else jax.device_put(zeros, NamedSharding(mesh, spec, memory_kind=kind))


_MOVES_DATA = frozenset({"broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims",
                         "convert_element_type", "reduce_precision", "sharding_constraint", "reshard",
                         "device_put", "optimization_barrier"})


def _is_staged(params: dict) -> bool:
    jaxpr = getattr(params.get("call_jaxpr"), "jaxpr", None)
    return jaxpr is not None and any(e.primitive.name == "name" and e.params.get("name") == STAGED
                                     for e in jaxpr.eqns)


def keep_all_but_params(prim: Any, *_: Any, **params: Any) -> bool:
    """Checkpoint policy for ``activation_checkpointing=False``: save every value but a unit's parameters.

    Not saved: values named :data:`~zinf_jax.engine.programs.GATHERED` or :data:`STAGED`, the output of a
    staged read (:func:`staged_read`'s custom VJP), which the backward reads again, and the results of
    operations that only move data (a broadcast, reshape, transpose or cast of a gathered parameter is a
    copy of it), recomputed from their operands.
    """
    if prim.name == "name":
        return params.get("name") not in (GATHERED, STAGED)
    if prim.name in _MOVES_DATA:  # recomputed from what they read: a broadcast of a gathered scale is a param copy
        return False
    if prim.name == "custom_vjp_call":
        return not _is_staged(params)
    return True
