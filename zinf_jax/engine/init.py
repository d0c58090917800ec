"""Initialisation unit by unit: the model is never materialised whole.

For each batch of units, the model constructor runs inside ``jax.jit``
returning only those units' parameters, already in stored form and sharded over
the mesh; XLA drops the rest of the model from the program. The arrays go
straight to the param tier (and to ``on_param``, e.g. the optimizer's fp32
master) and are released once written, so host and device memory hold about
three batches at a time: batch ``k + 1`` is created (its program dispatched
before batch ``k`` is touched) while batch ``k`` is copied to the host and
written and batch ``k - 1``'s writes finish.

A batch is consecutive units whose fp32 parameters stay within ``batch_bytes``
(a unit larger than that is a batch of its own). The constructor is traced once
(:class:`~zinf_jax.engine.adapters.InitTrace`); a batch runs one program per
unit, and alike units (a model's blocks) share one program: a program of many
blocks took seconds to compile (7 s for 16 blocks of d_model 256), one block's
a fraction of that, once. The first and the last batch's programs (a
transformer's block, and its embeddings and final norm) compile in background
threads while the RNG's scalar chain is computed (0.10B GPT: init 4.5-4.9 s ->
3.5-4.4 s).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import numpy as np

from zinf_jax.engine.store import ParamStore
from zinf_jax.engine.weights import LazyTensor, slice_key
from zinf_jax.plan.partition import ParamLayout, to_stored

__all__ = ["init_unit_by_unit", "param_groups", "param_batches", "INIT_BATCH_BYTES"]

INIT_BATCH_BYTES = 64 << 20
"""Default bound on the fp32 bytes one init program creates."""


def param_groups(adapter: Any) -> list[tuple[str, ...]]:
    """Parameter paths grouped by unit, then the persistent ones outside units."""
    groups = [tuple(u.param_paths) for u in adapter.units]
    if adapter.glue_paths:
        groups.append(tuple(adapter.glue_paths))
    return groups


def param_batches(adapter: Any, batch_bytes: int) -> list[list[tuple[str, ...]]]:
    """:func:`param_groups` merged in order into batches of at most ``batch_bytes`` fp32 bytes (each batch a list
    of groups)."""
    size = {p: 4 * math.prod(s.shape) for p, s in adapter.abstract_params.items()}
    batches: list[list[tuple[str, ...]]] = []
    held = 0
    for group in param_groups(adapter):
        nbytes = sum(size[p] for p in group)
        if batches and held + nbytes <= batch_bytes:
            batches[-1].append(group)
            held += nbytes
        else:
            batches.append([group])
            held = nbytes
    return batches


def init_unit_by_unit(
    adapter: Any,
    store: ParamStore,
    *,
    on_param: Callable[[str, jax.Array], None] | None = None,
    metadata: dict | None = None,
    batch_bytes: int = INIT_BATCH_BYTES,
    values: Callable[[Sequence[str]], list[np.ndarray]] | None = None,
) -> None:
    """Creates every parameter batch by batch of units and writes it to ``store``.

    Args:
      adapter: the model adapter.
      store: the parameter store to fill (committed at the end).
      on_param: called with ``(path, stored_fp32_array)`` for each parameter; may
        return futures of writes still using the array (waited for after the next
        batch's writes are issued, so that writing overlaps; the batch after that is
        already being created meanwhile).
      metadata: committed with the store.
      batch_bytes: fp32 bytes one init program may create (see the module doc).
      values: ``values(paths) -> host arrays``: given values (pretrained
        weights, :class:`~zinf_jax.engine.pretrained.Pretrained`) instead of
        the model's initialisers, read batch by batch too.
    """
    def stored(path: str, value: jax.Array) -> jax.Array:
        return to_stored(store.layouts[path], value)

    def create(groups: Sequence[Sequence[str]]) -> Sequence[jax.Array]:
        if values is None:  # one program per unit, shared by alike units; dispatched asynchronously
            return [a for g in groups for a in adapter.init_params(g, stored, [store.sharding(p) for p in g])]
        paths = [p for g in groups for p in g]
        return [_place(store.layouts[p], v, adapter.abstract_params[p].dtype, store.sharding(p))
                for p, v in zip(paths, values(paths))]

    batches = param_batches(adapter, batch_bytes)
    if values is None and batches:  # the first batch's programs and the last's (a transformer's block, its
        # embeddings and final norm) compile at once, in the background, while the RNG's scalars are computed
        ends = batches[:1] + batches[1:][-1:]
        adapter.prepare_init([(g, stored, [store.sharding(p) for p in g]) for b in ends for g in b])
    previous: list = []  # writes of the batch before, still in flight
    upcoming = create(batches[0]) if batches else []
    for k, group in enumerate(batches):
        arrays = upcoming
        # the next batch's program is dispatched before this batch is copied out and written
        upcoming = create(batches[k + 1]) if k + 1 < len(batches) else []
        futures = []
        for path, arr in zip([p for g in group for p in g], arrays):
            futures += store.put_array(path, arr)
            if on_param is not None:
                futures += on_param(path, arr) or []
        for f in previous:
            f.result()
        previous = futures
        del arrays
    for f in previous:
        f.result()
    store.commit(metadata)


def _place(layout: ParamLayout, value: Any, dtype: Any, sharding: Any) -> jax.Array:
    """A host value as a global stored-form array with ``sharding``, each process reading only its own shards.

    ``value`` is a host array or a lazy tensor (:class:`~zinf_jax.engine.weights.LazyTensor`): only the
    slices of this process's devices are read and converted to ``dtype``. A ``flat`` parameter (padded and
    flattened) is read whole first.
    """
    if layout.kind == "flat":
        host = to_stored(layout, np.asarray(value, dtype))
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
    shape = tuple(layout.shape)
    if not isinstance(value, LazyTensor):
        return jax.make_array_from_callback(shape, sharding, lambda idx: np.asarray(value[idx], dtype))
    # this process's slices read together: each byte once (a slice held by several devices, a reshape)
    wanted = list(sharding.addressable_devices_indices_map(shape).values())
    parts = {slice_key(i, shape): np.asarray(v, dtype) for i, v in zip(wanted, value.read_slices(wanted))}
    return jax.make_array_from_callback(shape, sharding, lambda idx: parts[slice_key(idx, shape)])
