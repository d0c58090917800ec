"""The C allocator's hold on freed memory: fewer glibc arenas, and freed pages handed back to the OS.

On a CPU mesh the devices' buffers are host memory, allocated by glibc ``malloc`` from many
threads; with any backend the gradient shards copied to the host and the tiers' staging copies are
too. Two ways freed memory stays resident:

* glibc returns freed memory to the system only from the top of a heap: a unit's gathered
  parameters, gradients and recompute temporaries are freed when the unit is done, but the resident
  size kept what the deepest point of the backward pass had freed (the 2048-wide GPT on 2 CPU
  devices: 1.2 GiB free-but-resident after the backward pass at 16 layers; peak RSS growth 3.5 GiB
  at 8 layers, 6.3 GiB at 64). :func:`trim` (``malloc_trim(0)``, ~15 ms) hands every free page
  back; the streamed engine calls it after each large unit call, the CLI after each save.
* glibc gives each thread that allocates (XLA's, tensorstore's I/O threads) an arena of its own, up
  to 8 per core, and keeps what is freed in each for reuse there: a long run's resident set crept up
  although nothing it holds grew (``tracemalloc`` flat; the soak: +109 MB over 2,000 steps).
  :func:`limit_arenas` caps the arenas, as ``MALLOC_ARENA_MAX`` would for a process already started
  (the CLI sets 2).

Both do nothing where the C library is not glibc.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

__all__ = ["limit_arenas", "trim"]

_M_ARENA_MAX = -8  # glibc's mallopt parameter


def _glibc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - present in glibc only
    except (OSError, AttributeError):
        return None
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return libc


_LIBC = _glibc()  # None where the C library is not glibc


def limit_arenas(count: int) -> bool:
    """Caps glibc's malloc arenas at ``count``, unless ``MALLOC_ARENA_MAX`` is set (the user's choice wins).

    Call it before the threads that allocate start (before the first device use): arenas already
    made stay. Returns whether the cap was set.
    """
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    return bool(_LIBC is not None and _LIBC.mallopt(_M_ARENA_MAX, int(count)))


def trim() -> bool:
    """Hands the free memory of every glibc arena back to the OS (``malloc_trim(0)``); whether any was."""
    return bool(_LIBC is not None and _LIBC.malloc_trim(0))
