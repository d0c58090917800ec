"""SIGINT, SIGTERM and SIGHUP as a request to stop at the next safe point.

The handler only records the signal (and writes a one-line notice with a raw
``os.write``, safe in a handler): no exception is raised into whatever the main
thread is doing, so an interrupt can never land inside XLA compilation, a tier
write or a checkpoint save. The main job checks the request between steps
(finish the step, save, exit ``128 + signal``) and at the safe points of its
startup (exit at once, nothing to save). A second signal aborts at once with
``os._exit``: the last committed state (checkpoints, tier generations) is
intact by design, as after a SIGKILL.
"""
from __future__ import annotations

import os
import signal
import threading
from typing import Any

from zinf_jax.errors import Interrupted

__all__ = ["StopRequest", "Interrupted", "SIGNALS"]

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopRequest:
    """Records SIGINT/SIGTERM/SIGHUP while installed (see module doc).

    Args:
      fd: file descriptor for the immediate one-line notice (e.g. 2); ``None``
        leaves the notice to :meth:`take_notice`.
    """

    def __init__(self, fd: int | None = None):
        self.fd = fd
        self.signum: int | None = None
        self._noticed = False
        self._old: dict[int, Any] = {}

    def install(self) -> StopRequest:
        """Installs the handlers (main thread only; elsewhere a no-op). Returns ``self``."""
        if threading.current_thread() is threading.main_thread() and not self._old:
            for s in SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def restore(self) -> None:
        """Puts the previous handlers back."""
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}

    @property
    def requested(self) -> bool:
        """A signal has been received."""
        return self.signum is not None

    @property
    def name(self) -> str:
        """The received signal's name (``SIGTERM``), or ``""``."""
        return signal.Signals(self.signum).name if self.signum is not None else ""

    @property
    def exit_code(self) -> int:
        """``128 + signum`` (0 when no signal was received)."""
        return 128 + self.signum if self.signum is not None else 0

    def check(self, where: str) -> None:
        """Raises :class:`Interrupted` if a signal has been received (a safe point of the startup)."""
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
