"""The main job's one-line live progress display (standard library only)."""
from __future__ import annotations

import time
from typing import Any, TextIO

from zinf_jax._internal.fmt import human_bytes

__all__ = ["Progress"]


class Progress:
    """A one-line live progress display, redrawn in place after each step.

    Args:
      total: the step to reach.
      start: the step the run starts from (for the bar and the ETA).
      out: the stream to draw on.
      enabled: draw at all.
    """

    def __init__(self, total: int, start: int, out: TextIO, enabled: bool):
        self.total, self.start, self.out, self.enabled = total, start, out, enabled
        self.t0 = time.perf_counter()

    def update(self, step: int, m: dict[str, Any]) -> None:
        """Redraws the line for ``step`` from a step's metrics (``Engine.train_step`` plus tier bytes)."""
        if not self.enabled:
            return
        done = (step - self.start) / max(1, self.total - self.start)
        bar = "#" * int(24 * done) + "-" * (24 - int(24 * done))
        el = time.perf_counter() - self.t0
        eta = el / max(done, 1e-9) - el
        line = (f"\rstep {step}/{self.total} [{bar}] loss {m['loss']:.4f} {m['tokens_per_s']:.0f} tok/s "
                f"dev {human_bytes(m['peak_device_bytes'], '')} host {human_bytes(m['bytes_host'], '')} "
                f"nvme {human_bytes(m['bytes_nvme'], '')} eta {eta:.0f}s ")
        self.out.write(line)
        self.out.flush()

    def close(self) -> None:
        """Ends the line."""
        if self.enabled:
            self.out.write("\n")
