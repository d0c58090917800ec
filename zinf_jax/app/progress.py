"""The main job's progress display: a live line on a terminal, plain lines in logs (standard library only)."""
from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Iterator, TextIO

from zinf_jax._internal.fmt import human_bytes

__all__ = ["Progress", "engine_log"]


def _is_tty(out: TextIO) -> bool:
    try:
        return bool(out.isatty())
    except (AttributeError, ValueError, OSError):
        return False


class Progress:
    """The main job's progress: a live line on a terminal, plain lines anywhere else.

    On a TTY the line is redrawn in place (``\\r``) after each step. Under a pipe, a log file or
    CI, a carriage return would put the whole run on one line: there a plain line is written every
    ``every`` steps and for the last step, each ending in a newline.

    Args:
      total: the step to reach.
      start: the step the run starts from (for the bar and the ETA).
      out: the stream to draw on.
      enabled: draw at all.
      every: steps between plain lines (not a TTY).
      live: redraw in place (default: whether ``out`` is a TTY).
    """

    def __init__(self, total: int, start: int, out: TextIO, enabled: bool, every: int = 10,
                 live: bool | None = None):
        self.total, self.start, self.out, self.enabled, self.every = total, start, out, enabled, max(1, every)
        self.live = _is_tty(out) if live is None else live
        self.t0 = time.perf_counter()
        self._drawn = False

    def update(self, step: int, m: dict[str, Any]) -> None:
        """Shows ``step`` from a step's metrics (``Engine.train_step`` plus tier bytes)."""
        if not self.enabled:
            return
        if not self.live and step % self.every and step != self.total:
            return
        done = (step - self.start) / max(1, self.total - self.start)
        bar = "#" * int(24 * done) + "-" * (24 - int(24 * done))
        el = time.perf_counter() - self.t0
        eta = el / max(done, 1e-9) - el
        line = (f"step {step}/{self.total} [{bar}] loss {m['loss']:.4f} {m['tokens_per_s']:.0f} tok/s "
                f"dev {human_bytes(m['peak_device_bytes'], '')} host {human_bytes(m['bytes_host'], '')} "
                f"nvme {human_bytes(m['bytes_nvme'], '')} eta {eta:.0f}s")
        self.out.write(f"\r{line} " if self.live else line + "\n")
        self.out.flush()
        self._drawn = True

    def close(self) -> None:
        """Ends the live line."""
        if self.enabled and self.live and self._drawn:
            self.out.write("\n")


@contextlib.contextmanager
def engine_log(out: TextIO) -> Iterator[None]:
    """Shows the library's log on ``out`` while the run lasts: the engine's build summary, its notes and what it
    compiles (logger ``zinf_jax``, INFO and above), each message once."""
    logger = logging.getLogger("zinf_jax")
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(message)s"))
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # a root handler someone configured would print each message twice
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
