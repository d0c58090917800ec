"""Checksums of the NVMe tier's chunk files: computed on write, published by the commit, verified on read.

Every chunk file of a shard has the 64-bit XXH3 digest (``xxhash``, C, GIL
released: 25-31 GB/s a core here against 13-15 for crc32c and 2-4 for
``zlib.crc32``, as ``scripts/bench_tiers.py`` records) of the shard bytes it
holds: its element range of the shard's C-order data, without the zero
padding zarr adds to a partial last chunk. A digest therefore describes the
data, not the I/O path: tensorstore's (small shards) and
:class:`~zinf_jax.tiers.direct.ChunkIO`'s (large ones, hashed off the I/O
threads) agree.

Invariants:
  * Digests of the uncommitted generation live only in memory
    (:class:`ShardSums`, *pending*) until the commit, which publishes them in
    the same atomic manifest replacement that names the slot they describe,
    after that slot's writes are durable. A manifest never holds a digest of
    data that is not the committed data, and a crash at any moment leaves the
    previous manifest, with its slots and their digests, untouched.
  * Every read of a shard that has stored digests is verified; a mismatch, a
    missing or truncated chunk file or a missing slot directory is a
    :class:`~zinf_jax.tiers.base.TierDataError` naming the key, the shard and
    the file. Shards committed without digests (``NvmeTier(checksums=False)``,
    benchmarks only) are read unverified.
"""
from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import xxhash

from zinf_jax.tiers.base import TierDataError

__all__ = ["ALGORITHM", "digest", "zero_digest", "ShardSums", "diagnose", "damaged"]

ALGORITHM = "xxh3_64"
"""Name of the digest, stored in the manifest next to the digests."""


def digest(data: np.ndarray) -> str:
    """Hex XXH3-64 digest of the bytes of a C-contiguous array (the GIL is released while hashing)."""
    return xxhash.xxh3_64_hexdigest(data)


@functools.lru_cache(maxsize=64)
def zero_digest(nbytes: int) -> str:
    """:func:`digest` of ``nbytes`` zero bytes (the chunk sizes of a run repeat: each is hashed once)."""
    return digest(np.zeros(nbytes, np.uint8))


class ShardSums:
    """Chunk digests per key and shard index: the committed ones and this generation's (pending).

    Args:
      committed: ``key -> {shard index: [digest per chunk file]}`` from the manifest.
    """

    def __init__(self, committed: Mapping[str, Mapping[int, Sequence[str]]]):
        self._committed = {k: {int(i): list(d) for i, d in v.items()} for k, v in committed.items()}
        self._pending: dict[str, dict[int, list[str]]] = {}
        self._lock = threading.Lock()

    def expected(self, key: str, index: int, *, pending: bool) -> list[str] | None:
        """The stored digests of a shard (``None``: stored without digests)."""
        with self._lock:
            return (self._pending if pending else self._committed).get(key, {}).get(index)

    def record(self, key: str, index: int, digests: Sequence[str]) -> None:
        """Remembers the digests of a finished write of this generation."""
        with self._lock:
            self._pending.setdefault(key, {})[index] = list(digests)

    def manifest_entry(self, key: str, local: Iterable[int], *, rewritten: bool) -> dict[str, list[str]] | None:
        """The ``checksums`` value of ``key`` in the next manifest (``None``: some shard has none)."""
        with self._lock:  # an in-place generation may rewrite only some shards: the others keep theirs
            sums = {**self._committed.get(key, {}), **(self._pending.get(key, {}) if rewritten else {})}
            if any(i not in sums for i in local):
                return None
            return {str(i): list(sums[i]) for i in local}

    def publish(self, keys: Iterable[str]) -> None:
        """After a commit: the pending digests of the rewritten ``keys`` become the committed ones."""
        with self._lock:
            for k in keys:
                self._committed[k] = {**self._committed.get(k, {}), **self._pending.pop(k, {})}
            self._pending.clear()

    def drop_pending(self) -> None:
        """Forgets this generation's digests (the generation was aborted)."""
        with self._lock:
            self._pending.clear()


def diagnose(slot_dir: Path, files: Sequence[tuple[Path, int]], want: Sequence[str] | None = None,
             got: Sequence[str] | None = None, mismatch: bool = False) -> str | None:
    """What is wrong with one shard's files, as a phrase naming the file (``None``: nothing found).

    Args:
      slot_dir: the zarr array directory of the slot read.
      files: ``(chunk file, size it must have)`` of the shard.
      want, got: stored and computed digests, one per file.
      mismatch: the digests are known to differ (a phrase is always returned).
    """
    if not slot_dir.is_dir():
        return f"its slot directory {str(slot_dir)!r} is missing"
    meta = slot_dir / "zarr.json"
    if not meta.is_file():
        return f"the array metadata file {str(meta)!r} is missing"
    for path, size in files:
        if not path.is_file():
            return f"chunk file {str(path)!r} is missing"
        if path.stat().st_size != size:
            return f"chunk file {str(path)!r} has {path.stat().st_size} bytes, its array needs {size}"
    for (path, _), w, g in zip(files, want or (), got or ()):
        if w != g:
            return f"chunk file {str(path)!r} does not match its checksum ({ALGORITHM} stored {w}, read {g})"
    return f"its {len(files)} chunk files under {str(slot_dir)!r} do not match their checksums" if mismatch else None


def damaged(tier_dir: Path, generation: int, key: str, index: int, what: str, cause: Any = None) -> TierDataError:
    """The error for a shard whose committed files were changed or lost."""
    tail = "" if cause is None else f" ({cause})"
    return TierDataError(
        f"nvme tier: shard {index} of {key!r} is damaged: {what}{tail}. The committed state (generation "
        f"{generation}) under {str(tier_dir)!r} was changed outside zinf_jax (bit rot, a deleted or edited file) "
        f"and cannot be used: delete {str(tier_dir)!r} (or use an empty offload path) and restore from a "
        "checkpoint with --resume."
    )
