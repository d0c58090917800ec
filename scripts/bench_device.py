"""The engines on whatever accelerator JAX sees: compiled, streamed and plain jit, side by side.

One prepared command for a machine with an accelerator (it runs on CPU too, at a small size, to
check the script): the bundled GPT at a size that fills the device (default d_model 2048 x 16,
batch 8 x 512), bf16 compute with fp32 master weights on every side:

* ``plain``: ``jit(value_and_grad)`` + ``optax.adamw`` with the params (fp32) on the device, cast
  to bf16 inside the step — what a JAX user writes when the model fits;
* ``compiled``: ``zinf`` with params in host memory (``offload_param="cpu"``, ``pinned_host``), the
  optimizer on the host (the streamed CPU Adam), one XLA program per step;
* ``streamed``: the same tiers with ``ZeroConfig(engine="streamed")``.

Reps are interleaved (one step of each runner in turn), medians of per-rep ratios vs plain are
reported, with the host<->device bandwidth measured here (a 1 GiB ``device_put`` each way)
against ``--link-gbps`` (PCIe Gen5 x16: 64 GB/s a direction), the peak device bytes
(``device.memory_stats()``, where the backend has it) and the compiled program's
``memory_analysis``. Writes ``results/bench_device_<platform>.json``.

Usage::

    python scripts/bench_device.py [--d-model 2048] [--layers 16] [--batch 8] [--seq 512] [--reps 5]
        [--warmup 2] [--link-gbps 64] [--runners plain,compiled,streamed] [--small] [--out FILE]

``--small``: d_model 256 x 4, batch 8 x 64 (a CPU check of the script, seconds).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import zinf_jax as zinf
from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss

REPO = Path(__file__).resolve().parents[1]
LR, WD = 1e-4, 0.1


def plain_runner(cfg: GPTConfig, dtype: str):
    """``jit(value_and_grad)`` + optax.adamw; params fp32 on the device, computed in ``dtype``."""
    model = GPT(cfg, rngs=nnx.Rngs(0))
    gdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adamw(LR, weight_decay=WD)
    state = {"p": params, "o": tx.init(params)}

    @jax.jit
    def step(p, o, batch):
        def loss(p):
            low = jax.tree.map(lambda x: x.astype(dtype), p)
            return lm_loss(nnx.merge(gdef, low, rest), batch)

        value, g = jax.value_and_grad(loss)(p)
        upd, o = tx.update(g, o, p)
        return optax.apply_updates(p, upd), o, value

    def run(batch: np.ndarray) -> float:
        state["p"], state["o"], value = step(state["p"], state["o"], jnp.asarray(batch))
        return float(value)

    return run


def zinf_engine(cfg: GPTConfig, dtype: str, engine: str):
    config = zinf.ZeroConfig(offload_param=zinf.Offload("cpu"), offload_optimizer=zinf.Offload("cpu"),
                             compute_dtype=dtype, engine=engine, persistence_threshold=100_000)
    return zinf.initialize(lambda: GPT(cfg, rngs=nnx.Rngs(0)), config=config, loss_fn=lm_loss,
                           optimizer=zinf.adamw(LR, weight_decay=WD))


def link_gbps(nbytes: int = 1 << 30) -> dict[str, float]:
    """Host->device and device->host bandwidth of one large ``device_put`` each way (best of 3)."""
    dev = jax.devices()[0]
    host = np.ones(nbytes // 4, np.float32)
    h2d, d2h = [], []
    for _ in range(3):
        t = time.perf_counter()
        x = jax.device_put(host, dev).block_until_ready()
        h2d.append(time.perf_counter() - t)
        t = time.perf_counter()
        np.asarray(x)
        d2h.append(time.perf_counter() - t)
        del x
    return {"h2d_gbps": nbytes / min(h2d) / 1e9, "d2h_gbps": nbytes / min(d2h) / 1e9}


def peak_device_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats()
    return None if not stats else int(stats.get("peak_bytes_in_use", 0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--link-gbps", type=float, default=64.0, help="the link's peak a direction (GB/s)")
    ap.add_argument("--runners", default="plain,compiled,streamed")
    ap.add_argument("--small", action="store_true", help="d_model 256 x 4, batch 8 x 64: a quick check")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.small:
        args.d_model, args.layers, args.heads, args.seq = 256, 4, 4, 64
    plat = jax.devices()[0].platform
    cfg = GPTConfig(d_model=args.d_model, n_heads=args.heads, n_layers=args.layers, seq=args.seq, dropout=0.0)
    data = corpus()
    batches = [batch_at(data, i, args.batch, args.seq) for i in range(args.warmup + args.reps)]
    names = [n for n in args.runners.split(",") if n]
    res: dict = {"platform": plat, "device": str(jax.devices()[0].device_kind), "devices": jax.device_count(),
                 "model": {"d_model": cfg.d_model, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads,
                           "seq": cfg.seq, "batch": args.batch},
                 "dtype": args.dtype, "jax": jax.__version__, "python": platform.python_version(),
                 "commit": _commit(), "link": {**link_gbps(), "peak_gbps": args.link_gbps}}
    runners, engines = {}, {}
    try:
        for name in names:
            if name == "plain":
                runners[name] = plain_runner(cfg, args.dtype)
            else:
                engines[name] = eng = zinf_engine(cfg, args.dtype, name)
                runners[name] = lambda b, eng=eng: eng.train_step(b)["loss"]
                if name == "compiled":
                    mem = eng.lower(batches[0]).compile().memory_analysis()
                    res["compiled_memory_analysis"] = None if mem is None else {
                        k: int(getattr(mem, k)) for k in ("temp_size_in_bytes", "argument_size_in_bytes",
                                                          "output_size_in_bytes", "host_argument_size_in_bytes")}
        times: dict[str, list[float]] = {n: [] for n in runners}
        losses: dict[str, list[float]] = {n: [] for n in runners}
        for r, b in enumerate(batches):
            for name, run in runners.items():
                t0 = time.perf_counter()
                losses[name].append(run(b))
                if r >= args.warmup:
                    times[name].append(time.perf_counter() - t0)
            print(f"rep {r}: " + "  ".join(f"{n} {t[-1] * 1e3:.0f}ms" for n, t in times.items() if t), flush=True)
        res["peak_device_bytes"] = peak_device_bytes()
    finally:
        for eng in engines.values():
            eng.close()
    res["median_s"] = {n: statistics.median(t) for n, t in times.items()}
    if "plain" in times:
        res["ratio_vs_plain"] = {n: statistics.median([a / p for a, p in zip(t, times["plain"])])
                                 for n, t in times.items() if n != "plain"}
    res["tokens_per_s"] = {n: args.batch * args.seq / v for n, v in res["median_s"].items()}
    res["losses"] = losses
    res["link"]["fraction_of_peak"] = {k: v / args.link_gbps for k, v in res["link"].items() if k.endswith("_gbps")
                                       and k != "peak_gbps"}
    out = args.out or REPO / "results" / f"bench_device_{plat}{'_small' if args.small else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(json.dumps({k: res[k] for k in ("median_s", "ratio_vs_plain", "link", "peak_device_bytes") if k in res},
                     indent=1))
    print(f"wrote {out}")


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()
