"""The main job's run directory: one job at a time, never silently reused, tidy after a crash.

A run directory holds ``metrics.jsonl``, ``summary.json``, ``ckpt/step_<N>/``
checkpoints and (by default) the nvme tiers under ``nvme/``. This module only
uses the standard library:

* :class:`RunLock`: an exclusive ``fcntl.flock`` on ``<run_dir>/.lock`` (the
  holder's pid is written in it) for every tier choice; the kernel drops it when
  the process dies, however it dies.
* :func:`check_reuse`: a new run (no ``--resume``) refuses a directory that holds
  checkpoints or tier state, unless ``--overwrite`` lets it delete them first.
* :func:`remove_stale`: ``.tmp_step_*`` directories of saves a kill interrupted.
* :func:`step_dirs` and :func:`set_aside`: every ``step_<N>`` directory newest
  first (complete or not), and moving a damaged one out of the way.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterable

from zinf_jax._internal import locks
from zinf_jax.checkpoint import format as fmt
from zinf_jax.errors import RunDirError
from zinf_jax.plan.placement import TIER_SUBDIRS

__all__ = ["RunDirError", "RunLock", "check_reuse", "clear_tier_state", "remove_stale", "step_dirs", "set_aside",
           "TIER_SUBDIRS"]

LOCK = ".lock"


class RunLock:
    """An exclusive lock on a run directory, held until :meth:`close` (or the process ends).

    Args:
      run_dir: the run directory (must exist).
      name: the lock file (one per process of a multi-process job).

    Raises:
      RunDirError: another process holds it (the message names its pid).
    """

    def __init__(self, run_dir: Path, name: str = LOCK):
        self.path = Path(run_dir) / name
        self._f = locks.take(self.path, lambda holder: RunDirError(
            f"run dir {str(run_dir)!r} is in use by {holder} (it holds {str(self.path)!r}); wait for that run to "
            "finish, stop it, or use another --run-dir"))

    def close(self) -> None:
        """Releases the lock (idempotent)."""
        locks.release(self._f)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def step_dirs(ckpt: Path) -> list[Path]:
    """Every ``step_<N>`` directory under ``ckpt`` (with or without its metadata), newest first."""
    return [p for _, p in reversed(fmt.list_steps(ckpt, complete=False))]


def _tier_dirs(nvme_paths: Iterable[str]) -> list[Path]:
    """The tier subdirectories under the offload paths that hold anything but lock files."""
    out = []
    for root in dict.fromkeys(nvme_paths):
        for sub in TIER_SUBDIRS:
            d = Path(root) / sub
            if d.is_dir() and any(f.is_file() and f.name != "LOCK" for f in d.rglob("*")):
                out.append(d)
    return out


def _half_updated(tier_dir: Path) -> bool:
    """Whether an in-place nvme tier under ``tier_dir`` was stopped in the middle of a step (its manifest says so)."""
    for man in tier_dir.glob("process_*/MANIFEST.json"):
        try:
            if json.loads(man.read_text()).get("in_progress"):
                return True
        except (OSError, ValueError):
            return True  # unreadable: not usable either (the tier names the problem when opened)
    return False


def _check_unlocked(tier_dir: Path) -> None:
    """Refuses to touch a tier directory (or one process's part of it) whose lock another process holds."""
    for lock in [*tier_dir.glob("process_*/LOCK"), *[tier_dir / "LOCK"] * (tier_dir / "LOCK").is_file()]:
        f = locks.take(lock, lambda holder: RunDirError(f"tier state {str(tier_dir)!r} is in use by {holder}; stop "
                                                        "that job or use another offload path"))
        locks.release(f)


def clear_tier_state(nvme_paths: Iterable[str], process: int | None = None) -> list[Path]:
    """Deletes the nvme tier state under ``nvme_paths`` (only the engine's own subdirectories).

    Args:
      nvme_paths: the offload paths of the nvme tiers.
      process: only this process's part (``<tier>/process_<I>``: one process of a multi-process job
        whose processes share the path); default: every process's.

    Returns:
      The directories deleted.

    Raises:
      RunDirError: another process holds one of the tiers' locks.
    """
    dirs = [Path(root) / sub for root in dict.fromkeys(nvme_paths) for sub in TIER_SUBDIRS
            if (Path(root) / sub).is_dir()]
    if process is not None:
        dirs = [d / f"process_{process}" for d in dirs if (d / f"process_{process}").is_dir()]
    for d in dirs:
        _check_unlocked(d)
    for d in dirs:
        shutil.rmtree(d)
    return dirs


def check_reuse(run_dir: Path, nvme_paths: list[str], *, resume: bool, overwrite: bool) -> list[str]:
    """Refuses (or with ``overwrite`` clears) a run directory that holds another run's state.

    Call it with the run directory's lock held. A resumed run keeps everything.

    Args:
      run_dir: the run directory.
      nvme_paths: the offload paths of the nvme tiers.
      resume: the run continues the newest checkpoint.
      overwrite: delete old checkpoints, tier state and logs first.

    Returns:
      What was deleted (for the log line), empty if nothing.

    Raises:
      RunDirError: old state is there and neither ``resume`` nor ``overwrite`` is set.
    """
    if resume:
        return []
    ckpt = run_dir / "ckpt"
    old = [p.name for p in step_dirs(ckpt)] + [str(d) for d in _tier_dirs(nvme_paths)]
    if not old:
        return []
    if not overwrite:
        shown = ", ".join(old[:3]) + (f" and {len(old) - 3} more" if len(old) > 3 else "")
        if not step_dirs(ckpt):  # a run stopped before its first checkpoint: nothing to resume from
            raise RunDirError(f"run dir {str(run_dir)!r} holds the tier state of a run that stopped before its first "
                              f"checkpoint ({shown}): there is nothing to resume from. Pass --overwrite to delete it "
                              "and start over")
        half = [str(d) for d in _tier_dirs(nvme_paths) if _half_updated(d)]
        why = (f"; its tier state {', '.join(half)} is half-updated (a step was in progress when the run stopped) "
               "and cannot be trained on: --resume rebuilds it from the newest checkpoint") if half else ""
        raise RunDirError(f"run dir {str(run_dir)!r} already holds a run ({shown}){why}: pass --resume to continue "
                          "it, or --overwrite to delete its checkpoints and tier state and start over")
    deleted = [str(d) for d in clear_tier_state(nvme_paths)]
    if ckpt.exists():
        shutil.rmtree(ckpt)
        deleted.append(str(ckpt))
    for log in ("metrics.jsonl", "summary.json"):
        if (run_dir / log).exists():
            (run_dir / log).unlink()
    return deleted


def remove_stale(ckpt: Path) -> list[str]:
    """Deletes what killed saves left under ``ckpt`` (``.tmp_step_*``, ``.del_step_*``); returns their names.

    Call it with the run directory's lock held (no save of this run is in flight).
    """
    stale = fmt.leftovers(ckpt)
    for p in stale:
        shutil.rmtree(p)
    return [p.name for p in stale]


def set_aside(step_dir: Path) -> Path:
    """Renames a damaged checkpoint out of the ``step_*`` namespace (kept for inspection).

    A later save of the same step then writes a fresh ``step_<N>`` instead of
    colliding with the damaged one.

    Returns:
      The new path (``<ckpt>/.bad_step_<N>_<id>``).
    """
    return fmt.set_aside(step_dir, fmt.BAD)
