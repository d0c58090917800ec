"""Checkpoint directories have one owner: the job that saves into one holds it until the engine closes.

A second job saving into the same directory would interleave its steps with the first's, and its retention
(``max_to_keep``) could delete the first job's newer checkpoints while it runs. So an engine takes the directory's
lock (:data:`~zinf_jax.checkpoint.format.OWNER`, an exclusive ``flock`` naming the holder's pid and host) at its
first save there and keeps it until :meth:`Engine.close <zinf_jax.api.Engine.close>`; another job's save is a
:class:`~zinf_jax.errors.CheckpointError` naming the holder. In a multi-process job process 0 holds it for the job.
Restoring takes no lock: reading a checkpoint another job writes is safe (a step directory appears whole, by a
rename).
"""
from __future__ import annotations

from pathlib import Path
from typing import IO

from zinf_jax._internal import locks
from zinf_jax.checkpoint import format as fmt
from zinf_jax.errors import CheckpointError

__all__ = ["Owner"]


class Owner:
    """The checkpoint directories an engine holds."""

    def __init__(self) -> None:
        self._held: dict[Path, IO[str]] = {}

    def hold(self, root: Path) -> None:
        """Takes ``root``'s lock unless this engine holds it already.

        Raises:
          CheckpointError: another job (or another engine of this process) holds it.
        """
        root = Path(root).absolute()
        if root in self._held:
            return
        self._held[root] = locks.take(root / fmt.OWNER, lambda holder: CheckpointError(
            f"checkpoint directory {str(root)!r} is held by {holder}, a job that saves there: one job saves into a "
            "checkpoint directory at a time (its retention could otherwise delete the other's checkpoints). Save "
            "into another directory, or stop that job (close its engine)"))

    def release(self) -> None:
        """Releases every directory held (idempotent)."""
        for f in self._held.values():
            locks.release(f)
        self._held.clear()
