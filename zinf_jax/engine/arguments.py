"""The parameter arguments of a compiled step program: which stored arrays it takes, kept fresh.

A traced program takes each unit parameter's stored shards as one argument, or, for the calls of a
scanned run (see [Note: scanned runs] in :mod:`~zinf_jax.engine.compiled`), one stacked argument per
parameter position (:class:`Slots`). :class:`ProgramArgs` hands a program its arguments after the
optimizer's last write: a path or stack is read again only when the store wrote it since, and the
bytes it copies on the host doing so are counted (:attr:`ProgramArgs.host_copy_bytes`).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from zinf_jax.engine.overlap import WriteGate
from zinf_jax.engine.runs import Run
from zinf_jax.engine.store import ParamStore
from zinf_jax.plan.partition import assemble_many, stacked_layout
from zinf_jax.tiers.memory import put_source

__all__ = ["ProgramArgs", "Slots"]


def _stack_groups(groups: Sequence[Sequence[jax.Array]]) -> list[jax.Array]:
    return [jnp.stack(g) for g in groups]


_stack_on_device = jax.jit(_stack_groups)
"""Stacks of single-device arrays of one device (the device tier's persistent shards), one program for all."""


@functools.lru_cache(maxsize=64)
def _stacker(shardings: tuple[NamedSharding, ...]) -> Callable:
    """One jitted program stacking groups of same-layout sharded arrays, group ``k`` into one array of
    ``shardings[k]`` (the device tier's stacks): one dispatch for all of a step's stale stacks."""
    return jax.jit(_stack_groups, out_shardings=list(shardings))


def _stack_per_device(bufs: list[dict[int, list[jax.Array]]]) -> list[dict[int, jax.Array]]:
    """``bufs`` (per stack, shard index to the single-device arrays to stack) stacked, one program per device."""
    by_device: dict[Any, list[tuple[int, int]]] = {}
    for k, b in enumerate(bufs):
        for i, xs in b.items():
            by_device.setdefault(next(iter(xs[0].devices())), []).append((k, i))
    out: list[dict[int, jax.Array]] = [{} for _ in bufs]
    for where in by_device.values():
        for (k, i), x in zip(where, _stack_on_device([bufs[k][i] for k, i in where])):
            out[k][i] = x
    return out


@dataclasses.dataclass(frozen=True)
class Slots:
    """How one traced program takes the parameters: one argument per path, or stacked per scanned run.

    Attributes:
      runs: the program's scanned runs.
      stacks: per stacked argument, its paths (one per call of its run, for one parameter position).
      run_stacks: per run (by start step), its stacked arguments' indices by parameter position.
      trained: the trained arguments: a path, or a stack index.
      frozen: the frozen arguments, likewise.
      layered: the paths that are stacks of layers the model itself scans (see [Note: stacks in scans] in
        :mod:`~zinf_jax.engine.compiled`).
    """

    runs: tuple[Run, ...]
    stacks: tuple[tuple[str, ...], ...]
    run_stacks: dict
    trained: tuple
    frozen: tuple
    layered: frozenset = frozenset()

    def values(self, trained: Sequence[Any], frozen: Sequence[Any],
               pieces: Callable[[int, bool], Sequence[tuple[int, int]]] | None = None
               ) -> tuple[Callable[[str], Any], list[Any]]:
        """``value(path)`` and the stacked arguments, from the program's parameter arguments.

        A trained argument may come as its ``(tap, stored)`` pair (see [Note: staged gradients] in
        :mod:`zinf_jax.engine.staged`); a path's value from a stack is then the pair of its slices, the tap's
        from the piece holding its layer (``pieces(n, True)``: a stack's layer ranges).
        """
        stacked: list[Any] = [None] * len(self.stacks)
        single: dict[str, Any] = {}
        for slot, x in [*zip(self.trained, trained), *zip(self.frozen, frozen)]:
            if isinstance(slot, str):
                single[slot] = x
            else:
                stacked[slot] = x
        where = {p: (g, k) for g, paths in enumerate(self.stacks) for k, p in enumerate(paths)}

        def value(path: str) -> Any:
            if path in single:
                return single[path]
            g, k = where[path]
            x = stacked[g]
            if not isinstance(x, tuple):
                return x[k]
            taps = x[0]
            if isinstance(taps, tuple):  # the tap in pieces
                ranges = pieces(len(self.stacks[g]), True) if pieces is not None else ((0, len(self.stacks[g])),)
                a, b = next(r for r in ranges if r[0] <= k < r[1])
                return taps[ranges.index((a, b))][k - a], x[1][k]
            return taps[k], x[1][k]

        return value, stacked


class ProgramArgs:
    """The stored arrays a compiled program reads, each read from the store again only after a write.

    Args:
      store: the parameter store.
      host_params: the parameters' shards live in ``pinned_host`` (the cpu tier): arrays and stacks
        are kept there.
      paths: the unit parameters' paths.
      gate: holds a read until an optimizer step in flight has written the parameters.

    Attributes:
      fetch_wait_s: seconds so far reading the shards into the program's arguments.
      host_copy_bytes: bytes copied on the host so far building the arguments (the optimizer's masters
        copied out, the stacks of the cpu tier's shards; fetching a path as stored copies nothing).
    """

    def __init__(self, store: ParamStore, *, host_params: bool, paths: Sequence[str], gate: WriteGate):
        self.store = store
        self.mesh = store.mesh
        self.host_params = host_params
        self.paths = list(paths)
        self.gate = gate
        self.fetch_wait_s = 0.0
        self.host_copy_bytes = 0
        self._fetched: dict[str, tuple[int, jax.Array]] = {}  # path -> (store writes when read, the array)
        self._stacked: dict[tuple[str, ...], tuple[tuple, jax.Array]] = {}  # stack paths -> (writes, array)

    def __call__(self, slots: Slots) -> tuple[list[jax.Array], list[jax.Array]]:
        """The program's parameter arguments (trained, frozen; see :class:`Slots`), after any optimizer write.

        A parameter the store has not written since it was last read (a frozen one, or all of them
        between evaluations) is not read again, nor a stack none of whose paths was written.
        """
        self.gate.wait(self.paths)  # See [Note: write gate]
        kind = "pinned_host" if self.host_params else None
        t0 = time.perf_counter()
        stacked_paths = {p for paths in slots.stacks for p in paths if self._raw_stack(p)}
        stale = [p for p in self.paths
                 if p not in stacked_paths and self._fetched.get(p, (-1,))[0] != self.store.writes(p)]
        views = {p: v for p in stale if self.host_params and (v := self.store.host_view(p)) is not None}
        stored = [p for p in stale if p not in views]
        for p, arr in zip(stored, self.store.fetch(stored, memory_kind=kind) if stored else []):
            self._fetched[p] = (self.store.writes(p), arr)
        for p, arr in zip(views, self._copy_out([self.store.layouts[p] for p in views], list(views.values()),
                                                [self.stack_dtype(p, True) if p in slots.layered
                                                 else self.store.dtype_of(p) for p in views])):
            self._fetched[p] = (self.store.writes(p), arr)
        self._restack(slots.stacks)
        stacked = [self._stacked[paths][1] for paths in slots.stacks]
        self.fetch_wait_s += time.perf_counter() - t0

        def arg(slot: Any) -> jax.Array:
            return self._fetched[slot][1] if isinstance(slot, str) else stacked[slot]

        return [arg(x) for x in slots.trained], [arg(x) for x in slots.frozen]

    def adopt(self, slots: Slots, new: Sequence[jax.Array]) -> None:
        """Takes ``new`` (per trained slot, the array the store now holds) as the next arguments as they are."""
        for slot, x in zip(slots.trained, new):
            if isinstance(slot, str):
                self._fetched[slot] = (self.store.writes(slot), x)
            else:
                self._stacked[slots.stacks[slot]] = (tuple(self.store.writes(p) for p in slots.stacks[slot]), x)

    def _copy_out(self, layouts: Sequence[Any], bufs: Sequence[dict[int, np.ndarray]],
                  dtypes: Sequence[str]) -> list[jax.Array]:
        """Sharded arrays in pinned host memory from host buffers that the optimizer overwrites in place (its
        float32 masters: see [Note: masters in rows] in :mod:`zinf_jax.optim.state_io`), each copied once
        (counted), cast to ``dtypes`` (the compute dtype's) on the way."""
        if not bufs:
            return []
        dev = self.mesh.devices.flat[0]
        owned = [{i: put_source(x, dt, dev) for i, x in b.items()} for b, dt in zip(bufs, dtypes)]
        self.host_copy_bytes += sum(x.nbytes for b in owned for x in b.values())
        # the transfers finish here: the buffers they read are rewritten by the next optimizer step
        return jax.block_until_ready(assemble_many(layouts, self.mesh, owned, memory_kind="pinned_host"))

    def stack_dtype(self, path: str, layered: bool = False) -> str:
        """The dtype a stack of ``path``'s layers is copied out in (``layered``: ``path`` is itself a stack of
        layers, the model scanning it): the stored dtype, except that a stack of 1-D layers in host memory stays
        float32 where the stored dtype is narrower. XLA:TPU slices a row of a host array only at its packing
        granularity (two bfloat16 rows per 32-bit sublane: "Sublane slicing size must be multiple of element
        packing factor"), and a 1-D layer's stack is 2-D, its layer axis tiled. Such layers (biases, norm
        scales) are a vanishing share of a model's bytes; the cast to the compute dtype runs after the move."""
        dtype = self.store.dtype_of(path)
        rank = len(self.store.layouts[path].stored_shape) - int(layered)
        if self.host_params and rank == 1 and jnp.dtype(dtype).itemsize < 4:
            return "float32"
        return dtype

    def _raw_stack(self, path: str) -> bool:
        """A stack of ``path``'s layout is built from the tier's shards, not from fetched arrays."""
        return self.host_params or self.store.layouts[path].dim is None

    def _restack(self, stacks: Sequence[tuple[str, ...]]) -> None:
        """Rebuilds the stacks (each: the stored shards of ``paths``, one layout, along a new first axis, in
        their tier's memory) of which the store wrote a path since they were built.

        Stacks of the optimizer's masters kept as rows of one host array are copied out whole, once (see
        [Note: masters in rows] in :mod:`zinf_jax.optim.state_io`). Other stacks built from the tier's shards
        (the cpu tier's host shards; a persistent parameter's one shard) are stacked per shard index (numpy
        on the host) and placed by one batched put for all of them; the device tier's sharded ones by one
        jitted stack of the fetched arrays each.
        """
        stale = []
        for paths in stacks:
            writes = tuple(self.store.writes(p) for p in paths)
            hit = self._stacked.get(paths)
            if hit is None or hit[0] != writes:
                stale.append((paths, writes))
        raw = [(paths, w) for paths, w in stale if self._raw_stack(paths[0])]
        rows = [self.store.host_rows(paths) if self.host_params else None for paths, _ in raw]
        direct = [(paths, w, r) for (paths, w), r in zip(raw, rows) if r is not None]  # the optimizer's rows
        lays = [stacked_layout(self.store.layouts[paths[0]], len(paths)) for paths, _, _ in direct]
        outs = self._copy_out(lays, [r for _, _, r in direct],
                              [self.stack_dtype(paths[0]) for paths, _, _ in direct])
        for (paths, writes, _), out in zip(direct, outs):
            self._stacked[paths] = (writes, out)
        raw = [(paths, w) for (paths, w), r in zip(raw, rows) if r is None]
        if raw:
            shards = self.store.read_shards([p for paths, _ in raw for p in paths])
            lays, bufs, at = [], [], 0
            for paths, _ in raw:
                mine, at = shards[at:at + len(paths)], at + len(paths)
                lays.append(stacked_layout(self.store.layouts[paths[0]], len(paths)))
                bufs.append({i: [s[i] for s in mine] for i in mine[0]})
            if self.host_params:
                bufs = [{i: np.stack([np.asarray(x) for x in xs]).astype(self.stack_dtype(paths[0]), copy=False)
                         for i, xs in b.items()} for b, (paths, _) in zip(bufs, raw)]
                # the stack, then its put into pinned host memory: two passes over its bytes
                self.host_copy_bytes += 2 * sum(x.nbytes for b in bufs for x in b.values())
            else:  # device arrays: one program per device for all of them (a dispatch each costs as much)
                bufs = _stack_per_device(bufs)
            kind = "pinned_host" if self.host_params else None
            for (paths, writes), out in zip(raw, assemble_many(lays, self.mesh, bufs, memory_kind=kind)):
                self._stacked[paths] = (writes, out)
        rest = [(paths, writes) for paths, writes in stale if not self._raw_stack(paths[0])]
        if rest:
            shardings = tuple(NamedSharding(self.mesh, P(None, *self.store.layouts[paths[0]].spec))
                              for paths, _ in rest)
            outs = _stacker(shardings)([[self._fetched[p][1] for p in paths] for paths, _ in rest])
            for (paths, writes), out in zip(rest, outs):
                self._stacked[paths] = (writes, out)
