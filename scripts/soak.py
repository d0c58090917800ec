"""Soak: the main job for many steps on nvme tiers, saving often, with the process's RSS and disk use over steps.

Runs ``zinf-jax train`` (the main job's model and tiers: params and optimizer on nvme) as a child
process for ``--steps`` steps, saving every ``--save-every`` with ``--keep`` checkpoints, and samples
the child's resident set size (``/proc/<pid>/status`` ``VmRSS``) and the bytes on disk of its
training state (``ckpt/`` and the tiers; the metrics log, which grows by a line a step, apart) every
``--every`` seconds. Each sample is matched to the step the job had logged by then
(``metrics.jsonl``). What a long run must show: RSS at the last step within ``--rss-slack-mb``
of RSS at the first save, and disk use flat after the second save (retention deletes as fast as
saves write). JSON under ``results/soak.json``: the samples, the per-step curve and the verdicts.

Usage::

    python scripts/soak.py [--steps 2000] [--save-every 100] [--keep 2] [--every 2] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def rss_bytes(pid: int) -> int | None:
    """The process's resident set size (``None`` once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def disk_bytes(root: Path) -> int:
    """Bytes the files under ``root`` occupy on disk (allocated blocks, as ``du``)."""
    total = 0
    if not root.exists():
        return 0
    if root.is_file():
        return root.stat().st_blocks * 512
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
            except FileNotFoundError:  # deleted by retention meanwhile
                pass
    return total


def steps_logged(metrics: Path) -> int:
    """The last step the job logged (0 before the first)."""
    try:
        lines = metrics.read_text().splitlines()
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--save-every", type=int, default=100)
    ap.add_argument("--keep", type=int, default=2)
    ap.add_argument("--every", type=float, default=2.0, help="seconds between samples")
    ap.add_argument("--rss-slack-mb", type=float, default=100.0)
    ap.add_argument("--run-dir", type=Path, default=None, help="default: a temporary directory, deleted after")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "soak.json")
    args = ap.parse_args()
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="zinf-soak-")) / "run"
    cmd = [sys.executable, "-m", "zinf_jax.app.cli", "train", "--run-dir", str(run_dir), "--steps", str(args.steps),
           "--save-every", str(args.save_every), "--keep", str(args.keep), "--no-progress"]
    t0 = time.time()
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    samples = []
    while child.poll() is None:
        rss = rss_bytes(child.pid)
        if rss is not None:
            samples.append({"t_s": round(time.time() - t0, 2), "step": steps_logged(run_dir / "metrics.jsonl"),
                            "rss_bytes": rss,  # the training state on disk: checkpoints and tiers, not the logs
                            "disk_bytes": disk_bytes(run_dir / "ckpt") + disk_bytes(run_dir / "nvme"),
                            "log_bytes": disk_bytes(run_dir / "metrics.jsonl")})
        time.sleep(args.every)
    err = child.stderr.read()
    if child.returncode != 0:
        sys.exit(f"the job failed ({child.returncode}): {err[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())

    def at(step: int) -> dict:
        """The first sample taken once the job had logged ``step``."""
        return next(s for s in samples if s["step"] >= step)

    first, last = at(args.save_every), [s for s in samples if s["step"] >= args.steps - 1][0]
    after_second = [s["disk_bytes"] for s in samples if s["step"] >= 2 * args.save_every + 1]
    # disk use swings by one checkpoint at each save (written, then the oldest deleted): flat means the
    # settled level between saves (each save window's lowest sample) does not grow
    windows: dict[int, int] = {}
    for s in samples:
        if s["step"] >= 2 * args.save_every + 1:
            w = s["step"] // args.save_every
            windows[w] = min(windows.get(w, s["disk_bytes"]), s["disk_bytes"])
    lows = [v for _, v in sorted(windows.items())][:-1]  # the last window may be cut short
    res = {
        "command": cmd[1:], "steps": args.steps, "save_every": args.save_every, "keep": args.keep,
        "final_loss": summary["final_loss"], "wall_s": round(time.time() - t0, 1),
        "rss_at_first_save_bytes": first["rss_bytes"], "rss_at_end_bytes": last["rss_bytes"],
        "rss_growth_mb": (last["rss_bytes"] - first["rss_bytes"]) / 1e6,
        "rss_flat": abs(last["rss_bytes"] - first["rss_bytes"]) <= args.rss_slack_mb * 1e6,
        "disk_after_second_save_bytes": {"min": min(after_second), "max": max(after_second)},
        "disk_settled_per_save_window_bytes": lows,
        "disk_flat": bool(lows) and max(lows) - min(lows) <= 0.02 * max(lows),
        "samples": samples,
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                 cwd=REPO).stdout.strip(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: v for k, v in res.items() if k != "samples"}, indent=1))
    if args.run_dir is None:
        shutil.rmtree(run_dir.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
