"""The C allocator's hold on freed memory: fewer glibc arenas, and freed pages handed back to the OS.

A long run's resident set grows although nothing it holds grows (``tracemalloc`` flat): glibc gives
each thread that allocates (XLA's, tensorstore's I/O threads) an arena of its own, up to 8 per core,
and keeps what is freed in them for reuse. Fragments of buffers of varying sizes then stay resident.
:func:`limit_arenas` caps the arenas (as ``MALLOC_ARENA_MAX`` would, for a process already
started), :func:`trim` returns the free pages at the top of each arena. Both do nothing where the
C library is not glibc.
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
        return libc
    except (OSError, AttributeError):
        return None


def limit_arenas(count: int) -> bool:
    """Caps glibc's malloc arenas at ``count``, unless ``MALLOC_ARENA_MAX`` is set (the user's choice wins).

    Call it before the threads that allocate start (before the first device use): arenas already
    made stay. Returns whether the cap was set.
    """
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    libc = _glibc()
    return bool(libc is not None and libc.mallopt(_M_ARENA_MAX, int(count)))


def trim() -> bool:
    """Hands the free memory of every glibc arena back to the OS (``malloc_trim(0)``); whether any was."""
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))
