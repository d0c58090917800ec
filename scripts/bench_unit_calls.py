"""The fixed cost of one unit call: a model of many tiny units, per tier, against plain ``jax.jit``.

A stack of ``--units`` tiny NNX blocks (``Linear(width, width)`` + gelu, each a unit, threshold 0 so
every parameter is sharded) on the 8-device CPU mesh. A whole ``engine.train_step`` (streamed
forward/backward, streamed CPU AdamW, commit) is timed against one jitted plain step
(``value_and_grad`` + ``optax.adamw``) of the same model; at this size nothing is I/O or compute, so
``(zinf step - plain step) / (2 x units)`` is the fixed cost of one unit call (forward and backward
each count one), the optimizer's and commit's share per unit included. Reps interleave the runners;
medians of per-rep times. ``--profile TIER`` prints the top functions of one step (cProfile).

Usage::

    python scripts/bench_unit_calls.py [--units 32] [--width 16] [--batch 8] [--reps 5] [--steps-per-rep 3]
        [--tiers device,cpu,nvme] [--dir DIR] [--out results/bench_unit_calls.json] [--profile device]
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import cProfile  # noqa: E402
import json  # noqa: E402
import pstats  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import zinf_jax as zinf  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TIERS = {"device": "none", "cpu": "cpu", "nvme": "nvme"}


class Tiny(nnx.Module):
    def __init__(self, width: int, rngs: nnx.Rngs):
        self.lin = nnx.Linear(width, width, rngs=rngs)

    def __call__(self, x):
        return x + jax.nn.gelu(self.lin(x))


class Stack(nnx.Module):
    def __init__(self, units: int, width: int, rngs: nnx.Rngs):
        self.blocks = nnx.List([Tiny(width, rngs) for _ in range(units)])

    def __call__(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def loss_fn(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def _plain(units: int, width: int):
    gdef, params, rest = nnx.split(Stack(units, width, nnx.Rngs(0)), nnx.Param, ...)
    tx = optax.adamw(1e-3)
    opt = tx.init(params)

    @jax.jit
    def step(p, o, b):
        loss, g = jax.value_and_grad(lambda p: loss_fn(nnx.merge(gdef, p, rest), b))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    state = [params, opt]

    def run(b):
        state[0], state[1], loss = step(state[0], state[1], b)
        return loss

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--units", type=int, default=32)
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps-per-rep", type=int, default=3)
    ap.add_argument("--tiers", default="device,cpu,nvme",
                    help="device|cpu|nvme, the streamed engine; TIER+compiled for the compiled one (device, cpu)")
    ap.add_argument("--dir", default=None, help="nvme directory (default: a temporary one)")
    ap.add_argument("--out", default=str(REPO / "results" / "bench_unit_calls.json"))
    ap.add_argument("--profile", default=None, help="a tier: print the top functions of one of its steps")
    a = ap.parse_args()
    root = Path(a.dir or tempfile.mkdtemp(prefix="zinf-unit-calls-"))
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((a.batch, a.width), dtype=np.float32),
                rng.standard_normal((a.batch, a.width), dtype=np.float32)) for _ in range(4)]
    runners = {"plain": _plain(a.units, a.width)}
    engines = {}
    for name in a.tiers.split(","):
        tier, _, engine = name.partition("+")  # "cpu+compiled": the compiled engine (default: streamed)
        off = zinf.Offload(TIERS[tier], path=str(root / tier) if tier == "nvme" else None)
        (root / tier).mkdir(parents=True, exist_ok=True)
        kw = {"engine": engine or "streamed"} if hasattr(zinf.ZeroConfig(), "engine") else {}
        eng = zinf.initialize(lambda: Stack(a.units, a.width, nnx.Rngs(0)), loss_fn=loss_fn, optimizer=zinf.adamw(1e-3),
                              config=zinf.ZeroConfig(offload_param=off, offload_optimizer=off if tier == "nvme" else
                                                     zinf.Offload("cpu" if tier == "cpu" else "none"),
                                                     persistence_threshold=0, **kw))
        engines[name] = eng
        runners[name] = lambda b, eng=eng: eng.train_step(b)["loss"]
    times: dict[str, list[float]] = {k: [] for k in runners}
    for rep in range(a.warmup + a.reps):
        for name, run in runners.items():
            t0 = time.perf_counter()
            for s in range(a.steps_per_rep):
                loss = run(batches[s % len(batches)])
            float(jax.device_get(loss))
            if rep >= a.warmup:
                times[name].append((time.perf_counter() - t0) / a.steps_per_rep)
    med = {k: statistics.median(v) for k, v in times.items()}
    calls = 2 * a.units  # each unit: one forward call and one backward call a step
    result = {
        "units": a.units, "width": a.width, "batch": a.batch, "reps": a.reps, "steps_per_rep": a.steps_per_rep,
        "devices": jax.device_count(), "median_step_s": med,
        "ratio_vs_plain": {k: med[k] / med["plain"] for k in med if k != "plain"},
        "per_unit_call_ms": {k: 1e3 * (med[k] - med["plain"]) / calls for k in med if k != "plain"},
        "times": times,
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                 cwd=REPO).stdout.strip(),
    }
    if a.profile:
        prof = cProfile.Profile()
        eng = engines[a.profile]
        prof.enable()
        eng.train_step(batches[0])
        prof.disable()
        stats = pstats.Stats(prof).sort_stats("cumulative")
        stats.print_stats(25)
    for eng in engines.values():
        eng.close()
    if not a.dir:
        shutil.rmtree(root, ignore_errors=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("median_step_s", "ratio_vs_plain", "per_unit_call_ms")}, indent=1))


if __name__ == "__main__":
    main()
