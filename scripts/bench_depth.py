"""Device memory and compile time of the compiled engine's step against depth (params on the cpu tier).

For each depth (GPT, d_model 256 by default, batch 8 x 16 so that activation checkpoints do not
dominate), a fresh engine with params and optimizer in host RAM: the step program's
``memory_analysis()`` (temp, argument, output bytes per device) and the wall time of the first
``train_step`` (trace + compile + one step) against a second one. Depths run in a fresh subprocess
each, in interleaved order over ``--reps`` rounds; medians. JSON under ``results/bench_depth.json``.

Usage::

    python scripts/bench_depth.py [--depths 4 8 16] [--d-model 256] [--reps 2] [--out FILE]
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

REPO = Path(__file__).resolve().parents[1]


def one(depth: int, d_model: int, engine: str) -> dict:
    import optax
    from flax import nnx

    import zinf_jax as zinf
    from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss

    cfg = GPTConfig(vocab=256, d_model=d_model, n_heads=4, n_layers=depth, seq=16)
    config = zinf.ZeroConfig(offload_param=zinf.Offload("cpu"), offload_optimizer=zinf.Offload("cpu"), engine=engine)
    eng = zinf.initialize(lambda: GPT(cfg, rngs=nnx.Rngs(0)), config=config, loss_fn=lm_loss,
                          optimizer=optax.adamw(1e-3))
    data = corpus()
    b0, b1 = batch_at(data, 0, 8, cfg.seq), batch_at(data, 1, 8, cfg.seq)
    t0 = time.perf_counter()
    eng.train_step(b0)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    eng.train_step(b1)
    second = time.perf_counter() - t0
    out = {"first_step_s": first, "second_step_s": second, "engine": eng.mode}
    if eng.mode == "compiled":
        mem = eng.lower(b1).compile().memory_analysis()
        out.update({k: int(getattr(mem, k)) for k in ("temp_size_in_bytes", "argument_size_in_bytes",
                                                       "output_size_in_bytes", "alias_size_in_bytes")})
    eng.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--engine", default="compiled", choices=["compiled", "streamed"])
    ap.add_argument("--out", type=Path, default=REPO / "results" / "bench_depth.json")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # internal: run one depth, print JSON
    args = ap.parse_args()
    if args.one is not None:
        print("RESULT " + json.dumps(one(args.one, args.d_model, args.engine)))
        return
    runs: dict[int, list[dict]] = {d: [] for d in args.depths}
    for rep in range(args.reps):
        for d in (args.depths if rep % 2 == 0 else args.depths[::-1]):
            p = subprocess.run([sys.executable, __file__, "--one", str(d), "--d-model", str(args.d_model),
                                "--engine", args.engine], capture_output=True, text=True, check=True)
            line = next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))
            runs[d].append(json.loads(line[len("RESULT "):]))
            print(d, runs[d][-1], flush=True)
    summary = {}
    for d, rs in runs.items():
        summary[d] = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "engine"}
    base = args.depths[0]
    res = {"d_model": args.d_model, "batch": [8, 16], "engine": args.engine, "reps": args.reps, "runs": runs,
           "median": summary,
           "first_step_ratio_vs_shallowest": {d: summary[d]["first_step_s"] / summary[base]["first_step_s"]
                                              for d in args.depths}}
    if "temp_size_in_bytes" in summary[base]:
        res["temp_ratio_vs_shallowest"] = {d: summary[d]["temp_size_in_bytes"] / summary[base]["temp_size_in_bytes"]
                                           for d in args.depths}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res[k] for k in res if k.endswith("shallowest")}, indent=1))


if __name__ == "__main__":
    main()
