"""The streaming driver of the CPU optimizer: sub-groups of optimizer state through a tier.

Float32 master weights and the update rule's per-element states (Adam: both
moments ``m`` and ``v``; an optax transform: its moment-like leaves, see
:mod:`zinf_jax.optim.rules`) live in a storage tier (host RAM or NVMe),
sharded exactly like the parameters. Every shard is cut into chunks of at
most ``sub_group_size`` elements; one *sub-group* is one ``(path, shard,
chunk)`` triple across the keys ``master/<path>``, ``m/<path>``, ...; the
chunks of a shard are near-equal (:func:`sub_groups`). Tier index of chunk
``c`` of shard ``i`` is ``i * n_chunks + c``; the last chunk is zero-padded
(only the valid part is ever used).

:meth:`StreamedOptimizer.step` makes one reduction pass over the gradient
(global norm, non-finite check), then streams the sub-groups through a pool of
at most ``buffer_count`` buffer sets: reads run ahead into free buffers while
the current sub-group is updated and earlier ones are written back, so the
disk is kept busy and the update hides behind the I/O (DeepSpeed's pipelined
NVMe optimizer: read(i+1) || update(i) || write(i-1)). The pool persists
across steps (fresh buffers cost page faults): it holds ``buffer_count *
min(largest shard, sub_group_size) * 4 * (1 + states)`` bytes (12 B/element
for Adam), plus one multi-chunk shard (4 B/element) assembled for
``write_param``. The buffers are page-aligned: the NVMe tier reads and writes
them with direct I/O, holding no copy of its own.

[Note: bf16 moments]
With ``state_dtype="bfloat16"`` (``ZeroConfig(moments_dtype="bfloat16")``) the rule's states are
stored in bfloat16 and nothing else changes: a sub-group's states are read into bfloat16 staging
buffers and widened exactly to float32, the update runs in float32 arithmetic as before (the new
moments are used unrounded in this step's update), and the tier rounds them to bfloat16 when they are
written (round-to-nearest-even, ml_dtypes' cast; no stochastic rounding). The fp32 master is never
rounded. Reference: optax's adamw whose state is rounded to bfloat16 after each update
(``tests/optim/test_bf16_moments.py``).

[Note: updates in place]
With the state in numpy buffers in host RAM (``CpuTier(memory="numpy")``, the tier of
``offload_optimizer="cpu"``), float32 states and the gradients held by the caller (no grad tier), the
update runs on the tier's own arrays (``CpuTier.writable``): a sub-group is not read into a buffer set
and written back, so a step reads and writes each state once (12 B/element for Adam, each way) instead
of three times (a copy in, the update, a copy out), as DeepSpeed's CPU Adam updates its fp32 partition
in place. A pack's members are separate arrays in the tier, so they are updated one at a time. The
numbers are the same (the update is the same kernel on the same values). With NVMe, bfloat16 states
(read into staging buffers and widened) or a grad tier, and for a whole-tensor rule, the state goes
through the buffer sets as described above.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np
from jax.profiler import TraceAnnotation

from zinf_jax._internal.futures import is_future, wait_all
from zinf_jax.config.zero import MOMENTS_DTYPES
from zinf_jax.optim.grad_arena import GradArena
from zinf_jax.optim.grads_out import TierGrads
from zinf_jax.optim.kernel import all_finite, sum_squares
from zinf_jax.optim.rules import UpdateRule, make_rule
from zinf_jax.optim.scaling import LossScaler, grad_scale, init_loss_scale, update_loss_scale
from zinf_jax.optim.subgroups import (PACK_BELOW, PACK_ELEMENTS, BufferSet, Group, Pack, Pipe, Tree, Whole, pack_groups,
                                     sub_groups, work_name)
from zinf_jax.optim.state_io import StateAccess
from zinf_jax.optim.work import MultiShardWork
from zinf_jax.tiers.base import ShardSpec, Tier, np_dtype

if TYPE_CHECKING:
    from zinf_jax.config import LossScaleConfig
    from zinf_jax.plan.partition import ParamLayout

__all__ = ["StreamedOptimizer", "StreamedAdam", "METADATA_KEY"]

METADATA_KEY = "streamed_adam"  # the optimizer's own counters in the tier metadata

KEEP_POOL_BELOW = 256 << 20
"""A buffer pool of fewer bytes is kept from step to step; a larger one is freed after each step.

Kept, the next step's buffers cost no page faults (the small models' steps are short); freed, host
RAM during the next forward and backward does not hold the optimizer's buffers as well (at 0.40B,
2 devices: 4 sets of 8.4M-element master, m, v and gradient chunks, 0.5 GiB, next to the
forward's own ~2 GiB), for a refault a step that costs a few tenths of a second of a 20 s step."""


class StreamedOptimizer(MultiShardWork, StateAccess):
    """An optimizer over state kept in a tier, streamed sub-group by sub-group.

    Args:
      spec: :func:`~zinf_jax.optim.adamw` / :func:`~zinf_jax.optim.adam` (the
        fused kernel), or an optax ``GradientTransformation`` (see :mod:`zinf_jax.optim.optax_rule`:
        chunk by chunk where it is element-wise, whole tensors elsewhere).
      tier: where master weights and moments live (``CpuTier(memory="numpy")`` or ``NvmeTier``).
      layouts: parameter path to its :class:`~zinf_jax.plan.partition.ParamLayout`.
      local_indices: shard indices of a parameter that this process stores.
      owner: whether shard ``(path, i)`` counts in the global norm (one owner per replica set).
      sub_group_size: most elements of one sub-group (chunk of a shard).
      buffer_count: most sub-groups held in RAM at once (at least 1).
      loss_scale: float16 loss scaling (dynamic or static); ``None`` or disabled: scale 1.
      allreduce: sums a float across processes (identity in a single process).
      grad_tier: where gradients go as they are produced (:attr:`grads`, a
        :class:`~zinf_jax.optim.grads_out.TierGrads`); ``None``: the caller
        holds them and passes ``grad(path, i)`` to :meth:`step`.
      state_dtype: how the rule's states (Adam's ``m`` and ``v``) are stored: ``"float32"``, or
        ``"bfloat16"`` (half the bytes on disk and in every read and write). See [Note: bf16 moments].
      pack_below: whole shards of at most this many elements are updated in packs (``0``: none); see
        [Note: packs] in :mod:`~zinf_jax.optim.subgroups`.
      rule: ``make_rule(spec, layouts, chunks)`` built already (the engine plans its buffers from it first);
        default: built here.
    """

    def __init__(self, spec: Any, tier: Tier, layouts: Mapping[str, ParamLayout], *,
                 local_indices: Callable[[str], list[int]],
                 owner: Callable[[str, int], bool] = lambda p, i: True,
                 sub_group_size: int, buffer_count: int = 4,
                 loss_scale: LossScaleConfig | None = None,
                 allreduce: Callable[[float], float] = lambda x: x,
                 grad_tier: Tier | None = None, state_dtype: str = "float32", pack_below: int = PACK_BELOW,
                 rule: UpdateRule | None = None):
        if sub_group_size < 1 or buffer_count < 1:
            raise ValueError(f"need sub_group_size >= 1 and buffer_count >= 1, got {sub_group_size}, {buffer_count}")
        if state_dtype not in MOMENTS_DTYPES:
            raise ValueError(f"state_dtype must be one of {MOMENTS_DTYPES}, got {state_dtype!r}")
        self.spec, self.tier, self.layouts = spec, tier, dict(layouts)
        self._pack_below = int(pack_below)
        self.state_dtype = state_dtype
        self._owner, self._allreduce = owner, allreduce
        self.buffer_count = int(buffer_count)
        self._ls = {} if loss_scale is None else dataclasses.asdict(loss_scale)
        self._ls.setdefault("enabled", False)
        self._scaler: LossScaler = init_loss_scale(**self._ls)
        self._count = self._skipped = 0
        self._numel: dict[str, int] = {}  # per path: elements of a shard, of a chunk, chunks per shard
        self._chunk: dict[str, int] = {}
        self._nch: dict[str, int] = {}
        self._local: dict[str, list[int]] = {}
        self._groups: list[Group] = []
        for path, lay in self.layouts.items():
            numel = math.prod(lay.shard_shape)
            chunk, n = sub_groups(numel, sub_group_size)
            self._numel[path], self._chunk[path], self._nch[path] = numel, chunk, n
            self._local[path] = sorted(int(i) for i in local_indices(path))
            for i in self._local[path]:
                for c in range(n):
                    self._groups.append(Group(path, i, c, c * chunk, min(chunk, numel - c * chunk), n, i * n + c))
        self._max_chunk = max(self._chunk.values(), default=1)
        self.rule: UpdateRule = make_rule(spec, self.layouts, self._chunk) if rule is None else rule
        self._whole = {p for p in self.layouts if getattr(self.rule, "whole", lambda p: False)(p)}
        self._holders = self._whole_holders()  # See [Note: whole-tensor updates]
        self._names = {path: ("master", *self.rule.state_names(path)) for path in self.layouts}
        self._n_arrays = max((len(v) for v in self._names.values()), default=1)
        self._work: list[Group | Pack] = self._plan()
        self.grads: TierGrads | None = None
        """This step's gradients in ``grad_tier`` (``None`` without one)."""
        if grad_tier is not None:
            geo = {p: (self._numel[p], self._chunk[p], self._nch[p], lay.num_shards) for p, lay in self.layouts.items()}
            self.grads = TierGrads(grad_tier, geo, self._local, owner)
        self._in_place = self._host_buffers and state_dtype == "float32" and self.grads is None
        """Updates run on the tier's own arrays: see [Note: updates in place]."""
        self.grad_arena = GradArena(self._grad_layout()) if self.grads is None else None
        """Where the gradient sink puts this process's gradient shards: [Note: the gradient arena]."""
        self._all_owned = all(owner(p, i) for p in self.layouts for i in self._local[p])  # (one process: all)
        self._sets: list[BufferSet] = []  # the pool, kept across steps (fresh buffers cost page faults)
        self._free: collections.deque[BufferSet] = collections.deque()
        self._live = 0
        self._set_size, self._set_arrays = 0, 0
        self._size_sets()
        self.peak_live_buffers = 0  # most sub-group buffer sets in use at once, since construction
        self._scratch: np.ndarray | None = None  # grad conversion (non-float32 grads)
        self._runs: dict = {}  # a pack -> its states as runs of the tier (updated in place as one array)
        self._run_keys: dict = {}  # a pack -> per state, its members' (key, index)
        self._grad_keys: dict = {}  # a pack -> its members' (path, shard)
        self._views: dict = {}  # a pack -> its spans and master views over its master run
        self._pack_g: np.ndarray | None = None
        self._zeros: np.ndarray | None = None  # the zero grad (read only)
        self._assembly: np.ndarray | None = None  # a multi-chunk shard handed to write_param
        self._assembly_pending: list[Future] = []
        self._on_written: Callable[[str], None] | None = None
        self._left: dict[str, int] = {}  # sub-groups of each path not yet written
        self._sub_groups = dict(collections.Counter(g.path for g in self._groups))  # (per path: the same every step)
        self.last_stats: dict[str, float] = {}
        """Seconds of the last :meth:`step` in the norm pass, waiting on reads and writes, in Adam, in write_param."""

    # --- layout -------------------------------------------------------------
    def _plan(self) -> list[Group | Pack | Whole | Tree]:
        """The step's units of work: the sub-groups in order, small whole shards in packs, the parameters of a
        whole-tensor rule whole (each where its first sub-group was), or every parameter of a tree-coupled rule in
        one unit.

        See [Note: packs] in :mod:`~zinf_jax.optim.subgroups` and [Note: whole-tensor updates].
        """
        rank = {id(g): i for i, g in enumerate(self._groups)}
        wholes: dict[str, list[Group]] = {}
        for g in self._groups:
            if g.path in self._whole:
                wholes.setdefault(g.path, []).append(g)
        work: list[Group | Pack | Whole | Tree] = pack_groups(
            [g for g in self._groups if g.path not in self._whole], self._pack_below, PACK_ELEMENTS,
            same=lambda g: self._names[g.path], order=lambda g: self.rule.pack_key(g.path, self.layouts[g.path].shape))
        units = []
        for path, gs in wholes.items():
            gs = sorted(gs, key=lambda g: (g.shard, g.chunk))
            units.append(Whole(path, tuple(gs), self._chunk[path], self._chunk[path] * self._nch[path]))
        if getattr(self.rule, "tree", None) is not None and units:  # one update over the tree
            offsets = [0]
            for u in units[:-1]:
                offsets.append(offsets[-1] + u.size)
            units = [Tree(tuple(units), tuple(offsets))]
        work += units
        first = lambda w: min(rank[id(g)] for g in (w.members if isinstance(w, (Pack, Whole, Tree)) else (w,)))  # noqa: E731
        return sorted(work, key=first)

    def declare(self) -> None:
        """Declares ``master/<path>`` and the rule's states (Adam: ``m/<path>``, ``v/<path>``) in the tier."""
        for path, lay in self.layouts.items():
            n = self._nch[path]
            local = [i * n + c for i in self._local[path] for c in range(n)]
            for s in self._names[path]:
                spec = ShardSpec(shard_shape=(self._chunk[path],), dtype=self._dtype_of(s),
                                 num_shards=lay.num_shards * n)
                self.tier.declare(f"{s}/{path}", spec, local)
        if self.grads is not None:
            self.grads.declare()

    def _dtype_of(self, name: str) -> str:
        """The stored dtype of state ``name``: the master is float32, the rule's states ``state_dtype``."""
        return "float32" if name == "master" else self.state_dtype

    def state_names(self, path: str) -> tuple[str, ...]:
        """The tier states of ``path``: ``"master"`` and the rule's (``"m"``, ``"v"`` for Adam)."""
        return self._names[path]

    def _zero_buffer(self) -> np.ndarray:
        """A read-only float32 chunk of zeros (a missing gradient, a master's padding)."""
        if self._zeros is None:  # calloc: pages never written cost no RAM; read-only as a guard
            self._zeros = np.zeros(self._max_chunk, np.float32)
            self._zeros.flags.writeable = False
        return self._zeros

    # --- state --------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        """The loss scale to multiply the next loss by (1 without loss scaling)."""
        return float(self._scaler.scale)

    @property
    def step_count(self) -> int:
        """Applied (not skipped) steps so far: optax's ``count``."""
        return self._count

    @property
    def skipped(self) -> int:
        """Steps skipped for a non-finite gradient so far."""
        return self._skipped

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's own counters as JSON-ready data (what :meth:`commit` stores)."""
        return {"count": self._count, "skipped": self._skipped, "loss_scaler": list(self._scaler),
                "rule": self.rule.state_dict()}

    def commit(self, metadata: dict | None = None) -> None:
        """Commits the tier, its metadata extended by the optimizer's counters.

        Args:
          metadata: the caller's metadata; ``None`` keeps what the tier holds.
        """
        meta = dict(self.tier.metadata() if metadata is None else metadata)
        meta[METADATA_KEY] = self.state_dict()
        self.tier.commit(meta)

    def restore_state(self, st: dict[str, Any] | None = None) -> None:
        """Reads the step count, skip count and loss scaler back from ``tier.metadata()`` (no-op if absent), or
        from ``st`` (a :meth:`state_dict`: what a step that failed puts back)."""
        checkpoint = st is None
        st = self.tier.metadata().get(METADATA_KEY) if st is None else st
        if st is None:
            return
        self._count, self._skipped = int(st["count"]), int(st["skipped"])
        self._scaler = LossScaler(*(t(x) for t, x in zip((float, int, int, int), st["loss_scaler"])))
        self.rule.load_state_dict(st.get("rule", {}), checkpoint=checkpoint)

    # --- the step -------------------------------------------------------------
    def _as_f32(self, g: np.ndarray, start: int, stop: int) -> np.ndarray:
        part = g[start:stop]
        if part.dtype == np.float32 and part.flags.c_contiguous:
            return part
        if self._scratch is None:
            self._scratch = np.empty(self._max_chunk, np.float32)
        out = self._scratch[:stop - start]
        np.copyto(out, part, casting="unsafe")
        return out

    def _grad_layout(self) -> list[tuple[str, int, tuple[int, ...], bool]]:
        """Every local shard, in the order the planned work reads them (a pack's members side by side, the others
        aligned): the :class:`GradArena` layout."""
        out, seen = [], set()
        for w in self._work:
            members = (w.members if isinstance(w, (Pack, Whole)) else
                       [m for wh in w.wholes for m in wh.members] if isinstance(w, Tree) else [w])
            for k, g in enumerate(members):
                if (g.path, g.shard) not in seen:
                    seen.add((g.path, g.shard))
                    out.append((g.path, g.shard, tuple(self.layouts[g.path].shard_shape),
                                k == 0 or not isinstance(w, Pack)))
        return out

    def _norm_sq(self, grad: Callable[[str, int], np.ndarray | None] | TierGrads) -> float:
        if isinstance(grad, TierGrads):  # accumulated as the gradients were written
            grad.wait()
            return self._allreduce(grad.norm_sq())
        if grad is self.grad_arena and self._all_owned and self.grad_arena.complete():
            return self._allreduce(self.grad_arena.norm_sq())  # one pass: [Note: the gradient arena]
        sums: list[float] = []
        for path in self.layouts:
            numel, chunk = self._numel[path], self._chunk[path]
            for i in self._local[path]:
                g = grad(path, i)
                if g is None:
                    continue
                g = np.asarray(g).reshape(-1)
                own = self._owner(path, i)
                for s in range(0, numel, chunk):  # per chunk: the sum is the same for any grad dtype
                    part = self._as_f32(g, s, min(s + chunk, numel))
                    if own:
                        sums.append(sum_squares(part))
                    elif not all_finite(part):
                        sums.append(math.inf)  # a NaN in a replica makes every process skip
        return self._allreduce(math.fsum(sums))

    def pool_bytes(self) -> int:
        """Host bytes the buffer pool holds now (sub-group sets, their staging buffers, the assembly buffer)."""
        sets = sum(a.nbytes for bs in self._sets for a in (*bs.arrays, *bs.staging()))
        return sets + (self._assembly.nbytes if self._assembly is not None else 0)

    def _take(self) -> BufferSet:
        if not self._free and len(self._sets) < self.buffer_count:  # (+1: the gradient read from its tier)
            self._sets.append(BufferSet(self._set_size, self._set_arrays))
            self._free.append(self._sets[-1])
        bs = self._free.popleft()
        self._live += 1
        self.peak_live_buffers = max(self.peak_live_buffers, self._live)
        return bs

    def _release(self, bs: BufferSet, *, quiet: bool = False) -> None:
        wait_all(bs.pending, quiet)
        bs.pending = []
        w, bs.written = bs.written, None
        self._live -= 1
        self._free.append(bs)
        for gr in (() if w is None or quiet else w.members if isinstance(w, (Pack, Whole, Tree)) else (w,)):
            self._left[gr.path] -= 1
            if self._left[gr.path] == 0 and self._on_written is not None:
                self._on_written(gr.path)

    def order(self, paths: Sequence[str]) -> None:
        """Updates the parameters in this order (the next forward's), the others after them.

        Changes no number: each sub-group's update is independent of the others,
        and the global norm is an exact sum. The packs are cut again in the new order, so a pack may now be
        larger than any before: the buffer sets grow with it (:meth:`_size_sets`).
        """
        rank = {p: i for i, p in enumerate(paths)}
        self._groups.sort(key=lambda g: rank.get(g.path, len(rank)))
        self._work = self._plan()
        if self.grad_arena is not None:
            self.grad_arena.relayout(self._grad_layout())
        self._runs, self._run_keys, self._views, self._grad_keys = {}, {}, {}, {}  # new packs: made at first use
        self._size_sets()

    def _size_sets(self) -> None:
        """Sizes the buffer sets for the planned work: each as large as its largest sub-group, pack or whole
        parameter, with one more array for the gradient where packs or a grad tier gather it there. A pool of
        smaller sets (made before a new order cut a larger pack) is dropped, to be allocated again."""
        buffered = [w for w in self._work if isinstance(w, (Whole, Tree)) or not self._in_place]  # See
        # [Note: updates in place]
        packs = any(isinstance(w, (Pack, Whole, Tree)) for w in buffered)  # their gradient is gathered into the set
        size = max([1 if self._in_place else self._max_chunk,
                    *(w.size for w in buffered if isinstance(w, (Pack, Whole, Tree)))])
        arrays = self._n_arrays + (self.grads is not None or packs)
        if size > self._set_size or arrays > self._set_arrays:
            if self._live:
                raise RuntimeError("StreamedOptimizer.order during a step: its buffer sets are in use")
            self._sets, self._free = [], collections.deque()
            self._set_size, self._set_arrays = max(size, self._set_size), max(arrays, self._set_arrays)

    def _io(self, bs: BufferSet, w: Group | Pack, read: bool) -> None:
        """Reads or writes every state of ``w`` (a sub-group or a pack); each future joins ``bs.pending`` at once."""
        if self._in_place and not isinstance(w, (Whole, Tree)):
            return  # the update writes the tier's arrays: [Note: updates in place]
        if isinstance(w, Pack):
            return self._io_pack(bs, w, read)
        if isinstance(w, Whole):
            return self._io_whole(bs, w, read)
        if isinstance(w, Tree):
            return self._io_tree(bs, w, read)
        gr, size = w, self._chunk[w.path]
        for k, (s, a) in enumerate(zip(self._names[gr.path], bs.arrays)):
            key, buf = f"{s}/{gr.path}", a[:size]
            if read and s != "master" and self.state_dtype != "float32":  # See [Note: bf16 moments]
                buf = bs.staged(k, size, np_dtype(self.state_dtype))
            bs.pending.append(self.tier.get(key, gr.index, out=buf) if read else self.tier.put(key, gr.index, buf))
        if read and self.grads is not None and self.grads.has(gr.path, gr.shard):
            bs.pending.append(self.grads.read_chunk(gr.path, gr.shard, gr.chunk, bs.arrays[-1][:size]))

    def _stored(self, path: str, index: int) -> list[np.ndarray]:
        """The tier's own arrays of sub-group ``index`` of ``path`` (master, then the rule's states), which the
        update writes in place: [Note: updates in place]."""
        return self.tier.writable([(f"{s}/{path}", index) for s in self._names[path]])

    def _fill(self, pipe: Pipe, j: int) -> None:
        """Reclaims finished writes, then reads ahead into free buffers (sub-group ``j`` at least)."""
        for bs in [b for b in pipe.writing if all(f.done() for f in b.pending)]:
            pipe.writing.remove(bs)
            self._release(bs)
        while pipe.nxt < len(self._work) and (pipe.nxt == j or self._free or len(self._sets) < self.buffer_count):
            if not self._free and len(self._sets) >= self.buffer_count:
                t = time.perf_counter()
                self._release(pipe.writing.popleft())  # a buffer must come free for sub-group j
                pipe.t_write += time.perf_counter() - t
            bs = self._take()
            pipe.reads.append(bs)
            self._io(bs, self._work[pipe.nxt], read=True)
            pipe.nxt += 1

    def step(self, grad: Callable[[str, int], np.ndarray | None],
             write_param: Callable[[str, int, np.ndarray], Any],
             on_written: Callable[[str], None] | None = None,
             write_params: Callable[[list[tuple[str, int, np.ndarray]]], list[Any]] | None = None,
             value: float | None = None) -> dict:
        """One optimizer step over every local shard.

        The first sub-groups are read while the norm pass runs; a skipped step
        only discards them.

        Args:
          grad: ``grad(path, i)``: the gradient shard in stored form (any float
            dtype, multiplied by :attr:`loss_scale` when loss scaling is on), or
            ``None`` for a zero gradient. Called twice per shard (norm pass,
            update pass); it should return a buffer, not recompute. Or
            :attr:`grads`: the gradients written to the grad tier this step,
            read per sub-group with the states.
          write_param: ``write_param(path, i, master)`` receives each updated
            float32 master shard once all its chunks are done. The array is
            the driver's buffer: copy it before returning, or return a future
            (the buffer is not reused before it resolves).
          on_written: ``on_written(path)``, called (on this thread) once every
            local shard of ``path`` is updated and its writes (state and
            ``write_param``) have resolved; not called for a skipped step.
            Called with :data:`NORM_DONE` once the global norm (and its
            cross-process all-reduce) is done.
          write_params: ``write_params([(path, i, master), ...])``: the shards of one pack at once (a
            list of futures or values; the same buffer rules as ``write_param``); default: ``write_param``
            for each.
          value: the step's loss (after accumulation), for a rule whose update reads it (an optax
            ``GradientTransformationExtraArgs`` gets it as ``value=``).

        Returns:
          ``{"grad_norm", "skipped", "loss_scale", "step", "lr"}``: the unscaled
          global norm before clipping, whether the step was skipped (non-finite
          gradient: state and parameters untouched), the loss scale for the next
          step, the applied-step count after this step and this step's learning rate.
        """
        t0 = time.perf_counter()
        pipe = Pipe()
        self._on_written = on_written
        self._left = dict(self._sub_groups)  # (a dict's copy: a Counter's is a Python loop)
        try:
            self._fill(pipe, 0)
            with TraceAnnotation("zinf/optimizer_norm"):
                norm_sq = self._norm_sq(grad)
            if on_written is not None:
                on_written(NORM_DONE)
            gs = grad_scale(norm_sq, loss_scale=self._scaler.scale, clip_norm=self.rule.clip_norm)
            stats = {"norm_s": time.perf_counter() - t0}
            lr = self.rule.lr_at(self._count)
            self.rule.begin_step(value)
            if gs.finite:
                try:
                    many = write_params or (lambda items: [write_param(*it) for it in items])
                    stats.update(self._stream(pipe, grad, write_param, many, step=self._count + 1, lr=lr,
                                              mult=gs.multiplier))
                except BaseException:
                    self.rule.end_step(applied=False)
                    raise
                self.rule.end_step(applied=True)
                self._count += 1
            self._scaler = update_loss_scale(self._scaler, not gs.finite, **self._ls)
            self._skipped += not gs.finite
        finally:  # on an error (or a skip), let in-flight I/O finish before buffers are reused
            for bs in [*pipe.reads, *pipe.writing, *([pipe.current] if pipe.current else [])]:
                self._release(bs, quiet=True)
            wait_all(self._assembly_pending, quiet=True)
            self._assembly_pending = []
            if self.pool_bytes() >= KEEP_POOL_BELOW:
                self._sets, self._free, self._assembly = [], collections.deque(), None
        self.last_stats = {**stats, "total_s": time.perf_counter() - t0}
        return {"grad_norm": gs.norm, "skipped": not gs.finite, "loss_scale": self.loss_scale,
                "step": self._count, "lr": lr}

    def _stream(self, pipe: Pipe, grad, write_param, write_params, *, step: int, lr: float,
                mult: np.float32) -> dict:
        t_read = t_adam = t_param = 0.0
        cur_key, cur_grad = None, None
        for j, w in enumerate(self._work):
            self._fill(pipe, j)
            bs = pipe.current = pipe.reads.popleft()
            t = time.perf_counter()
            with TraceAnnotation("zinf/optimizer_read", param=work_name(w)):
                for f in bs.pending:
                    f.result()
            bs.pending = []
            bs.unstage(w.size if isinstance(w, (Pack, Whole, Tree)) else self._chunk[w.path])  # bf16 states to f32
            t_read += time.perf_counter() - t
            if isinstance(w, (Pack, Whole, Tree)):
                t_adam_w, t_param_w = (self._update_pack(bs, w, grad, write_params, step=step, lr=lr, mult=mult)
                                       if isinstance(w, Pack) else self._update_whole(bs, w, grad, write_param,
                                                                                       mult=mult))
                t_adam, t_param = t_adam + t_adam_w, t_param + t_param_w
                bs.written = w
                pipe.writing.append(bs)
                pipe.current = None
                continue
            gr = w
            t = time.perf_counter()
            sl = slice(gr.start, gr.start + gr.valid)
            if isinstance(grad, TierGrads):  # read with the states, into the set's last array
                g_part = bs.arrays[-1][:gr.valid] if grad.has(gr.path, gr.shard) else self._zero_buffer()[:gr.valid]
            else:
                if (gr.path, gr.shard) != cur_key:
                    cur_key, g = (gr.path, gr.shard), grad(gr.path, gr.shard)
                    cur_grad = None if g is None else np.asarray(g).reshape(-1)
                g_part = self._zero_buffer()[:gr.valid] if cur_grad is None else self._as_f32(cur_grad, sl.start, sl.stop)
            size = self._chunk[gr.path]
            arrays = (self._stored(gr.path, gr.index) if self._in_place
                      else [a[:size] for a in bs.arrays[:len(self._names[gr.path])]])
            with TraceAnnotation("zinf/optimizer_update", param=gr.path):
                self.rule.update(gr.path, self.layouts[gr.path].shape, arrays, g_part, valid=gr.valid, step=step,
                                 lr=lr, mult=mult)
            p = arrays[0][:gr.valid]
            t_adam += time.perf_counter() - t
            with TraceAnnotation("zinf/optimizer_write", param=gr.path):
                self._io(bs, gr, read=False)

            t = time.perf_counter()
            shape, numel = self.layouts[gr.path].shard_shape, self._numel[gr.path]
            if gr.n_chunks == 1:
                out = write_param(gr.path, gr.shard, p.reshape(shape))
                bs.pending += [out] if is_future(out) else []
            else:
                if gr.chunk == 0:
                    wait_all(self._assembly_pending)
                    self._assembly_pending = []
                    if self._assembly is None:
                        self._assembly = np.empty(max(self._numel[q] for q in self.layouts
                                                      if self._nch[q] > 1), np.float32)
                self._assembly[sl] = p
                if gr.chunk == gr.n_chunks - 1:
                    out = write_param(gr.path, gr.shard, self._assembly[:numel].reshape(shape))
                    self._assembly_pending += [out] if is_future(out) else []
                    bs.pending += [out] if is_future(out) else []  # the shard counts as written once it resolves
            t_param += time.perf_counter() - t
            bs.written = gr
            pipe.writing.append(bs)
            pipe.current = None
        t = time.perf_counter()
        while pipe.writing:
            self._release(pipe.writing.popleft())
        wait_all(self._assembly_pending)
        self._assembly_pending = []
        pipe.t_write += time.perf_counter() - t
        return {"read_wait_s": t_read, "write_wait_s": pipe.t_write, "adam_s": t_adam,
                "write_param_s": t_param, "sub_groups": len(self._groups), "packs": self.packs}

    @property
    def packs(self) -> int:
        """How many packs of small shards a step updates (see :meth:`_plan`)."""
        return sum(isinstance(w, Pack) for w in self._work)


NORM_DONE = ""
"""What ``on_written`` receives when the step's global norm is known (its collectives are over)."""

StreamedAdam = StreamedOptimizer
"""The former name (Adam was the only rule)."""
