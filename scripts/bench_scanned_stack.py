"""A stack of layers scanned by the model's own code, streamed one layer at a time: its device memory and compile time.

A GPT-like decoder whose ``--layers`` blocks are one stack (``nnx.split_rngs`` + ``nnx.vmap``) applied by
``nnx.scan`` in the model's call, with the stack as the unit (``UnitPolicy(patterns=("blocks",))``), params and
optimizer on an nvme tier under ``--dir`` (the streamed engine), activations parked in host memory. Two
measurements, each taken in one run:

* ``memory``: the peak of live device arrays over a training step (``track_live_arrays``) at 4 and at
  ``--layers`` layers, with ``prefetch_depth`` 0 (the window is the layer in use) and 2 (the default), against
  one layer's bytes; the ratio of the two depths' peaks says whether memory grows with depth.
* ``compile``: the first step's extra time over a later step's (tracing and compiling) of the scanned model
  against the same blocks in a list applied by a Python loop (unrolled), both through zinf; reps interleaved,
  medians.
* ``host_copies``: params and optimizer on the cpu tier (the compiled engine), ``--copies-layers`` blocks: the
  host bytes copied per step for the parameters (the tier's puts of the optimizer's new values and the
  engine's restacking of scanned runs), as passes over the parameters' bytes, for the scanned stack (its
  stacked parameter is the step's argument as stored) and for the loop (a scanned run of alike units,
  restacked from the tier's per-block shards).

The models are the test suite's (``tests/helpers/scan_models.py``: ``ScannedDecoderLM``, ``LoopDecoderLM``).

Usage::

    python scripts/bench_scanned_stack.py [--layers 16] [--d-model 256] [--reps 3] [--copies-layers 4]
        [--copies-d-model 512] [--dir DIR] [--out results/bench_scanned_stack.json]
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import zinf_jax as zinf  # noqa: E402
from helpers.scan_models import LoopDecoderLM, ScannedDecoderLM  # noqa: E402


def _tokens(step: int, batch: int = 8, seq: int = 16, vocab: int = 64) -> jax.Array:
    return jax.random.randint(jax.random.key(step), (batch, seq + 1), 0, vocab)


def _loss(model, toks):
    logits = model(toks[:, :-1])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, toks[:, 1:]))


def _engine(cls, n: int, d: int, where: Path, depth: int, track: bool):
    where.mkdir(parents=True)
    off = zinf.Offload("nvme", path=str(where))
    cfg = zinf.ZeroConfig(offload_param=off, offload_optimizer=off, persistence_threshold=16,
                          offload_activations=True, prefetch_depth=depth)
    policy = zinf.UnitPolicy(patterns=("blocks",)) if cls is ScannedDecoderLM else None
    return zinf.initialize(lambda: cls(nnx.Rngs(0), n=n, d=d), config=cfg, optimizer=zinf.adamw(1e-3),
                           loss_fn=_loss, track_live_arrays=track, **({"unit_policy": policy} if policy else {}))


def memory(n: int, d: int, root: Path, depth: int) -> dict:
    eng = _engine(ScannedDecoderLM, n, d, root / f"mem_{n}_{depth}", depth, True)
    eng.train_step(_tokens(0))
    peaks = []
    for s in range(1, 4):
        eng.passes.reset_peaks()
        eng.train_step(_tokens(s))
        peaks.append(eng.passes.peak_live_array_bytes)
    stack = sum(eng.layouts[p].size * 4 for p in eng.layouts if p.startswith("blocks/"))
    eng.close()
    return {"layers": n, "prefetch_depth": depth, "peak_live_bytes": max(peaks), "peaks": peaks,
            "layer_bytes": stack // n, "stack_bytes": stack}


def compile_time(cls, n: int, d: int, where: Path) -> dict:
    eng = _engine(cls, n, d, where, 2, False)
    t0 = time.perf_counter()
    float(eng.train_step(_tokens(0))["loss"])
    first = time.perf_counter() - t0
    later = []
    for s in range(1, 3):
        t0 = time.perf_counter()
        float(eng.train_step(_tokens(s))["loss"])
        later.append(time.perf_counter() - t0)
    eng.close()
    return {"first_s": first, "step_s": min(later), "compile_s": first - min(later)}


def host_copies(cls, n: int, d: int, steps: int = 3) -> float:
    """Host bytes copied per step for the parameters, in passes over their bytes (cpu tier, compiled engine)."""
    cpu = zinf.Offload("cpu")
    eng = zinf.initialize(lambda: cls(nnx.Rngs(0), n=n, d=d), config=zinf.ZeroConfig(
        offload_param=cpu, offload_optimizer=cpu, persistence_threshold=16), optimizer=zinf.adamw(1e-3), loss_fn=_loss)
    copied = lambda: getattr(eng.store.tier, "copied_bytes", 0) + eng.passes.args.host_copy_bytes  # noqa: E731
    for s in range(2):
        float(eng.train_step(_tokens(s))["loss"])
    before = copied()
    for s in range(2, 2 + steps):
        float(eng.train_step(_tokens(s))["loss"])
    passes = (copied() - before) / steps / (4 * sum(lay.size for lay in eng.layouts.values()))
    eng.close()
    return passes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--copies-layers", type=int, default=4)
    ap.add_argument("--copies-d-model", type=int, default=512)
    ap.add_argument("--dir", default=None, help="where the nvme tiers go (default: a temporary directory)")
    ap.add_argument("--out", default="results/bench_scanned_stack.json")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="zinf-scan-", dir=args.dir))
    try:
        mem = [memory(n, args.d_model, root, depth) for depth in (0, 2) for n in (4, args.layers)]
        runs: dict[str, list[dict]] = {"scan": [], "loop": []}
        for r in range(args.reps):  # interleaved
            for name, cls in (("scan", ScannedDecoderLM), ("loop", LoopDecoderLM)):
                runs[name].append(compile_time(cls, args.layers, args.d_model, root / f"{name}_{r}"))
        copies = {name: host_copies(cls, args.copies_layers, args.copies_d_model)
                  for name, cls in (("scan", ScannedDecoderLM), ("loop", LoopDecoderLM))}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(x["compile_s"] for x in v) for k, v in runs.items()}
    by = {(m["layers"], m["prefetch_depth"]): m["peak_live_bytes"] for m in mem}
    out = {
        "layers": args.layers, "d_model": args.d_model, "reps": args.reps, "memory": mem, "compile": runs,
        "peak_ratio_deep_to_4_layers": {f"prefetch_depth={k}": by[(args.layers, k)] / by[(4, k)] for k in (0, 2)},
        "peak_over_layer_bytes": {f"prefetch_depth={k}": by[(args.layers, k)] / mem[0]["layer_bytes"] for k in (0, 2)},
        "compile_scan_over_loop": med["scan"] / med["loop"],
        "host_param_passes_per_step": copies,
        "compile_median_s": med,
        "jax": jax.__version__, "machine": platform.platform(), "cpus": os.cpu_count(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps({k: out[k] for k in ("peak_ratio_deep_to_4_layers", "peak_over_layer_bytes",
                                          "compile_scan_over_loop", "compile_median_s",
                                          "host_param_passes_per_step")}, indent=2))


if __name__ == "__main__":
    main()
