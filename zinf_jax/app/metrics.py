"""The main job's metrics: one JSON line per step in ``metrics.jsonl``, and the same scalars in TensorBoard.

Every step's metrics whose values are numbers, strings or booleans go to the JSON-lines log
(flushed per line: a killed run keeps every finished step). With ``--tensorboard DIR`` the
numeric ones (booleans as 0/1) are also written as TensorBoard scalars at the optimizer step,
through ``tensorboardX`` (``pip install 'zinf-jax[tensorboard]'``) or, without it, PyTorch's
``torch.utils.tensorboard``; neither installed is an error before the run starts.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TextIO

__all__ = ["MetricsLog", "tensorboard_writer", "log_line", "scalars"]


def log_line(m: dict[str, Any]) -> dict[str, Any]:
    """The entries of a step's metrics that the JSON-lines log keeps (plain JSON values)."""
    return {k: v for k, v in m.items() if isinstance(v, (int, float, str, bool))}


def scalars(m: dict[str, Any]) -> dict[str, float]:
    """The numeric entries of a step's metrics (booleans as 0/1), as TensorBoard scalars."""
    return {k: float(v) for k, v in log_line(m).items() if not isinstance(v, str)}


def tensorboard_writer(logdir: str) -> Any:
    """A TensorBoard ``SummaryWriter`` for ``logdir`` (tensorboardX's, else PyTorch's).

    Raises:
      ValueError: neither is installed (the message says what to install).
    """
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ValueError(f"--tensorboard {logdir}: needs tensorboardX (pip install 'zinf-jax[tensorboard]') "
                             "or PyTorch with tensorboard; neither is installed") from None
    return SummaryWriter(logdir)


class MetricsLog:
    """Writes each step's metrics to the JSON-lines log and, if asked, to TensorBoard.

    Args:
      log: the open ``metrics.jsonl`` (appended to).
      tensorboard: a TensorBoard log directory, or None.
    """

    def __init__(self, log: TextIO, tensorboard: str | None = None):
        self.log = log
        self.writer = None if tensorboard is None else tensorboard_writer(str(Path(tensorboard)))

    def write(self, step: int, m: dict[str, Any]) -> None:
        """Records the metrics of optimizer step ``step``."""
        self.log.write(json.dumps(log_line(m)) + "\n")
        self.log.flush()
        if self.writer is not None:
            for k, v in scalars(m).items():
                self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        """Flushes and closes the TensorBoard writer (the log file belongs to the caller)."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
