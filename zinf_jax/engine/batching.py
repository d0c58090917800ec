"""Batches: placement on the mesh, and micro-batches for gradient accumulation.

:func:`shard_batch` puts a process-local batch on the mesh, its leading axis
split over the batch axes. For gradient accumulation :func:`micro_batches`
cuts one batch into equal micro-batches along its leading axis:

``train_step`` runs the streamed forward/backward once per micro-batch. Each
backward is seeded with ``loss_scale / k``, so the gradients summed in the
grad sink (in place, no extra host copies) are the mean of the micro-batch
gradients: for a loss that is a mean over examples, the gradient of the mean
loss over the whole batch. Leaves without a batch axis (scalars, typed PRNG
keys, NNX ``Rngs`` objects) are shared by every micro-batch.
"""
from __future__ import annotations

import math
from typing import Any, Collection

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zinf_jax.plan.partition import batch_axes_of, batch_spec

__all__ = ["micro_batches", "shard_batch", "check_batch"]


def _batch_axis(x: Any) -> bool:
    return (not nnx.graph.is_graph_node(x) and getattr(x, "ndim", 0) >= 1
            and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key))


def check_batch(batch: Any) -> None:
    """Refuses a batch that would train nothing, before anything moves.

    Raises:
      ValueError: the batch holds no array, or an array with a zero-length axis (0 rows, or an empty sequence the
        loss would average over: a NaN loss and zero gradients, which the non-finite skip does not catch, while
        momentum and weight decay would still move every parameter).
    """
    leaves = [x for x in jax.tree.leaves(batch, is_leaf=nnx.graph.is_graph_node) if hasattr(x, "shape")]
    if not leaves:
        raise ValueError("the batch holds no array: pass the step's inputs (arrays with a leading batch axis)")
    for path, x in jax.tree_util.tree_flatten_with_path(batch, is_leaf=nnx.graph.is_graph_node)[0]:
        if hasattr(x, "shape") and not nnx.graph.is_graph_node(x) and 0 in tuple(x.shape):
            where = jax.tree_util.keystr(path) or "the batch"
            raise ValueError(f"batch leaf {where} has shape {tuple(x.shape)}, an empty axis: a step on it would "
                             "average over no examples (a NaN loss) and still apply momentum and weight decay. "
                             "Skip empty batches in the loop that makes them (the last partial batch of an "
                             "epoch, a filter that dropped every example)")


def micro_batches(batch: Any, k: int) -> list[Any]:
    """Cuts every batched leaf of ``batch`` into ``k`` equal parts along axis 0.

    Args:
      batch: the process-local batch (arrays with a leading batch axis; other
        leaves are passed to every micro-batch unchanged).
      k: ``gradient_accumulation_steps``.

    Returns:
      ``k`` batches of the same structure (``[batch]`` when ``k == 1``).

    Raises:
      ValueError: the batched leaves disagree on their leading size, or it does
        not divide by ``k``.
    """
    if k == 1:
        return [batch]
    leaves, tree = jax.tree.flatten(batch, is_leaf=nnx.graph.is_graph_node)
    sizes = {x.shape[0] for x in leaves if _batch_axis(x)}
    if len(sizes) != 1:
        raise ValueError(f"gradient_accumulation_steps={k} needs every batch array to share its leading (batch) "
                         f"size; got leading sizes {sorted(sizes) or 'none'}")
    n = sizes.pop()
    if n % k:
        raise ValueError(f"gradient_accumulation_steps={k} does not divide the batch's leading size {n}: pass a "
                         f"batch of a multiple of {k} examples (per process), or change gradient_accumulation_steps")
    m = n // k
    return [jax.tree.unflatten(tree, [x[i * m:(i + 1) * m] if _batch_axis(x) else x for x in leaves])
            for i in range(k)]


def _replicate_state(node: Any, mesh: Mesh) -> None:
    """Places the arrays of an NNX object passed with the batch (an ``nnx.Rngs``) on every device of ``mesh``,
    in place.

    A step writes the object's new state back replicated; placed so from the first step on, the object
    reused across steps has the same types every step, and the step's program is not compiled again (as
    under ``nnx.jit``, which does not specialise on an uncommitted argument's device).
    """
    rep = NamedSharding(mesh, P())

    def put(v: Any) -> Any:
        if isinstance(v, jax.Array) and not (isinstance(v.sharding, NamedSharding) and v.sharding.mesh == mesh):
            return jax.device_put(v, rep)
        return v

    state = nnx.state(node)
    nnx.update(node, jax.tree.map(put, state))


def shard_batch(batch: Any, mesh: Mesh, model_axes: Collection[str] = ()) -> Any:
    """Places a process-local batch on ``mesh``, the leading axis split over the batch axes.

    Arrays already on the mesh stay; typed PRNG keys (``jax.random.key(step)``)
    are replicated; NNX objects (an ``nnx.Rngs``) pass through as state, their arrays replicated in place.
    ``model_axes``: the axes
    the model splits its parameters over (tensor parallelism), which replicate the batch
    (:func:`~zinf_jax.plan.partition.batch_axes_of`).
    """
    parts = math.prod(mesh.shape[a] for a in batch_axes_of(mesh, model_axes)) // max(1, jax.process_count())

    def put(path: Any, x: Any) -> Any:
        if nnx.graph.is_graph_node(x):  # an nnx.Rngs passed with the batch: state, not data
            _replicate_state(x, mesh)
            return x
        if isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh:
            return x
        if jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key):  # a dropout key: every device
            return jax.device_put(x, NamedSharding(mesh, P()))
        x = np.asarray(x)
        if x.ndim == 0:  # a scalar (a step counter, a temperature): every device has it
            return jax.make_array_from_process_local_data(NamedSharding(mesh, P()), x)
        if x.ndim and x.shape[0] % parts:
            where = jax.tree_util.keystr(path) or "the batch"
            hint = (" It looks like a raw PRNG key (uint32[2], e.g. jax.random.PRNGKey(...) or fold_in of one): "
                    "pass a typed key instead, jax.random.key(seed) or jax.random.wrap_key_data(key), which is "
                    "replicated, not split." if x.shape == (2,) and x.dtype == np.uint32 else "")
            raise ValueError(f"batch leaf {where} of shape {x.shape}: its leading (batch) axis is split over "
                             f"{parts} devices of this process and {x.shape[0]} does not divide by {parts}.{hint}")
        return jax.make_array_from_process_local_data(NamedSharding(mesh, batch_spec(mesh, x.ndim, model_axes)), x)

    return jax.tree_util.tree_map_with_path(put, batch, is_leaf=nnx.graph.is_graph_node)
