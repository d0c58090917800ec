"""The C allocator's hold on freed memory: fewer glibc arenas, and freed pages handed back to the OS.

On a CPU mesh the devices' buffers are host memory, allocated by glibc ``malloc`` from many
threads; with any backend the gradient shards copied to the host and the tiers' staging copies are
too. Two ways freed memory stays resident:

* glibc returns freed memory to the system only from the top of a heap: a unit's gathered
  parameters, gradients and recompute temporaries are freed when the unit is done, but the resident
  size kept what the deepest point of the backward pass had freed (the 2048-wide GPT on 2 CPU
  devices: 1.2 GiB free-but-resident after the backward pass at 16 layers; peak RSS growth 3.5 GiB
  at 8 layers, 6.3 GiB at 64). :func:`trim` (``malloc_trim(0)``) hands every free page back; the
  CLI calls it after each save, and the streamed engine, through a :class:`Trimmer`, after a unit
  call once the resident set has grown :data:`TRIM_SLACK` past its low since the last trim. Not
  after every large unit call: the pages handed back are faulted in and zeroed again by the next
  unit's allocations, which cost the d=512 GPT's step (8 devices, every call of its 100 MB units
  trimmed) 1.29x plain jit against 1.01x with the slack, at the same peak RSS.
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

__all__ = ["TRIM_SLACK", "Trimmer", "limit_arenas", "resident_bytes", "trim"]

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


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int:
    """This process's resident set size (``/proc/self/statm``); 0 where there is no ``/proc``."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0

TRIM_SLACK = 512 << 20
"""Resident bytes a :class:`Trimmer` lets a process grow past its low before it trims."""


class Trimmer:
    """Calls :func:`trim` when the resident set has grown ``slack`` bytes past its lowest reading since the
    last trim: free-but-resident memory stays bounded by about ``slack``, and steady reuse of the same
    buffers (a model's unit calls, step after step) trims nothing.

    Args:
      slack: bytes of growth allowed before a trim.
      resident: the resident-size reader (:func:`resident_bytes`).
      release: the trim (:func:`trim`).
    """

    def __init__(self, slack: int = TRIM_SLACK, resident=resident_bytes, release=trim):
        self.slack = slack
        self._resident = resident
        self._release = release
        self._low = resident()
        self.trims = 0
        """Trims done so far."""

    def check(self) -> bool:
        """Trims if the resident set is ``slack`` past its low (which it then reads again); whether it did."""
        now = self._resident()
        if now - self._low <= self.slack:
            self._low = min(self._low, now)
            return False
        self._release()
        self.trims += 1
        self._low = self._resident()
        return True
