"""Small shards of the NVMe tier packed into shared files: which shards share a file, and that file's I/O.

[Note: packed shards]
A shard in a file of its own costs the file system a create, a sync and (through tensorstore) a
rename every time it is written; the 128-wide GPT of the main job wrote ~600 files of a few KiB a step.
Keys whose shards are smaller than the tier's ``pack_below_bytes`` are therefore *packed*: whole keys
(every local shard), in declaration order, share one file of at most ``chunk_bytes`` (a :class:`Pack`),
each shard at its own page-aligned offset, so a write never reads back a neighbour's page. The
optimizer declares ``master``, ``m`` and ``v`` of a parameter side by side, so one pack holds what
one of its sub-groups or packs reads and writes; the param tier declares a unit's parameters together.

The file of a pack is ``packs/<name>.s<slot>`` beside ``data/``: its shards are written with one
``pwrite`` each into the page cache, read with one ``pread``, and the file is made durable once per
generation (``fdatasync`` before the commit replaces the manifest, or the commit's ``syncfs``).
Everything else is the tier's, unchanged: a pack has the slot of its keys (double slot: a generation
writes the pack's other slot and the commit copies the members it did not write, so the manifest
names only complete files), each shard has its XXH3 digest in the manifest and is verified on
every read, and an in-place generation marks the manifest "in progress" before its first write
([Note: half-updated tier] in :mod:`zinf_jax.tiers.nvme`). A pack file is made at its full size
with ``posix_fallocate`` when its slot is first written, so a full disk fails there, naming the
file, and not in the middle of a later write. Reads bypass ``direct_io`` (they are page-sized).
"""
from __future__ import annotations

import dataclasses
import errno
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from zinf_jax._internal.fs import fsync_dir
from zinf_jax.tiers.base import ByteBudget, ShardSpec, TierError
from zinf_jax.tiers.checksum import ALGORITHM, digest
from zinf_jax.tiers.direct import ALIGN

__all__ = ["Pack", "plan_packs", "PackFiles", "PackedKeys", "PACKS", "PACK_BELOW_BYTES", "packed_nbytes"]

PACKS = "packs"
"""The directory of the pack files in a process directory."""

PACK_BELOW_BYTES = 1 << 20
"""The NVMe tier's default ``pack_below_bytes``: keys of smaller shards are packed."""


def packed_nbytes(shard_nbytes: int) -> int:
    """Bytes a packed shard takes in its pack file (it starts on a page)."""
    return -(-shard_nbytes // ALIGN) * ALIGN


@dataclasses.dataclass(frozen=True)
class Pack:
    """One pack file's layout: ``members[(key, index)] = (offset, nbytes)``, ``size`` bytes in all."""

    name: str
    size: int
    members: Mapping[tuple[str, int], tuple[int, int]]

    def keys(self) -> list[str]:
        """The keys packed here, in file order."""
        return list(dict.fromkeys(k for k, _ in self.members))

    def indices(self, key: str) -> list[int]:
        """The shard indices of ``key`` in this pack, sorted."""
        return sorted(i for k, i in self.members if k == key)

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "members": [[k, i, o, n] for (k, i), (o, n) in self.members.items()]}

    @classmethod
    def from_json(cls, name: str, d: Mapping[str, Any]) -> "Pack":
        """The pack of a manifest entry.

        Raises:
          ValueError: the entry is not a pack's layout (members outside the file, overlapping).
        """
        size = int(d["size"])
        members = {(str(k), int(i)): (int(o), int(n)) for k, i, o, n in d["members"]}
        end = 0
        for off, n in sorted(members.values()):
            if off < end or n < 0 or off + n > size:
                raise ValueError(f"pack {name!r}: members overlap or lie outside its {size} bytes")
            end = off + n
        return cls(name, size, members)


def plan_packs(keys: Sequence[tuple[str, ShardSpec, Sequence[int]]], most: int, first: int) -> list[Pack]:
    """Packs of whole keys in the given order, each at most ``most`` bytes (a larger key: a pack of its own).

    Args:
      keys: ``(key, spec, local shard indices)`` of the keys to pack.
      most: bytes one pack file may hold.
      first: the number in the name of the first new pack (``p<first>``, ``p<first + 1>``...).
    """
    packs: list[Pack] = []
    members: dict[tuple[str, int], tuple[int, int]] = {}
    size = 0

    def close() -> None:
        nonlocal members, size
        if members:
            packs.append(Pack(f"p{first + len(packs)}", size, members))
        members, size = {}, 0

    for key, spec, local in keys:
        step = packed_nbytes(spec.shard_nbytes)
        if members and size + step * len(local) > most:
            close()
        for i in local:
            members[(key, int(i))] = (size, spec.shard_nbytes)
            size += step
    close()
    return packs


class PackFiles:
    """The open pack files of one process directory: one descriptor per pack and slot, positional I/O.

    With ``sync``, a file whose every member has been written since the last flush is ``fdatasync``-ed
    at once by a background thread (the optimizer writes packs in order: the disk syncs one while the
    next is computed); :meth:`flush` waits for those and syncs the rest.

    Args:
      process_dir: the process directory (the files live in its ``packs/``).
      sync: :meth:`flush` makes the files written since the last flush durable.
    """

    def __init__(self, process_dir: Path, *, sync: bool):
        self.dir = process_dir / PACKS
        self._sync = sync
        self._fds: dict[tuple[str, int], int] = {}
        self._dirty: set[tuple[str, int]] = set()
        self._written: dict[tuple[str, int], set[tuple[str, int]]] = {}  # members written since the last flush
        self._syncing: list[tuple[tuple[str, int], Future]] = []
        self._syncer = ThreadPoolExecutor(1, thread_name_prefix="zinf-nvme-pack-sync") if sync else None
        self._created = False
        self._lock = threading.Lock()

    def path(self, name: str, slot: int) -> Path:
        """The file of one slot of a pack."""
        return self.dir / f"{name}.s{slot}"

    def _naming(self, e: OSError, name: str, slot: int) -> OSError:
        """``e`` again, its ``filename`` the file of that pack slot."""
        return OSError(e.errno, e.strerror, str(self.path(name, slot)))

    def _fd(self, pack: Pack, slot: int, *, create: bool) -> int:
        with self._lock:
            fd = self._fds.get((pack.name, slot))
            if fd is not None:
                return fd
            path = self.path(pack.name, slot)
            if not create:  # read and write: an in-place generation writes the slot it reads
                fd = os.open(path, os.O_RDWR)
            else:
                self.dir.mkdir(exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    _allocate(fd, pack.size)
                except OSError:
                    os.close(fd)
                    path.unlink(missing_ok=True)  # on a full disk it would hold what it got
                    raise
                self._created = True
            self._fds[(pack.name, slot)] = fd
            return fd

    def write(self, pack: Pack, slot: int, key: str, index: int, data: np.ndarray) -> None:
        """Writes one shard (C-contiguous, ``nbytes`` as packed) at its offset; creates the file at full size first.

        Raises:
          OSError: the file could not be made or written (``filename`` names it).
        """
        off, n = pack.members[(key, index)]
        name = (pack.name, slot)
        try:
            fd = self._fd(pack, slot, create=True)
            mv, done = memoryview(data.reshape(-1).view(np.uint8)), 0
            while done < n:
                done += os.pwrite(fd, mv[done:], off + done)
        except OSError as e:
            raise self._naming(e, *name) from e
        with self._lock:
            written = self._written.setdefault(name, set())
            new = (key, index) not in written
            written.add((key, index))
            whole = new and len(written) == len(pack.members)
            if whole and self._syncer is not None:  # complete: synced behind the next writes
                self._syncing.append((name, self._syncer.submit(os.fdatasync, fd)))
                self._dirty.discard(name)
            else:
                self._dirty.add(name)

    def read(self, pack: Pack, slot: int, key: str, index: int, out: np.ndarray) -> int:
        """Reads one shard into ``out`` (C-contiguous); returns the bytes read (fewer: the file is short).

        Raises:
          OSError: the file could not be opened or read (``filename`` names it).
        """
        off, n = pack.members[(key, index)]
        try:
            fd = self._fd(pack, slot, create=False)
            mv, done = memoryview(out.reshape(-1).view(np.uint8)), 0
            while done < n:
                got = os.preadv(fd, [mv[done:]], off + done)
                if got == 0:
                    break
                done += got
            return done
        except OSError as e:
            raise self._naming(e, pack.name, slot) from e

    def flush(self) -> None:
        """Makes the files written since the last flush durable (with ``sync``), and their directory entries.

        Raises:
          OSError: a sync failed (``filename`` names the file).
        """
        with self._lock:
            dirty = [(k, self._fds[k]) for k in self._dirty if k in self._fds]
            created, self._created = self._created, False
            syncing, self._syncing = self._syncing, []
            self._dirty.clear()
            self._written.clear()
        if not self._sync:
            return
        for (name, slot), fut in syncing:
            if fut.exception() is not None:
                raise self._naming(fut.exception(), name, slot) from fut.exception()
        for (name, slot), fd in dirty:
            try:
                os.fdatasync(fd)
            except OSError as e:
                raise self._naming(e, name, slot) from e
        if created:
            fsync_dir(self.dir)

    def _settle(self) -> None:
        """Waits for the background syncs (before their descriptors close); their errors do not matter then."""
        with self._lock:
            syncing, self._syncing = self._syncing, []
        for _, fut in syncing:
            fut.exception()

    def forget(self) -> None:
        """Drops the record of unflushed writes (their generation was aborted)."""
        self._settle()
        with self._lock:
            self._dirty.clear()
            self._written.clear()

    def delete(self, names: Iterable[tuple[str, int]]) -> None:
        """Closes and deletes the files of ``(pack, slot)`` (only ever slots no manifest names)."""
        self._settle()
        for name, slot in names:
            with self._lock:
                fd = self._fds.pop((name, slot), None)
                self._dirty.discard((name, slot))
            if fd is not None:
                os.close(fd)
            self.path(name, slot).unlink(missing_ok=True)

    def close(self) -> None:
        """Waits for the background syncs and closes every descriptor."""
        self._settle()
        if self._syncer is not None:
            self._syncer.shutdown(wait=True)
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)


class PackedKeys:
    """The packs of one tier directory: which key is where, each pack's committed and pending slot, its files.

    Args:
      process_dir: the process directory.
      committed: the committed packs (layout and slot) its manifest names.
      below: keys of smaller shards are packed (``0``: none).
      most: bytes one pack file may hold.
      double: the tier's generations go to the other slot (``"double_slot"``).
      sync: :meth:`flush` makes the written files durable.
      budget: the tier's in-flight bytes: a read or write is synchronous but counted (back-pressure, peak).
    """

    def __init__(self, process_dir: Path, committed: Mapping[str, tuple[Pack, int]], *, below: int, most: int,
                 double: bool, sync: bool, budget: ByteBudget):
        self.dir, self._budget = process_dir, budget
        self._packs = {n: p for n, (p, _) in committed.items()}
        self._slot = {n: slot for n, (_, slot) in committed.items()}
        self._of = {k: p.name for p in self._packs.values() for k in p.keys()}
        self._pending: dict[str, int] = {}
        self._below, self._most, self._double = int(below), int(most), double
        self.files = PackFiles(process_dir, sync=sync)
        self._lock = threading.Lock()

    def name_of(self, key: str) -> str | None:
        """The pack of ``key`` (``None``: not packed)."""
        return self._of.get(key)

    def of(self, key: str) -> Pack | None:
        name = self._of.get(key)
        return None if name is None else self._packs[name]

    def packable(self, spec: ShardSpec) -> bool:
        return spec.shard_nbytes < self._below

    def claim(self, key: str, spec: ShardSpec, local: Sequence[int], *, unpacked: bool) -> Pack | None:
        """The pack of ``key``; a small key not stored ``unpacked`` (declared mid-generation) is packed now."""
        if key not in self._of and not unpacked and self.packable(spec):
            self.add([(key, spec, local)])
        return self.of(key)

    def check_local(self, key: str, local: Sequence[int]) -> None:
        """Raises a :class:`TierError` if ``key`` is packed with other local shards than ``local``."""
        pack = self.of(key)
        if pack is not None and pack.indices(key) != sorted(local):
            raise TierError(
                f"nvme tier: {key!r} is stored in {str(self.dir)!r} packed with local shards {pack.indices(key)}, "
                f"not {sorted(local)}: the directory holds another layout's state; use an empty path")

    def add(self, keys: Sequence[tuple[str, ShardSpec, Sequence[int]]]) -> None:
        """Packs ``(key, spec, local shards)`` not packed yet, in the given order, into new packs."""
        with self._lock:
            todo = [k for k in keys if k[0] not in self._of]
            first = 1 + max((int(n[1:]) for n in self._packs), default=-1)
            for pack in plan_packs(todo, self._most, first):
                self._packs[pack.name] = pack
                self._of.update((k, pack.name) for k in pack.keys())

    def write(self, pack: Pack, key: str, index: int, data: np.ndarray) -> int:
        """Writes one shard into its pack's file of this generation; returns the slot written.

        Raises:
          OSError: naming the file.
        """
        with self._lock:
            slot = self._pending.get(pack.name)
            if slot is None:
                committed = self._slot.get(pack.name)
                slot = 0 if committed is None else 1 - committed if self._double else committed
                self._pending[pack.name] = slot
        self._budget.acquire(data.nbytes)
        try:
            self.files.write(pack, slot, key, index, data)
        finally:
            self._budget.release(data.nbytes)
        return slot

    def read(self, pack: Pack, slot: int, key: str, index: int, out: np.ndarray,
             want: Sequence[str] | None) -> str | None:
        """Reads one shard into ``out`` and checks it; returns what is wrong with its file (``None``: nothing).

        Raises:
          OSError: the file could not be read (naming it).
        """
        self._budget.acquire(out.nbytes)
        try:
            got = self.files.read(pack, slot, key, index, out)
        except FileNotFoundError:
            return f"pack file {str(self.files.path(pack.name, slot))!r} is missing"
        finally:
            self._budget.release(out.nbytes)
        if got == out.nbytes and (want is None or [digest(out)] == list(want)):
            return None
        path = self.files.path(pack.name, slot)
        if got < out.nbytes:
            return f"pack file {str(path)!r} has {path.stat().st_size} bytes, its pack needs {pack.size}"
        return (f"pack file {str(path)!r} does not match its checksum ({ALGORITHM} stored {want[0]}, read "
                f"{digest(out)}) in the shard's bytes at offset {pack.members[(key, index)][0]}")

    def companions(self) -> list[str]:
        """Double slot: the keys of the packs this generation writes (their new file must be completed)."""
        with self._lock:
            return [k for n in self._pending for k in self._packs[n].keys()] if self._double else []

    def slots(self, *, pending: bool = True) -> dict[str, int]:
        """Each pack's slot: committed, or (``pending``) the one this generation writes."""
        with self._lock:
            return {**self._slot, **self._pending} if pending else dict(self._slot)

    def manifest(self, slots: Mapping[str, int]) -> dict[str, Any]:
        """The manifest's ``packs`` value for packs in ``slots``."""
        return {n: {**self._packs[n].to_json(), "slot": s} for n, s in slots.items()}

    def publish(self) -> None:
        """After a commit: the pending slots become the committed ones."""
        with self._lock:
            self._slot.update(self._pending)
            self._pending.clear()

    def abort(self) -> None:
        """Drops this generation: double slot deletes the files it wrote (never a committed one)."""
        with self._lock:
            dead, self._pending = self._pending, {}
        self.files.forget()
        if self._double:
            self.files.delete((n, s) for n, s in dead.items() if self._slot.get(n) != s)


def _allocate(fd: int, size: int) -> None:
    """Gives a new (or reused) file ``size`` bytes of disk now; a file system without fallocate gets a sparse file."""
    if os.fstat(fd).st_size > size:
        os.ftruncate(fd, size)
    try:
        os.posix_fallocate(fd, 0, max(size, 1))
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)
