"""A failed checkpoint write as one line: the error, and orbax's noise about it held back.

When the disk fills during an orbax save, tensorstore fails every pending
write; orbax logs each from its threads, asyncio logs every failed task when it
is collected, and callbacks into orbax's closed event loop print ``RuntimeError:
Event loop is closed`` (hundreds of lines, some long after the save returned).
:func:`orbax_noise_held` holds back the ERROR logs of ``absl`` (orbax) and
``asyncio`` during a save (shown as usual if it succeeds), and drops, later
too, the ones that name the temporary directory of a failed save, and the
closed-loop reports during a save and in the minute after a failed one. :func:`write_error` turns the failure
into one :class:`~zinf_jax.checkpoint.integrity.CheckpointError` line. After a failure
the temporary directory is removed only once orbax's writer threads of that save
have ended and nothing recreates it (tensorstore finishes pending writes late).
"""
from __future__ import annotations

import contextlib
import errno
import gc
import logging
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

from zinf_jax.errors import CheckpointError

__all__ = ["orbax_noise_held", "write_error"]

_LOGGERS = ("absl", "asyncio")
_QUIET_S = 60.0  # closed-loop reports of a failed save arrive within this long after it


class _Noise(logging.Filter):
    """Holds ERROR records during a save; drops those that name a failed save's temporary directory."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[logging.LogRecord] | None = None
        self.failed: list[str] = []
        self.quiet_until = 0.0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        if self.held is not None:
            self.held.append(record)
            return False
        msg = record.getMessage()
        return not any(t in msg for t in self.failed)

    def unraisable(self, u: "sys.UnraisableHookArgs") -> None:
        during = self.held is not None or time.monotonic() < self.quiet_until
        if during and isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed":
            return
        self.previous_hook(u)


_noise: _Noise | None = None


def _install() -> _Noise:
    global _noise
    if _noise is None:
        _noise = _Noise()
        for name in _LOGGERS:
            logging.getLogger(name).addFilter(_noise)
        _noise.previous_hook = sys.unraisablehook
        sys.unraisablehook = _noise.unraisable
    return _noise


@contextlib.contextmanager
def orbax_noise_held(tmp: Path, *, remove_on_failure: bool) -> Iterator[None]:
    """Holds back orbax's and asyncio's ERROR logs while a save writes ``tmp`` (see module doc).

    Args:
      remove_on_failure: this process removes ``tmp`` if the block fails (process 0 of a job).
    """
    noise = _install()
    before = set(threading.enumerate())
    noise.held, held, ok = [], None, False
    try:
        yield
        ok = True
    finally:
        if not ok:
            noise.failed.append(str(tmp))
            noise.quiet_until = time.monotonic() + _QUIET_S
            if remove_on_failure:
                _remove_when_settled(tmp, before)
            gc.collect()  # orbax's failed tasks log "exception was never retrieved" when collected: held now
        held, noise.held = noise.held, None
        for r in held if ok else []:
            logging.getLogger(r.name).handle(r)


def _remove_when_settled(tmp: Path, before: set[threading.Thread], settle_s: float = 0.5,
                         timeout_s: float = 30.0) -> None:
    """Removes ``tmp`` once orbax's threads started since ``before`` have ended and it stays removed."""
    deadline = time.monotonic() + timeout_s
    for t in threading.enumerate():
        if t not in before and type(t).__module__.startswith("orbax"):
            try:
                t.join(max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 orbax's threads re-raise their own failure from join(): that is the
                pass  # failure of this save, already on its way out as the one CheckpointError
    gone_since = None
    while time.monotonic() < deadline:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
            gone_since = None
        elif gone_since is None:
            gone_since = time.monotonic()
        elif time.monotonic() - gone_since >= settle_s:
            return
        time.sleep(0.05)


def write_error(e: BaseException, final: Path, need_bytes: int) -> CheckpointError | None:
    """The one-line error for a failed write (disk full, another I/O error), or None for other failures.

    Args:
      need_bytes: about what the checkpoint takes (said when the disk is full).
    """
    if not isinstance(e, Exception):
        return None
    text = str(e)
    if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in text:
        try:
            size = f"{shutil.disk_usage(final.parent).total / 2**20:,.1f} MiB file system"
        except OSError:
            size = "file system"
        return CheckpointError(f"disk full while saving {str(final)!r}: No space left on device (a "
                               f"{size}; the checkpoint takes about {need_bytes / 2**20:,.1f} MiB); nothing was kept "
                               "of this save, older checkpoints are intact")
    if not isinstance(e, OSError):
        return None
    return CheckpointError(f"I/O error while saving {str(final)!r}: {text.splitlines()[0][:400] if text else e!r}")
