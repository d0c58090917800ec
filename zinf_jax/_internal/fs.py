"""Durable files: what a crash at any moment leaves behind (standard library only).

A file is durable once its bytes are fsynced; a rename (or a creation) once its
directory is. :func:`write_json` writes a file whose content is complete before
anyone can see it only when used on a temporary name that is then renamed
(:func:`replace_json` does both).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["fsync_dir", "write_json", "replace_json"]


def fsync_dir(path: str | os.PathLike) -> None:
    """Makes the entries of a directory (renames, creations, deletions) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str | os.PathLike, data: Any, *, indent: int | None = None) -> None:
    """Writes ``data`` as JSON (non-JSON values as ``str``) and fsyncs the file."""
    text = json.dumps(data, indent=indent, default=str)  # json.dump always takes the pure-Python encoder: 10x slower
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def replace_json(path: str | os.PathLike, data: Any) -> None:
    """Replaces ``path`` by ``data`` atomically and durably: write a temporary file, fsync, rename, fsync the dir.

    A crash at any moment leaves either the old file or the new one, complete.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    write_json(tmp, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)
