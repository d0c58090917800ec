"""Futures: already resolved, all of a list, waiting on a list (standard library only).

The tiers return :class:`concurrent.futures.Future` s (and tensorstore futures, which have the same
``result()``/``done()``); these helpers treat both alike.
"""
from __future__ import annotations

import functools
import threading
from concurrent.futures import Future
from typing import Any, Iterable, Sequence

__all__ = ["done_future", "failed_future", "then", "all_of", "is_future", "wait_all"]


def done_future(value: Any = None) -> Future:
    """A future that is already resolved with ``value``."""
    f: Future = Future()
    f.set_result(value)
    return f


def failed_future(error: BaseException) -> Future:
    """A future that has already failed with ``error``."""
    f: Future = Future()
    f.set_exception(error)
    return f


def then(fut: Future, fn: Any) -> Future:
    """A future of ``fn(fut.result())`` (its exception, if ``fut`` or ``fn`` fails)."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            out.set_result(fn(f.result()))
        except BaseException as e:  # noqa: BLE001 - delivered through the future
            out.set_exception(e)

    fut.add_done_callback(done)
    return out


def all_of(futs: Sequence[Future]) -> Future:
    """A future resolving when all of ``futs`` have, with the first exception (in list order) if any failed.

    Leaves no reference cycle once done (see [Note: no future cycles]).
    """
    out: Future = Future()
    if not futs:
        out.set_result(None)
        return out
    errors: list[BaseException | None] = [None] * len(futs)
    left = [len(futs)]
    box = [out]  # emptied by the last callback: the inputs' callbacks then reach nothing
    lock = threading.Lock()

    def one(i: int, f: Future) -> None:
        err = f.exception()
        with lock:
            errors[i] = err
            left[0] -= 1
            target = box.pop() if left[0] == 0 else None
        if target is not None:
            first = next((e for e in errors if e is not None), None)
            errors.clear()
            target.set_exception(first) if first is not None else target.set_result(None)

    for i, f in enumerate(futs):
        f.add_done_callback(functools.partial(one, i))
    return out


# [Note: no future cycles]
# A concurrent.futures.Future keeps its done-callbacks after calling them. A callback that reaches the
# future it is registered on (a closure over the list of inputs, or over an output whose own callback
# reaches the inputs) makes a reference cycle, and a cycle is freed only when Python's cyclic collector
# runs: until then every future in it keeps its result, a read shard's host buffer. A step of the
# 2048-wide GPT on nvme left ~5,000 such futures and gigabytes of buffers to the collector, so RSS
# depended on when the collector happened to run (the forward+backward peak at 0.40B: 2.2 GiB in one
# step, 3.2 in the next). all_of's callbacks reach nothing once the last has run, so each future is
# freed when its last holder lets go; a callback given an input list should drop it once it has run.


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
