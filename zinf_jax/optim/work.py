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
are as large as the largest such parameter's local shards (times ``buffer_count``: the pipeline depth).

In a multi-process job a process holds only its own shards. Each step it then gathers the other
processes' shards of the master, states and gradient of such a parameter (one collective per parameter,
in plan order, which is the same on every process), every process runs the rule on the whole tensor
(the same program on the same numbers: the same result, the transform's small state included), and each
keeps and writes its own shards. This costs, per parameter, a temporary of the whole tensor's arrays and
a transfer of the other processes' shards. The driver checks when it is built that every process holds
the same number of shards of each such parameter and that together they hold all of them (else a
ConfigError naming the parameter).
"""
from __future__ import annotations

import time
from typing import Any, Callable

import jax
import numpy as np
from jax.profiler import TraceAnnotation

from zinf_jax._internal.futures import is_future
from zinf_jax._internal.multihost import allgather
from zinf_jax.errors import ConfigError
from zinf_jax.optim.grads_out import TierGrads
from zinf_jax.optim.subgroups import BufferSet, Pack, Tree, Whole, work_name
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
    _local: dict
    _whole: set
    _holders: dict
    _in_place: bool
    _zero_buffer: Callable[[], np.ndarray]
    _runs: dict  # Pack -> None: its states cannot be runs of the tier (see _pack_runs)
    _run_keys: dict  # Pack -> per state, its members' (key, index)
    _grad_keys: dict  # Pack -> its members' (path, shard)
    _views: dict  # Pack -> (its master run, spans, members' master views): see _pack_views
    _pack_g: np.ndarray | None  # a pack's gradients side by side
    grad_arena: Any  # the gradient arena, or None

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

    def _io_whole(self, bs: BufferSet, wh: Whole, read: bool, base: int = 0) -> None:
        """:meth:`_io` of a whole parameter at ``base`` of the set's arrays: member ``k`` at ``base + k * chunk``
        of each array (gradients too, from a grad tier; a shard without a gradient this step gets zeros)."""
        for k, (s, a) in enumerate(zip(self._names[wh.path], bs.arrays)):
            whole = a[base:base + wh.size]
            if read and s != "master" and self.state_dtype != "float32":  # See [Note: bf16 moments]
                whole = bs.staged(k, wh.size, np_dtype(self.state_dtype), start=base)
            items = [(f"{s}/{wh.path}", gr.index, whole[m * wh.chunk:(m + 1) * wh.chunk])
                     for m, gr in enumerate(wh.members)]
            bs.pending += self.tier.get_many(items) if read else self.tier.put_many(items)
        if read and self.grads is not None:
            g = bs.arrays[-1][base:base + wh.size]
            for m, gr in enumerate(wh.members):
                part = g[m * wh.chunk:m * wh.chunk + gr.valid]
                if self.grads.has(gr.path, gr.shard):
                    bs.pending.append(self.grads.read_chunk(gr.path, gr.shard, gr.chunk, part))
                else:
                    part[:] = 0.0

    def _io_tree(self, bs: BufferSet, tree: Tree, read: bool) -> None:
        """:meth:`_io` of every parameter of a tree-coupled rule, each at its offset."""
        for wh, base in zip(tree.wholes, tree.offsets):
            self._io_whole(bs, wh, read, base)

    def _whole_inputs(self, bs: BufferSet, wh: Whole, grad, base: int = 0) -> tuple[list[np.ndarray], np.ndarray,
                                                                                   list[int]]:
        """The whole parameter read into ``bs`` at ``base``: its arrays (master, states), its gradient (filled from
        ``grad`` unless read from a grad tier; padding zero) and its local shards."""
        g = bs.arrays[-1][base:base + wh.size]
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
        return [a[base:base + wh.size] for a in bs.arrays[:len(self._names[wh.path])]], g, shards

    def _whole_item(self, wh: Whole, arrays: list[np.ndarray], g: np.ndarray, shards: list[int]) -> tuple:
        """What the rule's :meth:`update_tree` takes for one whole parameter: every shard, gathered from all
        processes in a multi-process job (see [Note: whole-tensor updates])."""
        lay = self.layouts[wh.path]
        if wh.path in self._holders:
            *full, full_g = self._gather_whole(wh.path, [*arrays, g], wh.per_shard)
            return wh.path, lay, full, full_g, lay.num_shards, wh.per_shard
        return wh.path, lay, arrays, g, len(shards), wh.per_shard

    def _whole_back(self, wh: Whole, item: tuple, arrays: list[np.ndarray], shards: list[int]) -> None:
        """After the update of a gathered parameter: this process's shards of the result back in ``arrays``
        (before they are written)."""
        if wh.path in self._holders:
            for a, f in zip(arrays, item[2]):
                a.reshape(len(shards), wh.per_shard)[:] = f.reshape(-1, wh.per_shard)[shards]

    def _whole_written(self, bs: BufferSet, wh: Whole, arrays: list[np.ndarray], shards: list[int],
                       write_param) -> None:
        """Each of this process's shards' new master to ``write_param``."""
        numel, shape = self._numel[wh.path], self.layouts[wh.path].shard_shape
        for s, i in enumerate(shards):
            out = write_param(wh.path, i, arrays[0][s * wh.per_shard:s * wh.per_shard + numel].reshape(shape))
            bs.pending += [out] if is_future(out) else []

    def _update_whole(self, bs: BufferSet, w: Whole | Tree, grad, write_param, *,
                      mult: np.float32) -> tuple[float, float]:
        """Updates a whole parameter (or every parameter of a tree-coupled rule) read into ``bs`` in one call of
        the rule, and issues its writes (states, then each shard's master); the seconds spent in the update and
        in ``write_param``."""
        t = time.perf_counter()
        wholes = (w,) if isinstance(w, Whole) else w.wholes
        bases = (0,) if isinstance(w, Whole) else w.offsets
        got = [self._whole_inputs(bs, wh, grad, base) for wh, base in zip(wholes, bases)]
        items = [self._whole_item(wh, *x) for wh, x in zip(wholes, got)]
        with TraceAnnotation("zinf/optimizer_update", param=work_name(w)):
            self.rule.update_tree(items, mult=mult)
        for wh, item, (arrays, _, shards) in zip(wholes, items, got):
            self._whole_back(wh, item, arrays, shards)
        t_update = time.perf_counter() - t
        with TraceAnnotation("zinf/optimizer_write", param=work_name(w)):
            if isinstance(w, Whole):
                self._io_whole(bs, w, read=False)
            else:
                self._io_tree(bs, w, read=False)
        t = time.perf_counter()
        for wh, (arrays, _, shards) in zip(wholes, got):
            self._whole_written(bs, wh, arrays, shards, write_param)
        return t_update, time.perf_counter() - t

    def _whole_holders(self) -> dict[str, np.ndarray]:
        """Per whole-tensor parameter of which this process holds only some shards: which shards each process
        holds (``[process, k]``: shard index). Built with collectives: every process calls it when the driver is
        built. See [Note: whole-tensor updates].

        Raises:
          ConfigError: the processes hold unequal numbers of a parameter's shards, or together not all of them.
        """
        paths = sorted(self._whole)
        if not paths or jax.process_count() == 1:
            return {}
        counts = allgather(np.array([len(self._local[p]) for p in paths], np.int32))
        out = {}
        for j, p in enumerate(paths):
            n = self.layouts[p].num_shards
            held = allgather(np.array(self._local[p], np.int32)) if len(set(counts[:, j])) == 1 else None
            if held is None or set(held.ravel().tolist()) != set(range(n)):
                raise ConfigError(
                    f"optimizer: {p!r} needs its whole tensor for its update ({self.rule.why.get(p, 'a whole-tensor rule')}), "
                    f"and the processes hold {counts[:, j].tolist()} of its {n} shards (every process must hold as many, "
                    "all of them together). Fix: shard it over axes every process spans (zero_axes), or an "
                    "element-wise transform", field="optimizer")
            if len(self._local[p]) != n:
                out[p] = held
        return out

    def _gather_whole(self, path: str, local: list[np.ndarray], per_shard: int) -> list[np.ndarray]:
        """``local`` (this process's shards of each array, shard ``s`` at ``s * per_shard``) as the whole
        parameter's arrays (shard ``i`` at ``i * per_shard``), gathered from every process in one collective."""
        held = self._holders[path]  # [process, k]: shard indices
        n_proc, k = held.shape
        got = allgather(np.stack([a[:k * per_shard] for a in local]))  # [process, array, k * per_shard]
        got = got.reshape(n_proc, len(local), k, per_shard).transpose(1, 0, 2, 3).reshape(len(local), -1, per_shard)
        full = np.empty((len(local), self.layouts[path].num_shards, per_shard), np.float32)
        full[:, held.ravel()] = got  # (a shard two processes hold is written twice, with the same numbers)
        return list(full.reshape(len(local), -1))

    def _pack_grad(self, pk: Pack, grad) -> np.ndarray:
        """The pack's gradients side by side in one float32 buffer: a view of the gradient arena where they sit so
        ([Note: the gradient arena]), else a buffer kept for the next step."""
        if grad is self.grad_arena:
            keys = self._grad_keys.get(pk)
            if keys is None:
                keys = self._grad_keys[pk] = [(gr.path, gr.shard) for gr in pk.members]
            run = grad.run(keys)
            if run is not None:
                return run
        if self._pack_g is None or self._pack_g.shape[0] < pk.size:
            self._pack_g = np.empty(pk.size, np.float32)
        return _fill_pack_grad(self._pack_g[:pk.size], pk, grad)

    def _update_pack(self, bs: BufferSet, pk: Pack, grad, write_params, *, step: int, lr: float,
                     mult: np.float32) -> tuple[float, float]:
        """Updates a pack read into ``bs`` and issues its writes (states, then its parameters in one call);
        the seconds spent in the update and in ``write_params``."""
        if self._in_place:
            return self._update_pack_in_place(bs, pk, grad, write_params, step=step, lr=lr, mult=mult)
        t = time.perf_counter()
        g = bs.arrays[-1]
        if not isinstance(grad, TierGrads):  # (read with the states otherwise)
            _fill_pack_grad(g, pk, grad)
        arrays = [a[:pk.size] for a in bs.arrays[:len(self._names[pk.members[0].path])]]
        spans = [(gr.path, self.layouts[gr.path].shape, off, off + gr.valid) for gr, off in zip(pk.members, pk.offsets)]
        with TraceAnnotation("zinf/optimizer_update", param=work_name(pk)):
            self.rule.update_many(spans, arrays, g[:pk.size], step=step, lr=lr, mult=mult)
        t_adam = time.perf_counter() - t
        with TraceAnnotation("zinf/optimizer_write", param=work_name(pk)):
            self._io(bs, pk, read=False)
        master = arrays[0]
        items = [(gr.path, gr.shard, master[lo:hi].reshape(self.layouts[gr.path].shard_shape))
                 for gr, (_, _, lo, hi) in zip(pk.members, spans)]
        return t_adam, self._write_params(bs, items, write_params)

    def _pack_views(self, pk: Pack, master: np.ndarray) -> tuple[list, list]:
        """The pack's spans (as ``update_many`` takes them) and its members' master views (as ``write_params``
        takes them) over its master run: worked out once per run, not per member per step."""
        hit = self._views.get(pk)
        if hit is None or hit[0] is not master:
            spans = [(gr.path, self.layouts[gr.path].shape, off, off + gr.valid)
                     for gr, off in zip(pk.members, pk.offsets)]
            items = [(gr.path, gr.shard, master[lo:hi].reshape(self.layouts[gr.path].shard_shape))
                     for gr, (_, _, lo, hi) in zip(pk.members, spans)]
            hit = self._views[pk] = (master, spans, items)
        return hit[1], hit[2]

    def _pack_runs(self, pk: Pack) -> list[np.ndarray] | None:
        """The pack's states as runs of the tier (per state one array, the members side by side:
        ``CpuTier.share_run``), made at its first update; ``None`` where the tier cannot (a member's master is a
        row of a scanned stack's array, [Note: masters in rows]): its members are updated one by one."""
        share = getattr(self.tier, "share_run", None)
        if share is None or self._runs.get(pk, True) is None:
            return None
        keys = self._run_keys.get(pk)
        if keys is None:
            keys = self._run_keys[pk] = [[(f"{s}/{gr.path}", gr.index) for gr in pk.members]
                                         for s in self._names[pk.members[0].path]]
        runs = []
        for items in keys:
            run = share(items)
            if run is None:
                self._runs[pk] = None  # (a member's master is a row of a stack: one at a time from now on)
                return None
            runs.append(run)
        return runs

    @staticmethod
    def _write_params(bs: BufferSet, items: list, write_params) -> float:
        """Issues a pack's parameter writes (kept in ``bs`` until they land); the seconds it took."""
        t = time.perf_counter()
        outs = write_params(items)
        bs.pending += [f for f in outs if is_future(f)]
        return time.perf_counter() - t

    def _update_pack_in_place(self, bs: BufferSet, pk: Pack, grad, write_params, *, step: int, lr: float,
                              mult: np.float32) -> tuple[float, float]:
        """:meth:`_update_pack` on the tier's own arrays (see [Note: updates in place] in
        :mod:`~zinf_jax.optim.driver`): as one array where the pack's states are runs of the tier
        (:meth:`_pack_runs`), else one member at a time."""
        t = time.perf_counter()
        runs = self._pack_runs(pk)
        names = self._names[pk.members[0].path]
        if runs is not None:
            self.tier.writable([])  # the runs are the tier's arrays, written in place: counts as a put of each
            g = self._pack_grad(pk, grad)
            spans, items = self._pack_views(pk, runs[0])
            with TraceAnnotation("zinf/optimizer_update", param=work_name(pk)):
                self.rule.update_many(spans, runs, g, step=step, lr=lr, mult=mult)
            return time.perf_counter() - t, self._write_params(bs, items, write_params)
        stored = self.tier.writable([(f"{s}/{gr.path}", gr.index) for gr in pk.members for s in names])
        shards, k = [], 0
        for gr in pk.members:
            n = len(names)
            part = grad(gr.path, gr.shard)
            g = self._zero_buffer()[:gr.valid] if part is None else np.asarray(part, np.float32).reshape(-1)
            shards.append((gr.path, self.layouts[gr.path].shape, stored[k:k + n], g))
            k += n
        with TraceAnnotation("zinf/optimizer_update", param=work_name(pk)):
            self.rule.update_each(shards, step=step, lr=lr, mult=mult)
        items = [(gr.path, gr.shard, arrays[0][:gr.valid].reshape(self.layouts[gr.path].shard_shape))
                 for gr, (_, _, arrays, _) in zip(pk.members, shards)]
        return time.perf_counter() - t, self._write_params(bs, items, write_params)


def _fill_pack_grad(g: np.ndarray, pk: Pack, grad: Callable[[str, int], np.ndarray | None]) -> np.ndarray:
    """``g`` holding the gradients of ``pk``'s members at their offsets (zeros for a member without one)."""
    for gr, off in zip(pk.members, pk.offsets):
        part = grad(gr.path, gr.shard)
        if part is None:
            g[off:off + gr.valid] = 0.0
        else:
            np.copyto(g[off:off + gr.valid], np.asarray(part).reshape(-1), casting="unsafe")
    return g
