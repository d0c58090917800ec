"""Benchmark the CPU Adam(W) shard update against its alternatives, in one run.

All candidates update the same number of float32 parameters (default 64M, one
flat shard with its two moments and a gradient) on this machine's CPU threads:

* ``zinf``: :func:`zinf_jax.optim.adam_update_shard` (fused numba kernel);
* ``optax``: ``optax.adamw`` under ``jax.jit`` with donated params and state;
* ``numpy_whole``: whole-array numpy expressions (temporaries per op);
* ``numpy_blocked``: numpy ``out=`` ufuncs over 1 MiB blocks, one thread per core;
* ``deepspeed``: ``DeepSpeedCPUAdam`` on torch CPU tensors when importable;
* ``roofline``: the memory-bandwidth bound, measured: a numba stream kernel
  with Adam's exact access pattern (read p, m, v, g; write p, m, v in place:
  28 bytes per parameter) and trivial arithmetic; its bytes/s divided by 28.

All candidates share one shard set (DeepSpeed and optax keep their own moment
buffers). After one warm-up call each, ``--reps`` rounds time every candidate
once per round (round-robin; each timed call follows ``--gap`` seconds idle and
one untimed call, so no candidate pays for another's spinning worker threads or
for waking its own), so the slow drift of a shared machine hits all alike; figures are medians over rounds, and ratios are medians of per-round
time ratios. Compare figures within one run only.

Usage::

    .venv/bin/python scripts/bench_adam.py [--params 67108864] [--reps 5] [--out results/bench_adam.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

BYTES_PER_PARAM = 28  # read p, m, v, g (16 B) + write p, m, v (12 B)
HP = dict(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)


def _buffers(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    p = rng.standard_normal(n, dtype=np.float32)
    g = rng.standard_normal(n, dtype=np.float32) * np.float32(1e-2)
    return p, np.zeros(n, np.float32), np.zeros(n, np.float32), g


# Each setup_* takes the shared shard set and returns (run, info): run() performs
# one full update of all n parameters and returns when it is done.


def setup_zinf(bufs):
    from zinf_jax.optim import NUMBA_AVAILABLE, adam_update_shard, warmup
    warmup()
    p, m, v, g = bufs
    step = [0]

    def run():
        step[0] += 1
        adam_update_shard(p, m, v, g, step=step[0], grad_scale=0.5, **HP)

    return run, {"backend": "numba" if NUMBA_AVAILABLE else "jax-fallback"}


def setup_optax(bufs):
    import jax
    import jax.numpy as jnp
    import optax
    tx = optax.adamw(HP["lr"], HP["b1"], HP["b2"], HP["eps"], weight_decay=HP["weight_decay"])
    params, grads = jnp.array(bufs[0]), jnp.array(bufs[3])  # JAX-owned copies
    state = [params, tx.init(params)]

    def _step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(_step, donate_argnums=(0, 1))

    def run():
        state[0], state[1] = step(state[0], state[1], grads)
        jax.block_until_ready(state[0])

    return run, {"jax": jax.__version__, "optax": optax.__version__, "jit": True, "donated": True}


def _coeffs(step: int):
    f = np.float32
    return dict(gs=f(0.5), b1=f(HP["b1"]), omb1=f(1 - HP["b1"]), b2=f(HP["b2"]), omb2=f(1 - HP["b2"]),
                bc1=f(1 - HP["b1"] ** step), bc2=f(1 - HP["b2"] ** step), eps=f(HP["eps"]),
                wd=f(HP["weight_decay"]), lr=f(HP["lr"]))


def setup_numpy_whole(bufs):
    p, m, v, g = bufs
    step = [0]

    def run():
        step[0] += 1
        c = _coeffs(step[0])
        gg = g * c["gs"]
        m[:] = c["omb1"] * gg + c["b1"] * m
        v[:] = c["omb2"] * (gg * gg) + c["b2"] * v
        u = (m / c["bc1"]) / (np.sqrt(v / c["bc2"]) + c["eps"]) + c["wd"] * p
        p[:] = p - c["lr"] * u

    return run, {}


def _numpy_block(p, m, v, g, t1, t2, c):
    np.multiply(g, c["gs"], out=t1)
    np.multiply(m, c["b1"], out=m)
    np.multiply(t1, c["omb1"], out=t2)
    np.add(m, t2, out=m)
    np.multiply(t1, t1, out=t1)
    np.multiply(t1, c["omb2"], out=t1)
    np.multiply(v, c["b2"], out=v)
    np.add(v, t1, out=v)
    np.divide(v, c["bc2"], out=t1)
    np.sqrt(t1, out=t1)
    np.add(t1, c["eps"], out=t1)
    np.divide(m, c["bc1"], out=t2)
    np.divide(t2, t1, out=t2)
    np.multiply(p, c["wd"], out=t1)
    np.add(t2, t1, out=t2)
    np.multiply(t2, c["lr"], out=t2)
    np.subtract(p, t2, out=p)


def setup_numpy_blocked(bufs, threads: int, block_bytes: int = 1 << 20):
    p, m, v, g = bufs
    n, blk = p.shape[0], block_bytes // 4
    starts = list(range(0, n, blk))
    scratch = [(np.empty(blk, np.float32), np.empty(blk, np.float32)) for _ in range(threads)]
    pool = cf.ThreadPoolExecutor(threads)
    step = [0]

    def worker(k, c):
        t1, t2 = scratch[k]
        for s in starts[k::threads]:
            e = min(s + blk, n)
            _numpy_block(p[s:e], m[s:e], v[s:e], g[s:e], t1[:e - s], t2[:e - s], c)

    def run():
        step[0] += 1
        c = _coeffs(step[0])
        list(pool.map(worker, range(threads), [c] * threads))

    return run, {"threads": threads, "block_bytes": block_bytes}


def setup_roofline(bufs):
    """Memory-bound kernels with Adam's access pattern; a zero factor leaves the data unchanged."""
    from numba import njit, prange

    @njit(parallel=True, fastmath=True, error_model="numpy")
    def adam_shaped(p, m, v, g, s):  # read p, m, v, g; write p, m, v: 28 bytes per element
        for i in prange(p.shape[0]):
            gi = g[i] * s
            p[i] += gi
            m[i] += gi
            v[i] += gi

    p, m, v, g = bufs
    zero = np.float32(0.0)
    return (lambda: adam_shaped(p, m, v, g, zero)), {"kernel": "numba prange in-place, 28 B/param"}


def _deepspeed_adam(p: np.ndarray, g: np.ndarray):
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    param = torch.nn.Parameter(torch.from_numpy(p))
    param.grad = torch.from_numpy(g)
    return DeepSpeedCPUAdam([param], lr=HP["lr"], betas=(HP["b1"], HP["b2"]), eps=HP["eps"],
                            weight_decay=HP["weight_decay"], adamw_mode=True)


def deepspeed_parity(n: int = 1 << 20, steps: int = 3) -> dict:
    """Both kernels from the same state for a few steps: they compute the same AdamW (a sanity check)."""
    from zinf_jax.optim import adam_update_shard
    p, m, v, g = _buffers(n, seed=1)
    ds_p = p.copy()
    ds = _deepspeed_adam(ds_p, g.copy())
    for t in range(1, steps + 1):
        ds.step()
        adam_update_shard(p, m, v, g, step=t, grad_scale=1.0, **HP)
    diff = np.abs(ds_p - p)
    return {"params": n, "steps": steps, "max_abs_diff": float(diff.max()),
            "max_abs_diff_per_lr_step": float(diff.max() / (HP["lr"] * steps)),
            "note": "differences in units of the largest possible update (lr per step)"}


def setup_deepspeed(bufs):
    import deepspeed
    import torch
    opt = _deepspeed_adam(bufs[0], bufs[3])
    return opt.step, {"torch": torch.__version__, "deepspeed": deepspeed.__version__,
                      "torch_threads": torch.get_num_threads(), "parity_vs_zinf": deepspeed_parity()}


def _ratio(rounds: dict, a: str, b: str):
    """Median over rounds of time(b)/time(a): a's speed relative to b, drift-robust."""
    if a not in rounds or b not in rounds:
        return None
    return statistics.median(tb / ta for ta, tb in zip(rounds[a], rounds[b]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=64 * 2**20, help="float32 parameters in the shard")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions (median reported)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for blocked numpy")
    ap.add_argument("--out", default="results/bench_adam.json")
    ap.add_argument("--skip", nargs="*", default=[], help="candidates to skip")
    ap.add_argument("--gap", type=float, default=0.5,
                    help="seconds of idle before each timed run: OpenMP and XLA worker threads spin-wait after "
                         "a parallel region and otherwise steal the cores of whichever candidate runs next")
    args = ap.parse_args(argv)
    n, reps = args.params, args.reps
    bufs = _buffers(n)
    setups = {
        "zinf": lambda: setup_zinf(bufs),
        "optax": lambda: setup_optax(bufs),
        "numpy_whole": lambda: setup_numpy_whole(bufs),
        "numpy_blocked": lambda: setup_numpy_blocked(bufs, args.threads),
        "roofline": lambda: setup_roofline(bufs),
        "deepspeed": lambda: setup_deepspeed(bufs),
    }
    runs, results = {}, {}
    for name, setup in setups.items():
        if name in args.skip:
            continue
        try:
            runs[name], results[name] = setup()
            runs[name]()  # warm-up: compile, first-touch pages
        except Exception as err:  # noqa: BLE001 - e.g. torch/deepspeed not installed
            runs.pop(name, None)
            results[name] = {"status": "unavailable", "reason": f"{type(err).__name__}: {err}"}
    # Round-robin: every round times each candidate once, so slow drift of this
    # shared machine hits all candidates alike; report medians over rounds.
    rounds = {name: [] for name in runs}
    for _ in range(reps):
        for name, run in runs.items():
            time.sleep(args.gap)  # let the previous candidate's spinning worker threads (OpenMP, XLA) go idle
            run()  # untimed: wakes this candidate's own thread pool, as in a training loop
            t0 = time.perf_counter()
            run()
            rounds[name].append(time.perf_counter() - t0)
    for name, times in rounds.items():
        t = statistics.median(times)
        results[name].update(status="ok", seconds=t, seconds_all=times, params_per_s=n / t)
        if name == "roofline":
            results[name]["bytes_per_s"] = BYTES_PER_PARAM * n / t
    for name, r in results.items():
        pps = r.get("params_per_s")
        print(f"{name:14s} " + (f"{pps / 1e9:6.3f} Gparam/s" if pps else r["reason"]), flush=True)

    import numba
    report = {
        "params": n, "reps": reps, "bytes_per_param": BYTES_PER_PARAM,
        "machine": {"cpus": os.cpu_count(), "numba_threads": numba.get_num_threads(),
                    "processor": platform.processor() or platform.machine(),
                    "python": sys.version.split()[0], "numpy": np.__version__, "numba": numba.__version__},
        "results": results,
        "ratios": {f"zinf/{b}": _ratio(rounds, "zinf", b)
                   for b in ("roofline", "deepspeed", "optax", "numpy_blocked", "numpy_whole")},
        "ratios_note": "median over rounds of time(other)/time(zinf); >1 means zinf is faster",
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["ratios"], indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
