"""The NVMe tier's directory layout: path checks, the lock, key paths, chunk shapes, slot arrays, the manifest.

Layout under ``path`` (each process of a job owns one subdirectory, on its own
host's disk)::

    path/process_<p>/LOCK            exclusive flock held while the tier is open
    path/process_<p>/MANIFEST.json   committed generation: key -> slot, spec, local shards,
                                     checksums (per shard, one digest per chunk file); metadata
    path/process_<p>/data/<key>/s0   zarr3 array (num_shards, *shard_shape), chunk = one shard
                                     (cut along leading dims into pieces of <= chunk_bytes)
    path/process_<p>/data/<key>/s1   the other slot
    path/process_<p>/packs/<name>.s<slot>  small shards of several keys in one file (see
                                     [Note: packed shards] in :mod:`zinf_jax.tiers.nvme_packs`)

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
import enum
import errno
import json
import math
import os
import re
import shutil
import threading
from pathlib import Path
from typing import IO, Any, Mapping, Sequence

import numpy as np

from zinf_jax._internal import locks
from zinf_jax._internal.fs import replace_json
from zinf_jax.tiers.base import ShardSpec, TierDataError, TierError
from zinf_jax.tiers.checksum import ALGORITHM
from zinf_jax.tiers.direct import ALIGN
from zinf_jax.tiers.nvme_packs import PACKS, Pack

__all__ = ["MANIFEST", "FORMAT", "Committed", "Generation", "read_manifest", "load_manifest", "lock_dir", "unlock",
           "io_error", "write_manifest", "half_updated", "check_dir", "chunk_shape", "syncfs", "key_dir",
           "open_process_dir"]

MANIFEST = "MANIFEST.json"
FORMAT = "zinf_jax.nvme/2"
"""Written in new manifests; ``/2`` added packs (``packs`` and a packed key's ``pack``)."""
FORMATS = ("zinf_jax.nvme/1", FORMAT)
"""The manifest formats this version reads."""


class Generation(enum.Enum):
    """Where the tier's next generation stands (one state per open tier)."""

    CLEAN = "clean"
    """Nothing written since the manifest was read or last replaced: on disk is exactly the committed
    generation the manifest names (unmarked). Allowed: everything; the first put moves to ``WRITING``."""
    WRITING = "writing"
    """Puts of the next generation have started. Double slot: they go to the slots the manifest does not
    name, the committed generation stays intact on disk. In place: the manifest was marked "in progress"
    before the first write and the committed slots are being overwritten ([Note: half-updated tier] in
    :mod:`zinf_jax.tiers.nvme`).
    Scratch: overwritten, nothing published. Allowed: puts, gets (a shard's newest data: this generation's
    if written), commit (back to ``CLEAN``). After a failed write, commit and close raise it and drop the
    generation: double slot deletes its slots (back to ``CLEAN``), in place becomes ``BROKEN``."""
    BROKEN = "broken"
    """An in-place generation failed half-way (a write error, then commit or close): the marked manifest
    stays and the data mixes two steps. Allowed: nothing but close; put, get and commit raise the
    half-updated error, as every later opener does ([Note: half-updated tier] in :mod:`zinf_jax.tiers.nvme`)."""


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
    packs: dict[str, tuple[Pack, int]] = dataclasses.field(default_factory=dict)
    """The committed packs: their layout and slot."""
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
    if man.get("format", FORMAT) not in FORMATS:
        raise ValueError(f"format {man['format']!r}; this version of zinf_jax reads {FORMATS}")
    packs = man.get("packs", {})
    if not isinstance(packs, dict):
        raise ValueError("'packs' is not an object")
    for name, v in packs.items():
        if not isinstance(v, dict) or v.get("slot") not in (0, 1):
            raise ValueError(f"pack {name!r} has no slot 0/1")
        Pack.from_json(name, v)
    for key, v in man["keys"].items():
        if not isinstance(v, dict) or v.get("slot") not in (0, 1) or not isinstance(v.get("local"), list):
            raise ValueError(f"entry of key {key!r} has no slot 0/1 or no local shard list")
        sums = v.get("checksums")
        if sums is not None and (not isinstance(sums, dict) or {str(i) for i in v["local"]} != set(sums)):
            raise ValueError(f"checksums of key {key!r} do not list its local shards")
        ShardSpec.from_json(v["spec"])
        if "pack" in v and (v["pack"] not in packs or packs[v["pack"]]["slot"] != v["slot"]):
            raise ValueError(f"key {key!r} names pack {v['pack']!r}, which is not listed with its slot")


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
        packs={n: (Pack.from_json(n, v), int(v["slot"])) for n, v in man.get("packs", {}).items()},
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
        "checkpoint: zinf_jax.restore(checkpoint, ...) with this offload path does so (as `zinf-jax train --resume` "
        "does). (ZeroConfig(nvme_update='double_slot') keeps every step durable at twice the disk.)"
    )


def write_manifest(process_dir: Path, manifest: Mapping[str, Any]) -> None:
    """Replaces the manifest atomically and durably (write, fsync, rename, fsync the directory)."""
    replace_json(process_dir / MANIFEST, manifest)


def lock_dir(process_dir: Path) -> IO[str]:
    """Takes the exclusive lock of a process directory; the open LOCK file (naming us) keeps it.

    Raises:
      TierError: another process or tier holds it (the message names the holder's pid).
    """
    return locks.take(process_dir / "LOCK", lambda holder: TierError(
        f"nvme tier: {str(process_dir)!r} is locked by {holder}; another job is using this directory. "
        "Stop it or give this job its own offload path."))


def unlock(f: IO[str]) -> None:
    """Releases a lock taken by :func:`lock_dir`."""
    locks.release(f)


def _clear(process_dir: Path) -> None:
    """Deletes a process directory's state (its manifest first: a crash half-way leaves an empty directory)."""
    (process_dir / MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(process_dir / "data", ignore_errors=True)
    shutil.rmtree(process_dir / PACKS, ignore_errors=True)


def open_process_dir(root: Path, process_index: int, *, durable: bool,
                     rebuild: bool = False) -> tuple[Path, IO[str], Committed]:
    """Opens one process's directory ``<root>/process_<i>`` (made if missing) for a tier: ``(directory, its lock,
    the committed state)``. Not ``durable`` (scratch): whatever an earlier run left is deleted first. ``rebuild``
    (a restore, which writes every key from a checkpoint): a half-updated directory is cleared, not refused.

    Raises:
      TierError: ``root`` is not a usable directory, or another job holds the lock.
      TierDataError: the manifest is damaged, or the directory is half-updated (the lock is released).
    """
    check_dir(root)
    process_dir = root / f"process_{process_index}"
    process_dir.mkdir(exist_ok=True)
    lock = lock_dir(process_dir)
    try:
        if not durable:  # nothing in it outlives the process that wrote it
            _clear(process_dir)
        state = load_manifest(process_dir)
        if state.in_progress is not None and (state.generation == 0 or rebuild):
            _clear(process_dir)  # an initialisation that never committed, or a restore to come: it opens empty
            state = load_manifest(process_dir)
        if state.in_progress is not None:  # See [Note: half-updated tier] in zinf_jax.tiers.nvme
            raise half_updated(process_dir, state.in_progress)
    except TierError:
        unlock(lock)
        raise
    return process_dir, lock, state


def io_error(e: BaseException, what: str, where: str, process_dir: Path, generation: int,
             file: str | os.PathLike | None = None) -> TierError:
    """A failed read, write or open as a :class:`TierError` naming the file; a full disk says so."""
    msg = str(e)
    file = getattr(e, "filename", None) or file
    where += "" if file is None else f" (file {str(file)!r})"
    if "No space left" in msg or "ENOSPC" in msg or getattr(e, "errno", None) == errno.ENOSPC:
        kept = (f"The committed state (generation {generation}) is intact and the failed generation's files are "
                "deleted when the tier is committed or closed" if generation else
                "Nothing was committed yet (the tier was being initialised): the directory opens empty again")
        return TierError(f"nvme tier: disk full while {what} {where} under {str(process_dir)!r}. {kept}; free space "
                         "or use a larger disk for the offload path.")
    return TierError(f"nvme tier: {what} {where} under {str(process_dir)!r} failed: {msg}")
