"""SIGINT, SIGTERM and SIGHUP as a request to stop the whole job at one step that every process agrees on.

A handler only records the signal (and writes a one-line notice with a raw ``os.write``, safe in a
handler): nothing is raised into whatever the main thread is doing, so a signal never lands inside
XLA compilation, a tier write or a checkpoint save. The training loop asks
:meth:`StopAgreement.reached` once per step, on every process; it answers True on every process at
the same step, and a save there is one complete checkpoint. A second signal aborts at once with
``os._exit``: the last complete checkpoint is intact by design, as after a SIGKILL.

In a multi-process job the agreement is JAX's preemption service (the one orbax's
``CheckpointManager.reached_preemption`` uses): since ``jax.distributed.initialize`` its notifier owns
SIGTERM (how schedulers preempt a host); whichever process gets it, the service picks the step after
the furthest one any process has reached, and :func:`~jax.experimental.multihost_utils.reached_preemption_sync_point`
answers True there on each. A SIGINT or SIGHUP recorded here is sent on to that service as a SIGTERM
to this process at the next :meth:`~StopAgreement.reached`; this process keeps its own exit status
(130 for SIGINT), the others take 143. With one process the recorded signal is the answer itself.

This module loads no JAX at import: a program can install the handlers before JAX starts.
"""
from __future__ import annotations

import os
import signal
import threading
from typing import Any

from zinf_jax.errors import DistributedError, Interrupted

__all__ = ["StopAgreement", "SIGNALS"]

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""The signals taken as a request to stop (SIGTERM is JAX's own once this process has joined a job)."""


def _client():
    """The ``jax.distributed`` client, or ``None`` (no job joined; JAX is not loaded for the answer)."""
    import sys

    if "jax" not in sys.modules:
        return None
    from zinf_jax._internal.jax_private import distributed_client

    return distributed_client()


class StopAgreement:
    """One step at which every process of the job stops, for a signal to any one of them (see module doc).

    Use::

        stop = zinf.distributed.StopAgreement()      # after zinf.distributed.initialize, or before JAX loads
        for step in range(start, steps):
            engine.train_step(batch(step))
            if stop.reached(step + 1):               # every process, every step, the same counter
                engine.save(ckpt)                     # one complete checkpoint of that step
                break
        stop.restore()

    Args:
      fd: file descriptor for the handler's one-line notice (default 2, stderr); ``None`` leaves the
        notice to :meth:`take_notice`.
      install: installs the handlers now (main thread only; elsewhere a no-op).
    """

    def __init__(self, *, fd: int | None = 2, install: bool = True):
        self.fd = fd
        self.signum: int | None = None
        self._noticed = self._forwarded = self._agreed = False
        self._old: dict[int, Any] = {}
        if install:
            self.install()

    def __enter__(self) -> StopAgreement:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def install(self) -> StopAgreement:
        """Installs the handlers (main thread only; elsewhere a no-op). Returns ``self``.

        Once this process has joined a job, SIGTERM is left to JAX's preemption notifier (replacing it
        would keep the other processes from hearing of it).
        """
        if threading.current_thread() is threading.main_thread() and not self._old:
            joined = _client() is not None
            for s in SIGNALS:
                if not (joined and s == signal.SIGTERM):
                    self._old[s] = signal.signal(s, self._handle)
        return self

    def restore(self) -> None:
        """Puts the previous handlers back."""
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}

    @property
    def requested(self) -> bool:
        """A signal has been received here, or the job agreed to stop."""
        return self.signum is not None

    @property
    def name(self) -> str:
        """The received signal's name (``SIGTERM``), or ``""``."""
        return signal.Signals(self.signum).name if self.signum is not None else ""

    @property
    def exit_code(self) -> int:
        """``128 + signum`` (0 when no signal was received): the process's exit status after a stop."""
        return 128 + self.signum if self.signum is not None else 0

    def reached(self, step: int) -> bool:
        """Whether the job stops at ``step``: True on every process at the same step, after a signal to any.

        Call it once per step on every process, with a counter that grows by one each step and is the
        same on every process (e.g. the steps done so far, counting from where the run started or
        resumed); once it is True it stays True.

        Args:
          step: this step's number.

        Returns:
          True when the job has agreed to stop at ``step``: save there (every process), then leave.

        Raises:
          DistributedError: in a multi-process job whose preemption service is off
            (``jax_enable_preemption_service``).
        """
        if self._agreed:
            return True
        client = _client()
        if client is None:
            self._agreed = self.signum is not None
            return self._agreed
        from jax.experimental import multihost_utils

        from zinf_jax._internal.jax_private import preemption_sync_manager

        if preemption_sync_manager() is None:
            raise DistributedError("StopAgreement needs JAX's preemption service, which is off "
                                   "(jax_enable_preemption_service); turn it on before joining the job")
        if self.signum is not None and self.signum != signal.SIGTERM and not self._forwarded:
            self._forwarded = True
            os.kill(os.getpid(), signal.SIGTERM)  # to JAX's notifier: every process hears of it
        if not multihost_utils.reached_preemption_sync_point(step):
            return False
        self.request(signal.SIGTERM, "to a process of the job")
        self._agreed = True
        return True

    def check(self, where: str) -> None:
        """Raises :class:`~zinf_jax.errors.Interrupted` if a signal has come (for a safe point before any step).

        Raises:
          Interrupted: a signal came; nothing was trained, nothing is to be saved.
        """
        if self.signum is not None:
            raise Interrupted(self.signum, where)

    def request(self, signum: int, why: str) -> None:
        """Records a stop that came another way (another process's signal, agreed on by the job): ``why`` says so."""
        if self.signum is None:
            self.signum = signum
            self._noticed = True
            self._write(f"\n{signal.Signals(signum).name} {why}: stopping after this step, with a checkpoint\n")

    def take_notice(self) -> str | None:
        """The one-line notice, once, if a signal came and the handler could not write it."""
        if self.signum is None or self._noticed:
            return None
        self._noticed = True
        return self._notice()

    def _notice(self) -> str:
        return (f"\n{self.name}: stopping after the current step (saving a checkpoint if any step ran); "
                f"send it again to abort at once\n")

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:  # the second one: leave now, the committed state is intact
            self._write(f"\n{signal.Signals(signum).name} again: aborting at once; the last checkpoint is intact\n")
            os._exit(128 + signum)
        self.signum = signum
        if self.fd is not None:
            self._noticed = True
            self._write(self._notice())

    def _write(self, text: str) -> None:
        if self.fd is not None:
            try:
                os.write(self.fd, text.encode())
            except OSError:
                pass
