"""Small models, where per-unit costs dominate: the compiled and streamed engines against plain jit.

Two models a CPU-mesh test suite trains: an NNX U-Net (channels 8 -> 128 -> 8 at 32 x 32, a skip
connection across every level, ~10 units, batch 8) and a 2-layer GPT of width 32 (batch 8 x 16).
Each against ``jit(value_and_grad)`` + ``optax.adamw`` on the unwrapped model, on one device and
data-parallel on the same 8-device CPU mesh (``plain_mesh``; each of the 8 simulated devices runs its
program on the 2 cores, so a small model's step is dominated by the devices' synchronisation); zinf with params and optimizer in host RAM (``cpu``), compiled and streamed, and ``fused``: the
compiled engine with both in device memory (``none``), whose update runs inside the step's program; ``default``:
``ZeroConfig()``'s tiers (params in device memory, the optimizer on the host, zinf's adamw); at the
default ``persistence_threshold`` (``--threshold 0``: every parameter sharded and gathered). Reps
interleave the runners; medians of per-rep ratios. JSON under ``results/bench_small.json``.

Usage::

    python scripts/bench_small.py [--reps 7] [--warmup 2] [--steps-per-rep 5] [--out FILE]
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import zinf_jax as zinf  # noqa: E402
from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LR = 1e-3


class Level(nnx.Module):
    """Two 3 x 3 convolutions with a group norm."""

    def __init__(self, cin: int, cout: int, rngs: nnx.Rngs):
        self.a = nnx.Conv(cin, cout, (3, 3), rngs=rngs)
        self.norm = nnx.GroupNorm(cout, num_groups=4, rngs=rngs)
        self.b = nnx.Conv(cout, cout, (3, 3), rngs=rngs)

    def __call__(self, x):
        return nnx.relu(self.b(nnx.relu(self.norm(self.a(x)))))


class UNet(nnx.Module):
    """Down 8 -> 16 -> 32 -> 64 -> 128, up again with a skip connection at every level."""

    def __init__(self, rngs: nnx.Rngs, widths=(8, 16, 32, 64, 128)):
        self.stem = nnx.Conv(1, widths[0], (3, 3), rngs=rngs)
        self.down = nnx.List([Level(widths[i], widths[i + 1], rngs) for i in range(len(widths) - 1)])
        self.up = nnx.List([Level(widths[i + 1] + widths[i], widths[i], rngs) for i in reversed(range(len(widths) - 1))])
        self.out = nnx.Conv(widths[0], 1, (1, 1), rngs=rngs)

    def __call__(self, x):
        x = self.stem(x)
        skips = []
        for lvl in self.down:
            skips.append(x)
            x = lvl(nnx.avg_pool(x, (2, 2), (2, 2)) if skips[:-1] else x)
        for lvl, skip in zip(self.up, reversed(skips)):
            if x.shape[1] != skip.shape[1]:
                x = jax.image.resize(x, (x.shape[0], skip.shape[1], skip.shape[2], x.shape[3]), "nearest")
            x = lvl(jnp.concatenate([x, skip], axis=-1))
        return self.out(x)


def unet_loss(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def plain(ctor, loss_fn, mesh=None):
    """The plain step: on one device, or (``mesh``) data-parallel on the mesh zinf uses (params and optimizer
    state replicated, the batch split over the devices, as ``bench_step.py``'s plain step)."""
    model = ctor()
    gdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adamw(LR, weight_decay=0.0)
    st = {"p": params, "o": tx.init(params)}
    place = lambda b: b  # noqa: E731
    if mesh is not None:
        rep = NamedSharding(mesh, P())
        st, rest = jax.device_put((st, rest), rep)
        place = lambda b: jax.device_put(b, NamedSharding(mesh, P(mesh.axis_names)))  # noqa: E731

    @jax.jit
    def step(p, o, b):
        value, g = jax.value_and_grad(lambda p: loss_fn(nnx.merge(gdef, p, rest), b))(p)
        upd, o = tx.update(g, o, p)
        return optax.apply_updates(p, upd), o, value

    def run(b):
        st["p"], st["o"], value = step(st["p"], st["o"], jax.tree.map(place, b))
        return value

    return run


def engine(ctor, loss_fn, mode, threshold):
    """``mode``: ``compiled``/``streamed`` (params and optimizer on cpu, optax's adamw), ``fused`` (the compiled
    engine with both in device memory and zinf's adamw, whose update runs inside the step's program), or
    ``default`` (``ZeroConfig()``'s tiers: params in device memory, the optimizer on the host; zinf's adamw)."""
    if mode == "default":
        config = zinf.ZeroConfig(persistence_threshold=threshold)
        return zinf.initialize(ctor, config=config, loss_fn=loss_fn, optimizer=zinf.adamw(LR, weight_decay=0.0))
    tier = "none" if mode == "fused" else "cpu"
    config = zinf.ZeroConfig(offload_param=zinf.Offload(tier), offload_optimizer=zinf.Offload(tier),
                             engine="compiled" if mode == "fused" else mode, persistence_threshold=threshold)
    opt = zinf.adamw(LR, weight_decay=0.0) if mode == "fused" else optax.adamw(LR, weight_decay=0.0)
    return zinf.initialize(ctor, config=config, loss_fn=loss_fn, optimizer=opt)


def bench(name, ctor, loss_fn, batches, args) -> dict:
    engines = {m: engine(ctor, loss_fn, m, args.threshold) for m in ("fused", "default", "compiled", "streamed")}
    runners = {"plain": plain(ctor, loss_fn), "plain_mesh": plain(ctor, loss_fn, engines["fused"].mesh)}
    units = len(engines["compiled"].adapter.units)
    for m, eng in engines.items():
        runners[m] = lambda b, eng=eng: eng.train_step(b)["loss"]
    times = {k: [] for k in runners}
    for rep in range(args.warmup + args.reps):
        for k, run in runners.items():
            t0 = time.perf_counter()
            for s in range(args.steps_per_rep):
                value = run(batches[s % len(batches)])
            float(jax.device_get(value))
            if rep >= args.warmup:
                times[k].append((time.perf_counter() - t0) / args.steps_per_rep)
        if rep >= args.warmup:
            print(f"{name} rep {rep - args.warmup}: " + "  ".join(f"{k} {v[-1] * 1e3:.1f}ms" for k, v in times.items()),
                  flush=True)
    for eng in engines.values():
        eng.close()
    return {"units": units, "median_s": {k: statistics.median(v) for k, v in times.items()},
            "ratio_vs_plain": {k: statistics.median([a / b for a, b in zip(v, times["plain"])])
                               for k, v in times.items() if k != "plain"},
            "ratio_vs_plain_mesh": {k: statistics.median([a / b for a, b in zip(v, times["plain_mesh"])])
                                    for k, v in times.items() if not k.startswith("plain")}, "times_s": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps-per-rep", type=int, default=5)
    ap.add_argument("--threshold", type=int, default=100_000,
                    help="persistence_threshold (default: ZeroConfig's; 0 shards every parameter)")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "bench_small.json")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    images = [(rng.standard_normal((8, 32, 32, 1), dtype=np.float32), rng.standard_normal((8, 32, 32, 1),
                                                                                          dtype=np.float32))
              for _ in range(3)]
    cfg = GPTConfig(d_model=32, n_heads=4, n_layers=2, seq=16, dropout=0.0)
    data = corpus()
    tokens = [batch_at(data, s, 8, cfg.seq) for s in range(3)]
    res = {"unet": bench("unet", lambda: UNet(nnx.Rngs(0)), unet_loss, images, args),
           "lm_d32_L2": bench("lm", lambda: GPT(cfg, rngs=nnx.Rngs(0)), lm_loss, tokens, args),
           "persistence_threshold": args.threshold, "devices": jax.device_count(), "jax": jax.__version__,
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=REPO).stdout.strip()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: {"vs_plain_one_device": v["ratio_vs_plain"], "vs_plain_on_the_mesh": v["ratio_vs_plain_mesh"]}
                      for k, v in res.items() if isinstance(v, dict)}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
