"""The job's processes (JAX's multi-controller model): barriers, gathers and sums across them.

Every call is trivial, and makes no collective, in a one-process job.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils

__all__ = ["Procs", "allreduce_sum", "allgather"]


class Procs:
    """The job's processes, for the steps process 0 does for all (every call is trivial with one process).

    Args:
      tag: names the barriers of one operation (the same on every process).
    """

    def __init__(self, tag: str):
        self.count, self.index = jax.process_count(), jax.process_index()
        self.primary = self.index == 0
        self._tag, self._n = tag, 0

    def sync(self, what: str) -> None:
        """A barrier of all processes."""
        if self.count > 1:
            self._n += 1
            multihost_utils.sync_global_devices(f"{self._tag}:{self._n}:{what}")

    def gather(self, x: int) -> list[int]:
        """Every process's ``x`` (``[0]`` is process 0's: a broadcast)."""
        return [int(v) for v in np.ravel(allgather(np.int32(x)))]


def allreduce_sum(x: float) -> float:
    """The sum of ``x`` over the job's processes (float64; ``x`` itself with one process)."""
    if jax.process_count() == 1:
        return x
    return float(np.sum(allgather(np.float64(x))))


def allgather(x: np.ndarray) -> np.ndarray:
    """Every process's ``x`` (the same shape and dtype on each), stacked along a new first axis in process order
    (``x[None]`` with one process)."""
    if jax.process_count() == 1:
        return np.asarray(x)[None]
    return np.asarray(multihost_utils.process_allgather(np.asarray(x)))
