"""Unpacked keys of the NVMe tier: one zarr3 array per key and slot, and the I/O of one shard's chunk files.

Chunk files of shards of ``direct_min`` bytes and more are read and written by
:class:`~zinf_jax.tiers.direct.ChunkIO` (direct I/O, in place, in zarr3's own
layout), smaller ones by tensorstore; tensorstore creates and validates the
arrays, and plain tensorstore (or any zarr3 reader) opens them. Keys of small
shards are usually packed instead (:mod:`zinf_jax.tiers.nvme_packs`).
"""
from __future__ import annotations

import shutil
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import tensorstore as ts

from zinf_jax.tiers.base import ShardSpec, np_dtype
from zinf_jax.tiers.checksum import digest, zero_digest
from zinf_jax.tiers.direct import ZARR3_CODECS, ZARR3_KEY_ENCODING, ChunkIO, chunk_files
from zinf_jax.tiers.nvme_layout import chunk_shape, key_dir

__all__ = ["SlotArrays", "ChunkFiles"]

ChunkFiles = list[tuple[Path, np.ndarray, int]]
"""``(chunk file, the shard's bytes in it, file size)`` of one shard."""


class SlotArrays:
    """The tensorstore ``zarr3`` arrays of a process directory's slots, opened once and kept, and the I/O of
    one shard's chunk files.

    Args:
      process_dir: the process directory.
      chunk_bytes: chunk size limit of newly created arrays.
      sync: what is written is fsynced (tensorstore and ChunkIO).
      direct_io: reads bypass the page cache (``O_DIRECT``).
      direct_min: shards of this many bytes and more are moved by ChunkIO, smaller ones by tensorstore.
      read_threads, write_threads: ChunkIO's pools.
      checksums: writes and reads compute the digests of the chunk files.
    """

    def __init__(self, process_dir: Path, chunk_bytes: int, *, sync: bool, direct_io: bool, direct_min: int,
                 read_threads: int, write_threads: int, checksums: bool):
        self.dir = process_dir
        self._chunk_bytes = int(chunk_bytes)
        self._direct_min, self._checksums = int(direct_min), checksums
        self._io = ChunkIO(read_threads, write_threads, sync=sync, direct_read=direct_io)
        ctx: dict[str, Any] = {"cache_pool": {"total_bytes_limit": 0}, "file_io_sync": sync,
                               "file_io_concurrency": {"limit": 32}}
        if direct_io:
            ctx["file_io_mode"] = {"mode": "direct"}
        self._ctx = ts.Context(ctx)
        self._handles: dict[tuple[str, int], ts.TensorStore] = {}

    def slot_dir(self, key: str, slot: int) -> Path:
        """The array directory of one slot of ``key``."""
        return self.dir / "data" / key_dir(key) / f"s{slot}"

    def has(self, key: str, slot: int) -> bool:
        """Whether the array of this slot is open."""
        return (key, slot) in self._handles

    def open(self, key: str, spec: ShardSpec, slot: int, *, fresh: bool = False) -> ts.TensorStore:
        """The array of a slot; ``fresh`` (an uncommitted slot): reuse its files if the layout matches, else start over.

        Raises:
          ValueError, OSError: tensorstore's errors (a missing array, a full disk).
        """
        h = self._handles.get((key, slot))
        if h is not None:
            return h
        ts_spec = self._ts_spec(key, spec, slot, new=fresh)  # an existing array keeps the chunking it was made with
        try:
            h = ts.open(ts_spec, open=True, context=self._ctx).result()
        except ValueError:
            if not fresh:
                raise
            h = ts.open(ts_spec, create=True, delete_existing=True, context=self._ctx).result()
        self._handles[(key, slot)] = h
        return h

    def create_many(self, items: Sequence[tuple[str, ShardSpec, int]]) -> None:
        """Creates the arrays of ``(key, spec, slot)`` that are neither open nor on disk, all at once.

        Each creation writes (and with ``sync``, fsyncs) the array's metadata; one after another behind a
        step's data writes they cost ~9 ms each (the 0.40B GPT: 450 arrays, 3.9 s of a 9 s init), issued
        together ~0.3 ms. An array that exists is left to :meth:`open`, which checks its layout.

        Raises:
          ValueError, OSError: tensorstore's errors (a full disk).
        """
        todo = [(key, spec, slot) for key, spec, slot in items
                if (key, slot) not in self._handles and not self.slot_dir(key, slot).exists()]
        futures = []
        for key, spec, slot in todo:
            futures.append(ts.open(self._ts_spec(key, spec, slot, new=True), create=True, context=self._ctx))
        for (key, _, slot), fut in zip(todo, futures):
            self._handles[(key, slot)] = fut.result()

    def _ts_spec(self, key: str, spec: ShardSpec, slot: int, *, new: bool) -> dict[str, Any]:
        """The tensorstore spec of a slot's array; ``new``: with the chunking and codecs an array is created with."""
        meta: dict[str, Any] = {"shape": [spec.num_shards, *spec.shard_shape], "data_type": spec.dtype}
        if new:
            chunk = chunk_shape(spec.shard_shape, np.dtype(np_dtype(spec.dtype)).itemsize, self._chunk_bytes)
            meta["chunk_grid"] = {"name": "regular", "configuration": {"chunk_shape": [1, *chunk]}}
            meta["chunk_key_encoding"] = ZARR3_KEY_ENCODING
            meta["codecs"] = ZARR3_CODECS
        return {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(self.slot_dir(key, slot))},
                "metadata": meta}

    def delete(self, key: str, slot: int) -> None:
        """Forgets a slot's array and deletes its files (only ever an uncommitted slot)."""
        self._handles.pop((key, slot), None)
        shutil.rmtree(self.slot_dir(key, slot), ignore_errors=True)

    # --- one shard's I/O ----------------------------------------------------
    def chunk_files(self, key: str, slot: int, index: int, h: ts.TensorStore, arr: np.ndarray) -> ChunkFiles:
        """``(file, bytes of arr, padded file size)`` per chunk of shard ``index``, as the array was created."""
        chunk = list(h.chunk_layout.write_chunk.shape)[1:]
        return chunk_files(self.slot_dir(key, slot) / "c" / str(index), arr, chunk)

    def write(self, h: ts.TensorStore, index: int, arr: np.ndarray,
              files: ChunkFiles) -> tuple[list[Any], list[str] | None]:
        """Issues the writes of shard ``index`` (``arr``, unchanged until they finish).

        Returns:
          ``(futures, digests)``: with checksums on the tensorstore route the digests, computed now;
          else ``None`` and (ChunkIO, with checksums) each future resolves to its chunk's digest.
        """
        if arr.nbytes < self._direct_min:
            sums = [digest(d) for _, d, _ in files] if self._checksums else None
            return [h[index].write(arr).commit], sums
        hash_ = digest if self._checksums else None
        return [self._io.write(path, data, padded, digest=hash_) for path, data, padded in files], None

    def zero(self, files: ChunkFiles) -> tuple[list[Future], list[str] | None]:
        """Issues the allocation of a shard of zeros whose every chunk file is large enough for the direct route
        (:meth:`ChunkIO.allocate`): ``(futures, digests)`` as :meth:`write` returns them."""
        futs = [self._io.allocate(path, padded) for path, _, padded in files]
        return futs, [zero_digest(data.nbytes) for _, data, _ in files] if self._checksums else None

    def zeroable(self, nbytes: int) -> bool:
        """Whether a shard of ``nbytes`` takes the direct route (where :meth:`zero` applies)."""
        return nbytes >= self._direct_min

    def read(self, h: ts.TensorStore, index: int, out: np.ndarray, files: ChunkFiles,
             verify: bool) -> tuple[list[Any], Callable[[Sequence[Any]], list[str]]]:
        """Issues the reads of shard ``index`` into ``out``.

        Returns:
          ``(futures, sums)``: ``sums(results)`` are the digests of the chunks read (once the futures are done).
        """
        if out.nbytes < self._direct_min:
            return ([ts.array(out, copy=False, write=True).write(h[index]).commit],
                    lambda _: [digest(d) for _, d, _ in files])
        return [self._io.read(path, data, digest=digest if verify else None) for path, data, _ in files], list

    def close(self) -> None:
        """Waits for the chunk I/O issued and stops its threads."""
        self._io.close()
