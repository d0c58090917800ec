"""Futures: already resolved, all of a list, waiting on a list (standard library only).

The tiers return :class:`concurrent.futures.Future` s (and tensorstore futures, which have the same
``result()``/``done()``); these helpers treat both alike.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Iterable, Sequence

__all__ = ["done_future", "all_of", "is_future", "wait_all"]


def done_future(value: Any = None) -> Future:
    """A future that is already resolved with ``value``."""
    f: Future = Future()
    f.set_result(value)
    return f


def all_of(futs: Sequence[Future]) -> Future:
    """A future resolving when all of ``futs`` have, with the first exception if any failed."""
    out: Future = Future()
    left = [len(futs)]
    lock = threading.Lock()

    def one(_: Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            err = next((f.exception() for f in futs if f.exception() is not None), None)
            out.set_exception(err) if err is not None else out.set_result(None)

    if not futs:
        out.set_result(None)
    for f in futs:
        f.add_done_callback(one)
    return out


def is_future(x: Any) -> bool:
    """Whether ``x`` looks like a future (``result`` and ``done`` methods: concurrent or tensorstore)."""
    return callable(getattr(x, "result", None)) and callable(getattr(x, "done", None))


def wait_all(futures: Iterable[Any], quiet: bool = False) -> None:
    """Waits for every future; ``quiet`` (unwinding after an error) swallows their errors."""
    for f in futures:
        try:
            f.result()
        except Exception:  # noqa: BLE001
            if not quiet:
                raise
