"""The in-memory tiers: device memory and host RAM.

Memory does not outlive the process, so these tiers have no committed state to
protect from a crash and keep one copy of every shard: a put replaces it (the
numpy host tier overwrites its buffer in place, as DeepSpeed's CPU optimizer
updates its state), and :meth:`commit` waits for the puts and records the
metadata. A tier holding the optimizer state therefore costs 12 B/param, not
twice that. Transfers run on a small thread pool so that puts and gets are
asynchronous like the NVMe tier's, with in-flight bytes bounded by the same
:class:`ByteBudget`; a get waits for an earlier put of the same shard. Declared keys
live in a :class:`~zinf_jax.tiers.keys.KeyRegistry`, as in the NVMe tier.
"""
from __future__ import annotations

import contextlib
import math
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import numpy as np

from zinf_jax._internal.futures import done_future
from zinf_jax.tiers.base import ByteBudget, ShardSpec, TierError, np_dtype as _np
from zinf_jax.tiers.keys import KeyRegistry

__all__ = ["DeviceTier", "CpuTier", "put_source"]

# [Note: one copy per put]
# A put of a numpy shard makes one copy, into the tier's own array: the caller (the optimizer) reuses its
# buffers, so the tier may not keep them. To a GPU's or TPU's pinned host memory jax.device_put is that
# copy (a pageable numpy buffer cannot be pinned memory). On the CPU backend device_put may alias the numpy
# buffer (may_alias=False does not stop it for host memory kinds), so there the tier copies into a fresh
# array first and the put aliases it: one copy on every backend (put_source).
# MemoryTier.copied_bytes counts these copies (see scripts/bench_step.py's host-copy count).


INLINE_BYTES = 1 << 18
"""Transfers smaller than this run in the caller's thread (a completed future), not on the pool."""


def _nbytes(value: Any) -> int:
    return math.prod(value.shape) * np.dtype(value.dtype).itemsize


def put_source(value: Any, dtype: Any, device: jax.Device) -> np.ndarray:
    """``value`` as the source of a put to ``device`` that copies it once (see [Note: one copy per put])."""
    if device.platform == "cpu":
        return np.array(value, dtype=dtype, copy=True)
    return np.asarray(value, dtype=dtype)


class _MemoryTier:
    """Shared bookkeeping of the device and cpu tiers (not public)."""

    def _copied(self, value: Any) -> None:
        with self._count_lock:
            self.copied_bytes += _nbytes(value)

    kind = "memory"

    def __init__(self, *, max_in_flight_bytes: int, io_threads: int = 2):
        self.budget = ByteBudget(max_in_flight_bytes)
        self._keys = KeyRegistry(self.kind)
        self._data: dict[tuple[str, int], Any] = {}
        self._bytes = 0  # bytes of the shards in _data (see :meth:`_set`)
        self._swaps = 0  # grows whenever a shard's stored object is replaced (see CpuTier.share_run)
        self._puts: dict[tuple[str, int], Future] = {}  # the last put of each shard (reads wait for it)
        self._meta: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix=f"zinf-{self.kind}")
        self.copied_bytes = 0  # bytes copied from callers' host buffers by puts (see [Note: one copy per put])
        self._count_lock = threading.Lock()
        self._futures: set[Future] = set()
        self._version = 0  # puts so far (see :attr:`version`)

    # --- layout (see :class:`~zinf_jax.tiers.keys.KeyRegistry`) ----------------
    def declare(self, key: str, spec: ShardSpec, local_indices: Sequence[int] | None = None) -> None:
        self._keys.declare(key, spec, local_indices)

    def keys(self) -> list[str]:
        return self._keys.keys()

    def spec(self, key: str) -> ShardSpec:
        return self._keys.spec(key)

    def local_indices(self, key: str) -> list[int]:
        return self._keys.local_indices(key)

    # --- I/O ----------------------------------------------------------------
    def _submit(self, nbytes: int, fn: Callable[[], Any]) -> Future:
        if nbytes < INLINE_BYTES:  # a pool round trip costs more than the copy
            fut: Future = Future()
            try:
                fut.set_result(fn())
            except Exception as e:  # noqa: BLE001 - delivered through the future, as from the pool
                fut.set_exception(e)
            return fut
        self.budget.acquire(nbytes)

        def run():
            try:
                return fn()
            finally:
                self.budget.release(nbytes)

        fut = self._pool.submit(run)
        with self._lock:
            self._futures.add(fut)
        fut.add_done_callback(self._forget)
        return fut

    def _forget(self, fut: Future) -> None:
        with self._lock:
            self._futures.discard(fut)

    def _check(self, key: str, index: int, value: Any | None = None) -> ShardSpec:
        spec = self.spec(key)
        if not 0 <= index < spec.num_shards:
            raise TierError(f"{self.kind} tier: shard {index} of {key!r} out of range 0..{spec.num_shards - 1}")
        if value is not None and tuple(value.shape) != spec.shard_shape:
            raise TierError(
                f"{self.kind} tier: shard of {key!r} has shape {tuple(value.shape)}, declared {spec.shard_shape}"
            )
        return spec

    def _settle(self, key: str, index: int) -> None:
        """Waits (in the caller's thread) for the last put of a shard, so I/O on it stays in program order."""
        with self._lock:
            last = self._puts.get((key, index))
        if last is not None:
            last.result()

    def _settle_many(self, shards: Sequence[tuple[str, int]]) -> None:
        """:meth:`_settle` of several shards."""
        with self._lock:
            last = [f for f in (self._puts.get(s) for s in shards) if f is not None]
        for f in last:
            f.result()

    @property
    def version(self) -> int:
        """Grows with every put: a holder of arrays built from the shards knows none changed while it is the same."""
        return self._version

    def put(self, key: str, index: int, value: Any) -> Future:
        spec = self._check(key, index, value)
        self._settle(key, index)
        self._version += 1

        def store():
            with self._lock:
                old = self._data.get((key, index))
            stored = self._place(index, value, spec, old)
            with self._lock:
                self._set(key, index, stored)

        fut = self._submit(spec.shard_nbytes, store)
        with self._lock:
            self._puts[(key, index)] = fut
        return fut

    def put_zeros(self, key: str, index: int) -> Future:
        """:meth:`put` of a shard of zeros."""
        spec = self.spec(key)
        return self.put(key, index, np.zeros(spec.shard_shape, _np(spec.dtype)))

    def put_many(self, items: Sequence[tuple[str, int, Any]]) -> list[Future]:
        """Host shards stored, in the caller's thread: as jax.Arrays (see :meth:`_memory_kind`) in one
        ``device_put`` (one transfer call instead of one per shard), into numpy buffers by copies."""
        kind = self._memory_kind()
        specs = [self._check(key, index, value) for key, index, value in items]
        if kind is None:  # copied here, in the caller's thread (a pack's shards are small): no future per shard
            self._settle_many([(key, index) for key, index, _ in items])
            with self._lock:
                for (key, index, value), spec in zip(items, specs):
                    self._set(key, index, self._place(index, value, spec, self._data.get((key, index))))
                self._version += 1
            return [done_future()]
        hosts = [put_source(value, _np(spec.dtype), self._placement(index))
                 for (_, index, value), spec in zip(items, specs)]
        targets = [jax.sharding.SingleDeviceSharding(self._placement(index), memory_kind=kind) for _, index, _ in items]
        arrays = jax.device_put(hosts, targets) if hosts else []  # one copy each: [Note: one copy per put]
        for h in hosts:
            self._copied(h)
        jax.block_until_ready(arrays)
        self.put_arrays([(key, index, arr) for (key, index, _), arr in zip(items, arrays)])
        return [done_future()]

    def get_many(self, items: Sequence[tuple[str, int, np.ndarray]]) -> list[Future]:
        """Shards to host buffers, in the caller's thread (jax.Arrays with one ``device_get``: one transfer call
        instead of one per shard)."""
        for key, index, _ in items:
            self._check(key, index)
        self._settle_many([(key, index) for key, index, _ in items])
        with self._lock:
            values = [self._data.get((key, index)) for key, index, _ in items]
        for (key, index, _), value in zip(items, values):
            if value is None:
                raise TierError(f"{self.kind} tier: no data for shard {index} of {key!r}")
        hosts = values if self._memory_kind() is None else jax.device_get(values)
        for (_, _, out), host in zip(items, hosts):
            out[...] = host
        return [done_future()]

    def put_arrays(self, items: Sequence[tuple[str, int, jax.Array]]) -> None:
        """Stores jax.Arrays as the shards they are, at once (no transfer, no future): a compiled step's outputs,
        or what :meth:`put_many` moved.

        Each array must already have its key's shard shape and dtype and live in this tier's memory.

        Raises:
          TierError: an array's shape or dtype is not its key's.
        """
        for key, index, value in items:
            spec = self._check(key, index, value)
            if value.dtype != _np(spec.dtype):
                raise TierError(f"{self.kind} tier: shard of {key!r} has dtype {value.dtype}, declared {spec.dtype}")
        self._settle_many([(key, index) for key, index, _ in items])  # an earlier put still in flight lands first
        with self._lock:
            for key, index, value in items:
                self._set(key, index, value)
            self._version += 1

    def _set(self, key: str, index: int, value: Any) -> None:
        """Stores a shard (under the lock), keeping count of the bytes held."""
        old = self._data.get((key, index))
        self._bytes += _nbytes(value) - (0 if old is None else _nbytes(old))
        self._swaps += old is not value
        self._data[(key, index)] = value

    def _memory_kind(self) -> str | None:
        """The memory kind of the jax.Arrays this tier keeps (``None``: numpy buffers)."""
        raise NotImplementedError

    def current(self, key: str, index: int) -> Any:
        """The shard's stored object as it is now (after any put in flight), without a copy.

        A device tier's shard is an immutable ``jax.Array``: the object itself tells whether the shard
        was written since (identity), which is what a holder of a larger array built from it checks.
        """
        self._check(key, index)
        self._settle(key, index)
        with self._lock:
            return self._data.get((key, index))

    def get(self, key: str, index: int, *, out: np.ndarray | None = None) -> Future:
        spec = self._check(key, index)
        self._settle(key, index)
        with self._lock:
            value = self._data.get((key, index))
        if value is None:
            raise TierError(f"{self.kind} tier: no data for shard {index} of {key!r}")

        if out is None and not isinstance(value, np.ndarray):
            return done_future(value)  # an immutable jax.Array: nothing to copy, no transfer to schedule

        def load():
            if out is None:
                return value.copy() if isinstance(value, np.ndarray) else value  # numpy buffers are reused
            out[...] = np.asarray(value)
            return out

        return self._submit(spec.shard_nbytes, load)

    def _place(self, index: int, value: Any, spec: ShardSpec, old: Any) -> Any:
        """The stored form of ``value`` (``old``: the shard's current stored value, or None)."""
        raise NotImplementedError

    # --- commit -------------------------------------------------------------
    def wait(self) -> None:
        with self._lock:
            futs = list(self._futures)
        for f in futs:
            f.result()

    def commit(self, metadata: Mapping[str, Any] | None = None) -> None:
        self.wait()
        with self._lock:
            self._puts.clear()
            if metadata is not None:
                self._meta = dict(metadata)

    def metadata(self) -> dict[str, Any]:
        return dict(self._meta)

    def stored_bytes(self) -> int:
        """Bytes held."""
        with self._lock:
            return self._bytes

    def close(self) -> None:
        self.wait()
        self._pool.shutdown(wait=True)


class DeviceTier(_MemoryTier):
    """Shards kept as single-device ``jax.Array`` in accelerator memory.

    Args:
      placement: shard index to the device that stores it (default: the first
        local device for every index).
      max_in_flight_bytes: bound on bytes being transferred at once.
    """

    kind = "device"

    def __init__(self, *, placement: Callable[[int], jax.Device] | None = None, max_in_flight_bytes: int = 1 << 30):
        super().__init__(max_in_flight_bytes=max_in_flight_bytes)
        self._placement = placement or (lambda i: jax.local_devices()[0])

    def _memory_kind(self) -> str | None:
        return self._placement(0).default_memory().kind

    def _place(self, index: int, value: Any, spec: ShardSpec, old: Any) -> Any:
        if isinstance(value, jax.Array) and value.sharding.memory_kind in (None, "device"):
            return value.astype(spec.dtype) if value.dtype != spec.dtype else value
        dev = self._placement(index)
        self._copied(value)  # See [Note: one copy per put]
        return jax.device_put(put_source(value, _np(spec.dtype), dev), dev).block_until_ready()


class CpuTier(_MemoryTier):
    """Shards kept in host RAM.

    Args:
      memory: ``"pinned_host"`` keeps shards as jax.Arrays in the pinned host
        memory of their device (fast host-to-device copies, zero-copy
        ``np.asarray``); ``"numpy"`` keeps plain numpy buffers (what the CPU
        optimizer updates in place).
      placement: shard index to the device whose host memory holds it.
      max_in_flight_bytes: bound on bytes being transferred at once.
    """

    kind = "cpu"

    def __init__(
        self,
        *,
        memory: str = "pinned_host",
        placement: Callable[[int], jax.Device] | None = None,
        max_in_flight_bytes: int = 1 << 30,
    ):
        if memory not in ("pinned_host", "numpy"):
            raise ValueError(f"CpuTier memory must be 'pinned_host' or 'numpy', got {memory!r}")
        super().__init__(max_in_flight_bytes=max_in_flight_bytes)
        self.memory = memory
        self._placement = placement or (lambda i: jax.local_devices()[0])
        self._run_cache: dict[tuple, tuple[np.ndarray, list[np.ndarray], int]] = {}  # share_run: run, parts, swaps

    def _memory_kind(self) -> str | None:
        return None if self.memory == "numpy" else "pinned_host"

    def share_rows(self, keys: Sequence[str], index: int) -> np.ndarray:
        """Keeps shard ``index`` of ``keys`` (one shard layout) as the rows of one array, which it returns.

        The shards keep their values, and every later put of one of them overwrites its row in place, so the
        array always holds their current values: a holder reads all of them at once, without stacking them
        (see [Note: masters in rows] in :mod:`zinf_jax.optim.state_io`). A key's shards are already rows of
        the returned array when it is asked again for the same keys.

        Raises:
          TierError: the tier keeps ``pinned_host`` arrays (immutable: no put is in place), the keys'
            layouts differ, or a shard has no data.
        """
        specs = [self._check(key, index) for key in keys]
        if len({(s.shard_shape, s.dtype) for s in specs}) != 1:
            raise TierError(f"cpu tier: shards of {list(keys)} differ in shape or dtype; they cannot share an array")
        with self._numpy_shards([(key, index) for key in keys], "kept as rows of one array") as old:
            base = old[0].base if isinstance(old[0].base, np.ndarray) else None
            if (base is not None and base.shape[0] == len(keys)
                    and all(x.base is base and x.ctypes.data == base[k].ctypes.data for k, x in enumerate(old))):
                return base
            rows = np.empty((len(keys), *specs[0].shard_shape), old[0].dtype)
            for k, (key, x) in enumerate(zip(keys, old)):
                rows[k] = x
                self._data[(key, index)] = rows[k]
                self._swaps += 1
            return rows

    def share_run(self, items: Sequence[tuple[str, int]]) -> np.ndarray | None:
        """Keeps the 1-D shards ``items`` (one dtype, any sizes) side by side in one flat array, which it returns
        (``None``: a shard is a row of :meth:`share_rows`'s array, and stays there; a shard of an earlier run
        moves).

        As :meth:`share_rows`: the shards keep their values, later puts land in place, and asking again for the
        same items returns the same array while they are still its parts. The array starts on a 64-byte
        boundary (XLA's CPU client reads it without a copy). The optimizer updates a pack of small shards as
        one array this way ([Note: optax packs] in :mod:`~zinf_jax.optim.optax_rule`).
        """
        key = tuple(items)
        hit = self._run_cache.get(key)
        if hit is not None and (hit[2] == self._swaps or all(self._data.get(it) is v for it, v in zip(items, hit[1]))):
            self._run_cache[key] = (hit[0], hit[1], self._swaps)  # (no shard replaced since: no check per shard)
            return hit[0]
        specs = [self._check(k, i) for k, i in items]
        if len({sp.dtype for sp in specs}) != 1 or any(len(sp.shard_shape) != 1 for sp in specs):
            raise TierError("cpu tier: a run of shards needs 1-D shards of one dtype")
        with self._numpy_shards(items, "kept side by side") as old:
            if any(isinstance(x.base, np.ndarray) and x.base.ndim != 1 for x in old):
                return None
            n = sum(x.shape[0] for x in old)
            raw = np.empty(n + 64 // old[0].itemsize, old[0].dtype)
            off = ((-raw.ctypes.data) % 64) // old[0].itemsize
            run = raw[off:off + n]
            views, at = [], 0
            for item, x in zip(items, old):
                run[at:at + x.shape[0]] = x
                views.append(run[at:at + x.shape[0]])
                self._data[item] = views[-1]
                self._swaps += 1
                at += x.shape[0]
            self._version += 1  # the same values in new arrays: holders of the old ones read them again
            self._run_cache[key] = (run, views, self._swaps)
            return run

    def writable(self, items: Sequence[tuple[str, int]]) -> list[np.ndarray]:
        """The stored arrays of these ``(key, index)`` shards, for the caller to write its new values into.

        What a put of each would store, without the copy: the caller updates them in place (see [Note: updates
        in place] in :mod:`zinf_jax.optim.driver`) and is done before its next call to the tier. Counts as a put
        of each (:attr:`version` grows); earlier puts of them land first.

        Raises:
          TierError: the tier keeps ``pinned_host`` arrays (immutable), or a shard has no data.
        """
        with self._numpy_shards(items, "written in place") as out:
            self._version += 1
        return out

    @contextlib.contextmanager
    def _numpy_shards(self, items: Sequence[tuple[str, int]], use: str) -> Iterator[list[np.ndarray]]:
        """The stored numpy arrays of ``items`` (after their puts in flight), the tier's lock held meanwhile.

        Raises:
          TierError: the tier keeps ``pinned_host`` arrays (``use`` says what needed numpy), a shard is out
            of range, or has no data.
        """
        if self.memory != "numpy":
            raise TierError(f"cpu tier: only memory='numpy' shards can be {use}")
        for key, index in items:
            self._check(key, index)
        self._settle_many(items)
        with self._lock:
            out = [self._data.get(s) for s in items]
            missing = [s for s, x in zip(items, out) if x is None]
            if missing:
                raise TierError(f"cpu tier: no data for shard {missing[0][1]} of {missing[0][0]!r}")
            yield out

    def _place(self, index: int, value: Any, spec: ShardSpec, old: Any) -> Any:
        if self.memory == "numpy":
            self._copied(value)
            if isinstance(old, np.ndarray):  # in place: the state is held once
                np.copyto(old, np.asarray(value), casting="unsafe")
                return old
            return np.array(value, dtype=_np(spec.dtype), copy=True)
        dev = self._placement(index)
        sharding = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
        if isinstance(value, jax.Array):  # immutable: moved (a copy only between memories)
            return jax.device_put(value, sharding).block_until_ready()
        self._copied(value)  # See [Note: one copy per put]
        return jax.device_put(put_source(value, _np(spec.dtype), dev), sharding).block_until_ready()

