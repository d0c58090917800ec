"""The on-disk names of checkpoints, and listing them: the only module that spells them.

A checkpoint root (``<run_dir>/ckpt``, or any ``engine.save`` directory) holds::

    step_<N>/                  one complete checkpoint (N zero-padded to 8 digits); complete
                               exactly when it holds META (written last, before the rename)
      zinf_meta.json           META: step, optimizer counters, config, parameter table, user state
      checksums.json           CHECKSUMS: [size, crc32] of every other file
      group_<k>/               one orbax PyTree checkpoint per unit (then the persistent params)
      rng/                     orbax PyTree checkpoint of the model's non-parameter state
    .tmp_step_<N>_<token>/     a save in progress (renamed to step_<N> when complete)
    .del_step_<N>_<id>/        a checkpoint being deleted by retention (renamed out first)
    .bad_step_<N>_<id>/        a damaged checkpoint set aside (kept for inspection)
    .zinf_owner                OWNER: the lock a live job holds while it saves here (naming it)

Every name a save, a restore, retention, the main job's run directory or ``zinf-jax inspect``
uses comes from here. Standard library only.
"""
from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

__all__ = ["META", "CHECKSUMS", "PARTIAL", "RNG", "FORMAT", "FORMATS", "TMP", "DOOMED", "BAD", "OWNER", "step_name",
           "group_name", "temp_name", "step_of", "is_complete", "list_steps", "set_aside", "leftovers"]

FORMAT = "zinf_jax.checkpoint/2"
"""The format written: ``/2`` carries ``checksums.json``."""
FORMATS = (FORMAT, "zinf_jax.checkpoint/1")
"""The formats read (``/1`` checkpoints have no checksums and are read unverified)."""
META = "zinf_meta.json"
"""The metadata file, written last into a step directory: a ``step_<N>`` with it is complete."""
CHECKSUMS = "checksums.json"
"""The checksum table of a step directory (covers every other file)."""
PARTIAL = ".crc_process_"
"""Prefix of one process's share of the checksum table while a multi-process save assembles it."""
RNG = "rng"
"""The orbax tree of the model's non-parameter state."""
TMP = ".tmp_"
"""Prefix of a step directory being written."""
DOOMED = ".del_"
"""Prefix of a step directory being deleted (hidden, and not ``step_*``)."""
BAD = ".bad_"
"""Prefix of a damaged step directory set aside."""
OWNER = ".zinf_owner"
"""The lock file of a checkpoint root: held by the job that saves there (see :mod:`zinf_jax.checkpoint.owner`)."""

_STEP_DIR = re.compile(r"step_(\d+)")


def step_name(step: int) -> str:
    """``step_00000150`` for step 150."""
    return f"step_{step:08d}"


def group_name(k: int) -> str:
    """The orbax tree of the ``k``-th parameter group (unit)."""
    return f"group_{k:04d}"


def temp_name(final: str, token: str) -> str:
    """The hidden name a step directory is assembled under before the rename to ``final``."""
    return f"{TMP}{final}_{token}"


def step_of(name: str) -> int | None:
    """The step of a ``step_<N>`` directory name, else None (hidden and other names)."""
    m = _STEP_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def is_complete(step_dir: str | os.PathLike) -> bool:
    """Whether a step directory holds its metadata (written last: the checkpoint is whole)."""
    return (Path(step_dir) / META).is_file()


def list_steps(root: str | os.PathLike, *, complete: bool = True) -> list[tuple[int, Path]]:
    """The ``step_<N>`` directories under ``root``, oldest first (empty if ``root`` is not a directory).

    Args:
      root: a checkpoint root.
      complete: only those that hold their metadata (``False``: damaged or incomplete ones too).
    """
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(n, p) for p in root.iterdir() if (n := step_of(p.name)) is not None and p.is_dir()]
    return sorted((n, p) for n, p in found if not complete or is_complete(p))


def set_aside(step_dir: Path, prefix: str) -> Path:
    """Renames a step directory out of ``step_*`` (hidden, with a unique suffix); returns the new path.

    Args:
      step_dir: the ``step_<N>`` directory.
      prefix: :data:`DOOMED` (about to be deleted) or :data:`BAD` (damaged, kept for inspection).
    """
    hidden = step_dir.parent / f"{prefix}{step_dir.name}_{uuid.uuid4().hex[:8]}"
    os.rename(step_dir, hidden)
    return hidden


def leftovers(root: str | os.PathLike, prefixes: tuple[str, ...] = (TMP, DOOMED)) -> list[Path]:
    """Directories a killed save (``.tmp_step_*``) or retention delete (``.del_step_*``) left, sorted."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for prefix in prefixes for p in root.glob(f"{prefix}step_*") if p.is_dir())
