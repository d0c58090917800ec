"""The optimizer step overlapped with the next step's forward, exactly.

:meth:`Engine.train_steps <zinf_jax.api.Engine.train_steps>` runs step ``N``'s
optimizer on a worker thread while the main thread starts step ``N+1``'s
forward. The optimizer updates the parameters in the order the forward uses
them (glue first, then the units in call order), and a :class:`WriteGate`
holds each unit's fetch until the optimizer has written that unit's new
values: the forward of unit ``i`` starts as soon as unit ``i`` is written, and
no forward ever reads a stale parameter, so the numbers are those of
sequential :meth:`~zinf_jax.api.Engine.train_step` calls, bit for bit.

Before step ``N+1``'s backward adds its first gradient, it waits for the whole
gate (step ``N``'s optimizer has read every gradient) and clears the sink.
"""
from __future__ import annotations

import threading
from typing import Iterable

__all__ = ["WriteGate"]


class WriteGate:
    """Which parameters the optimizer step in flight has not written yet.

    Paths never armed (frozen parameters, or no step in flight) pass at once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: dict[str, threading.Event] = {}

    def arm(self, paths: Iterable[str]) -> None:
        """Marks ``paths`` as about to be rewritten: readers wait until :meth:`written`."""
        with self._lock:
            self._events = {p: threading.Event() for p in paths}

    def written(self, path: str) -> None:
        """``path``'s new values are in its tier: its readers may go."""
        with self._lock:
            ev = self._events.get(path)
        if ev is not None:
            ev.set()

    def open(self) -> None:
        """Lets every reader go (the step finished, was skipped or failed)."""
        with self._lock:
            events, self._events = list(self._events.values()), {}
        for ev in events:
            ev.set()

    def wait(self, paths: Iterable[str] | None = None) -> None:
        """Waits until ``paths`` (default: all armed ones) are written or the gate is opened."""
        with self._lock:
            events = list(self._events.values()) if paths is None else [
                self._events[p] for p in paths if p in self._events]
        for ev in events:
            ev.wait()
