"""The step's gradient shards in one host buffer, laid out in the order the optimizer reads them.

[Note: the gradient arena]
A host optimizer reads each local gradient shard twice a step: once for the global norm, once for the update.
Held as one array per shard (the gradient sink's own, allocated every step), that costs a Python call and a
kernel launch per shard for the norm, a copy of every small shard into its pack's buffer for the update, and
a fresh allocation (page faults) per shard per step: per-leaf costs that dominate a model of hundreds of small
leaves (LoRA adapters, norms and biases). The arena is one float32 buffer, kept across steps, holding every
trained local shard at an offset the optimizer chose: the members of each pack side by side in the pack's
order. The sink copies each shard's gradient straight into its slot (a second contribution, a tied
parameter's, adds in place); the norm of a complete step is one pass over the buffer, and a pack's
gradient is a view of it. Which shards arrived is tracked per step; a shard without a gradient reads as
``None``, as from the sink.
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np

from zinf_jax.optim.kernel import sum_squares

__all__ = ["GradArena"]

Key = tuple[str, int]


class GradArena:
    """Float32 gradient shards of this process in one buffer (see [Note: the gradient arena]).

    Args:
      layout: ``(path, shard index, shard shape, aligned)`` of every trained local shard, in the order the
        optimizer reads them; an ``aligned`` shard starts on a 64-byte boundary (XLA's CPU client reads such an
        array without a copy), the others right after the shard before them (a pack's later members).
    """

    def __init__(self, layout: Sequence[tuple[str, int, tuple[int, ...], bool]]):
        self._slots: dict[Key, tuple[int, int, tuple[int, ...]]] = {}
        self._present: set[Key] = set()
        self._runs: dict[tuple[Key, int], tuple[int, int]] = {}  # run(): (first key, length) -> (start, stop or -1)
        self._size = 0
        self._buffer: np.ndarray | None = None  # made at the first gradient (an engine whose update runs in its
        self.relayout(layout)                   # program never makes it)

    def relayout(self, layout: Sequence[tuple[str, int, tuple[int, ...], bool]]) -> None:
        """Lays the shards out in a new order, keeping the gradients present."""
        slots, at = {}, 0
        for path, index, shape, aligned in layout:
            at += -at % 16 if aligned else 0
            n = math.prod(shape)
            slots[(path, index)] = (at, n, tuple(shape))
            at += n
        old, old_slots = self._buffer, self._slots
        self._slots, self._size, self._buffer, self._runs = slots, at, None, {}
        self._present &= set(slots)
        if old is not None and self._present:
            buffer = self.buffer
            for key in self._present:
                lo, n, _ = slots[key]
                buffer[lo:lo + n] = old[old_slots[key][0]:old_slots[key][0] + n]

    @property
    def buffer(self) -> np.ndarray:
        """The buffer (64-byte aligned, as XLA's CPU client reads without a copy)."""
        if self._buffer is None:
            raw = np.zeros(self._size + 16, np.float32)  # (zeros: the alignment gaps add nothing to the norm)
            start = ((-raw.ctypes.data) % 64) // 4
            self._buffer = raw[start:start + self._size]
        return self._buffer

    def __contains__(self, key: Key) -> bool:
        return key in self._slots

    def has(self, path: str, index: int) -> bool:
        """A gradient of the shard arrived this step."""
        return (path, index) in self._present

    def put(self, path: str, index: int, grad: np.ndarray) -> None:
        """The shard's gradient (any float dtype, the shard's size): copied into its slot, or added to what is
        there."""
        lo, n, _ = self._slots[(path, index)]
        slot = self.buffer[lo:lo + n]
        src = np.asarray(grad).reshape(-1)
        if (path, index) in self._present:
            np.add(slot, src, out=slot, casting="unsafe")
        else:
            np.copyto(slot, src, casting="unsafe")
            self._present.add((path, index))

    def accumulator(self, path: str, index: int) -> np.ndarray:
        """The shard's slot in its shape, to add into in place: zeros when nothing arrived yet this step."""
        lo, n, shape = self._slots[(path, index)]
        slot = self.buffer[lo:lo + n]
        if (path, index) not in self._present:
            slot[:] = 0.0
            self._present.add((path, index))
        return slot.reshape(shape)

    def __call__(self, path: str, index: int) -> np.ndarray | None:
        """The shard's gradient this step (a view of the buffer, in its shape), or ``None``."""
        if (path, index) not in self._present:
            return None
        lo, n, shape = self._slots[(path, index)]
        return self.buffer[lo:lo + n].reshape(shape)

    def items(self) -> Iterable[tuple[Key, np.ndarray]]:
        return [(key, self(*key)) for key in self._slots if key in self._present]

    def complete(self) -> bool:
        """Every shard got its gradient this step."""
        return len(self._present) == len(self._slots)

    def norm_sq(self) -> float:
        """The sum of squares of every shard (of a complete step), in one pass (the gaps that align shards are
        zeros)."""
        return sum_squares(self.buffer)

    def run(self, keys: Sequence[Key]) -> np.ndarray | None:
        """The gradients of ``keys`` as one view, where they sit side by side in this order and all arrived."""
        if not keys or (len(self._present) != len(self._slots) and any(k not in self._present for k in keys)):
            return None
        span = self._runs.get((keys[0], len(keys)))  # (a shard is in one run: its first key and length name it)
        if span is None:
            lo, n, _ = self._slots[keys[0]]
            at = lo + n
            for key in keys[1:]:
                k_lo, k_n, _ = self._slots[key]
                at = k_lo + k_n if k_lo == at else -1
            span = self._runs[(keys[0], len(keys))] = (lo, at)
        return None if span[1] < 0 else self.buffer[span[0]:span[1]]

    def clear(self) -> None:
        """Forgets this step's gradients (the buffer is kept)."""
        self._present.clear()

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.nbytes
