"""The NVMe tier's directory layout: path checks, key paths, chunk shapes, the manifest.

Layout under ``path`` (each process of a job owns one subdirectory, on its own
host's disk)::

    path/process_<p>/LOCK            exclusive flock held while the tier is open
    path/process_<p>/MANIFEST.json   committed generation: key -> slot, specs, metadata
    path/process_<p>/data/<key>/s0   zarr3 array (num_shards, *shard_shape), chunk = one shard
                                     (cut along leading dims into pieces of <= chunk_bytes)
    path/process_<p>/data/<key>/s1   the other slot

The manifest is only ever replaced whole (:func:`write_manifest`: write, fsync,
rename, fsync the directory), so it always names one complete generation.
"""
from __future__ import annotations

import json
import math
import os
import re
import threading
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from zinf_jax.tiers.base import ShardSpec, TierError
from zinf_jax.tiers.direct import ALIGN

__all__ = ["MANIFEST", "FORMAT", "read_manifest", "load_manifest", "write_manifest", "check_dir", "chunk_shape", "syncfs", "key_dir"]

MANIFEST = "MANIFEST.json"
FORMAT = "zinf_jax.nvme/1"


def read_manifest(process_dir: str | os.PathLike) -> dict[str, Any]:
    """The committed manifest of one process directory (empty state if none)."""
    p = Path(process_dir) / MANIFEST
    if not p.exists():
        return {"format": FORMAT, "generation": 0, "keys": {}, "metadata": {}}
    with open(p) as f:
        return json.load(f)


def load_manifest(process_dir: Path) -> tuple[int, dict[str, Any], dict[str, ShardSpec], dict[str, list[int]],
                                               dict[str, int]]:
    """Generation, metadata, and per key spec, local shard indices and committed slot.

    Raises:
      TierError: the manifest cannot be parsed (it is only ever replaced whole:
        edited or damaged by something else).
    """
    try:
        man = read_manifest(process_dir)
        keys = man["keys"]
        return (int(man["generation"]), dict(man.get("metadata", {})),
                {k: ShardSpec.from_json(v["spec"]) for k, v in keys.items()},
                {k: list(v["local"]) for k, v in keys.items()}, {k: int(v["slot"]) for k, v in keys.items()})
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise TierError(
            f"nvme tier: {str(Path(process_dir) / MANIFEST)!r} is unreadable ({type(e).__name__}: {e}); "
            "restore from a checkpoint into an empty offload path"
        ) from e


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


def write_manifest(process_dir: Path, manifest: Mapping[str, Any]) -> None:
    """Replaces the manifest atomically and durably (write, fsync, rename, fsync the directory)."""
    tmp = process_dir / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, process_dir / MANIFEST)
    dfd = os.open(process_dir, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
