"""Reading and writing zarr3 chunk files with direct I/O, for the NVMe tier.

tensorstore writes a chunk through the page cache into a temporary file, then
fsyncs and renames it. On a small host that costs a kernel copy of every byte
plus page-cache pressure, and the measured write bandwidth stayed at 58-72% of
the raw disk (``scripts/bench_tiers.py``). The tier therefore moves the chunk
files of large shards itself (small ones, where per-file Python work would
dominate, stay with tensorstore), in the exact layout tensorstore's ``zarr3`` driver reads and
writes (uncompressed ``bytes`` codec, little endian, ``default`` chunk keys
with ``/`` separators: ``<array>/c/<i0>/<i1>/...``); tensorstore creates and
validates the arrays, and any zarr3 reader can open them.

A chunk is written in place (``O_DIRECT`` where the file system allows it,
buffered otherwise) from page-aligned blocks, by a small pool of threads, each
with its own staging buffer; a block that is already page-aligned is written
without the copy. Reads take the same route in reverse, straight into the
caller's buffer: tensorstore's reader copies every chunk once more and reached
only 74-78% of the raw disk on 256 MiB shards.

Crash safety does not come from here: the tier only ever writes into the slot
that the committed manifest does not name. A write that fails removes its file
(its content is undefined; on a full disk that frees its blocks at once) and
raises an ``OSError`` naming it. Given a ``digest`` function (the tier's
checksums), a chunk is hashed by a third pool: while it is written (the data
is not changed meanwhile) or right after it was read, so the I/O threads never
wait for the hash and the disk's queue stays full.
"""
from __future__ import annotations

import contextlib
import errno
import math
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from zinf_jax._internal.futures import all_of

__all__ = ["ChunkIO", "chunk_ranges", "chunk_files", "aligned_empty", "untouched_zeros", "ZARR3_CODECS",
           "ZARR3_KEY_ENCODING", "ALIGN"]

ALIGN = 4096
"""Alignment of direct-I/O offsets, lengths and buffers (covers 512 B and 4 KiB sectors)."""

ZARR3_CODECS = [{"name": "bytes", "configuration": {"endian": "little"}}]
"""The codec chain the writer produces: raw little-endian C-order bytes, no compression."""

ZARR3_KEY_ENCODING = {"name": "default", "configuration": {"separator": "/"}}
"""Chunk key encoding the writer produces: ``c/<i0>/<i1>/...``."""


def chunk_ranges(shard_shape: Sequence[int], chunk_shape: Sequence[int]) -> Iterator[tuple[tuple[int, ...], int, int, int]]:
    """The chunks of one shard as contiguous element ranges of its C-order data.

    Only the chunk shapes the tier creates are supported: ones on the leading
    dims, one cut dim, then the full trailing dims (or the whole shard). Then
    every chunk is one contiguous run of the shard's elements; the last chunk
    along the cut dim may be partial and is padded in the file (zarr stores
    full chunks).

    Yields:
      ``(grid_index, start, count, padded_count)`` in elements.

    Raises:
      ValueError: ``chunk_shape`` is not of that form.
    """
    shape, chunk = list(shard_shape), list(chunk_shape)
    if len(shape) != len(chunk):
        raise ValueError(f"chunk shape {chunk} does not match shard shape {shape}")
    total = int(np.prod(shape, dtype=np.int64))
    cut = max((d for d in range(len(shape)) if chunk[d] != shape[d]), default=None)
    if cut is None:
        yield tuple(0 for _ in shape), 0, total, total
        return
    if any(chunk[d] != 1 for d in range(cut)):
        raise ValueError(f"chunk shape {chunk} of shard {shape} is not contiguous (ones, one cut dim, full dims)")
    inner = int(np.prod(shape[cut + 1 :], dtype=np.int64))
    pieces = -(-shape[cut] // chunk[cut])
    lead = list(np.ndindex(*shape[:cut])) if cut else [()]
    for outer_i, outer in enumerate(lead):
        base = outer_i * shape[cut] * inner
        for k in range(pieces):
            rows = min(chunk[cut], shape[cut] - k * chunk[cut])
            grid = (*outer, k) + tuple(0 for _ in shape[cut + 1 :])
            yield grid, base + k * chunk[cut] * inner, rows * inner, chunk[cut] * inner


def chunk_files(base: Path, arr: np.ndarray, chunk_shape: Sequence[int]) -> list[tuple[Path, np.ndarray, int]]:
    """``(file, bytes of arr in it, padded file size)`` per chunk of one shard stored under ``base`` (``.../c/<i>``)."""
    flat = arr.reshape(-1).view(np.uint8)
    size = arr.dtype.itemsize
    return [(base.joinpath(*map(str, grid)), flat[start * size : (start + count) * size], padded * size)
            for grid, start, count, padded in chunk_ranges(arr.shape, chunk_shape)]


def aligned_empty(nbytes: int) -> np.ndarray:
    """An uninitialised uint8 array whose data starts on an ``ALIGN`` boundary."""
    raw = np.empty(nbytes + ALIGN, np.uint8)
    off = (-raw.ctypes.data) % ALIGN
    return raw[off : off + nbytes]


def untouched_zeros(shape: Sequence[int], dtype: np.dtype) -> np.ndarray:
    """A read-only array of zeros whose memory is never written: an anonymous mapping, which reads as the
    kernel's zero page and takes no memory. (``np.zeros`` clears every byte of a block that malloc serves from
    its heap: up to 32 MiB once glibc's mmap threshold has grown; 1.2 s of init's main thread at 0.81B.)"""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < mmap.PAGESIZE:
        out = np.zeros(shape, dtype)
    else:
        out = np.frombuffer(mmap.mmap(-1, nbytes), dtype).reshape(shape)
    out.flags.writeable = False
    return out


def _created(path: Path, flags: int, mode: int) -> int:
    """``os.open`` of a file being written, its directory made if missing (by the I/O thread: a mkdir per chunk
    file on the caller's thread cost 1.5 s of the 1.61B GPT's init)."""
    try:
        return os.open(path, flags, mode)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, flags, mode)


def _removed_on_error(path: Path, make: Callable[..., None], *args: object) -> None:
    """``make(path, *args)``; if it fails, the file is removed (half written: useless, and on a full disk it holds
    the space) and the ``OSError`` names it."""
    try:
        make(path, *args)
    except OSError as e:
        with contextlib.suppress(OSError):
            path.unlink()
        raise OSError(e.errno, e.strerror, str(path)) from e


class ChunkIO:
    """Thread pools reading and writing whole chunk files, with direct I/O where possible.

    Reads and writes have separate pools, so read-ahead never queues behind
    write-behind (the optimizer does both at once); digests have a third.

    Args:
      read_threads: chunk files read at once.
      write_threads: chunk files written at once.
      block_bytes: size of each I/O request straight from or into the caller's
        (page-aligned) memory.
      stage_bytes: size of each thread's staging buffer, and of the requests
        that go through it (unaligned memory, sector tails, zero padding).
      sync: ``fdatasync`` every written file before its future resolves (durable writes).
      direct_read: read with ``O_DIRECT`` too (cold reads measure the disk, not
        the page cache). Writes always try ``O_DIRECT``; a file system that
        refuses it (tmpfs) gets buffered I/O instead.
      hash_threads: chunks hashed at once (a digest runs at tens of GB/s a thread).
    """

    def __init__(self, read_threads: int = 4, write_threads: int = 4, *, block_bytes: int = 8 << 20,
                 stage_bytes: int = 2 << 20, sync: bool = True, direct_read: bool = False, hash_threads: int = 2):
        if block_bytes % ALIGN or stage_bytes % ALIGN or stage_bytes <= 0:
            raise ValueError(f"block_bytes and stage_bytes must be positive multiples of {ALIGN}")
        self._readers = ThreadPoolExecutor(max(1, int(read_threads)), thread_name_prefix="zinf-nvme-read")
        self._writers = ThreadPoolExecutor(max(1, int(write_threads)), thread_name_prefix="zinf-nvme-write")
        self._hashers = ThreadPoolExecutor(max(1, int(hash_threads)), thread_name_prefix="zinf-nvme-hash")
        self._block, self._stage_bytes = int(block_bytes), int(stage_bytes)
        self._sync = bool(sync)
        self._direct = {"write": True, "read": bool(direct_read)}
        self._local = threading.local()

    @property
    def direct_writes(self) -> bool:
        """Whether writes bypass the page cache (false after a file system refused ``O_DIRECT``)."""
        return self._direct["write"]

    def write(self, path: Path, data: np.ndarray, padded_nbytes: int, *,
              digest: Callable[[np.ndarray], str] | None = None) -> Future:
        """Writes ``data`` (contiguous uint8) as the file ``path``, in place, zero-padded to ``padded_nbytes`` (its
        directory made if missing).

        The caller keeps ``data`` unchanged until the future resolves. It
        resolves to ``digest(data)`` (hashed while the file is written), or to
        ``None`` without ``digest``; on failure the file is removed and the
        ``OSError`` names it.
        """
        wrote = self._writers.submit(self._write, path, data, padded_nbytes)
        if digest is None:
            return wrote
        return _both(wrote, self._hashers.submit(digest, data))

    def allocate(self, path: Path, nbytes: int) -> Future:
        """Makes ``path`` a file of ``nbytes`` zeros without writing them: emptied, then its blocks reserved with
        ``posix_fallocate`` (the file system reads them as zeros; a full disk fails here, as a write would),
        synced like a write. On failure the file is removed and the ``OSError`` names it."""
        return self._writers.submit(self._allocate, path, nbytes)

    def read(self, path: Path, out: np.ndarray, *, digest: Callable[[np.ndarray], str] | None = None) -> Future:
        """Reads the first ``out.nbytes`` bytes of the file ``path`` into ``out`` (contiguous uint8).

        The future resolves to ``out``, or with ``digest`` to ``digest(out)``
        (hashed once the read is done, while the reading thread reads on).
        """
        read = self._readers.submit(self._read, path, out)
        if digest is None:
            return read
        hashed: Future = Future()

        def then(f: Future) -> None:
            if f.exception() is not None:
                hashed.set_exception(f.exception())
            else:
                _chain(self._hashers.submit(digest, out), hashed)

        read.add_done_callback(then)
        return hashed

    # --- workers --------------------------------------------------------------
    def _stage(self) -> np.ndarray:
        buf = getattr(self._local, "buf", None)
        if buf is None:  # one per pool thread, freed with the pool
            buf = self._local.buf = aligned_empty(self._stage_bytes)
        return buf

    def _open(self, path: Path, mode: str) -> tuple[int, bool]:
        flags = os.O_WRONLY | os.O_CREAT if mode == "write" else os.O_RDONLY
        opener = _created if mode == "write" else os.open
        if self._direct[mode]:
            try:
                return opener(path, flags | os.O_DIRECT, 0o644), True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._direct[mode] = False  # this file system has no direct I/O
        return opener(path, flags, 0o644), False

    def _step(self, mem: np.ndarray, off: int, size: int, direct: bool) -> tuple[int, bool]:
        """Bytes of the next request at ``off`` (of ``size``) and whether it goes straight to ``mem``.

        Direct I/O needs sector-aligned memory, offsets and lengths: an aligned
        buffer moves in large blocks (aligned down; the tail and any zero
        padding beyond ``mem`` are staged), anything else through the staging buffer.
        """
        left = size - off
        if not direct:
            n = min(self._block, left)
            return (n, True) if off + n <= mem.nbytes else (min(n, self._stage_bytes), False)
        avail = max(0, min(self._block, left, mem.nbytes - off)) // ALIGN * ALIGN
        if mem.ctypes.data % ALIGN == 0 and avail:
            return avail, True
        return min(self._stage_bytes, left), False

    def _write(self, path: Path, data: np.ndarray, padded: int) -> None:
        _removed_on_error(path, self._write_file, data, padded)

    def _allocate(self, path: Path, nbytes: int) -> None:
        _removed_on_error(path, self._allocate_file, nbytes)

    def _allocate_file(self, path: Path, nbytes: int) -> None:
        fd = _created(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, 0)  # (old data in place: allocating keeps it)
            os.posix_fallocate(fd, 0, nbytes)
            if self._sync:
                os.fdatasync(fd)
        finally:
            os.close(fd)

    def _write_file(self, path: Path, data: np.ndarray, padded: int) -> None:
        fd, direct = self._open(path, "write")
        try:
            off = 0
            while off < padded:
                n, straight = self._step(data, off, padded, direct)
                src = data[off : min(off + n, data.nbytes)]
                if straight:
                    buf = src  # written from the caller's memory
                else:  # staged: unaligned memory, a sector tail or the zero padding of the last chunk
                    buf = self._stage()[: -(-n // ALIGN) * ALIGN if direct else n]
                    np.copyto(buf[: src.nbytes], src)
                    buf[src.nbytes :] = 0
                mv, done = memoryview(buf), 0
                while done < len(mv):
                    done += os.pwrite(fd, mv[done:], off + done)
                off += n
            if os.fstat(fd).st_size != padded:
                os.ftruncate(fd, padded)  # cuts the sector padding of the last block, or an old longer file
            if self._sync:
                os.fdatasync(fd)
        finally:
            os.close(fd)

    def _read(self, path: Path, out: np.ndarray) -> np.ndarray:
        fd, direct = self._open(path, "read")
        try:
            off = 0
            while off < out.nbytes:
                n, straight = self._step(out, off, out.nbytes, direct)
                dst = out[off : off + n]
                staged = not straight
                buf = self._stage()[: -(-n // ALIGN) * ALIGN] if staged else dst
                mv, done = memoryview(buf), 0
                while done < n:
                    got = os.preadv(fd, [mv[done:]], off + done)
                    if got == 0:
                        raise OSError(errno.EIO, f"chunk file {str(path)!r} is shorter than its array says")
                    done += got
                if staged:
                    np.copyto(dst, buf[:n])
                off += n
        finally:
            os.close(fd)
        return out

    def close(self) -> None:
        """Waits for queued I/O and stops the threads (their staging buffers go with them)."""
        self._readers.shutdown(wait=True)  # (a finished read hands its hash on before its thread ends)
        self._writers.shutdown(wait=True)
        self._hashers.shutdown(wait=True)


def _chain(src: Future, dst: Future) -> None:
    """Resolves ``dst`` like ``src`` once ``src`` is done."""
    src.add_done_callback(lambda f: dst.set_exception(f.exception()) if f.exception() is not None
                          else dst.set_result(f.result()))


def _both(first: Future, second: Future) -> Future:
    """A future resolving to ``second``'s result once both are done; ``first``'s error wins."""
    out: Future = Future()
    held = [first, second]  # dropped once used: See [Note: no future cycles] in zinf_jax._internal.futures

    def done(_: Future) -> None:
        a, b = held
        held.clear()
        err = a.exception() or b.exception()
        out.set_exception(err) if err is not None else out.set_result(b.result())

    all_of([first, second]).add_done_callback(done)
    return out
