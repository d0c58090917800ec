"""The main job as one process of a multi-process job (``jax.distributed``, JAX's multi-controller model).

:func:`start` joins the job (before anything else uses JAX); :class:`Job` says what this process does:
process 0 writes the job's progress, metrics and summary, every other process its own log under
``<run_dir>/logs/``; each process feeds its share of every batch's rows. With one process every call is
the plain one-process behaviour.
"""
from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Any, Callable, Iterator, TextIO, TypeVar

import numpy as np

from zinf_jax._internal.multihost import Procs

__all__ = ["start", "Job"]

T = TypeVar("T")


def start(coordinator: str, num_processes: int, process_id: int, peer_timeout: int) -> None:
    """Joins the job: ``jax.distributed.initialize`` (``coordinator == "auto"``: from the cluster's environment).

    ``peer_timeout`` is JAX's heartbeat timeout: a process that stops beating (killed, crashed) leaves
    the job's live set that long after, and every other process's :class:`~zinf_jax.app.peers.PeerWatch`
    stops it (the service runs in JAX's recoverable mode so that it is the watch, with its message,
    that stops them).

    Raises:
      OSError: the job cannot be joined (the coordinator is unreachable, a peer never came).
    """
    import jax

    from zinf_jax.app.peers import enable_recovery

    enable_recovery()
    try:
        if coordinator == "auto":
            jax.distributed.initialize(heartbeat_timeout_seconds=peer_timeout)
        else:
            jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id,
                                       heartbeat_timeout_seconds=peer_timeout)
    except Exception as e:  # noqa: BLE001 - jax raises RuntimeError/ValueError/XlaRuntimeError by cause
        raise OSError(f"--coordinator {coordinator}: could not join the job as process {process_id} of "
                      f"{num_processes}: {e}") from e


class Job:
    """This process's part in the job (the whole job when there is one process).

    Args:
      run_dir: the run directory (shared by the job's processes).
    """

    def __init__(self, run_dir: Path):
        self.procs = Procs("zinf-train")
        self.count, self.index, self.primary = self.procs.count, self.procs.index, self.procs.primary
        self.run_dir = Path(run_dir)
        self._forwarded = False

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

    def agreed_stop(self, position: int, stop: Any) -> bool:
        """Whether the job stops after this step for a signal to any of its processes (every process, every step).

        JAX's preemption service (``multihost_utils.reached_preemption_sync_point``, as orbax's
        preemption checkpointing uses it) takes SIGTERM on whichever process gets it and makes every
        process return True at the same ``position`` (here the data position, which grows every step).
        A SIGINT or SIGHUP this process's handler recorded is sent on as SIGTERM to that service;
        the process keeps its own exit status (130 for SIGINT), the others take 143.
        """
        from jax.experimental import multihost_utils

        if stop.requested and not self._forwarded:
            self._forwarded = True
            os.kill(os.getpid(), signal.SIGTERM)
        if not multihost_utils.reached_preemption_sync_point(position):
            return False
        stop.request(signal.SIGTERM, "to a process of the job")
        return True

    def leave(self, timeout_s: float = 60.0) -> None:
        """Leaves the job in order, once this process's work is done (a no-op with one process).

        In recoverable mode (:func:`start`) JAX's shutdown no longer waits for every process, and a
        process disconnecting after process 0 has stopped the coordination service aborts. So all meet
        at a barrier, the others disconnect, and process 0 stops the service once they are gone (or
        after ``timeout_s``).
        """
        if self.count == 1:
            return
        import time

        import jax

        from zinf_jax._internal.jax_private import distributed_client

        self.procs.sync("leave")
        if self.primary:
            client, deadline = distributed_client(), time.monotonic() + timeout_s
            while len(client.get_live_nodes(list(range(self.count)))) > 1 and time.monotonic() < deadline:
                time.sleep(0.05)
        jax.distributed.shutdown()

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
