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

import datetime
import shutil
import warnings
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from zinf_jax._internal.fs import fsync_dir
from zinf_jax.checkpoint import format as fmt
from zinf_jax.checkpoint.policies import StepInfo

__all__ = ["check_max_to_keep", "apply_retention", "remove_doomed_leftovers", "doomed_steps"]


def check_max_to_keep(max_to_keep: Any) -> None:
    """Raises ValueError unless ``max_to_keep`` is a positive int or None."""
    if max_to_keep is None:
        return
    if isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1:
        raise ValueError(f"max_to_keep must be a positive int or None (keep all), got {max_to_keep!r}")


def doomed_steps(root: Path, keep: Path, max_to_keep: int) -> list[Path]:
    """The complete checkpoints to delete so that at most ``max_to_keep`` remain, ``keep`` among them.

    ``keep`` is always kept, and the newest ``max_to_keep - 1`` of the others with it. A checkpoint newer than
    ``keep`` is never deleted (a save of an older step, asked for with ``overwrite=True``): retention only ever
    removes the past of the step just saved, as orbax's CheckpointManager, which never saves a step at or below
    its latest.
    """
    mine = fmt.step_of(keep.name)
    others = [(n, p) for n, p in fmt.list_steps(root) if p.name != keep.name and (mine is None or n < mine)]
    infos = [StepInfo(step=n, time=datetime.datetime.fromtimestamp((p / fmt.META).stat().st_mtime)) for n, p in others]
    policy = ocp.checkpoint_managers.LatestN(n=max_to_keep - 1)
    preserve = policy.should_preserve(infos, context=ocp.checkpoint_managers.PreservationContext())
    return [p for (_, p), kept in zip(others, preserve) if not kept]


def remove_doomed_leftovers(root: Path) -> None:
    """Finishes deletions a crash interrupted (``.del_step_*`` directories)."""
    for p in fmt.leftovers(root, (fmt.DOOMED,)):
        shutil.rmtree(p, ignore_errors=True)


def apply_retention(root: Path, keep: Path, max_to_keep: int | None) -> None:
    """Deletes the oldest complete checkpoints beyond ``max_to_keep`` (rename out of ``step_*``, then remove).

    Call it only once ``keep`` is complete and durable. A failure to delete is a
    warning, not an error: the checkpoint just written is good.
    """
    if max_to_keep is None:
        return
    try:
        doomed = [fmt.set_aside(p, fmt.DOOMED) for p in doomed_steps(root, keep, max_to_keep)]
        if doomed:
            fsync_dir(root)  # the renames are durable before any file goes
        for p in doomed:
            shutil.rmtree(p)
    except OSError as e:
        warnings.warn(f"checkpoint retention (max_to_keep={max_to_keep}) in {str(root)!r}: could not delete an old "
                      f"checkpoint: {e}", RuntimeWarning, stacklevel=3)
