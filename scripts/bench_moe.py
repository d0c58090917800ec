"""Device memory and step time of a top-k mixture-of-experts LM whose experts stay split over an expert axis.

The model is the test suite's (``tests/helpers/moe_models.py``: ``MoELM``, 2 MoE blocks, top-2 routing,
experts stacked as ``(E, D, F)`` / ``(E, F, D)`` parameters declaring ``("expert", None, None)``), on a
(fsdp=2, expert=4) mesh of 8 CPU devices, for E = 8 and E = 32. Per E, in one run:

* device bytes per device: the compiled engine's step program (XLA's ``memory_analysis``: temp +
  arguments + outputs - aliased) and the streamed engine's peak (its own accounting), with the experts
  split (as declared) and gathered whole (the same model declaring no expert axis), against one
  expert's bytes (its two matrices, float32) and plain GSPMD's step program on the same mesh;
* step time, medians of interleaved reps: zinf's compiled engine with everything in device memory
  (none/none) and with params and optimizer in host RAM (cpu/cpu), against plain ``jax.jit``
  (value_and_grad + optax.adamw) on the same mesh and shardings.

    python scripts/bench_moe.py [--reps 7] [--d 128] [--f 512] [--out results/moe.json]
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import zinf_jax as zinf  # noqa: E402
from helpers.moe_models import MoELM, moe_loss  # noqa: E402

LR = 1e-3


def _mesh():
    return jax.make_mesh((2, 4), ("fsdp", "expert"), axis_types=(AxisType.Auto,) * 2)


def _tokens(step: int) -> np.ndarray:
    return np.random.default_rng(step).integers(0, 64, (8, 33)).astype(np.int32)


def _program_bytes(compiled) -> int:
    m = compiled.memory_analysis()
    return int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)


def _engine(engine: str, tier: str, split: bool, experts: int, d: int, f: int):
    off = zinf.Offload(tier)
    return zinf.initialize(lambda: MoELM(nnx.Rngs(0), experts=experts, d=d, f=f, split=split), loss_fn=moe_loss,
                           mesh=_mesh(), optimizer=zinf.adamw(LR),
                           config=zinf.ZeroConfig(offload_param=off, offload_optimizer=off, persistence_threshold=16,
                                                  engine=engine))


class _Plain:
    """Plain jit(value_and_grad) + optax.adamw on the mesh: stacks split over the expert axis, batch over both."""

    def __init__(self, experts: int, d: int, f: int):
        mesh = _mesh()
        with jax.set_mesh(mesh):
            model = MoELM(nnx.Rngs(0), experts=experts, d=d, f=f)
        gdef, params, rest = nnx.split(model, nnx.Param, ...)
        place = lambda x: jax.device_put(x, NamedSharding(mesh, P("expert") if x.ndim == 3 else P()))  # noqa: E731
        self.params, self.rest, self.mesh, self.tx = jax.tree.map(place, params), rest, mesh, optax.adamw(LR)
        self.opt = self.tx.init(self.params)

        def step(p, o, toks):
            loss, g = jax.value_and_grad(lambda q: moe_loss(nnx.merge(gdef, q, rest), toks))(p)
            u, o = self.tx.update(g, o, p)
            return loss, optax.apply_updates(p, u), o

        self.step = jax.jit(step, donate_argnums=(0, 1))
        self.batch = NamedSharding(mesh, P(("fsdp", "expert")))

    def program_bytes(self) -> int:
        with jax.set_mesh(self.mesh):
            return _program_bytes(self.step.lower(self.params, self.opt, jax.device_put(_tokens(0), self.batch)).compile())

    def __call__(self, s: int) -> float:
        with jax.set_mesh(self.mesh):
            loss, self.params, self.opt = self.step(self.params, self.opt, jax.device_put(_tokens(s), self.batch))
        return float(loss)


def one(experts: int, d: int, f: int, reps: int) -> dict:
    expert_bytes = 2 * d * f * 4
    memory = {}
    for split in (True, False):
        name = "split" if split else "whole"
        eng = _engine("compiled", "cpu", split, experts, d, f)
        eng.train_step(_tokens(0))
        memory[f"compiled_{name}_bytes_per_device"] = _program_bytes(eng.lower(_tokens(0)).compile())
        eng.close()
        eng = _engine("streamed", "cpu", split, experts, d, f)
        eng.train_step(_tokens(0))
        memory[f"streamed_{name}_peak_bytes_per_device"] = eng.train_step(_tokens(1))["peak_device_bytes"] // 8
        eng.close()
    plain = _Plain(experts, d, f)
    memory["plain_gspmd_bytes_per_device"] = plain.program_bytes()
    runs = {"plain": plain, "zinf_none": _engine("compiled", "none", True, experts, d, f),
            "zinf_cpu": _engine("compiled", "cpu", True, experts, d, f)}
    calls = {k: (v if k == "plain" else (lambda s, e=v: float(e.train_step(_tokens(s))["loss"])))
             for k, v in runs.items()}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for k in runs:  # compile and warm
        calls[k](0)
    for r in range(reps):  # interleaved
        for k in runs:
            t0 = time.perf_counter()
            calls[k](r + 1)
            times[k].append(time.perf_counter() - t0)
    for k, v in runs.items():
        if k != "plain":
            v.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "experts": experts, "experts_per_device": experts // 4, "one_expert_bytes": expert_bytes, **memory,
        "compiled_split_vs_expert": memory["compiled_split_bytes_per_device"] / expert_bytes,
        "streamed_split_vs_expert": memory["streamed_split_peak_bytes_per_device"] / expert_bytes,
        "step_s_median": med,
        "zinf_none_vs_plain": med["zinf_none"] / med["plain"], "zinf_cpu_vs_plain": med["zinf_cpu"] / med["plain"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--f", type=int, default=512)
    ap.add_argument("--out", default="results/moe.json")
    args = ap.parse_args()
    rows = [one(e, args.d, args.f, args.reps) for e in (8, 32)]
    small, big = rows
    out = {
        "d": args.d, "f": args.f, "layers": 2, "top_k": 2, "mesh": "fsdp=2 x expert=4 (8 CPU devices)", "rows": rows,
        "growth_8_to_32": {k: big[k] / small[k] for k in small if k.endswith("per_device")},
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                 cwd=ROOT).stdout.strip(),
        "date": time.strftime("%Y-%m-%d"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
