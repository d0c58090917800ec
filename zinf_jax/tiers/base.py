"""The contract every storage tier implements, and the byte budget they share.

A tier stores *shards*: for each key (a parameter path such as
``"blocks/0/mlp/up/kernel"`` or an optimizer key such as ``"m/blocks/0/..."``)
it holds ``num_shards`` equally shaped pieces, indexed by their global shard
index (the device's coordinate on the ``fsdp`` mesh axis). A process stores only
the indices it is given (its addressable shards).

Every ``put`` and ``get`` is asynchronous and returns a
:class:`concurrent.futures.Future`. The bytes of all operations in flight are
bounded by a :class:`ByteBudget`: an operation that would exceed it waits until
earlier ones finish (back-pressure), so buffering is never unbounded.

Writes become visible to *other openers* only at :meth:`Tier.commit`, all at
once; a process may read back its own uncommitted writes. (Only the NVMe tier
has other openers: a later process, after a crash. The memory tiers hold one
copy of each shard and replace it on put.)
"""
from __future__ import annotations

import dataclasses
import functools
import math
import threading
from concurrent.futures import Future
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from zinf_jax._internal.futures import done_future
from zinf_jax.errors import TierDataError, TierError

__all__ = ["ShardSpec", "Tier", "ByteBudget", "TierError", "TierDataError", "done_future", "np_dtype"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardSpec:
    """Shape of one key's shards.

    Attributes:
      shard_shape: shape of one shard.
      dtype: numpy dtype name of the stored values (``"float32"``, ``"bfloat16"``...).
      num_shards: number of shards across all processes.
    """

    shard_shape: tuple[int, ...]
    dtype: str
    num_shards: int

    @functools.cached_property
    def shard_nbytes(self) -> int:
        """Bytes of one shard (worked out once: every transfer asks)."""
        return math.prod(self.shard_shape) * np.dtype(np_dtype(self.dtype)).itemsize

    def to_json(self) -> dict[str, Any]:
        return {"shard_shape": list(self.shard_shape), "dtype": self.dtype, "num_shards": self.num_shards}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "ShardSpec":
        return cls(shard_shape=tuple(d["shard_shape"]), dtype=d["dtype"], num_shards=int(d["num_shards"]))


def np_dtype(name: str) -> Any:
    """numpy dtype for a name, including ml_dtypes' bfloat16."""
    import ml_dtypes  # a jax dependency; provides bfloat16 for numpy

    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


class ByteBudget:
    """Counts bytes in flight and blocks new work beyond ``limit`` (back-pressure).

    A single request larger than the limit is admitted only when nothing else
    is in flight, so it can never deadlock.
    """

    def __init__(self, limit: int):
        if limit <= 0:
            raise ValueError(f"max in-flight bytes must be positive, got {limit}")
        self.limit = int(limit)
        self._used = 0
        self._peak = 0
        self._cv = threading.Condition()

    def acquire(self, nbytes: int) -> None:
        """Block until ``nbytes`` fit under the limit, then count them."""
        with self._cv:
            while self._used > 0 and self._used + nbytes > self.limit:
                self._cv.wait()
            self._used += nbytes
            self._peak = max(self._peak, self._used)

    def release(self, nbytes: int) -> None:
        """Stop counting ``nbytes``; wake waiters."""
        with self._cv:
            self._used -= nbytes
            self._cv.notify_all()

    @property
    def in_flight(self) -> int:
        """Bytes counted right now."""
        return self._used

    @property
    def peak(self) -> int:
        """Largest in-flight count seen since the last :meth:`reset_peak`."""
        return self._peak

    def reset_peak(self) -> None:
        with self._cv:
            self._peak = self._used


@runtime_checkable
class Tier(Protocol):
    """A place where shards live: device memory, host RAM or NVMe.

    The implementations keep their declared keys in a :class:`~zinf_jax.tiers.keys.KeyRegistry`
    (``declare``, ``keys``, ``spec``, ``local_indices``).
    """

    kind: str
    """``"device"``, ``"cpu"`` or ``"nvme"``."""

    budget: ByteBudget
    """In-flight byte accounting; ``budget.peak`` is the tier's own high-water mark."""

    def declare(self, key: str, spec: ShardSpec, local_indices: Sequence[int] | None = None) -> None:
        """Register ``key`` with its shard layout before the first put.

        Args:
          key: the name, ``/``-separated.
          spec: shard shape, dtype and count.
          local_indices: the shard indices this process stores (default: all).

        Raises:
          TierError: ``key`` exists with a different spec.
        """
        ...

    def put(self, key: str, index: int, value: Any) -> Future:
        """Store shard ``index`` of ``key`` (numpy array or single-device jax.Array)."""
        ...

    def put_zeros(self, key: str, index: int) -> Future:
        """:meth:`put` of a shard of zeros (the nvme tier allocates its files instead of writing them)."""
        ...

    def put_many(self, items: Sequence[tuple[str, int, Any]]) -> list[Future]:
        """:meth:`put` of several ``(key, index, value)`` shards (a device tier moves them in one transfer)."""
        ...

    def get_many(self, items: Sequence[tuple[str, int, np.ndarray]]) -> list[Future]:
        """:meth:`get` of several ``(key, index, out)`` shards into host buffers (a device tier: one transfer)."""
        ...

    def get(self, key: str, index: int, *, out: np.ndarray | None = None) -> Future:
        """Fetch shard ``index`` of ``key``; the future resolves to the stored value.

        Args:
          out: optional preallocated host buffer to read into (host tiers only).
        """
        ...

    def keys(self) -> list[str]:
        """Declared keys."""
        ...

    def spec(self, key: str) -> ShardSpec:
        """The declared layout of ``key``."""
        ...

    def local_indices(self, key: str) -> list[int]:
        """Shard indices of ``key`` stored by this process."""
        ...

    def commit(self, metadata: Mapping[str, Any] | None = None) -> None:
        """Wait for all writes, then make them (and ``metadata``) visible at once."""
        ...

    def metadata(self) -> dict[str, Any]:
        """The metadata given at the last commit (empty if none)."""
        ...

    def wait(self) -> None:
        """Block until every operation issued so far has finished."""
        ...

    def close(self) -> None:
        """Finish outstanding work and release resources (locks, threads)."""
        ...
