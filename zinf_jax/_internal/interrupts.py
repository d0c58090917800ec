"""Ctrl-C held over a section that must not stop half-way (an optimizer step updating state in place).

:func:`deferred_interrupts` records a SIGINT that arrives in the section and delivers it when the section ends:
to the handler that was installed before (Python's default raises ``KeyboardInterrupt``). Outside the main
thread (where no signal handler can be set) it does nothing.
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

__all__ = ["deferred_interrupts"]


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Holds SIGINT for the block; delivers one that arrived to the previous handler after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[tuple] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: got.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if got:
            if callable(previous):
                previous(*got[0])
            elif previous == signal.SIG_DFL:
                raise KeyboardInterrupt
