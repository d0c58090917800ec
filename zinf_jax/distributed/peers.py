"""A lost process stops the whole job within the peer timeout, with one line naming it and the checkpoint to resume.

JAX's coordination service (``jax.distributed``, hosted by process 0) watches every process's
heartbeats: a process that stops beating (killed, out of memory, crashed, its host gone) leaves the
service's live set ``peer_timeout`` seconds after its last beat. Left to itself the service then
aborts every other process from C++ (``SIGABRT``, a log line naming a task). :func:`enable_recovery`
puts the service in JAX's recoverable mode (``jax_enable_recoverability``: it only marks the process
dead) and each process runs a :class:`PeerWatch`: a thread that reads the live set
(``get_live_nodes``) every ``poll_s`` and, when a process has left it, writes one line — which
process, its host and pid (each process publishes them in the service's key-value store when its
watch starts), and the last complete checkpoint — and ends this process with
:data:`EXIT_PEER_LOST`, wherever its main thread is (a collective waiting for the dead peer never
returns). Nothing half-written is taken for a checkpoint: a save in flight is a ``.tmp_step_*``
directory until it is complete.

If process 0 itself is lost, the service goes with it. In JAX 0.10.2 each other process's client then
aborts it at once from C++ (exit 134, JAX's own "service detected fatal errors" line) before any Python
runs; only where a client does not, the watch's reads fail and after three failed polls it names
process 0 (the coordinator) the same way.
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import Callable

from zinf_jax.errors import DistributedError

__all__ = ["PeerWatch", "EXIT_PEER_LOST", "RESTART", "enable_recovery", "last_checkpoint_phrase"]

EXIT_PEER_LOST = 75
"""The exit status of a process stopped because another process of the job was lost (``EX_TEMPFAIL``:
restart the whole job from the last complete checkpoint)."""

RESTART = "restart all {count} processes and zinf.restore it to continue"
"""How :func:`last_checkpoint_phrase` says to continue from a checkpoint (``{count}``: the job's processes)."""

_KEY = "zinf_jax/peer/"
_STOPPING = "zinf_jax/stopping/"


def enable_recovery() -> None:
    """Makes the coordination service mark a lost process dead instead of aborting the others (before joining).

    The :class:`PeerWatch` of each process then stops it with a line of its own.
    """
    import jax

    jax.config.update("jax_enable_recoverability", True)


def last_checkpoint_phrase(ckpt_root: str | os.PathLike, count: int, restart: str = RESTART) -> str:
    """The last complete checkpoint under ``ckpt_root`` and how to continue from it, as one phrase.

    Args:
      ckpt_root: the directory ``Engine.save`` writes its ``step_<N>`` checkpoints into.
      count: the job's process count.
      restart: how to continue from it; ``{count}`` is replaced by ``count``.

    Returns:
      ``"<path> (step <N>); <restart>"``, or ``"none yet; ..."`` when no complete checkpoint is there.
    """
    from zinf_jax.checkpoint import format as fmt

    steps = fmt.list_steps(ckpt_root) if os.path.isdir(ckpt_root) else []
    if not steps:
        return f"none yet under {os.fspath(ckpt_root)}; start all {count} processes again from the beginning"
    step, path = steps[-1]
    return f"{path} (step {step}); {restart.format(count=count)}"


def _client():
    from zinf_jax._internal.jax_private import distributed_client

    client = distributed_client()
    if client is None:
        raise DistributedError("the peer watch needs a multi-process job: call zinf.distributed.initialize first")
    return client


class PeerWatch:
    """Watches the job's live set from a thread; stops this process when another process is lost (see module doc).

    :func:`zinf_jax.distributed.initialize` starts one; a job joined with ``jax.distributed.initialize``
    (in recoverable mode, :func:`enable_recovery`) can run its own, as a context manager around its
    work. Stopping the watch (leaving the context) lets a finished process leave the live set unreported.

    Args:
      peer_timeout: JAX's heartbeat timeout the job was started with (seconds; for the message).
      last_checkpoint: the last complete checkpoint, as a phrase for the message (called on a loss; e.g.
        ``functools.partial(last_checkpoint_phrase, ckpt_dir, count)``).
      label: the message's first word (the program that stops).
      poll_s: seconds between reads of the live set.
    """

    def __init__(self, *, peer_timeout: int, last_checkpoint: Callable[[], str], label: str = "zinf_jax",
                 poll_s: float = 1.0):
        import jax

        self.count, self.index = jax.process_count(), jax.process_index()
        self.peer_timeout, self.label, self.poll_s = peer_timeout, label, poll_s
        self._last_checkpoint = last_checkpoint
        self._echo: Callable[[str], None] | None = None
        self._done = threading.Event()
        self._peers: dict[int, str] = {}
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeerWatch:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        """The watch's thread is running."""
        return self._thread is not None and self._thread.is_alive() and not self._done.is_set()

    def start(self) -> PeerWatch:
        """Publishes this process's host and pid, then starts watching. Returns ``self``.

        Raises:
          DistributedError: this process is in no ``jax.distributed`` job.
        """
        client = _client()
        client.key_value_set(f"{_KEY}{self.index}", f"host {socket.gethostname()}, pid {os.getpid()}",
                             allow_overwrite=True)
        self._thread = threading.Thread(target=self._run, args=(client,), name="zinf-peer-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops watching (a process leaving the live set from now on is not reported)."""
        self._done.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def echo(self, write: Callable[[str], None] | None) -> None:
        """Also writes the loss line with ``write`` (e.g. this process's own log); ``None``: stderr only."""
        self._echo = write

    def settle(self) -> None:
        """After a failure this process cannot place: waits long enough for the watch to see a lost peer.

        A collective or barrier whose peer died may fail before the service has marked it dead; if a
        process is lost the watch then ends this process with its line, otherwise this returns (after
        at most ``peer_timeout`` + 3 polls) and the failure is reported as it is.
        """
        if self.running:
            self._thread.join(self.peer_timeout + 3 * self.poll_s)

    def _run(self, client) -> None:
        everyone = list(range(self.count))
        failing = 0
        while not self._done.wait(self.poll_s):
            try:
                live = client.get_live_nodes(everyone)
            except Exception:  # noqa: BLE001 - the service (process 0) is unreachable: it is gone
                failing += 1
                if failing >= 3 and self.index != 0:
                    self._stop([0], "the job's coordinator: its coordination service stopped answering")
                continue
            failing = 0
            self._learn(client)
            lost = [i for i in everyone if i not in live]
            if lost:
                self._stop(lost, f"it stopped answering the job's heartbeats for the peer timeout, "
                                 f"{self.peer_timeout} s (killed, out of memory, crashed, or its host is gone)",
                           client)

    def _learn(self, client) -> None:
        """Reads every process's host and pid from the key-value store (once all have published them)."""
        if len(self._peers) == self.count:
            return
        try:
            for key, value in client.key_value_dir_get(_KEY):
                self._peers[int(key.rsplit("/", 1)[-1])] = value
        except Exception:  # noqa: BLE001 - the names are for the message only
            pass

    def _stop(self, lost: list[int], why: str, client=None) -> None:
        if self._done.is_set():
            return
        who = ", ".join(f"process {i}" + (f" ({self._peers[i]})" if i in self._peers else "") for i in lost)
        try:
            ckpt = self._last_checkpoint()
        except Exception as e:  # noqa: BLE001 - still stop, and say why the checkpoint is unknown
            ckpt = f"unknown ({e})"
        line = (f"{self.label}: lost {who} of the job's {self.count}: {why}; process {self.index} stops too "
                f"(exit {EXIT_PEER_LOST}). Last complete checkpoint: {ckpt}\n")
        for write in (self._stderr, self._echo):
            if write is not None:
                try:
                    write(line)
                except (OSError, ValueError):
                    pass
        if client is not None:
            self._leave_in_order(client, lost)
        os._exit(EXIT_PEER_LOST)

    def _leave_in_order(self, client, lost: list[int]) -> None:
        """Process 0 hosts the service: it leaves last, so no survivor's client sees the service vanish first.

        A survivor whose client loses the service before its own watch has seen the lost peer is
        aborted from C++ (``SIGABRT``, no line). So each survivor says it is stopping (a key) before
        it exits, and process 0 waits for every survivor's key — or for it to leave the live set —
        for at most ``peer_timeout`` + 3 polls — and then half a second more (a survivor exits right
        after its key is set; this process's exit must come after).
        """
        try:
            if self.index != 0:
                client.key_value_set(f"{_STOPPING}{self.index}", "1", allow_overwrite=True)
                return
            waiting = set(range(1, self.count)) - set(lost)
            deadline = time.monotonic() + self.peer_timeout + 3 * self.poll_s
            while waiting and time.monotonic() < deadline:
                said = {int(key.rsplit("/", 1)[-1]) for key, _ in client.key_value_dir_get(_STOPPING)}
                waiting -= said
                if waiting:
                    waiting &= set(client.get_live_nodes(list(range(self.count))))
                time.sleep(min(self.poll_s, 0.1))
            time.sleep(0.5)
        except Exception:  # noqa: BLE001 - the service is failing anyway; stop as promised
            pass

    @staticmethod
    def _stderr(line: str) -> None:
        sys.stderr.flush()
        os.write(2, line.encode())
