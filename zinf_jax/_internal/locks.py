"""Exclusive directory locks that name their holder: one job per nvme tier, run directory, checkpoint directory.

:func:`take` opens a lock file, takes an exclusive ``fcntl.flock`` on it without waiting, and writes who holds it
(pid, host, since when); another process's attempt reads that back into its error. The lock goes with the process:
a killed job leaves nothing to clean up. Two opens in one process are two holders too (two engines on one
directory are refused as two jobs would be).
"""
from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path
from typing import IO, Callable

__all__ = ["take", "release", "holder_of"]


def holder_of(f: IO[str]) -> str:
    """Who holds the lock, as its holder wrote it."""
    f.seek(0)
    return f.read().strip() or "another process"


def take(path: Path, refused: Callable[[str], Exception]) -> IO[str]:
    """Takes the exclusive lock of ``path`` (the lock file, created); keep the returned file open to hold it.

    Args:
      path: the lock file.
      refused: the error to raise when another holder has it, given the holder's description.

    Raises:
      The ``refused`` error: the lock is held.
    """
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = holder_of(f)
        f.close()
        raise refused(holder) from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    return f


def release(f: IO[str]) -> None:
    """Releases a lock :func:`take` took (idempotent)."""
    if f.closed:
        return
    f.seek(0)
    f.truncate()
    fcntl.flock(f, fcntl.LOCK_UN)
    f.close()
