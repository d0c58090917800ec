"""Checkpoint integrity: a CRC32 of every file of a step directory, and errors that name the file.

``checksums.json`` (written into a step directory just before it is renamed
into place) maps every file's path, relative to the step directory, to
``[size, crc32]`` (``zlib.crc32``, hex). It covers ``zinf_meta.json`` and every
orbax file; only itself is left out. A restore verifies each group's files just
before reading them (:func:`verify`): a missing file, another size or another
CRC raises :class:`CheckpointError` naming the file. The cost is one extra
sequential read of each file, from the page cache for orbax's read right after
(measured: 0.08 s for an 86 MiB checkpoint, about 1.1 GB/s, 2% of its restore;
0.15 s of a 3.3 s save, fsync of every file included).

In a multi-process job each process checksums (at save) and verifies (at
restore) its share of the files, and all of them raise the same error.

Every kind of damage (missing or garbage ``zinf_meta.json``, a missing group
directory, a file orbax cannot read) is a :class:`CheckpointError` that names the
file, so a caller can fall back to an older checkpoint by catching that one type.
"""
from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any, Iterable, Mapping

from zinf_jax._internal.fs import write_json
from zinf_jax._internal.multihost import Procs
from zinf_jax.checkpoint.format import CHECKSUMS, PARTIAL
from zinf_jax.errors import CheckpointError

__all__ = ["CheckpointError", "read_json", "read_table", "write_checksums", "verify"]

_BLOCK = 8 << 20


def read_json(path: Path, what: str) -> Any:
    """A JSON file of a checkpoint; any failure to read or parse it is a :class:`CheckpointError` naming it."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8"))
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint {what} {str(path)!r} is missing") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {what} {str(path)!r} is unreadable or damaged: {e}") from e


def list_files(step_dir: Path) -> list[str]:
    """Every file under ``step_dir`` (relative, ``/``-separated, sorted) but the checksum tables."""
    out = []
    for dirpath, _, files in os.walk(step_dir):
        rel = os.path.relpath(dirpath, step_dir)
        for f in files:
            if f == CHECKSUMS or f.startswith(PARTIAL):
                continue
            out.append(f if rel == "." else f"{rel}/{f}".replace(os.sep, "/"))
    return sorted(out)


def file_crc(path: Path, *, sync: bool = False) -> list:
    """``[size, crc32 hex]`` of one file, read once in 8 MiB blocks (then made durable if ``sync``)."""
    crc, size = 0, 0
    buf = bytearray(_BLOCK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            size += n
        if sync:
            os.fsync(f.fileno())
    return [size, f"{crc:08x}"]


def write_checksums(tmp: Path, procs: Procs) -> None:
    """Writes ``tmp/checksums.json`` of every file under ``tmp`` (each made durable on the way).

    Collective: each process reads its share of the files; process 0 writes the table.
    """
    names = list_files(tmp)
    part = {n: file_crc(tmp / n, sync=True) for n in names[procs.index::procs.count]}
    if procs.count == 1:
        write_json(tmp / CHECKSUMS, part, indent=1)
        return
    write_json(tmp / f"{PARTIAL}{procs.index}.json", part, indent=1)
    procs.sync("checksums")
    if procs.primary:
        table: dict[str, list] = {}
        for i in range(procs.count):
            p = tmp / f"{PARTIAL}{i}.json"
            table.update(read_json(p, "checksum share"))
            p.unlink()
        write_json(tmp / CHECKSUMS, dict(sorted(table.items())), indent=1)


def read_table(step_dir: Path) -> dict[str, list]:
    """The ``checksums.json`` of a step directory (:class:`CheckpointError` if missing or damaged)."""
    table = read_json(step_dir / CHECKSUMS, "checksum table")
    if not isinstance(table, dict) or not all(isinstance(v, list) and len(v) == 2 for v in table.values()):
        raise CheckpointError(f"checkpoint checksum table {str(step_dir / CHECKSUMS)!r} is damaged")
    return table


def first_bad(step_dir: Path, table: Mapping[str, list], names: Iterable[str]) -> tuple[str, str] | None:
    """The first of ``names`` (keys of ``table``) whose file is missing or differs: ``(name, why)``, else None."""
    for n in names:
        p = step_dir / n
        try:
            size, crc = file_crc(p)
        except FileNotFoundError:
            return n, "is missing"
        except OSError as e:
            return n, f"cannot be read ({e})"
        want_size, want_crc = table[n]
        if size != want_size:
            return n, f"has {size} bytes, the checkpoint wrote {want_size}"
        if crc != want_crc:
            return n, f"has crc32 {crc}, the checkpoint wrote {want_crc} (damaged on disk)"
    return None


def verify(step_dir: Path, table: Mapping[str, list] | None, name: str, procs: Procs) -> None:
    """Checks ``name`` (a file, or a directory's files) of a checkpoint against its table.

    Collective: each process reads its share; all raise the same :class:`CheckpointError`, naming the
    first bad file. ``table=None`` (a checkpoint from before checksums) checks only that ``name`` exists.
    """
    if not (step_dir / name).exists():
        raise CheckpointError(f"checkpoint {str(step_dir)!r} is damaged: {str(step_dir / name)!r} is missing")
    if table is None:
        return
    names = [n for n in table if n == name or n.startswith(name + "/")]
    bad = first_bad(step_dir, table, names[procs.index::procs.count])
    hits = [i for i in procs.gather(names.index(bad[0]) if bad else -1) if i >= 0]
    if hits:
        first = names[min(hits)]
        why = bad[1] if bad and bad[0] == first else "failed its check on another process"
        raise CheckpointError(f"checkpoint {str(step_dir)!r} is damaged: file {str(step_dir / first)!r} {why}")
