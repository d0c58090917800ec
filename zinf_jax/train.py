"""The main job: train the bundled GPT on CPython's help text with tiered offload.

Parameters and optimizer state live on the nvme tier under ``--nvme-dir`` by
default; a live progress line shows step, loss, tokens/s and bytes per tier;
metrics go to a JSON-lines log; checkpoints are saved every ``save_every``
steps, at the end, and on Ctrl-C; ``resume`` continues from the newest one and
reproduces the uninterrupted run (the batch of a step is a pure function of the
step, and the RNG state is in the checkpoint).
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import numpy as np
from flax import nnx

from zinf_jax.api import Engine, close_quietly, initialize, restore
from zinf_jax.checkpoint import latest_step_dir
from zinf_jax.config import Offload, ZeroConfig
from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss
from zinf_jax.optim import adamw

__all__ = ["TrainArgs", "train", "build_config"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainArgs:
    """Settings of the main job (each is a ``zinf-jax train`` flag).

    Attributes:
      steps: optimizer steps to reach (a resumed run continues up to it).
      batch: sequences per step (split over the mesh).
      seq: tokens per sequence.
      d_model, n_layers, n_heads: model shape.
      lr, warmup, weight_decay, clip: AdamW with linear warmup then cosine decay.
      run_dir: where the metrics log, checkpoints and (default) nvme tiers go.
      nvme_dir: directory of the nvme tiers (default ``<run_dir>/nvme``).
      param_device, optimizer_device: ``none`` / ``cpu`` / ``nvme`` tiers.
      save_every: checkpoint period in steps (0: only at the end and on Ctrl-C).
      keep: keep the newest N checkpoints, deleting older ones after each save; 0 keeps all.
      resume: continue from the newest checkpoint in ``<run_dir>/ckpt``.
      config: a zinf config JSON (``ZeroConfig.to_dict`` form) overriding the tier flags.
      deepspeed_config: a DeepSpeed JSON config (stage 3) instead.
      seed: initialisation and data seed.
      persistence_threshold: parameters with at most this many elements are not
        sharded (small, so that the demo model's blocks really are partitioned).
      progress: draw the live progress line.
    """

    steps: int = 150
    batch: int = 16
    seq: int = 64
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    lr: float = 3e-3
    warmup: int = 10
    weight_decay: float = 0.1
    clip: float = 1.0
    run_dir: str = "runs/gpt"
    nvme_dir: str | None = None
    param_device: str = "nvme"
    optimizer_device: str = "nvme"
    save_every: int = 50
    keep: int = 0
    resume: bool = False
    config: str | None = None
    deepspeed_config: str | None = None
    seed: int = 0
    persistence_threshold: int = 1024
    progress: bool = True


def build_config(args: TrainArgs) -> ZeroConfig:
    """The ZeroConfig the flags (or the given config files) describe."""
    if args.config and args.deepspeed_config:
        raise ValueError("give either --config or --deepspeed-config, not both")
    if args.deepspeed_config or args.config:
        if args.deepspeed_config:
            cfg = ZeroConfig.from_deepspeed(args.deepspeed_config)
        else:
            with open(args.config) as f:
                cfg = ZeroConfig.from_dict(json.load(f))
        for off in (cfg.offload_param, cfg.offload_optimizer):
            if off.device == "nvme" and not os.path.isabs(off.path):
                os.makedirs(off.path, exist_ok=True)  # a relative swap folder is the job's own, like DeepSpeed's
        return cfg
    nvme = args.nvme_dir or os.path.join(args.run_dir, "nvme")
    if "nvme" in (args.param_device, args.optimizer_device):
        os.makedirs(nvme, exist_ok=True)
    off = lambda d: Offload(d, path=nvme if d == "nvme" else None)  # noqa: E731
    return ZeroConfig(offload_param=off(args.param_device), offload_optimizer=off(args.optimizer_device),
                      gradient_clipping=args.clip, seed=args.seed, persistence_threshold=args.persistence_threshold)


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return str(n)


class _Progress:
    """A one-line live progress display (no dependency)."""

    def __init__(self, total: int, start: int, out: TextIO, enabled: bool):
        self.total, self.start, self.out, self.enabled = total, start, out, enabled
        self.t0 = time.perf_counter()

    def update(self, step: int, m: dict[str, Any]) -> None:
        if not self.enabled:
            return
        done = (step - self.start) / max(1, self.total - self.start)
        bar = "#" * int(24 * done) + "-" * (24 - int(24 * done))
        el = time.perf_counter() - self.t0
        eta = el / max(done, 1e-9) - el
        line = (f"\rstep {step}/{self.total} [{bar}] loss {m['loss']:.4f} {m['tokens_per_s']:.0f} tok/s "
                f"dev {_human(m['peak_device_bytes'])} host {_human(m['bytes_host'])} "
                f"nvme {_human(m['bytes_nvme'])} eta {eta:.0f}s ")
        self.out.write(line)
        self.out.flush()

    def close(self) -> None:
        if self.enabled:
            self.out.write("\n")


def _engine(args: TrainArgs, config: ZeroConfig, ckpt: Path) -> Engine:
    cfg = GPTConfig(d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads, seq=args.seq)
    seed = config.seed
    ctor = lambda: GPT(cfg, rngs=nnx.Rngs(seed))  # noqa: E731
    import optax

    sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup, max(args.steps, args.warmup + 1), args.lr * 0.1)
    opt = adamw(sched, weight_decay=args.weight_decay, clip_norm=args.clip or None)
    kw = dict(config=config, optimizer=opt, loss_fn=lm_loss)
    if args.resume:
        latest_step_dir(ckpt)  # a clear error if there is nothing to resume from
        return restore(ckpt, ctor, **kw)
    return initialize(ctor, **kw)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _tier_split(engine: Engine, m: dict[str, Any]) -> tuple[int, int]:
    host = nvme = 0
    for tier, key in ((engine.param_tier, "bytes_param_tier"), (engine.opt_tier, "bytes_optimizer_tier")):
        if tier.kind == "nvme":
            nvme += m[key]
        else:
            host += m[key]
    return host, nvme


def train(args: TrainArgs, *, out: TextIO | None = None) -> dict[str, Any]:
    """Runs the main job; returns its summary (also printed and written as JSON).

    Raises:
      ConfigError, TierError, CheckpointError: bad input, with a clear message.
    """
    out = out or sys.stderr
    if args.keep < 0:
        raise ValueError(f"--keep must be >= 0 (the newest checkpoints to keep; 0 keeps all), got {args.keep}")
    keep = args.keep or None
    run = Path(args.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    ckpt = run / "ckpt"
    config = build_config(args)
    engine = _engine(args, config, ckpt)
    data = corpus()
    start = engine.step
    log = open(run / "metrics.jsonl", "a")
    bar = _Progress(args.steps, start, out, args.progress)
    losses, rates, stop = [], [], []
    t0 = time.perf_counter()

    def on_sigint(signum: int, frame: Any) -> None:
        if stop:  # second Ctrl-C: give up at once; the last committed state stays intact
            raise KeyboardInterrupt
        stop.append(True)
        out.write("\nCtrl-C: finishing this step, then saving a checkpoint (Ctrl-C again to abort)\n")

    old = signal.signal(signal.SIGINT, on_sigint) if _main_thread() else None
    try:
        for step in range(start, args.steps):
            if stop:
                break
            m = engine.train_step(batch_at(data, step, args.batch, args.seq, config.seed))
            m["bytes_host"], m["bytes_nvme"] = _tier_split(engine, m)
            losses.append(m["loss"])
            rates.append(m["tokens_per_s"])
            log.write(json.dumps({k: v for k, v in m.items() if isinstance(v, (int, float, str, bool))}) + "\n")
            log.flush()
            bar.update(step + 1, m)
            if args.save_every and (step + 1) % args.save_every == 0:
                engine.save(ckpt, user_state={"data_step": step + 1}, max_to_keep=keep)
        saved = engine.save(ckpt, user_state={"data_step": engine.step}, max_to_keep=keep)
    except BaseException:
        close_quietly(engine)  # releases the tier locks; the error raised here is the one to report
        raise
    finally:
        bar.close()
        log.close()
        if old is not None:
            signal.signal(signal.SIGINT, old)
    interrupted = bool(stop)
    engine.close()
    summary = {
        "steps_run": len(losses), "step": int(saved.name.split("_")[-1]), "interrupted": interrupted,
        "initial_loss": losses[0] if losses else None, "final_loss": losses[-1] if losses else None,
        "median_tokens_per_s": float(np.median(rates)) if rates else None,
        "wall_s": time.perf_counter() - t0, "checkpoint": str(saved),
        "tiers": {"param": config.offload_param.device, "optimizer": config.offload_optimizer.device},
    }
    with open(run / "summary.json", "w") as f:
        json.dump(summary, f, indent=1)
    out.write(
        f"{'interrupted' if interrupted else 'done'}: {summary['steps_run']} steps (now at {summary['step']}), "
        f"loss {summary['initial_loss']} -> {summary['final_loss']}, "
        f"{summary['median_tokens_per_s'] or 0:.0f} tok/s median, checkpoint {saved}\n"
    )
    return summary
