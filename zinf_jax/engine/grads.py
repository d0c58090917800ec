"""The gradient sink: where reduce-scattered parameter gradients go.

Each unit's backward hands its float32 gradients, already reduce-scattered to
the stored sharding, to :meth:`GradSink.add`. The sink copies this process's
shards to host arrays of their own (device memory is released at once), keeps
them as they are, and sums repeated contributions, so a parameter used by two
unit calls (a tied embedding) gets the sum of both gradients.

Given a ``target`` (the optimizer's :class:`~zinf_jax.optim.grads_out.TierGrads`,
with NVMe offload), the sink holds nothing: each host shard goes straight to
the target, which writes it to the grad tier and sums repeats there. Given the
optimizer's :class:`~zinf_jax.optim.grad_arena.GradArena`, the shards it lays out
are copied straight into it (see [Note: the gradient arena]).
"""
from __future__ import annotations

import dataclasses

import threading
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from zinf_jax.optim.grad_arena import GradArena
from zinf_jax.plan.partition import ParamLayout, split_local

__all__ = ["GradSink", "host_copy"]


def host_copy(x: jax.Array) -> np.ndarray:
    """A single-device array's float32 values in a host array of their own, which holds no device buffer.

    Elsewhere ``np.asarray`` is that device-to-host copy; on the CPU backend it is a view of the device
    buffer, which the copy here releases (the sink keeps what it is handed: :meth:`GradSink.add_local`).
    """
    if isinstance(x, np.ndarray) or next(iter(x.devices())).platform == "cpu":  # (a row of one read as numpy)
        return np.array(x, dtype=np.float32, copy=True)
    return np.asarray(x, dtype=np.float32)


class GradSink:
    """Host float32 accumulators per (parameter path, local shard index).

    Args:
      layouts: parameter layouts (for the shard indices).
      mesh: the mesh.
      target: where shards go instead of host accumulators (``add(path, index,
        host_shard)`` and ``clear()``), e.g. a
        :class:`~zinf_jax.optim.grads_out.TierGrads`.
      arena: where the shards it lays out go (no target): one buffer in the optimizer's order.
    """

    def __init__(self, layouts: Mapping[str, ParamLayout], mesh: Mesh, target: Any = None,
                 arena: GradArena | None = None):
        self.layouts = layouts
        self.mesh = mesh
        self.target = target
        self.arena = arena if target is None else None
        self._acc: dict[tuple[str, int], np.ndarray] = {}
        self._rows: dict[tuple[str, int], list] = {}  # a target's stacked shards being summed (add_layer)
        self._summed: set[tuple[str, int]] = set()  # shards whose gradient is a sum the sink made (its own array)
        self._lock = threading.Lock()

    @property
    def source(self) -> Callable[[str, int], np.ndarray | None] | Any:
        """What the optimizer step reads the gradients from: the arena, :meth:`get`, or the target."""
        if self.target is not None:
            return self.target
        return self.get if self.arena is None else self.arena  # (the arena holds every trained shard)

    def _into(self, path: str, index: int, shard: Any) -> None:
        """One local shard of a device gradient to :meth:`add_local`: as it reads on the host for a shard the arena
        copies into its slot (one copy), else a host array of its own (:func:`host_copy`)."""
        arena = self.arena is not None and (path, index) in self.arena
        self.add_local(path, index, np.asarray(shard) if arena else host_copy(shard))

    def add(self, path: str, grad: jax.Array) -> None:
        """Adds a stored-form, sharded float32 gradient of ``path``."""
        self.add_many([path], [grad])

    def add_many(self, paths: Sequence[str], grads: Sequence[jax.Array]) -> None:
        """Adds the gradients of several parameters (a unit's), their device-to-host copies issued together."""
        parts = [(path, split_local(self.layouts[path], self.mesh, g)) for path, g in zip(paths, grads)]
        for _, shards in parts:
            for s in shards.values():
                s.copy_to_host_async()
        for path, shards in parts:
            for idx, s in shards.items():
                self._into(path, idx, s)

    def _to_host(self, paths: Sequence[str], layouts: Sequence[ParamLayout],
                 grads: Sequence[jax.Array]) -> Iterator[tuple[str, int, np.ndarray]]:
        """``(path, shard index, float32 host shard)`` of each local shard of ``grads`` (sharded as ``layouts``),
        every device-to-host copy issued before the first is waited for."""
        parts = [(path, split_local(lay, self.mesh, g)) for path, lay, g in zip(paths, layouts, grads)]
        for _, shards in parts:
            for s in shards.values():
                s.copy_to_host_async()
        for path, shards in parts:
            for idx, s in shards.items():
                yield path, idx, host_copy(s)

    def add_stacked(self, paths: Sequence[str], grad: jax.Array) -> None:
        """Adds gradients that arrive stacked, ``grad[k]`` being ``paths[k]``'s (a scanned run's parameters,
        see [Note: scanned runs] in :mod:`zinf_jax.engine.compiled`); the paths share one layout."""
        shards = split_local(self.layouts[paths[0]], self.mesh, grad)
        for s in shards.values():
            s.copy_to_host_async()
        for idx, s in shards.items():
            host = np.asarray(s)
            for k, path in enumerate(paths):
                self._into(path, idx, host[k])

    def add_rows(self, path: str, pieces: Sequence[tuple[int, jax.Array]]) -> None:
        """Adds a stacked parameter's gradient that arrives in pieces along its leading (layer) axis, each
        ``(first row, rows)`` (a model-scanned stack's backward: [Note: staged gradients] in
        :mod:`zinf_jax.engine.staged`); the pieces cover the axis."""
        lay = self.layouts[path]
        rows: dict[int, np.ndarray] = {}
        for a, g in pieces:
            part = dataclasses.replace(lay, shape=(g.shape[0], *lay.shape[1:]))
            for _, idx, host in self._to_host([path], [part], [g]):
                if idx not in rows:
                    rows[idx] = np.empty((lay.shape[0], *host.shape[1:]), np.float32)
                rows[idx][a:a + host.shape[0]] = host
        for idx, full in rows.items():
            self.add_local(path, idx, full)

    def add_layer(self, paths: Sequence[str], layouts: Sequence[ParamLayout], grads: Sequence[jax.Array], layer: int,
                  n: int) -> None:
        """Adds the gradients of one layer of stacked parameters (``layouts``: one layer's; see [Note: layers of a
        stack] in :mod:`zinf_jax.engine.streamed`) into row ``layer`` of each stacked shard's gradient.

        With a target, a stacked shard's rows are summed here and handed over once all ``n`` arrived (a
        backward pass calls every layer once).
        """
        for path, idx, row in self._to_host(paths, layouts, grads):
            with self._lock:
                if self.target is None:
                    if self.arena is not None and (path, idx) in self.arena:
                        acc = self.arena.accumulator(path, idx)
                    else:
                        acc = self._acc.get((path, idx))
                        if acc is None:
                            acc = self._acc[(path, idx)] = np.zeros((n, *row.shape), np.float32)
                    acc[layer] += row
                    continue
                rows = self._rows.setdefault((path, idx), [np.zeros((n, *row.shape), np.float32), 0])
                rows[0][layer] += row
                rows[1] += 1
                done = rows[1] == n
                if done:
                    del self._rows[(path, idx)]
            if done:
                self.target.add(path, idx, rows[0])

    def add_local(self, path: str, index: int, grad: np.ndarray) -> None:
        """Adds a host gradient for one local shard.

        ``grad`` is handed over (:func:`host_copy`): the sink keeps it as the shard's gradient without a copy
        (it may be read only) until a second gradient of the shard is added.
        """
        if self.target is not None:
            self.target.add(path, index, grad)
            return
        key = (path, index)
        with self._lock:
            if self.arena is not None and key in self.arena:
                self.arena.put(path, index, grad)
                return
            acc = self._acc.get(key)
            if acc is None:
                self._acc[key] = np.asarray(grad, dtype=np.float32)
            elif key in self._summed:  # the sink's own array
                acc += grad
            else:
                self._acc[key] = np.add(acc, grad, dtype=np.float32)
                self._summed.add(key)

    def get(self, path: str, index: int) -> np.ndarray | None:
        """The accumulated gradient shard, or ``None`` if none arrived this step."""
        if self.arena is not None and (path, index) in self.arena:
            return self.arena(path, index)
        return self._acc.get((path, index))

    def items(self) -> Iterator[tuple[tuple[str, int], np.ndarray]]:
        arena = list(self.arena.items()) if self.arena is not None else []
        return iter(arena + list(self._acc.items()))

    def nbytes(self) -> int:
        """Host bytes held (by the target, with one)."""
        if self.target is not None:
            return self.target.nbytes()
        return sum(a.nbytes for a in self._acc.values()) + (self.arena.nbytes if self.arena is not None else 0)

    def clear(self) -> None:
        """Forgets every gradient (start of a step)."""
        with self._lock:
            self._acc.clear()
            self._rows.clear()
            self._summed.clear()
            if self.arena is not None:
                self.arena.clear()
        if self.target is not None:
            self.target.clear()
