"""The prefetcher: keeps the next units' parameters in flight.

It walks a static schedule (the plan's forward calls, then the same in reverse
for the backward pass). When unit ``i`` of the schedule is taken, fetches for
``i+1 .. i+depth`` are issued on a worker thread (tier read, host-to-device
copy, assembly into sharded arrays), as long as the bytes held on device stay
under ``max_live_bytes``. A call that does not follow the schedule is served on
demand.

A unit that ``keep`` names (one whose parameters are all whole: nothing to gather, the same arrays
on every device) is held from its forward call to its last call of the pass instead of being
fetched again for its backward: parameters do not change within a pass, and its arrays are put on
every device whole, which made the second fetch as dear as the first (the d=128 GPT's blocks, all
under ``persistence_threshold``: the prefetch threads' device puts were ~35 ms of CPU a step).
Held units count in :meth:`Prefetcher.held_bytes`, so ``max_live_bytes`` still bounds the total.
"""
from __future__ import annotations

import time

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Sequence

import jax

from zinf_jax._internal.futures import done_future

__all__ = ["Prefetcher"]

Call = tuple[int, str]


class Prefetcher:
    """Schedules unit fetches ahead of use.

    Args:
      fetch: uid to the unit's stored-form device arrays (runs on a worker).
      nbytes: uid to the device bytes those arrays take.
      depth: units kept in flight ahead of the current one (0: fetch on use).
      max_live_bytes: bound on bytes held (current + prefetched + kept); ``None``: none.
      keep: uid to whether its arrays are held for its later calls of a pass (default: none are).
    """

    def __init__(
        self,
        fetch: Callable[[int], list[jax.Array]],
        nbytes: Callable[[int], int],
        depth: int,
        max_live_bytes: int | None,
        keep: Callable[[int], bool] = lambda uid: False,
    ):
        self._fetch = fetch
        self._nbytes = nbytes
        self._keep = keep
        self.depth = depth
        self.max_live_bytes = max_live_bytes
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="zinf-prefetch")
        self.wait_s = 0.0
        """Seconds :meth:`take` spent waiting for fetches not yet done, since construction."""
        self._schedule: tuple[Call, ...] = ()
        self._pos = 0
        self._inflight: dict[int, Future] = {}
        self._current: tuple[int, list[jax.Array]] | None = None
        self._kept: dict[int, list[jax.Array]] = {}  # uid -> arrays held for a later call of this pass
        self._last: dict[int, int] = {}  # uid -> the last schedule position that calls it
        self.fetches = 0

    def start(self, schedule: Sequence[Call]) -> None:
        """Begins a pass over ``schedule`` and issues the first fetches."""
        self.finish()
        self._schedule = tuple(schedule)
        self._last = {uid: p for p, (uid, _) in enumerate(self._schedule)}
        self._pos = 0
        self._fill()

    def held_bytes(self) -> int:
        """Bytes of parameters held on device: the current unit, prefetched and kept ones."""
        uids = {self._schedule[p][0] for p in self._inflight} | set(self._kept)
        if self._current is not None:
            uids.add(self._current[0])
        return sum(self._nbytes(u) for u in uids)

    def settle(self) -> None:
        """Waits until the fetches in flight have landed (their arrays are then all live)."""
        for fut in list(self._inflight.values()):
            fut.result()

    def take(self, call: Call) -> list[jax.Array]:
        """The arrays of the unit of ``call``, prefetched when the schedule foresaw it."""
        uid = call[0]
        expected = self._schedule[self._pos] if self._pos < len(self._schedule) else None
        fut = None
        if expected is not None and expected[0] == uid:
            fut = self._inflight.pop(self._pos, None)
            self._pos += 1
        if fut is None:  # not foreseen (or not fetched ahead): served now
            if self._current is not None and self._current[0] == uid:
                fut = done_future(self._current[1])
            elif uid in self._kept:
                fut = done_future(self._kept[uid])
            else:
                fut = self._submit(uid)
        t = time.perf_counter()
        arrays = fut.result()
        self.wait_s += time.perf_counter() - t
        self._current = (uid, arrays)
        if self._keep(uid) and self._last.get(uid, -1) >= self._pos:  # called again later in this pass
            self._kept[uid] = arrays
        else:
            self._kept.pop(uid, None)
        self._fill()
        return arrays

    def release(self) -> None:
        """Drops the reference to the current unit unless the next call reuses it."""
        if self._current is None:
            return
        nxt = self._schedule[self._pos] if self._pos < len(self._schedule) else None
        if nxt is None or nxt[0] != self._current[0]:
            self._current = None

    def _submit(self, uid: int) -> Future:
        self.fetches += 1
        return self._pool.submit(self._fetch, uid)

    def _fill(self) -> None:
        stop = min(len(self._schedule), self._pos + self.depth)
        for p in range(self._pos, stop):
            if p in self._inflight:
                continue
            uid = self._schedule[p][0]
            if self._current is not None and self._current[0] == uid:
                self._inflight[p] = done_future(self._current[1])
                continue
            if uid in self._kept:
                self._inflight[p] = done_future(self._kept[uid])
                continue
            if any(self._schedule[q][0] == uid for q in self._inflight):
                q = next(q for q in self._inflight if self._schedule[q][0] == uid)
                self._inflight[p] = self._inflight[q]
                continue
            if self.max_live_bytes is not None and self.held_bytes() + self._nbytes(uid) > self.max_live_bytes:
                break
            self._inflight[p] = self._submit(uid)

    def finish(self) -> None:
        """Ends the pass: waits for stray fetches and drops every reference."""
        for f in self._inflight.values():
            f.exception()
        self._inflight.clear()
        self._current = None
        self._kept.clear()

    def close(self) -> None:
        self.finish()
        self._pool.shutdown(wait=True)
