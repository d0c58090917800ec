"""The NVMe tier's directory layout: path checks, the lock, key paths, chunk shapes, slot arrays, the manifest.

Layout under ``path`` (each process of a job owns one subdirectory, on its own
host's disk)::

    path/process_<p>/LOCK            exclusive flock held while the tier is open
    path/process_<p>/MANIFEST.json   committed generation: key -> slot, spec, local shards,
                                     checksums (per shard, one digest per chunk file); metadata
    path/process_<p>/data/<key>/s0   zarr3 array (num_shards, *shard_shape), chunk = one shard
                                     (cut along leading dims into pieces of <= chunk_bytes)
    path/process_<p>/data/<key>/s1   the other slot

The manifest is only ever replaced whole (:func:`write_manifest`: write, fsync,
rename, fsync the directory), so it always names one complete generation, with
the checksums of exactly that generation's data (:mod:`zinf_jax.tiers.checksum`).
An in-place update marks it ``"in_progress"`` before its first write and the
commit unmarks it; a marked manifest is a half-updated directory that no opener
uses (see [Note: half-updated tier] in :mod:`zinf_jax.tiers.nvme`).
A manifest that does not parse is a :class:`~zinf_jax.tiers.base.TierDataError`
naming the file, never a bare decode error.
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import math
import os
import re
import shutil
import threading
from pathlib import Path
from typing import IO, Any, Mapping, Sequence

import numpy as np
import tensorstore as ts

from zinf_jax._internal.fs import replace_json
from zinf_jax.tiers.base import ShardSpec, TierDataError, TierError, np_dtype
from zinf_jax.tiers.checksum import ALGORITHM
from zinf_jax.tiers.direct import ALIGN, ZARR3_CODECS, ZARR3_KEY_ENCODING

__all__ = ["MANIFEST", "FORMAT", "Committed", "read_manifest", "load_manifest", "lock_dir", "unlock", "SlotArrays",
           "io_error", "write_manifest", "half_updated", "check_dir", "chunk_shape", "syncfs", "key_dir"]

MANIFEST = "MANIFEST.json"
FORMAT = "zinf_jax.nvme/1"


@dataclasses.dataclass
class Committed:
    """What a manifest says: the committed generation of one process directory."""

    generation: int
    metadata: dict[str, Any]
    specs: dict[str, ShardSpec]
    local: dict[str, list[int]]
    """Shard indices of each key stored by this process."""
    slot: dict[str, int]
    """The committed slot (0 or 1) of each key."""
    sums: dict[str, dict[int, list[str]]]
    """Digests of each shard's chunk files, for the keys committed with checksums."""
    in_progress: dict[str, Any] | None = None
    """Set while an in-place generation is being written: the data may be half-updated (see
    [Note: half-updated tier] in :mod:`zinf_jax.tiers.nvme`)."""


def _damaged_manifest(path: Path, why: str) -> TierDataError:
    return TierDataError(
        f"nvme tier: manifest {str(path)!r} is unreadable ({why}); it is only ever replaced whole, so it was "
        f"damaged or edited outside zinf_jax and the tier's state cannot be trusted: delete {str(path.parent)!r} "
        "(or use an empty offload path) and restore from a checkpoint with --resume."
    )


def _check_manifest(man: Any) -> None:
    """Raises ``ValueError`` unless ``man`` has the manifest's structure."""
    if not isinstance(man, dict) or not isinstance(man.get("keys"), dict) or not isinstance(man.get("generation"), int):
        raise ValueError("not a manifest object with 'generation' and 'keys'")
    if not isinstance(man.get("metadata", {}), dict):
        raise ValueError("'metadata' is not an object")
    if not isinstance(man.get("in_progress") or {}, dict):
        raise ValueError("'in_progress' is not an object")
    if man.get("checksum", ALGORITHM) != ALGORITHM:
        raise ValueError(f"checksums of kind {man['checksum']!r}, this version reads {ALGORITHM!r}")
    for key, v in man["keys"].items():
        if not isinstance(v, dict) or v.get("slot") not in (0, 1) or not isinstance(v.get("local"), list):
            raise ValueError(f"entry of key {key!r} has no slot 0/1 or no local shard list")
        sums = v.get("checksums")
        if sums is not None and (not isinstance(sums, dict) or {str(i) for i in v["local"]} != set(sums)):
            raise ValueError(f"checksums of key {key!r} do not list its local shards")
        ShardSpec.from_json(v["spec"])


def read_manifest(process_dir: str | os.PathLike) -> dict[str, Any]:
    """The committed manifest of one process directory (empty state if none).

    Raises:
      TierDataError: the manifest is empty, not JSON or not a manifest; the
        message names the file and what to do.
    """
    p = Path(process_dir) / MANIFEST
    if not p.exists():
        return {"format": FORMAT, "generation": 0, "keys": {}, "metadata": {}}
    try:
        with open(p, "rb") as f:
            man = json.loads(f.read().decode("utf-8"))
        _check_manifest(man)
    except (OSError, ValueError, KeyError, TypeError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise _damaged_manifest(p, f"{type(e).__name__}: {e}") from e
    return man


def load_manifest(process_dir: Path) -> Committed:
    """The committed state a process directory's manifest names.

    Raises:
      TierDataError: the manifest cannot be parsed.
    """
    man = read_manifest(process_dir)
    keys = man["keys"]
    return Committed(
        generation=int(man["generation"]), metadata=dict(man.get("metadata", {})),
        specs={k: ShardSpec.from_json(v["spec"]) for k, v in keys.items()},
        local={k: [int(i) for i in v["local"]] for k, v in keys.items()},
        slot={k: int(v["slot"]) for k, v in keys.items()},
        sums={k: {int(i): list(d) for i, d in v["checksums"].items()} for k, v in keys.items() if v.get("checksums")},
        in_progress=man.get("in_progress"),
    )


def check_dir(root: Path) -> None:
    """Raises a :class:`TierError` naming the fix unless ``root`` is an existing, writable directory."""
    if not root.exists():
        raise TierError(f"nvme tier: path {str(root)!r} does not exist; create it or set offload path to a directory on a local disk")
    if not root.is_dir():
        raise TierError(f"nvme tier: path {str(root)!r} is not a directory; set offload path to a directory")
    probe = root / f".zinf_probe_{os.getpid()}_{threading.get_ident()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"x")
        probe.unlink()
    except OSError as e:
        raise TierError(f"nvme tier: path {str(root)!r} is not writable ({e.strerror}); choose a writable directory") from e


def chunk_shape(shard_shape: Sequence[int], itemsize: int, limit: int) -> list[int]:
    """A chunk of one shard: the whole shard, or near-equal leading-dim pieces of <= ``limit`` bytes.

    Several chunk files per large shard let tensorstore copy, write and fsync
    them concurrently (one 256 MiB file is written and synced by one thread).
    """
    chunk = list(shard_shape)
    if itemsize * int(np.prod(chunk, dtype=np.int64)) <= limit:
        return chunk
    for d, n in enumerate(chunk):
        inner = itemsize * int(np.prod(chunk[d + 1 :], dtype=np.int64))
        if inner <= limit:
            pieces = -(-inner * n // limit)
            chunk[d] = -(-n // pieces)
            step = ALIGN // math.gcd(inner, ALIGN)  # rows per sector-aligned piece: no staging copy
            if step * inner <= limit // 16:
                chunk[d] = min(n, -(-chunk[d] // step) * step)
            return chunk
        chunk[d] = 1
    return chunk


def syncfs(path: Path) -> None:
    """Flushes every dirty page of the filesystem holding ``path`` (one call instead of an fsync per file)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    finally:
        os.close(fd)


def key_dir(key: str) -> str:
    """A key as a relative directory path (characters outside ``[A-Za-z0-9._-]`` become ``_``)."""
    parts = [re.sub(r"[^A-Za-z0-9._-]", "_", p) or "_" for p in key.split("/")]
    return "/".join(p if p not in (".", "..") else "_" + p for p in parts)


def half_updated(process_dir: Path, in_progress: Mapping[str, Any]) -> TierDataError:
    """The error for a directory whose in-place update was interrupted (its data mixes two steps).

    See [Note: half-updated tier] in :mod:`zinf_jax.tiers.nvme`: every opener, and a tier whose in-place
    generation failed half-way, raises it.
    """
    return TierDataError(
        f"nvme tier: {str(process_dir)!r} is half-updated: an in-place update of generation "
        f"{in_progress.get('generation')} (metadata {in_progress.get('metadata', {})}) was in progress when its "
        "process stopped, so its shards mix two steps and cannot be trained on. Rebuild it from the newest "
        "checkpoint: `zinf-jax train --resume` does so, or delete the directory (use an empty offload path) and "
        "zinf_jax.restore(...) from a checkpoint. (ZeroConfig(nvme_update='double_slot') keeps every step durable "
        "at twice the disk.)"
    )


def write_manifest(process_dir: Path, manifest: Mapping[str, Any]) -> None:
    """Replaces the manifest atomically and durably (write, fsync, rename, fsync the directory)."""
    replace_json(process_dir / MANIFEST, manifest)


def lock_dir(process_dir: Path) -> IO[str]:
    """Takes the exclusive lock of a process directory; the open LOCK file (holding our pid) keeps it.

    Raises:
      TierError: another process or tier holds it (the message names the holder's pid).
    """
    f = open(process_dir / "LOCK", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise TierError(
            f"nvme tier: {str(process_dir)!r} is locked by {holder}; another job is using this directory. "
            "Stop it or give this job its own offload path."
        ) from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()}\n")
    f.flush()
    return f


def unlock(f: IO[str]) -> None:
    """Releases a lock taken by :func:`lock_dir`."""
    fcntl.flock(f, fcntl.LOCK_UN)
    f.close()


class SlotArrays:
    """The tensorstore ``zarr3`` arrays of a process directory's slots, opened once and kept.

    Args:
      process_dir: the process directory.
      chunk_bytes: chunk size limit of newly created arrays.
      sync: tensorstore fsyncs what it writes.
      direct_io: tensorstore reads with ``O_DIRECT``.
    """

    def __init__(self, process_dir: Path, chunk_bytes: int, *, sync: bool, direct_io: bool):
        self.dir = process_dir
        self._chunk_bytes = int(chunk_bytes)
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


def io_error(e: BaseException, what: str, where: str, process_dir: Path, generation: int,
             file: str | os.PathLike | None = None) -> TierError:
    """A failed read, write or open as a :class:`TierError` naming the file; a full disk says so."""
    msg = str(e)
    file = getattr(e, "filename", None) or file
    where += "" if file is None else f" (file {str(file)!r})"
    if "No space left" in msg or "ENOSPC" in msg or getattr(e, "errno", None) == errno.ENOSPC:
        return TierError(
            f"nvme tier: disk full while {what} {where} under {str(process_dir)!r}. The committed state (generation "
            f"{generation}) is intact and the failed generation's files are deleted when the tier is committed or "
            "closed; free space or use a larger disk for the offload path."
        )
    return TierError(f"nvme tier: {what} {where} under {str(process_dir)!r} failed: {msg}")
