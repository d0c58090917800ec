"""Gradients out of host RAM: gradient shards written to a tier as they are produced.

With NVMe offload the gradient of the whole model does not fit the host next
to everything else (it is as large as the fp32 master). :class:`TierGrads`
takes each reduce-scattered gradient shard when a unit's backward produces it,
cuts it into the optimizer's sub-groups (the chunks of ``master/<path>``) and
writes them to the keys ``grad/<path>`` of a tier (the engine's scratch tier on
NVMe), so host RAM holds a gradient only while it is being written.

The global norm is accumulated on the way: the squared sum of every chunk is
recorded as it is written (``inf`` for a non-finite chunk of a shard this
process does not own), and :meth:`TierGrads.norm_sq` sums them with
``math.fsum``, which is correctly rounded and so independent of order: the
same value as a norm pass over gradients held in RAM, bitwise.

Shards smaller than :data:`IN_RAM_BELOW` stay in host RAM (a file per tiny
chunk cost more than the whole update), up to :data:`RAM_BYTES` of them a step;
the rest go to the tier like larger ones, so what a step holds in RAM does not
grow with the number of layers (issue 47: a d_model 1024 block's attention
kernels are 0.5 MiB shards on 8 devices, 16 MiB of RAM a layer).

A shard that receives a second contribution in the same step (a tied
embedding used by two units, the next micro-batch under gradient accumulation)
is read back, summed and rewritten. The optimizer reads ``grad/<path>`` next
to ``master``/``m``/``v`` per sub-group; a shard that received nothing this
step is never read (its stale data stays unused; the update sees zeros).
"""
from __future__ import annotations

import math
import threading
import time
from concurrent.futures import Future
from typing import Callable, Mapping

import numpy as np

from zinf_jax.optim.kernel import all_finite, sum_squares
from zinf_jax._internal.futures import done_future
from zinf_jax.tiers.base import ShardSpec, Tier

__all__ = ["TierGrads", "GRAD", "IN_RAM_BELOW", "RAM_BYTES", "ram_bytes", "stays_in_ram"]

GRAD = "grad"
"""Key prefix of gradient chunks in the tier."""

IN_RAM_BELOW = 1 << 20
"""Gradient shards of fewer bytes (float32) are kept in host RAM instead of the tier (up to :data:`RAM_BYTES`)."""

RAM_BYTES = 64 << 20
"""The most bytes of small gradient shards a step keeps in host RAM; the rest are written to the tier."""


def stays_in_ram(numel: int) -> bool:
    """Whether a gradient shard of ``numel`` elements is small enough to stay in host RAM (float32, under
    :data:`IN_RAM_BELOW` bytes) rather than go to the scratch tier: the one rule the tier, the host plan and the
    estimator read."""
    return 4 * numel < IN_RAM_BELOW


def ram_bytes(small: int) -> int:
    """Host bytes a step's small gradient shards hold, of ``small`` bytes of them (the host plan's and the
    estimator's figure; a shard's padding to whole chunks aside)."""
    return min(small, RAM_BYTES)


class TierGrads:
    """This step's gradient shards in a tier, chunked like the optimizer's sub-groups.

    Args:
      tier: where they go (written in place, never committed as training state).
      geometry: path to ``(numel, chunk, n_chunks, num_shards)`` of its shards.
      local: path to the shard indices this process holds.
      owner: whether shard ``(path, i)`` counts in the global norm.
    """

    def __init__(self, tier: Tier, geometry: Mapping[str, tuple[int, int, int, int]],
                 local: Mapping[str, list[int]], owner: Callable[[str, int], bool], ram_limit: int = RAM_BYTES):
        self.tier, self._geo, self._local, self._owner = tier, dict(geometry), dict(local), owner
        self._ram_limit, self._ram_bytes = int(ram_limit), 0
        self._sums: dict[tuple[str, int], list[float]] = {}
        self._ram: dict[tuple[str, int], np.ndarray] = {}  # small shards, padded to whole chunks
        self._pending: list[Future] = []
        self._lock = threading.Lock()
        self.seconds = 0.0
        """Seconds spent in :meth:`add` (norms, padding, read-back, queueing writes) since construction."""

    def declare(self) -> None:
        """Declares ``grad/<path>`` for every path (one key per path, the optimizer's chunk layout)."""
        for path, (_, chunk, n, shards) in self._geo.items():
            local = [i * n + c for i in self._local[path] for c in range(n)]
            self.tier.declare(f"{GRAD}/{path}", ShardSpec(shard_shape=(chunk,), dtype="float32",
                                                            num_shards=shards * n), local)

    def add(self, path: str, index: int, grad: np.ndarray) -> None:
        """Adds one gradient shard (stored form, any float dtype) of ``path`` to what this step holds."""
        t0 = time.perf_counter()
        numel, chunk, n, _ = self._geo[path]
        flat = np.asarray(grad, np.float32).reshape(-1)
        if flat.shape[0] != numel:
            raise ValueError(f"gradient shard of {path!r} has {flat.shape[0]} elements, layout says {numel}")
        key = (path, index)
        with self._lock:
            again = key in self._sums
        if again:  # a second contribution this step: read back, sum, rewrite
            flat = self.read(path, index)[:numel] + flat
        with self._lock:  # small, and within the step's RAM bound (a repeat keeps its place)
            in_ram = stays_in_ram(numel) and (
                key in self._ram or self._ram_bytes + 4 * n * chunk <= self._ram_limit)
        if in_ram:
            padded = np.zeros(n * chunk, np.float32)
            padded[:numel] = flat
        own = self._owner(path, index)
        sums, futs = [], []
        for c in range(n):
            part = flat[c * chunk:(c + 1) * chunk]
            if own:
                sums.append(sum_squares(part))
            elif not all_finite(part):
                sums.append(math.inf)  # a NaN in a replica makes every process skip
            if in_ram:
                continue
            if part.shape[0] < chunk:  # the last chunk is zero-padded in the tier
                part = np.concatenate([part, np.zeros(chunk - part.shape[0], np.float32)])
            futs.append(self.tier.put(f"{GRAD}/{path}", index * n + c, part))
        with self._lock:
            if in_ram:
                self._ram_bytes += 0 if key in self._ram else padded.nbytes
                self._ram[key] = padded
            self._sums[key] = sums
            self._pending = [f for f in self._pending if not f.done()] + futs
            self.seconds += time.perf_counter() - t0

    def has(self, path: str, index: int) -> bool:
        """Whether shard ``index`` of ``path`` received a gradient this step."""
        return (path, index) in self._sums

    def nbytes(self) -> int:
        """Host bytes held: the small shards kept in RAM."""
        with self._lock:
            return sum(a.nbytes for a in self._ram.values())

    def norm_sq(self) -> float:
        """This process's share of the squared global norm (``inf``/``nan``: non-finite)."""
        with self._lock:
            return math.fsum(x for sums in self._sums.values() for x in sums)

    def read_chunk(self, path: str, index: int, chunk: int, out: np.ndarray) -> Future:
        """Reads chunk ``chunk`` of shard ``index`` into ``out`` (``chunk`` float32 elements)."""
        _, size, n, _ = self._geo[path]
        held = self._ram.get((path, index))
        if held is not None:
            out[...] = held[chunk * size:(chunk + 1) * size]
            return done_future(out)
        return self.tier.get(f"{GRAD}/{path}", index * n + chunk, out=out)

    def read(self, path: str, index: int) -> np.ndarray:
        """The whole (padded) gradient shard, flat."""
        _, chunk, n, _ = self._geo[path]
        out = np.empty(n * chunk, np.float32)
        for f in [self.read_chunk(path, index, c, out[c * chunk:(c + 1) * chunk]) for c in range(n)]:
            f.result()
        return out

    def wait(self) -> None:
        """Blocks until every gradient written so far is in the tier (raises a failed write's error)."""
        with self._lock:
            futs, self._pending = self._pending, []
        for f in futs:
            f.result()

    def clear(self) -> None:
        """Starts a new step: nothing received yet (waits for writes still in flight first)."""
        try:
            self.wait()
        finally:
            with self._lock:
                self._sums.clear()
                self._ram.clear()
                self._ram_bytes = 0
            self.tier.commit()  # a scratch tier publishes nothing: this only ends its generation
