"""The host optimizer's time per step as the leaf count grows, for zinf's Adam and for optax's.

The same parameter count in few leaves and in many: stacks of ``nnx.Linear`` layers (``--params``
parameters in 10 layers, 20 leaves; and in 130 layers, 260 leaves), trained on the 8-device CPU mesh by
the compiled engine with params and optimizer state in host RAM (``offload_param="cpu"``,
``offload_optimizer="cpu"``), with ``zinf.adamw`` and with ``optax.adamw``. The figure is the optimizer's
own time a step (``time_split["optimizer_total_s"]``), reps interleaved, medians, and its ratios: many leaves
against few, optax against zinf's Adam at many leaves. Two models of many leaves with ``optax.adamw`` on
the same placement give the optimizer's share of the whole step: ``umt5_like`` (the bundled GPT, narrow
and deep: its norms, biases and projections) and ``lora_like`` (a frozen stack with rank-4 ``nnx.LoRA``
adapters trained, two small leaves a layer).

    python scripts/bench_optax_leaves.py [--params 1.08e6] [--reps 5] [--out results/optax_leaves.json]
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import zinf_jax as zinf  # noqa: E402
from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss  # noqa: E402

LR, WD = 1e-3, 0.01


class Stack(nnx.Module):
    """``layers`` square ``nnx.Linear`` layers of ``width`` (two leaves each), optionally with LoRA adapters."""

    def __init__(self, layers: int, width: int, lora: int = 0, *, rngs: nnx.Rngs):
        make = (lambda: nnx.LoRALinear(width, width, lora_rank=lora, rngs=rngs)) if lora else \
            (lambda: nnx.Linear(width, width, rngs=rngs))
        self.layers = nnx.List([make() for _ in range(layers)])

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return x


def mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def _config() -> zinf.ZeroConfig:
    return zinf.ZeroConfig(offload_param=zinf.Offload("cpu"), offload_optimizer=zinf.Offload("cpu"),
                           engine="compiled")


def _stack_batches(width: int, n: int) -> list:
    rng = np.random.default_rng(0)
    return [{"x": rng.standard_normal((16, width)).astype(np.float32),
             "y": rng.standard_normal((16, width)).astype(np.float32)} for _ in range(n)]


def _leaf_engines(params: float) -> dict:
    """(model, optimizer) -> (engine, batches): the same parameter count in 20 and in 260 leaves."""
    out = {}
    for leaves in (20, 260):
        layers = leaves // 2
        width = int(round(math.sqrt(params / layers)))
        batches = _stack_batches(width, 2)
        for name, tx in (("zinf.adamw", zinf.adamw(LR, weight_decay=WD)),
                         ("optax.adamw", optax.adamw(LR, weight_decay=WD))):
            eng = zinf.initialize(lambda layers=layers, width=width: Stack(layers, width, rngs=nnx.Rngs(0)),
                                  config=_config(), optimizer=tx, loss_fn=mse)
            out[(f"{leaves}_leaves", name)] = (eng, batches)
    return out


def _model_engines() -> dict:
    """The many-leaf models with optax.adamw: a deep narrow GPT, and LoRA adapters on a frozen stack."""
    cfg = GPTConfig(vocab=256, d_model=64, n_heads=2, n_layers=24, seq=32)
    gpt = zinf.initialize(lambda: GPT(cfg, rngs=nnx.Rngs(0)), config=_config(),
                          optimizer=optax.adamw(LR, weight_decay=WD), loss_fn=lm_loss)
    lora = zinf.initialize(lambda: Stack(128, 128, lora=4, rngs=nnx.Rngs(0)), config=_config(),
                           optimizer=optax.adamw(LR, weight_decay=WD), loss_fn=mse, trainable=nnx.LoRAParam)
    return {("umt5_like", "optax.adamw"): (gpt, [batch_at(corpus(), s, 8, cfg.seq) for s in range(2)]),
            ("lora_like", "optax.adamw"): (lora, _stack_batches(128, 2))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=1.08e6)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps-per-rep", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("results/optax_leaves.json"))
    args = ap.parse_args(argv)
    engines = {**_leaf_engines(args.params), **_model_engines()}
    try:
        for eng, batches in engines.values():  # warm-up: compile every program, first buffers
            for b in batches:
                eng.train_step(b)
        opt: dict = {k: [] for k in engines}
        step: dict = {k: [] for k in engines}
        for _ in range(args.reps):
            for k, (eng, batches) in engines.items():
                for s in range(args.steps_per_rep):
                    m = eng.train_step(batches[s % len(batches)])
                    opt[k].append(m["time_split"]["optimizer_total_s"])
                    step[k].append(m["step_time_s"])
        rows = {}
        for (model, tx), (eng, _) in engines.items():
            leaves = len(eng.trainable)
            rows.setdefault(model, {})[tx] = {
                "trained_leaves": leaves, "trained_params": int(sum(math.prod(eng.layouts[p].shape)
                                                                    for p in eng.trainable)),
                "optimizer_s": statistics.median(opt[(model, tx)]), "step_s": statistics.median(step[(model, tx)]),
                "optimizer_share": statistics.median(o / s for o, s in zip(opt[(model, tx)], step[(model, tx)]))}
    finally:
        for eng, _ in engines.values():
            eng.close()
    ratios = {
        "zinf.adamw 260 vs 20 leaves": rows["260_leaves"]["zinf.adamw"]["optimizer_s"]
        / rows["20_leaves"]["zinf.adamw"]["optimizer_s"],
        "optax.adamw 260 vs 20 leaves": rows["260_leaves"]["optax.adamw"]["optimizer_s"]
        / rows["20_leaves"]["optax.adamw"]["optimizer_s"],
        "optax.adamw vs zinf.adamw at 260 leaves": rows["260_leaves"]["optax.adamw"]["optimizer_s"]
        / rows["260_leaves"]["zinf.adamw"]["optimizer_s"],
        "umt5_like optimizer share of the step": rows["umt5_like"]["optax.adamw"]["optimizer_share"],
        "lora_like optimizer share of the step": rows["lora_like"]["optax.adamw"]["optimizer_share"],
    }
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                            text=True).stdout.strip()
    out = {"rows": rows, "ratios": ratios, "reps": args.reps, "steps_per_rep": args.steps_per_rep,
           "devices": jax.device_count(), "commit": commit, "date": time.strftime("%Y-%m-%d"),
           "command": "python scripts/bench_optax_leaves.py " + " ".join(argv or sys.argv[1:])}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(json.dumps(ratios, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
