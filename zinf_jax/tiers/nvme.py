"""The NVMe tier: shards in tensorstore zarr3 arrays on a local disk, small ones packed into shared files.

The directory layout: :mod:`zinf_jax.tiers.nvme_layout`; the arrays and their chunk files' I/O:
:mod:`zinf_jax.tiers.nvme_arrays`; the packs: :mod:`zinf_jax.tiers.nvme_packs`.

Updates come in three modes (``update=``, a
:class:`~zinf_jax.plan.placement.UpdateMode` or its value):

* ``"double_slot"``: a key's writes in a new generation go to the slot the
  manifest does *not* point at; :meth:`NvmeTier.commit` waits for the (fsynced)
  writes and then replaces the manifest atomically (write, fsync, rename, fsync
  the directory). A process killed at any moment leaves the last committed
  generation readable and bitwise intact, at twice the disk.
* ``"in_place"``: one slot, rewritten in place (no second copy on disk). Before
  the first write of a generation the manifest is replaced by one that says
  "in progress"; the commit replaces it by the finished one. A process killed
  in between leaves a *half-updated* directory (see [Note: half-updated tier]).
* ``"scratch"``: in place, never synced, nothing published, emptied when
  opened (the gradients of the current step: never needed by another process).

Where a generation stands is one :class:`Generation` state: ``CLEAN`` (the
manifest names the newest finished generation), ``WRITING`` (the next one is
being written) or ``BROKEN`` (an in-place one failed half-way).

[Note: half-updated tier]
In ``"in_place"`` mode the committed slots are overwritten, so between the first
write of a generation and its commit the data on disk mixes two steps. The
invariant: the manifest is marked "in progress" (durably) *before* the first
write, and only the commit replaces it by an unmarked one. A process killed in
between, or a generation whose write failed (``Generation.BROKEN``), therefore
leaves a *half-updated* tier, and every opener refuses it
(:func:`~zinf_jax.tiers.nvme_layout.half_updated`, a
:class:`~zinf_jax.tiers.base.TierDataError` saying how to rebuild) rather than
train on mixed state. The main job's ``--resume`` deletes such a directory and
rebuilds it from the newest checkpoint. Enforced where it is cited by name.

Shards smaller than ``pack_below_bytes`` share files, whole keys at a time
(see [Note: packed shards] in :mod:`zinf_jax.tiers.nvme_packs`), under the same
slots, digests and commit.

Integrity (:mod:`zinf_jax.tiers.checksum`): every chunk file's digest is
computed on the write path, published by the commit in the same manifest that
names the slot, and verified on every read; a changed, truncated or missing
file is a :class:`~zinf_jax.tiers.base.TierDataError` naming key, shard and
file. A write that fails (a full disk) removes its partial file at once and
makes the generation uncommittable; :meth:`NvmeTier.commit` and
:meth:`NvmeTier.close` then delete the whole uncommitted slot, never the
committed one.
"""
from __future__ import annotations

import os
import shutil
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import tensorstore as ts

from zinf_jax.config.zero import NVME_CHUNK_BYTES, NVME_UPDATE
from zinf_jax.plan.placement import UpdateMode
from zinf_jax._internal.futures import all_of, done_future, failed_future
from zinf_jax.tiers.base import ByteBudget, ShardSpec, TierDataError, TierError, np_dtype
from zinf_jax.tiers.checksum import ALGORITHM, ShardSums, damaged, diagnose, digest
from zinf_jax.tiers.direct import aligned_empty, untouched_zeros
from zinf_jax.tiers.keys import KeyRegistry
from zinf_jax.tiers.nvme_arrays import ChunkFiles, SlotArrays
from zinf_jax.tiers.nvme_packs import PACK_BELOW_BYTES, Pack, PackedKeys
from zinf_jax.tiers.nvme_layout import (FORMAT, MANIFEST, Generation, half_updated, io_error, open_process_dir,
                                        read_manifest, syncfs, unlock, write_manifest)

__all__ = ["NvmeTier", "Generation", "read_manifest", "MANIFEST"]
_WRITTEN = done_future()  # what a packed put returns (resolved, no value: one shared future will do)


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
      chunk_bytes: shards larger than this are stored as several chunk files (written, synced
        and read concurrently); default :data:`~zinf_jax.config.zero.NVME_CHUNK_BYTES`.
      read_threads: chunk files read at once.
      write_threads: chunk files written at once.
      direct_min_bytes: unpacked shards smaller than this are read and written by tensorstore's own
        (C++) I/O instead: per-file Python work of the direct path, contending with the training loop
        for the GIL, cost more than the copy on many small files (the 8-device demo job: 35% slower).
      pack_below_bytes: keys of smaller shards are packed, whole keys in files of up to ``chunk_bytes``
        ([Note: packed shards] in :mod:`zinf_jax.tiers.nvme_packs`); ``0``: none. Keys committed
        unpacked (a directory written before packing) stay so.
      checksums: compute a digest of every chunk file on write, commit it with
        the data and verify it on every read (default). ``False`` does
        neither (benchmarks only): shards it commits are read unverified.
      update: ``"double_slot"``, ``"in_place"`` or ``"scratch"``, or the :class:`~zinf_jax.plan.placement.UpdateMode`
        member (see the module doc); default :data:`~zinf_jax.config.zero.NVME_UPDATE`.
      rebuild: the caller writes every key anew (a restore from a checkpoint): a directory a crash left
        half-updated is cleared instead of refused (the checkpoint is the truth, the tier a cache of it).

    Attributes:
      update: the :class:`~zinf_jax.plan.placement.UpdateMode` it applies steps in.

    Raises:
      ValueError: ``sync`` or ``update`` is not one of the accepted values.
      TierError: the path is missing, not a directory or not writable, or
        another job holds its lock.
      TierDataError: the manifest is damaged, or an in-place update was
        interrupted (half-updated; the message says how to rebuild).
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
        chunk_bytes: int = NVME_CHUNK_BYTES,
        read_threads: int = 4,
        write_threads: int = 4,
        direct_min_bytes: int = 1 << 20,
        pack_below_bytes: int = PACK_BELOW_BYTES,
        checksums: bool = True,
        update: str | UpdateMode = NVME_UPDATE,
        rebuild: bool = False,
    ):
        if sync not in (True, False, "write", "commit"):  # before the lock is taken
            raise ValueError(f"nvme tier sync must be 'commit', 'write' (True) or False, got {sync!r}")
        try:
            mode = UpdateMode(update)
        except ValueError:
            accepted = tuple(m.value for m in UpdateMode)
            raise ValueError(f"nvme tier update must be one of {accepted}, got {update!r}") from None
        if not mode.durable:  # nothing in it must survive a crash: no fsync
            sync = False
        if process_index is None:
            import jax

            process_index = jax.process_index()
        # a half-updated directory is refused here: see [Note: half-updated tier]
        self.dir, self._lockf, state = open_process_dir(Path(path), process_index, durable=mode.durable,
                                                        rebuild=rebuild)
        self.update = mode
        self._state = Generation.CLEAN
        self._generation, self._meta, self._slot = state.generation, state.metadata, state.slot
        self._keys = KeyRegistry(self.kind, specs=state.specs, local=state.local, conflict=self._conflict)
        self._checksums = bool(checksums)
        self._sums = ShardSums(state.sums)
        self.budget = ByteBudget(max_in_flight_bytes)
        self._sync_at_commit = sync == "commit"
        self._arrays = SlotArrays(self.dir, chunk_bytes, sync=sync in (True, "write"), direct_io=direct_io,
                                  direct_min=direct_min_bytes, read_threads=read_threads, write_threads=write_threads,
                                  checksums=self._checksums)
        self._packed = PackedKeys(self.dir, state.packs, below=pack_below_bytes, most=chunk_bytes,
                                  double=mode.slots == 2, sync=sync in (True, "write"), budget=self.budget)
        self._pending_slot: dict[str, int] = {}
        self._written: dict[str, set[int]] = {}
        self._inflight: dict[tuple[str, int], Future] = {}
        self._futures: set[Future] = set()
        self._failed: list[TierError] = []  # write errors of the generation being written; commit refuses while any
        self._lock = threading.Lock()
        self.bytes_written = 0
        """Shard bytes handed to :meth:`put` since the tier was opened (what a step rewrites)."""
        self.bytes_zeroed = 0
        """Shard bytes of :meth:`put_zeros` allocated as zeros, not written (in neither count)."""
        self.bytes_read = 0
        """Shard bytes requested by :meth:`get` since the tier was opened."""

    # --- layout -------------------------------------------------------------
    @property
    def generation(self) -> int:
        """Number of commits so far (the committed generation)."""
        return self._generation

    def _conflict(self, key: str, old: ShardSpec, spec: ShardSpec) -> str:
        """The message for a key declared with another spec than the directory holds."""
        return (f"nvme tier: {key!r} is stored in {str(self.dir)!r} as {old}, not {spec}: "
                "the directory holds another model's state; use an empty path")

    def declare(self, key: str, spec: ShardSpec, local_indices: Sequence[int] | None = None) -> None:
        self._packed.check_local(key, range(spec.num_shards) if local_indices is None else local_indices)
        self._keys.declare(key, spec, local_indices)

    def keys(self) -> list[str]:
        return self._keys.keys()

    def spec(self, key: str) -> ShardSpec:
        return self._keys.spec(key)

    def local_indices(self, key: str) -> list[int]:
        return self._keys.local_indices(key)

    def _array(self, key: str, slot: int, *, fresh: bool = False) -> ts.TensorStore:
        try:
            return self._arrays.open(key, self._keys.spec(key), slot, fresh=fresh)
        except Exception as e:  # tensorstore raises ValueError/OSError subclasses
            raise self._error(e, "opening", key, None, self._arrays.slot_dir(key, slot)) from e

    def _error(self, e: Exception, what: str, key: str, index: int | None, file: Path | None = None) -> TierError:
        where = f"{key!r}" + ("" if index is None else f" shard {index}")
        return io_error(e, what, where, self.dir, self._generation, file)

    def _read_error(self, e: Exception | None, key: str, index: int, slot: int, files: ChunkFiles,
                    want: Sequence[str] | None = None, got: Sequence[str] | None = None) -> TierError:
        """A failed or unverified read: what is damaged (naming the file), else the I/O error ``e``."""
        what = diagnose(self._arrays.slot_dir(key, slot), [(p, n) for p, _, n in files], want, got, e is None)
        if what is None:
            return self._error(e, "reading", key, index)
        return damaged(self.dir, self._generation, key, index, what)

    # --- I/O ----------------------------------------------------------------
    def _track(self, parts: Sequence[Any], nbytes: int, what: str, key: str, index: int,
               finish: Callable[[Sequence[Any]], Any], file: Path | None = None) -> Future:
        """A future for ``finish(parts)`` once all ``parts`` are done; errors become :class:`TierError`."""
        cf: Future = Future()

        def done(_: Any) -> None:
            self.budget.release(nbytes)
            try:
                value = finish(parts)
            except TierError as e:
                err = e
            except Exception as e:  # noqa: BLE001 - re-raised through the future
                err = self._error(e, what, key, index, file)
            else:
                cf.set_result(value)
                return
            if what == "writing":  # recorded before the future (and its discard) completes
                with self._lock:
                    self._failed.append(err)
            cf.set_exception(err)

        with self._lock:
            self._futures.add(cf)
        cf.add_done_callback(lambda f: self._discard(f))
        all_of(parts).add_done_callback(done)
        return cf

    def _discard(self, f: Future) -> None:
        with self._lock:
            self._futures.discard(f)

    def _half_updated(self) -> TierDataError:
        """The error for this tier in :attr:`Generation.BROKEN` (the one its next opener raises)."""
        return half_updated(self.dir, {"generation": self._generation + 1, "metadata": self._meta})

    def _check(self, key: str, index: int) -> ShardSpec:
        if self._state is Generation.BROKEN:  # See [Note: half-updated tier]
            raise self._half_updated()
        spec = self.spec(key)
        if not self._keys.holds(key, index):
            raise TierError(f"nvme tier: shard {index} of {key!r} is not stored by this process "
                            f"({self._keys.local_indices(key)})")
        return spec

    def put_many(self, items: Sequence[tuple[str, int, Any]]) -> list[Future]:
        return [self.put(key, index, value) for key, index, value in items]

    def get_many(self, items: Sequence[tuple[str, int, np.ndarray]]) -> list[Future]:
        return [self.get(key, index, out=out) for key, index, out in items]

    def put(self, key: str, index: int, value: Any) -> Future:
        spec = self._check(key, index)
        arr = np.asarray(value, dtype=np_dtype(spec.dtype))
        if not arr.flags.c_contiguous:  # (np.ascontiguousarray would turn a scalar shard into shape (1,))
            arr = arr.copy(order="C")
        if arr.shape != spec.shard_shape:
            raise TierError(f"nvme tier: shard of {key!r} has shape {arr.shape}, declared {spec.shard_shape}")
        return self._put(key, index, spec, arr, zeros=False)

    def put_zeros(self, key: str, index: int) -> Future:
        """:meth:`put` of a shard of zeros: its chunk files are allocated (``posix_fallocate``), not written; packed
        and small shards are written as usual. A fresh optimizer's moments: two thirds of init's bytes at fp32."""
        zeros = untouched_zeros((spec := self._check(key, index)).shard_shape, np_dtype(spec.dtype))
        return self._put(key, index, spec, zeros, zeros=self._arrays.zeroable(zeros.nbytes))

    def _put(self, key: str, index: int, spec: ShardSpec, arr: np.ndarray, *, zeros: bool) -> Future:
        """Writes (``zeros``: allocates, ``arr`` being zeros) one shard, checked against ``spec``."""
        self._begin_writing()
        pack = self._packed.claim(key, spec, self._keys.local_indices(key), unpacked=key in self._slot)
        if pack is not None:
            return self._put_packed(pack, key, index, arr)
        with self._lock:
            double = self.update.slots == 2
            fresh = 1 - self._slot.get(key, 1)
            slot = self._pending_slot.setdefault(key, fresh if double else self._slot.get(key, 0))
            self._written.setdefault(key, set()).add(index)
            self.bytes_zeroed += arr.nbytes if zeros else 0
            self.bytes_written += 0 if zeros else arr.nbytes
        try:  # (no handle yet: the first put of this generation, or one after a failed open)
            # in place over committed data: open the array as it is (never recreate it)
            committed = not double and key in self._slot
            h = self._array(key, slot, fresh=not committed and not self._arrays.has(key, slot))
        except TierError as err:
            with self._lock:
                self._failed.append(err)
            raise
        files = self._arrays.chunk_files(key, slot, index, h, arr)
        held = 0 if zeros else arr.nbytes  # (allocated zeros hold no memory: untouched_zeros)
        self.budget.acquire(held)
        try:
            parts, sums = self._arrays.zero(files) if zeros else self._arrays.write(h, index, arr, files)
        except Exception as e:
            self.budget.release(held)
            err = self._error(e, "writing", key, index, files[0][0])
            with self._lock:
                self._failed.append(err)
            raise err from e

        def finish(done: Sequence[Any]) -> None:
            got = [f.result() for f in done]
            if self._checksums:  # recorded before the write's future resolves: a read of it verifies
                self._sums.record(key, index, got if sums is None else sums)

        fut = self._track(parts, held, "writing", key, index, finish, files[0][0])
        with self._lock:
            self._inflight[(key, index)] = fut
        return fut

    def _begin_writing(self) -> None:
        """Before a put: a clean tier starts a generation (in place: the manifest is marked first)."""
        first = self._state is Generation.CLEAN
        if self.update is UpdateMode.IN_PLACE and first:
            self._mark_in_progress()  # See [Note: half-updated tier]
        with self._lock:
            if self._state is Generation.CLEAN:
                self._state = Generation.WRITING
        if first:
            self._create_new_arrays()

    def _create_new_arrays(self) -> None:
        """At a generation's first put: packs the declared small keys that have no place yet and creates at
        once the arrays of the other keys that have none (a new tier's first generation writes every key
        into its slot 0). A failure here is left to the puts, which create one at a time and report it for
        their own key."""
        with self._lock:
            new = [key for key in self._keys.keys() if key not in self._slot and self._packed.of(key) is None]
        self._packed.add([(k, self._keys.spec(k), self._keys.local_indices(k)) for k in new
                          if self._packed.packable(self._keys.spec(k))])
        arrays = [(key, self._keys.spec(key), 0) for key in new if self._packed.of(key) is None]
        try:
            self._arrays.create_many(arrays)
        except Exception:  # noqa: BLE001 - each put creates its own array again and names its key
            pass

    def _put_packed(self, pack: Pack, key: str, index: int, arr: np.ndarray) -> Future:
        """:meth:`put` of a packed shard: one positional write into the pack's file of this generation's slot."""
        try:
            slot = self._packed.write(pack, key, index, arr)
        except OSError as e:
            err = self._error(e, "writing", key, index)
            with self._lock:
                self._failed.append(err)
            raise err from e
        with self._lock:
            self._pending_slot[key] = slot
            self._written.setdefault(key, set()).add(index)
            self.bytes_written += arr.nbytes
        if self._checksums:  # recorded before put returns: a read of it verifies
            self._sums.record(key, index, [digest(arr)])
        return _WRITTEN

    def _read_slot(self, key: str, index: int) -> tuple[int, list[str] | None]:
        """The slot holding the newest data of a shard, and its stored digests (waits for its write)."""
        with self._lock:
            pending = self._inflight.get((key, index))
            mine = index in self._written.get(key, ())
            if mine:
                slot = self._pending_slot[key]
            elif key in self._slot:
                slot = self._slot[key]
            else:
                raise TierError(f"nvme tier: no data for shard {index} of {key!r} in {str(self.dir)!r}")
        if pending is not None:
            pending.result()
        return slot, (self._sums.expected(key, index, pending=mine) if self._checksums else None)

    def get(self, key: str, index: int, *, out: np.ndarray | None = None) -> Future:
        spec = self._check(key, index)
        slot, want = self._read_slot(key, index)
        dtype = np_dtype(spec.dtype)
        if out is None:  # page-aligned, so direct reads land in it without a copy
            out = aligned_empty(spec.shard_nbytes).view(dtype).reshape(spec.shard_shape)
        elif out.shape != spec.shard_shape or out.dtype != dtype or not out.flags.c_contiguous:
            raise TierError(
                f"nvme tier: out for {key!r} must be a C-contiguous {spec.dtype} array of shape "
                f"{spec.shard_shape}, got {out.dtype} {out.shape}"
            )
        pack = self._packed.of(key)
        if pack is not None:
            return self._get_packed(pack, slot, key, index, out, want)
        try:
            h = self._array(key, slot)
        except TierError as e:
            raise self._read_error(e, key, index, slot, []) from e
        files = self._arrays.chunk_files(key, slot, index, h, out)
        self.budget.acquire(spec.shard_nbytes)
        with self._lock:
            self.bytes_read += spec.shard_nbytes
        try:  # (with digests to check, ChunkIO's reading threads hash their chunks)
            parts, digests_of = self._arrays.read(h, index, out, files, verify=want is not None)
        except Exception as e:
            self.budget.release(spec.shard_nbytes)
            raise self._error(e, "reading", key, index) from e

        def finish(done: Sequence[Any]) -> np.ndarray:
            try:
                got = [f.result() for f in done]
            except Exception as e:
                raise self._read_error(e, key, index, slot, files) from e
            if want is not None:
                sums = digests_of(got)
                if sums != want:
                    raise self._read_error(None, key, index, slot, files, want, sums)
            return out

        return self._track(parts, spec.shard_nbytes, "reading", key, index, finish)

    def _get_packed(self, pack: Pack, slot: int, key: str, index: int, out: np.ndarray,
                    want: Sequence[str] | None) -> Future:
        """:meth:`get` of a packed shard: one positional read from its pack's file, verified."""
        with self._lock:
            self.bytes_read += out.nbytes
        try:
            what = self._packed.read(pack, slot, key, index, out, want)
        except OSError as e:
            return failed_future(self._error(e, "reading", key, index))
        return failed_future(damaged(self.dir, self._generation, key, index, what)) if what else done_future(out)

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
            the previous generation stays committed (in place: the tier is
            half-updated, :attr:`Generation.BROKEN`).
          TierDataError: the tier is :attr:`Generation.BROKEN` (half-updated).
        """
        if self._state is Generation.BROKEN:  # See [Note: half-updated tier]
            raise self._half_updated()
        try:
            self.wait()  # raises the write errors of a WRITING generation
            for key, written in self._to_complete().items():
                missing = [i for i in self._keys.local_indices(key) if i not in written]
                if missing and key not in self._slot:
                    raise TierError(f"nvme tier: {key!r} shards {missing} were never written; write every local shard")
                for i in missing if self.update.slots == 2 else ():  # in place: they are there already
                    self.put(key, i, self.get(key, i).result())
            self.wait()
            self._packed.files.flush()
            if self._sync_at_commit and self._written:
                syncfs(self.dir)
        except TierError:
            self._abort()
            raise
        except OSError as e:
            self._abort()
            raise self._error(e, "flushing", "data", None) from e
        slots = {**self._slot, **self._pending_slot}
        pack_slots = self._packed.slots()
        man = self._manifest(slots, pack_slots, self._generation + 1,
                             dict(self._meta if metadata is None else metadata))
        if self.update.durable:
            try:
                write_manifest(self.dir, man)  # unmarked: See [Note: half-updated tier]
            except OSError as e:
                self._abort()
                raise self._error(e, "committing", "MANIFEST", None) from e
        self._state = Generation.CLEAN
        self._sums.publish(self._pending_slot)
        self._generation += 1
        self._slot = slots
        self._packed.publish()
        self._meta = man["metadata"]
        self._pending_slot.clear()
        self._written.clear()
        self._inflight.clear()

    def _to_complete(self) -> dict[str, set[int]]:
        """The keys a commit must find complete in their new slot, with the shards this generation wrote: the
        keys written, and (double slot) every committed key of a pack written (its file is new)."""
        if not self.update.durable:
            return {}
        todo = {k: set(v) for k, v in self._written.items()}
        for key in self._packed.companions():
            if key in self._slot:
                todo.setdefault(key, set())
        return todo

    def _manifest(self, slots: Mapping[str, int], pack_slots: Mapping[str, int], generation: int,
                  metadata: Mapping[str, Any]) -> dict[str, Any]:
        man = {"format": FORMAT, "checksum": ALGORITHM, "generation": generation,
               "keys": {k: self._manifest_entry(k, slots[k]) for k in slots}, "metadata": dict(metadata)}
        if pack_slots:
            man["packs"] = self._packed.manifest(pack_slots)
        return man

    def _mark_in_progress(self) -> None:
        """Announces an in-place generation in the manifest, durably, before its first write.

        See [Note: half-updated tier]. The committed entries stay as they were
        (an interrupted generation is recognised by the mark alone; its data is
        never read again). Moves :attr:`Generation.CLEAN` to ``WRITING``.
        """
        with self._lock:
            if self._state is not Generation.CLEAN:
                return
            man = self._manifest(dict(self._slot), self._packed.slots(pending=False), self._generation, self._meta)
            man["in_progress"] = {"generation": self._generation + 1, "metadata": self._meta}
            try:
                write_manifest(self.dir, man)
            except OSError as e:
                raise self._error(e, "marking an update in progress in", "MANIFEST", None) from e
            self._state = Generation.WRITING

    def _manifest_entry(self, key: str, slot: int) -> dict[str, Any]:
        local = self._keys.local_indices(key)
        entry = {"slot": slot, "spec": self._keys.spec(key).to_json(), "local": local}
        if self._packed.name_of(key) is not None:
            entry["pack"] = self._packed.name_of(key)
        sums = self._sums.manifest_entry(key, local, rewritten=key in self._pending_slot)
        if sums is not None:  # the digests of exactly the data in ``slot``
            entry["checksums"] = sums
        return entry

    def _abort(self) -> None:
        """Drops the uncommitted generation and deletes its slots to free their space.

        A pending slot is never the one the manifest names, so deleting it
        cannot touch committed data; after a full disk this makes room again.
        Leaves the tier :attr:`Generation.CLEAN`, or ``BROKEN`` after an
        in-place generation that had marked the manifest.
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
        self._sums.drop_pending()
        self._packed.abort()
        if self.update.slots == 1:  # the slot written is the committed one: it stays (half-updated, marked)
            marked = self.update is UpdateMode.IN_PLACE and self._state is Generation.WRITING
            self._state = Generation.BROKEN if marked else Generation.CLEAN  # See [Note: half-updated tier]
            return
        self._state = Generation.CLEAN
        for key, slot in dead.items():
            if self._packed.of(key) is None:
                self._arrays.delete(key, slot)

    def metadata(self) -> dict[str, Any]:
        return dict(self._meta)

    def stored_bytes(self) -> int:
        """Bytes of committed data on disk for this process."""
        return sum(self._keys.spec(k).shard_nbytes * len(self._keys.local_indices(k)) for k in self._slot)

    def destroy(self) -> None:
        """Closes the tier and deletes this process's directory."""
        self.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def close(self) -> None:
        if self._lockf.closed:
            return
        try:
            self.wait()
        except TierError:
            self._abort()  # a generation with a failed write can never commit: free its files now
            raise
        finally:
            self._arrays.close()
            self._packed.files.close()
            unlock(self._lockf)
