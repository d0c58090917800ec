"""Reading, updating and writing the units of work that span several shards: packs and whole tensors.

A mixin of :class:`~zinf_jax.optim.driver.StreamedOptimizer` (its attributes: the tier, the rule, the
state names and geometry per path, the grad tier): the driver streams units of work through its
buffer pool; a :class:`~zinf_jax.optim.subgroups.Pack` (small whole shards of element-wise updates,
[Note: packs]) or a :class:`~zinf_jax.optim.subgroups.Whole` (every shard of one parameter of a
whole-tensor rule, [Note: whole-tensor updates]) is read, updated and written here.

[Note: whole-tensor updates]
A rule that couples the elements of one tensor (an optax transform that is not element-wise on a
parameter, see :mod:`~zinf_jax.optim.optax_rule`) updates the parameter whole. The driver plans one
:class:`~zinf_jax.optim.subgroups.Whole` per such parameter: every sub-group of every shard, read into
one buffer set (master, the rule's tier states and the gradient; member ``k`` at ``k * chunk``), the
rule's :meth:`update_whole` run once on it, each chunk written back to its key and index, each shard's
master handed to ``write_param``. Nothing about storage changes (the same keys and chunks as the
element-wise path), so checkpoints, restore and ``params()`` see the same data; the buffer pool's sets
are as large as the largest such parameter (times ``buffer_count``: the pipeline depth), which the
estimator counts. The process must hold every shard of the parameter (a single-process job, or
replicated params); otherwise the driver refuses the rule when it is built.
"""
from __future__ import annotations

import time
from typing import Any

import numpy as np
from jax.profiler import TraceAnnotation

from zinf_jax._internal.futures import is_future
from zinf_jax.optim.grads_out import TierGrads
from zinf_jax.optim.subgroups import BufferSet, Pack, Whole, work_name
from zinf_jax.tiers.base import np_dtype

__all__ = ["MultiShardWork"]


class MultiShardWork:
    """The driver's I/O and update of packs and whole tensors (a mixin; see module doc)."""

    tier: Any
    rule: Any
    layouts: Any
    grads: TierGrads | None
    state_dtype: str
    _names: dict
    _numel: dict

    def _io_pack(self, bs: BufferSet, pk: Pack, read: bool) -> None:
        """:meth:`_io` of a pack: each member's states at its offset of the set's arrays (gradients too, from a
        grad tier; a member without a gradient this step gets zeros)."""
        names = self._names[pk.members[0].path]
        for k, (s, a) in enumerate(zip(names, bs.arrays)):
            whole = a[:pk.size]
            if read and s != "master" and self.state_dtype != "float32":  # See [Note: bf16 moments]
                whole = bs.staged(k, pk.size, np_dtype(self.state_dtype))
            items = [(f"{s}/{gr.path}", gr.index, whole[off:off + gr.valid]) for gr, off in zip(pk.members, pk.offsets)]
            bs.pending += self.tier.get_many(items) if read else self.tier.put_many(items)
        if read and self.grads is not None:
            g = bs.arrays[-1]
            for gr, off in zip(pk.members, pk.offsets):
                if self.grads.has(gr.path, gr.shard):
                    bs.pending.append(self.grads.read_chunk(gr.path, gr.shard, 0, g[off:off + gr.valid]))
                else:
                    g[off:off + gr.valid] = 0.0

    def _io_whole(self, bs: BufferSet, wh: Whole, read: bool) -> None:
        """:meth:`_io` of a whole parameter: member ``k`` at ``k * chunk`` of each array (gradients too, from a grad
        tier; a shard without a gradient this step gets zeros)."""
        for k, (s, a) in enumerate(zip(self._names[wh.path], bs.arrays)):
            whole = a[:wh.size]
            if read and s != "master" and self.state_dtype != "float32":  # See [Note: bf16 moments]
                whole = bs.staged(k, wh.size, np_dtype(self.state_dtype))
            items = [(f"{s}/{wh.path}", gr.index, whole[m * wh.chunk:(m + 1) * wh.chunk])
                     for m, gr in enumerate(wh.members)]
            bs.pending += self.tier.get_many(items) if read else self.tier.put_many(items)
        if read and self.grads is not None:
            g = bs.arrays[-1]
            for m, gr in enumerate(wh.members):
                part = g[m * wh.chunk:m * wh.chunk + gr.valid]
                if self.grads.has(gr.path, gr.shard):
                    bs.pending.append(self.grads.read_chunk(gr.path, gr.shard, gr.chunk, part))
                else:
                    part[:] = 0.0

    def _update_whole(self, bs: BufferSet, wh: Whole, grad, write_param, *, mult: np.float32) -> tuple[float, float]:
        """Updates a whole parameter read into ``bs`` and issues its writes (states, then each shard's master);
        the seconds spent in the update and in ``write_param``."""
        t = time.perf_counter()
        g = bs.arrays[-1][:wh.size]
        numel = self._numel[wh.path]
        shards = sorted({gr.shard for gr in wh.members})
        if not isinstance(grad, TierGrads):  # (read with the states otherwise)
            for s, i in enumerate(shards):
                part = grad(wh.path, i)
                dst = g[s * wh.per_shard:s * wh.per_shard + numel]
                if part is None:
                    dst[:] = 0.0
                else:
                    np.copyto(dst, np.asarray(part).reshape(-1), casting="unsafe")
        for s in range(len(shards)):  # the padding of each shard: zero (never read as data)
            g[s * wh.per_shard + numel:(s + 1) * wh.per_shard] = 0.0
        arrays = [a[:wh.size] for a in bs.arrays[:len(self._names[wh.path])]]
        with TraceAnnotation("zinf/optimizer_update", param=wh.path):
            self.rule.update_whole(wh.path, self.layouts[wh.path], arrays, g, shards=len(shards),
                                   per_shard=wh.per_shard, mult=mult)
        t_update = time.perf_counter() - t
        with TraceAnnotation("zinf/optimizer_write", param=wh.path):
            self._io(bs, wh, read=False)
        t = time.perf_counter()
        shape = self.layouts[wh.path].shard_shape
        for s, i in enumerate(shards):
            out = write_param(wh.path, i, arrays[0][s * wh.per_shard:s * wh.per_shard + numel].reshape(shape))
            bs.pending += [out] if is_future(out) else []
        return t_update, time.perf_counter() - t

    def _update_pack(self, bs: BufferSet, pk: Pack, grad, write_params, *, step: int, lr: float,
                     mult: np.float32) -> tuple[float, float]:
        """Updates a pack read into ``bs`` and issues its writes (states, then its parameters in one call);
        the seconds spent in the update and in ``write_params``."""
        t = time.perf_counter()
        g = bs.arrays[-1]
        if not isinstance(grad, TierGrads):  # (read with the states otherwise)
            for gr, off in zip(pk.members, pk.offsets):
                part = grad(gr.path, gr.shard)
                if part is None:
                    g[off:off + gr.valid] = 0.0
                else:
                    np.copyto(g[off:off + gr.valid], np.asarray(part).reshape(-1), casting="unsafe")
        arrays = [a[:pk.size] for a in bs.arrays[:len(self._names[pk.members[0].path])]]
        spans = [(gr.path, self.layouts[gr.path].shape, off, off + gr.valid) for gr, off in zip(pk.members, pk.offsets)]
        with TraceAnnotation("zinf/optimizer_update", param=work_name(pk)):
            self.rule.update_many(spans, arrays, g[:pk.size], step=step, lr=lr, mult=mult)
        t_adam = time.perf_counter() - t
        with TraceAnnotation("zinf/optimizer_write", param=work_name(pk)):
            self._io(bs, pk, read=False)
        t = time.perf_counter()
        master = arrays[0]
        items = [(gr.path, gr.shard, master[lo:hi].reshape(self.layouts[gr.path].shard_shape))
                 for gr, (_, _, lo, hi) in zip(pk.members, spans)]
        outs = write_params(items)
        bs.pending += [f for f in outs if is_future(f)]
        return t_adam, time.perf_counter() - t
