"""The NVMe tier: shards in tensorstore zarr3 arrays on a local disk.

The directory layout is described in :mod:`zinf_jax.tiers.nvme_layout`.
Chunk files of shards of ``direct_min_bytes`` and more are read and written
by :class:`~zinf_jax.tiers.direct.ChunkIO` (direct I/O, in place, in zarr3's
own layout), smaller ones by tensorstore; tensorstore creates and validates the
arrays, and plain tensorstore (or any zarr3 reader) opens them.

Crash safety comes from double buffering: a key's writes in a new generation go
to the slot the manifest does *not* point at; :meth:`NvmeTier.commit` waits for
the (fsynced) writes and then replaces the manifest atomically (write, fsync,
rename, fsync the directory). A process killed at any moment therefore leaves
the last committed generation readable and bitwise intact.
"""
from __future__ import annotations

import errno
import fcntl
import os
import shutil
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import tensorstore as ts

from zinf_jax.tiers.base import ByteBudget, ShardSpec, TierError, np_dtype
from zinf_jax.tiers.direct import ZARR3_CODECS, ZARR3_KEY_ENCODING, ChunkIO, aligned_empty, all_of, chunk_ranges
from zinf_jax.tiers.nvme_layout import (
    FORMAT, MANIFEST, check_dir, chunk_shape, key_dir, load_manifest, read_manifest, syncfs, write_manifest,
)

__all__ = ["NvmeTier", "read_manifest", "MANIFEST"]


class NvmeTier:
    """Shards on local NVMe through tensorstore, committed atomically.

    Args:
      path: an existing, writable directory on a local disk.
      process_index: this process's index (default ``jax.process_index()``).
      max_in_flight_bytes: bound on bytes of reads and writes in flight.
      direct_io: read with ``O_DIRECT`` too, bypassing the page cache, so reads
        measure the disk. Writes of shards of ``direct_min_bytes`` and more
        always use ``O_DIRECT`` where the file system allows it.
      sync: how writes are made durable before a commit publishes them: ``"write"``/``True``
        (default: every chunk file is ``fdatasync``-ed as it is written), ``"commit"``
        (one ``syncfs`` at commit), ``False`` (not durable; benchmarks only).
      chunk_bytes: shards larger than this are stored as several chunk files
        (written, synced and read concurrently).
      read_threads: chunk files read at once.
      write_threads: chunk files written at once.
      direct_min_bytes: shards smaller than this are read and written by
        tensorstore's own (C++) I/O instead: on many small files the per-file
        Python work of the direct path, contending with the training loop for
        the GIL, cost more than the copy (the 8-device demo job ran 35% slower).

    Raises:
      TierError: the path is missing, not a directory or not writable, or
        another job holds its lock.
    """

    kind = "nvme"

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        process_index: int | None = None,
        max_in_flight_bytes: int = 1 << 30,
        direct_io: bool = False,
        sync: bool | str = "write",
        chunk_bytes: int = 16 << 20,
        read_threads: int = 4,
        write_threads: int = 4,
        direct_min_bytes: int = 1 << 20,
    ):
        if sync not in (True, False, "write", "commit"):  # before the lock is taken
            raise ValueError(f"nvme tier sync must be 'commit', 'write' (True) or False, got {sync!r}")
        root = Path(path)
        check_dir(root)
        if process_index is None:
            import jax

            process_index = jax.process_index()
        self.dir = root / f"process_{process_index}"
        self.dir.mkdir(exist_ok=True)
        self._lockf = open(self.dir / "LOCK", "a+")
        try:
            fcntl.flock(self._lockf, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lockf.seek(0)
            holder = self._lockf.read().strip() or "another process"
            self._lockf.close()
            raise TierError(
                f"nvme tier: {str(self.dir)!r} is locked by {holder}; another job is using this directory. "
                "Stop it or give this job its own offload path."
            ) from None
        self._lockf.seek(0)
        self._lockf.truncate()
        self._lockf.write(f"pid {os.getpid()}\n")
        self._lockf.flush()

        try:
            self._generation, self._meta, self._specs, self._local, self._slot = load_manifest(self.dir)
        except TierError:
            fcntl.flock(self._lockf, fcntl.LOCK_UN)
            self._lockf.close()
            raise
        self.budget = ByteBudget(max_in_flight_bytes)
        self._chunk_bytes = int(chunk_bytes)
        self._sync_at_commit = sync == "commit"
        self._io = ChunkIO(read_threads, write_threads, sync=sync in (True, "write"), direct_read=direct_io)
        self._direct_min = int(direct_min_bytes)
        ctx: dict[str, Any] = {"cache_pool": {"total_bytes_limit": 0}, "file_io_sync": sync in (True, "write"),
                               "file_io_concurrency": {"limit": 32}}
        if direct_io:
            ctx["file_io_mode"] = {"mode": "direct"}
        self._ctx = ts.Context(ctx)
        self._pending_slot: dict[str, int] = {}
        self._written: dict[str, set[int]] = {}
        self._handles: dict[tuple[str, int], ts.TensorStore] = {}
        self._inflight: dict[tuple[str, int], Future] = {}
        self._futures: set[Future] = set()
        self._failed: list[TierError] = []  # write errors of this generation; commit refuses while any
        self._lock = threading.Lock()
        self.bytes_written = 0
        """Shard bytes handed to :meth:`put` since the tier was opened (what a step rewrites)."""
        self.bytes_read = 0
        """Shard bytes requested by :meth:`get` since the tier was opened."""

    # --- layout -------------------------------------------------------------
    @property
    def generation(self) -> int:
        """Number of commits so far (the committed generation)."""
        return self._generation

    def declare(self, key: str, spec: ShardSpec, local_indices: Sequence[int] | None = None) -> None:
        old = self._specs.get(key)
        if old is not None and old != spec:
            raise TierError(
                f"nvme tier: {key!r} is stored in {str(self.dir)!r} as {old}, not {spec}: "
                "the directory holds another model's state; use an empty path"
            )
        self._specs[key] = spec
        self._local[key] = sorted(range(spec.num_shards) if local_indices is None else local_indices)

    def keys(self) -> list[str]:
        return list(self._specs)

    def spec(self, key: str) -> ShardSpec:
        try:
            return self._specs[key]
        except KeyError:
            raise TierError(f"nvme tier: unknown key {key!r}; declare it first") from None

    def local_indices(self, key: str) -> list[int]:
        self.spec(key)
        return list(self._local[key])

    def _array(self, key: str, slot: int, *, fresh: bool = False) -> ts.TensorStore:
        h = self._handles.get((key, slot))
        if h is not None:
            return h
        spec = self._specs[key]
        meta: dict[str, Any] = {"shape": [spec.num_shards, *spec.shard_shape], "data_type": spec.dtype}
        if fresh:  # an existing array keeps the chunking it was created with
            chunk = chunk_shape(spec.shard_shape, np.dtype(np_dtype(spec.dtype)).itemsize, self._chunk_bytes)
            meta["chunk_grid"] = {"name": "regular", "configuration": {"chunk_shape": [1, *chunk]}}
            meta["chunk_key_encoding"] = ZARR3_KEY_ENCODING
            meta["codecs"] = ZARR3_CODECS
        ts_spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(self._slot_dir(key, slot))}, "metadata": meta}
        try:
            if fresh:  # an uncommitted slot: reuse its files if the layout matches, else start over
                try:
                    h = ts.open(ts_spec, open=True, context=self._ctx).result()
                except ValueError:
                    h = ts.open(ts_spec, create=True, delete_existing=True, context=self._ctx).result()
            else:
                h = ts.open(ts_spec, open=True, context=self._ctx).result()
        except Exception as e:  # tensorstore raises ValueError/OSError subclasses
            raise self._error(e, "opening", key, None) from e
        self._handles[(key, slot)] = h
        return h

    def _slot_dir(self, key: str, slot: int) -> Path:
        return self.dir / "data" / key_dir(key) / f"s{slot}"

    def _error(self, e: Exception, what: str, key: str, index: int | None) -> TierError:
        msg = str(e)
        where = f"{key!r}" + ("" if index is None else f" shard {index}")
        if "No space left" in msg or "ENOSPC" in msg or getattr(e, "errno", None) == errno.ENOSPC:
            return TierError(
                f"nvme tier: disk full while {what} {where} under {str(self.dir)!r}. The committed state "
                f"(generation {self._generation}) is intact; free space or use a larger disk for the offload path."
            )
        return TierError(f"nvme tier: {what} {where} under {str(self.dir)!r} failed: {msg}")

    # --- I/O ----------------------------------------------------------------
    def _track(self, tsfut: Any, nbytes: int, what: str, key: str, index: int, result: Any = None) -> Future:
        cf: Future = Future()

        def done(f: Any) -> None:
            self.budget.release(nbytes)
            try:
                value = f.result()
                cf.set_result(value if result is None else result)
            except Exception as e:  # noqa: BLE001 - re-raised through the future
                err = self._error(e, what, key, index)
                if what == "writing":  # recorded before the future (and its discard) completes
                    with self._lock:
                        self._failed.append(err)
                cf.set_exception(err)

        with self._lock:
            self._futures.add(cf)
        cf.add_done_callback(lambda f: self._discard(f))
        tsfut.add_done_callback(done)
        return cf

    def _discard(self, f: Future) -> None:
        with self._lock:
            self._futures.discard(f)

    def _check(self, key: str, index: int) -> ShardSpec:
        spec = self.spec(key)
        if index not in self._local[key]:
            raise TierError(f"nvme tier: shard {index} of {key!r} is not stored by this process ({self._local[key]})")
        return spec

    def put(self, key: str, index: int, value: Any) -> Future:
        spec = self._check(key, index)
        arr = np.asarray(value, dtype=np_dtype(spec.dtype))
        if not arr.flags.c_contiguous:  # (np.ascontiguousarray would turn a scalar shard into shape (1,))
            arr = arr.copy(order="C")
        if arr.shape != spec.shard_shape:
            raise TierError(f"nvme tier: shard of {key!r} has shape {arr.shape}, declared {spec.shard_shape}")
        with self._lock:
            slot = self._pending_slot.get(key)
            fresh = slot is None
            if fresh:
                slot = 1 - self._slot.get(key, 1)
                self._pending_slot[key] = slot
            self._written.setdefault(key, set()).add(index)
            self.bytes_written += arr.nbytes
        try:
            h = self._array(key, slot, fresh=fresh and (key, slot) not in self._handles)
        except TierError as err:
            with self._lock:
                self._failed.append(err)
            raise
        self.budget.acquire(arr.nbytes)
        try:
            if spec.shard_nbytes < self._direct_min:
                parts = [h[index].write(arr).commit]
            else:
                parts = self._write_chunks(key, slot, index, h, arr)
        except Exception as e:
            self.budget.release(arr.nbytes)
            err = self._error(e, "writing", key, index)
            with self._lock:
                self._failed.append(err)
            raise err from e
        fut = self._track(all_of(parts), arr.nbytes, "writing", key, index)
        with self._lock:
            self._inflight[(key, index)] = fut
        return fut

    def _chunk_files(
        self, key: str, slot: int, index: int, h: ts.TensorStore, arr: np.ndarray
    ) -> Iterator[tuple[Path, np.ndarray, int]]:
        """``(file, bytes of arr, padded file size)`` per chunk of shard ``index``, as the array was created."""
        chunk = list(h.chunk_layout.write_chunk.shape)[1:]
        flat = arr.reshape(-1).view(np.uint8)
        size = arr.dtype.itemsize
        base = self._slot_dir(key, slot) / "c" / str(index)
        for grid, start, count, padded in chunk_ranges(arr.shape, chunk):
            yield base.joinpath(*map(str, grid)), flat[start * size : (start + count) * size], padded * size

    def _write_chunks(self, key: str, slot: int, index: int, h: ts.TensorStore, arr: np.ndarray) -> list[Future]:
        futs = []
        for path, data, padded in self._chunk_files(key, slot, index, h, arr):
            path.parent.mkdir(parents=True, exist_ok=True)
            futs.append(self._io.write(path, data, padded))
        return futs

    def _read_slot(self, key: str, index: int) -> int:
        with self._lock:
            pending = self._inflight.get((key, index))
            if index in self._written.get(key, ()):
                slot = self._pending_slot[key]
            elif key in self._slot:
                slot = self._slot[key]
            else:
                raise TierError(f"nvme tier: no data for shard {index} of {key!r} in {str(self.dir)!r}")
        if pending is not None:
            pending.result()
        return slot

    def get(self, key: str, index: int, *, out: np.ndarray | None = None) -> Future:
        spec = self._check(key, index)
        slot = self._read_slot(key, index)
        h = self._array(key, slot)
        dtype = np_dtype(spec.dtype)
        if out is None:  # page-aligned, so direct reads land in it without a copy
            out = aligned_empty(spec.shard_nbytes).view(dtype).reshape(spec.shard_shape)
        elif out.shape != spec.shard_shape or out.dtype != dtype or not out.flags.c_contiguous:
            raise TierError(
                f"nvme tier: out for {key!r} must be a C-contiguous {spec.dtype} array of shape "
                f"{spec.shard_shape}, got {out.dtype} {out.shape}"
            )
        self.budget.acquire(spec.shard_nbytes)
        with self._lock:
            self.bytes_read += spec.shard_nbytes
        try:
            if spec.shard_nbytes < self._direct_min:
                futs = [ts.array(out, copy=False, write=True).write(h[index]).commit]
            else:
                futs = [self._io.read(path, data) for path, data, _ in self._chunk_files(key, slot, index, h, out)]
            return self._track(all_of(futs), spec.shard_nbytes, "reading", key, index, result=out)
        except Exception as e:
            self.budget.release(spec.shard_nbytes)
            raise self._error(e, "reading", key, index) from e

    # --- commit -------------------------------------------------------------
    def wait(self) -> None:
        with self._lock:
            futs = list(self._futures)
        errors = [f.exception() for f in futs if f.exception() is not None]
        with self._lock:
            errors += self._failed  # writes that failed (and left _futures) before this wait
        if errors:
            raise errors[0]

    def commit(self, metadata: Mapping[str, Any] | None = None) -> None:
        """Waits for the writes of this generation, then publishes them atomically.

        Shards of a rewritten key that this generation did not write are copied
        from the committed slot, so every slot a manifest names is complete.

        Raises:
          TierError: a write failed (e.g. disk full); nothing was published and
            the previous generation stays committed.
        """
        try:
            self.wait()
            for key, written in self._written.items():
                missing = [i for i in self._local[key] if i not in written]
                if missing and key not in self._slot:
                    raise TierError(f"nvme tier: {key!r} shards {missing} were never written; write every local shard")
                for i in missing:
                    self.put(key, i, self.get(key, i).result())
            self.wait()
            if self._sync_at_commit and self._written:
                syncfs(self.dir)
        except TierError:
            self._abort()
            raise
        except OSError as e:
            self._abort()
            raise self._error(e, "flushing", "data", None) from e
        slots = {**self._slot, **self._pending_slot}
        man = {
            "format": FORMAT,
            "generation": self._generation + 1,
            "keys": {k: {"slot": slots[k], "spec": self._specs[k].to_json(), "local": self._local[k]} for k in slots},
            "metadata": dict(self._meta if metadata is None else metadata),
        }
        try:
            write_manifest(self.dir, man)
        except OSError as e:
            self._abort()
            raise self._error(e, "committing", "MANIFEST", None) from e
        self._generation += 1
        self._slot = slots
        self._meta = man["metadata"]
        self._pending_slot.clear()
        self._written.clear()
        self._inflight.clear()

    def _abort(self) -> None:
        """Drops the uncommitted generation and deletes its slots to free their space.

        A pending slot is never the one the manifest names, so deleting it
        cannot touch committed data; after a full disk this makes room again.
        """
        with self._lock:
            futs = list(self._futures)
        for f in futs:
            f.exception()  # let in-flight operations finish before their files go
        with self._lock:
            dead = dict(self._pending_slot)
            self._pending_slot.clear()
            self._written.clear()
            self._inflight.clear()
            self._failed.clear()
        for key, slot in dead.items():
            self._handles.pop((key, slot), None)
            shutil.rmtree(self.dir / "data" / key_dir(key) / f"s{slot}", ignore_errors=True)

    def metadata(self) -> dict[str, Any]:
        return dict(self._meta)

    def stored_bytes(self) -> int:
        """Bytes of committed data on disk for this process."""
        return sum(self._specs[k].shard_nbytes * len(self._local[k]) for k in self._slot)

    def destroy(self) -> None:
        """Closes the tier and deletes this process's directory."""
        self.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def close(self) -> None:
        if self._lockf.closed:
            return
        try:
            self.wait()
        finally:
            self._io.close()
            fcntl.flock(self._lockf, fcntl.LOCK_UN)
            self._lockf.close()
