"""Joining a multi-process job with its peer watch on, and leaving it in order.

:func:`initialize` is ``jax.distributed.initialize`` in JAX's recoverable mode (a lost process is
marked dead, not aborted everywhere from C++) with ``peer_timeout`` as the heartbeat timeout, plus a
:class:`~zinf_jax.distributed.peers.PeerWatch` that ends every other process within that timeout
with one line naming the lost one and the last complete checkpoint. It returns the :class:`Job`:
used as a context manager it leaves the job in order at the end (:meth:`Job.shutdown`), and on a
runtime error it first waits for the watch to tell whether a lost peer caused it (a collective whose
peer died can fail before the service has marked it dead); this process's own verdicts
(:class:`~zinf_jax.errors.ZinfError`, ``ValueError``, ``TypeError``) propagate at once. A process that
leaves the context with an error leaves the job: the others' watches report it as lost.
"""
from __future__ import annotations

import functools
import os
import time
from typing import Any

from zinf_jax.distributed.peers import RESTART, PeerWatch, enable_recovery, last_checkpoint_phrase
from zinf_jax.errors import DistributedError, ZinfError

__all__ = ["Job", "initialize", "current"]

_current: Job | None = None


def current() -> Job | None:
    """The job :func:`initialize` joined (until it is shut down), or ``None``."""
    return _current


class Job:
    """This process's part in a multi-process job joined by :func:`initialize`: its peer watch, and leaving.

    Attributes:
      count: the job's process count.
      index: this process's index.
      peer_timeout: seconds after which a silent process counts as lost.
      watch: the running peer watch.
    """

    def __init__(self, peer_timeout: int, watch: PeerWatch):
        self.count, self.index = watch.count, watch.index
        self.peer_timeout, self.watch = peer_timeout, watch
        self._left = False

    def __enter__(self) -> Job:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: Any) -> None:
        """Leaves in order at the end or on ``SystemExit`` (every process exiting after an agreed stop, say);
        after another exception, stops watching once the watch has had its chance to name a lost peer."""
        if kind is None or issubclass(kind, SystemExit):
            self.shutdown()
            return
        if not issubclass(kind, (ZinfError, ValueError, TypeError)):  # those are this process's own verdict
            self.watch.settle()  # a runtime failure may be a lost peer's doing: the watch ends this process if so
        self.watch.stop()

    def settle(self) -> None:
        """After a failure this process cannot place, waits for the watch to see a lost peer (see PeerWatch.settle)."""
        self.watch.settle()

    def shutdown(self, timeout_s: float = 600.0) -> None:
        """Leaves the job in order, once this process's work is done (every process calls it).

        In recoverable mode JAX's own shutdown no longer waits for every process, and a process whose
        client loses the coordination service (process 0's) before it disconnects is aborted. So all
        meet at a barrier with the watch still on (a process lost before the end is reported as
        such), stop their watches, meet again, and process 0 stops the service once the others are
        gone (or after ``timeout_s``).

        Args:
          timeout_s: how long to wait for the other processes at each barrier.

        Raises:
          DistributedError: not every process came to the end within ``timeout_s``.
        """
        global _current
        if self._left:
            return
        import jax

        from zinf_jax._internal.jax_private import distributed_client

        client = distributed_client()
        try:
            if client is not None and self.count > 1:
                self._barrier(client, "end", timeout_s)
                self.watch.stop()
                self._barrier(client, "leave", timeout_s)
                if self.index == 0:
                    deadline = time.monotonic() + timeout_s
                    while len(client.get_live_nodes(list(range(self.count)))) > 1 and time.monotonic() < deadline:
                        time.sleep(0.05)
        finally:
            self.watch.stop()
            self._left = True
            if _current is self:
                _current = None
        jax.distributed.shutdown()

    def _barrier(self, client: Any, what: str, timeout_s: float) -> None:
        try:
            client.wait_at_barrier(f"zinf_jax/{what}", int(timeout_s * 1000))
        except Exception as e:  # noqa: BLE001 - jax raises XlaRuntimeError (DEADLINE_EXCEEDED) and the like
            raise DistributedError(f"process {self.index}: not every process of the job's {self.count} came to "
                                   f"its end within {timeout_s:g} s ({e})") from e


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               *, peer_timeout: int = 60, checkpoint_dir: str | os.PathLike | None = None, restart: str = RESTART,
               label: str = "zinf_jax", poll_s: float = 1.0, **jax_kwargs: Any) -> Job:
    """Joins a multi-process job (``jax.distributed``) with lost-peer detection; call it before any other JAX call.

    Args:
      coordinator: ``HOST:PORT`` of process 0 (every process gives the same); ``None``: JAX reads the
        cluster's environment (SLURM, a TPU VM, ...).
      num_processes: processes in the job (``None`` with an auto-detected cluster).
      process_id: this process's index, 0 to ``num_processes - 1``.
      peer_timeout: seconds without a heartbeat after which a process counts as lost (JAX's heartbeat
        timeout); every other process then exits :data:`~zinf_jax.distributed.peers.EXIT_PEER_LOST`
        within it, plus a few polls.
      checkpoint_dir: where ``Engine.save`` writes the job's checkpoints, named in the loss line as
        the last complete one (``None``: "unknown").
      restart: how the loss line says to continue from that checkpoint (``{count}``: the processes).
      label: the loss line's first word.
      poll_s: seconds between the watch's reads of the job's live set.
      **jax_kwargs: passed on to ``jax.distributed.initialize`` (``local_device_ids``, ...).

    Returns:
      The :class:`Job` (a context manager that leaves the job in order).

    Raises:
      DistributedError: the job cannot be joined (the coordinator is unreachable, a peer never came).
    """
    global _current
    import jax

    if _current is not None:
        raise DistributedError("zinf.distributed.initialize: this process has already joined a job")
    enable_recovery()
    try:
        jax.distributed.initialize(coordinator, num_processes=num_processes, process_id=process_id,
                                   heartbeat_timeout_seconds=peer_timeout, **jax_kwargs)
    except Exception as e:  # noqa: BLE001 - jax raises RuntimeError/ValueError/XlaRuntimeError by cause
        where = coordinator or "the cluster's coordinator"
        raise DistributedError(f"{where}: could not join the job as process {process_id} of "
                               f"{num_processes}: {e}") from e
    count = jax.process_count()
    if checkpoint_dir is None:
        last = functools.partial(str, "unknown (zinf.distributed.initialize was given no checkpoint_dir)")
    else:
        last = functools.partial(last_checkpoint_phrase, checkpoint_dir, count, restart)
    watch = PeerWatch(peer_timeout=peer_timeout, last_checkpoint=last, label=label, poll_s=poll_s)
    _current = Job(peer_timeout, watch.start())
    return _current
