"""The main job as one process of a multi-process job (``jax.distributed``, JAX's multi-controller model).

:func:`start` joins the job (before anything else uses JAX) through :mod:`zinf_jax.distributed`, which also
watches the peers and leaves the job in order; :class:`Job` says what this process does:
process 0 writes the job's progress, metrics and summary, every other process its own log under
``<run_dir>/logs/``; each process feeds its share of every batch's rows. With one process every call is
the plain one-process behaviour.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Callable, Iterator, TextIO, TypeVar

import numpy as np

from zinf_jax._internal.multihost import Procs

__all__ = ["start", "Job"]

T = TypeVar("T")


def start(coordinator: str, num_processes: int, process_id: int, peer_timeout: int, run_dir: str) -> None:
    """Joins the job through :func:`zinf_jax.distributed.initialize` (``coordinator == "auto"``: from the cluster's
    environment), its loss line worded for this command: a lost process names ``<run_dir>/ckpt``'s last complete
    checkpoint and ``--resume``.

    Raises:
      DistributedError: the job cannot be joined (the coordinator is unreachable, a peer never came).
    """
    from zinf_jax import distributed

    where = (None, None, None) if coordinator == "auto" else (coordinator, num_processes, process_id)
    distributed.initialize(*where, peer_timeout=peer_timeout, checkpoint_dir=Path(run_dir) / "ckpt",
                           label="zinf-jax train",
                           restart="restart all {count} processes with --resume to continue from it")


class Job:
    """This process's part in the job (the whole job when there is one process).

    Args:
      run_dir: the run directory (shared by the job's processes).
    """

    def __init__(self, run_dir: Path):
        self.procs = Procs("zinf-train")
        self.count, self.index, self.primary = self.procs.count, self.procs.index, self.procs.primary
        self.run_dir = Path(run_dir)

    @property
    def lock_name(self) -> str:
        """This process's lock file in the run dir (one per process in a multi-process job)."""
        return ".lock" if self.count == 1 else f".lock.process_{self.index}"

    @contextlib.contextmanager
    def output(self, out: TextIO) -> Iterator[TextIO]:
        """Where this process writes its progress and messages: ``out`` on process 0, else its own log."""
        if self.primary:
            yield out
            return
        logs = self.run_dir / "logs"
        logs.mkdir(exist_ok=True)
        with open(logs / f"process_{self.index}.log", "a") as f:
            yield f

    def metrics_path(self) -> str:
        """The job's metrics file (process 0's); the others write none."""
        return str(self.run_dir / "metrics.jsonl") if self.primary else os.devnull

    def rows(self, batch: np.ndarray) -> np.ndarray:
        """This process's rows of a batch of the whole job."""
        if self.count == 1:
            return batch
        n = len(batch) // self.count
        return batch[self.index * n:(self.index + 1) * n]

    def on_primary(self, fn: Callable[[], T], what: str) -> T | None:
        """``fn()`` on process 0 (its result; ``None`` on the others), every process told whether it succeeded.

        Raises:
          OSError: on the other processes, when process 0's ``fn`` raised (that error is raised on process 0).
        """
        if self.count == 1:
            return fn()
        result, error = None, None
        if self.primary:
            try:
                result = fn()
            except BaseException as e:  # noqa: BLE001 - re-raised below, after the others know
                error = e
        ok = self.procs.gather(int(error is None))[0]
        if error is not None:
            raise error
        if not ok:
            raise OSError(f"process 0 failed {what} (its error is in its output); process {self.index} stops too")
        return result
