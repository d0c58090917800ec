"""Gradient accumulation: one batch cut into equal micro-batches along its leading axis.

``train_step`` runs the streamed forward/backward once per micro-batch. Each
backward is seeded with ``loss_scale / k``, so the gradients summed in the
grad sink (in place, no extra host copies) are the mean of the micro-batch
gradients: for a loss that is a mean over examples, the gradient of the mean
loss over the whole batch. Leaves without a batch axis (scalars, typed PRNG
keys, NNX ``Rngs`` objects) are shared by every micro-batch.
"""
from __future__ import annotations

from typing import Any

import jax
from flax import nnx

__all__ = ["micro_batches"]


def _batch_axis(x: Any) -> bool:
    return (not nnx.graph.is_graph_node(x) and getattr(x, "ndim", 0) >= 1
            and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key))


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
