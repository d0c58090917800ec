"""``zinf-jax plot RUN_DIR``: a run's loss, tokens/s and bytes per tier over the steps, as one PNG.

Reads ``RUN_DIR/metrics.jsonl`` (one JSON object per step, as the main job writes it) and draws
three panels: loss (and the gradient norm on a second axis), tokens per second, and the bytes each
tier holds (device peak, host, nvme). Needs matplotlib (``pip install 'zinf-jax[plot]'``); it is
imported only here, with the non-interactive Agg backend.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["plot_run", "read_metrics"]


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """The steps of ``RUN_DIR/metrics.jsonl`` (a torn last line, from a killed run, is left out).

    Raises:
      ValueError: no metrics there (not a run directory, or no step finished).
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"zinf-jax plot {run_dir}: no {path.name} there (pass the --run-dir of a zinf-jax train run)")
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    rows = [r for r in rows if isinstance(r, dict) and "step" in r]
    if not rows:
        raise ValueError(f"zinf-jax plot {run_dir}: {path} holds no finished step")
    return rows


def plot_run(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Draws the run's metrics into ``out`` (default ``RUN_DIR/metrics.png``); returns the PNG's path.

    Raises:
      ValueError: no metrics, or matplotlib is not installed (the message says what to install).
    """
    rows = read_metrics(run_dir)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("zinf-jax plot needs matplotlib: pip install 'zinf-jax[plot]'") from None
    step = [r["step"] for r in rows]
    fig, (ax_loss, ax_rate, ax_bytes) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    ax_loss.plot(step, [r.get("loss") for r in rows], label="loss", color="C0")
    ax_loss.set_ylabel("loss")
    if any("grad_norm" in r for r in rows):
        twin = ax_loss.twinx()
        twin.plot(step, [r.get("grad_norm") for r in rows], label="grad norm", color="C1", alpha=0.5)
        twin.set_ylabel("grad norm")
    ax_rate.plot(step, [r.get("tokens_per_s") for r in rows], color="C2")
    ax_rate.set_ylabel("tokens / s")
    for key, label in (("peak_device_bytes", "device (peak)"), ("bytes_host", "host"), ("bytes_nvme", "nvme")):
        if any(key in r for r in rows):
            ax_bytes.plot(step, [r.get(key, 0) / 2**20 for r in rows], label=label)
    ax_bytes.set_ylabel("MiB held")
    ax_bytes.set_xlabel("optimizer step")
    ax_bytes.legend(loc="best")
    fig.suptitle(f"zinf-jax train: {Path(run_dir).resolve().name}")
    fig.tight_layout()
    dest = Path(out) if out is not None else Path(run_dir) / "metrics.png"
    fig.savefig(dest, dpi=100)
    plt.close(fig)
    return dest
