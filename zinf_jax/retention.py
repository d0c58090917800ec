"""Checkpoint retention (``max_to_keep``) and the crash-safe deletion of old step directories.

``apply_retention(root, keep, n)`` deletes the oldest complete ``step_<N>``
checkpoints so that at most ``n`` remain, ``keep`` (the one just written)
always among them. Which ones go is orbax's own ``LatestN`` preservation policy
(the one its CheckpointManager applies for ``max_to_keep``), used on its own:
zinf assembles the step directories itself, so no CheckpointManager owns them.

A doomed ``step_<N>`` is first renamed to a hidden ``.del_step_<N>_*`` (the
renames made durable) and only then removed, so a crash mid-delete never leaves
a half-deleted directory that looks like a checkpoint; the next save clears such
leftovers (:func:`remove_doomed_leftovers`).
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import re
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

__all__ = ["check_max_to_keep", "apply_retention", "remove_doomed_leftovers", "complete_steps", "fsync_dir",
           "STEP_DIR", "META"]

META = "zinf_meta.json"  # written last into a step directory: a step_<N> with it is complete
STEP_DIR = re.compile(r"step_(\d+)")
DOOMED = ".del_"  # prefix of a step directory being deleted (hidden, and not ``step_*``)


def check_max_to_keep(max_to_keep: Any) -> None:
    """Raises ValueError unless ``max_to_keep`` is a positive int or None."""
    if max_to_keep is None:
        return
    if isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1:
        raise ValueError(f"max_to_keep must be a positive int or None (keep all), got {max_to_keep!r}")


def fsync_dir(path: Path) -> None:
    """Makes the entries of a directory (renames, creations) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def complete_steps(root: Path) -> list[tuple[int, Path]]:
    """The complete ``step_<N>`` directories under ``root``, oldest first."""
    out = []
    for p in root.iterdir():
        m = STEP_DIR.fullmatch(p.name)
        if m and (p / META).is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


@dataclasses.dataclass(frozen=True)
class _StepInfo:
    """One checkpoint as orbax's preservation policies see it (``PolicyCheckpointInfo``)."""

    step: int
    time: datetime.datetime
    metrics: dict[str, Any] | None = None


def doomed_steps(root: Path, keep: Path, max_to_keep: int) -> list[Path]:
    """The complete checkpoints to delete so that at most ``max_to_keep`` remain, ``keep`` among them.

    ``keep`` is always kept, and the newest ``max_to_keep - 1`` of the others with it.
    """
    others = [p for _, p in complete_steps(root) if p.name != keep.name]
    infos = [_StepInfo(step=int(STEP_DIR.fullmatch(p.name).group(1)),
                       time=datetime.datetime.fromtimestamp((p / META).stat().st_mtime)) for p in others]
    policy = ocp.checkpoint_managers.LatestN(n=max_to_keep - 1)
    preserve = policy.should_preserve(infos, context=ocp.checkpoint_managers.PreservationContext())
    return [p for p, kept in zip(others, preserve) if not kept]


def remove_doomed_leftovers(root: Path) -> None:
    """Finishes deletions a crash interrupted (``.del_*`` directories)."""
    for p in root.glob(DOOMED + "*"):
        shutil.rmtree(p, ignore_errors=True)


def set_aside(step_dir: Path, prefix: str = DOOMED) -> Path:
    """Renames a step directory out of ``step_*`` (hidden, with a unique suffix); returns the new path."""
    hidden = step_dir.parent / f"{prefix}{step_dir.name}_{uuid.uuid4().hex[:8]}"
    os.rename(step_dir, hidden)
    return hidden


def apply_retention(root: Path, keep: Path, max_to_keep: int | None) -> None:
    """Deletes the oldest complete checkpoints beyond ``max_to_keep`` (rename out of ``step_*``, then remove).

    Call it only once ``keep`` is complete and durable. A failure to delete is a
    warning, not an error: the checkpoint just written is good.
    """
    if max_to_keep is None:
        return
    try:
        doomed = [set_aside(p) for p in doomed_steps(root, keep, max_to_keep)]
        if doomed:
            fsync_dir(root)  # the renames are durable before any file goes
        for p in doomed:
            shutil.rmtree(p)
    except OSError as e:
        warnings.warn(f"checkpoint retention (max_to_keep={max_to_keep}) in {str(root)!r}: could not delete an old "
                      f"checkpoint: {e}", RuntimeWarning, stacklevel=3)
