"""Host RSS during initialisation: zinf_jax.initialize with NVMe offload vs eager construction.

Issue 3's acceptance check: host peak RSS during init of a model at least 4x
larger than the cap stays under the cap. Every measurement runs in a fresh
subprocess:

* ``zinf``: ``zinf_jax.initialize`` of the GPT of :mod:`zinf_jax.models` with
  ``offload_param`` and ``offload_optimizer`` both ``Offload("nvme", path=tmp)``
  (parameters created unit by unit, written to the param tier, fp32 master,
  Adam m and v written to the optimizer tier);
* ``eager``: ``GPT(cfg, rngs=nnx.Rngs(0))`` constructed eagerly (parameters
  only, 4 B/param);
* ``eager_adamw``: eager construction plus ``nnx.Optimizer(model, optax.adamw)``
  (parameters, m and v: 12 B/param; the optimizer state a plain JAX run holds).

The model state counted against the cap is what zinf keeps: params (4 B/param)
+ fp32 master, m and v (12 B/param) = 16 B/param. The child records the RSS
baseline after imports and JAX backend start, then resets the kernel's peak-RSS
mark (``/proc/self/clear_refs``) and samples RSS (psutil) on a thread every
``--interval`` seconds during init; the peak reported is the larger of the
sampled peak and ``VmHWM``. growth = peak - baseline; pass = growth <= cap.

Usage::

    python scripts/bench_init_memory.py [--cap-mib 512] [--d-model 1024] [--layers 12]
        [--modes zinf,eager,eager_adamw] [--dir DIR] [--out results/bench_init_memory.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench_tiers import fstype, scratch_root  # same folder

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20
GiB = 1 << 30


# --- the child: one measurement ------------------------------------------------------------
def _read_status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class _Sampler(threading.Thread):
    def __init__(self, interval: float):
        super().__init__(daemon=True)
        import psutil

        self.proc = psutil.Process()
        self.interval = interval
        self.samples: list[tuple[float, int]] = []
        self.stop = threading.Event()
        self.t0 = time.perf_counter()

    def run(self) -> None:
        while not self.stop.is_set():
            self.samples.append((time.perf_counter() - self.t0, self.proc.memory_info().rss))
            self.stop.wait(self.interval)
        self.samples.append((time.perf_counter() - self.t0, self.proc.memory_info().rss))


def child(args) -> dict:
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(args.devices))
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import zinf_jax as zinf
    from zinf_jax.models import GPT, GPTConfig, lm_loss

    jax.devices()
    jnp.zeros(8).block_until_ready()  # backend started
    cfg = GPTConfig(d_model=args.d_model, n_heads=args.heads, n_layers=args.layers, seq=args.seq, dropout=0.0)
    ctor = lambda: GPT(cfg, rngs=nnx.Rngs(0))  # noqa: E731
    abstract = nnx.state(nnx.eval_shape(ctor), nnx.Param)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract))
    del abstract
    import gc

    gc.collect()
    time.sleep(0.2)
    baseline = _read_status("VmRSS")
    reset_ok = _reset_peak()
    sampler = _Sampler(args.interval)
    sampler.start()
    t0 = time.perf_counter()
    extra = {}
    if args.child == "zinf":
        config = zinf.ZeroConfig(offload_param=zinf.Offload("nvme", path=args.nvme_dir),
                                 offload_optimizer=zinf.Offload("nvme", path=args.nvme_dir))
        engine = zinf.initialize(ctor, config=config, optimizer=zinf.adamw(3e-4, weight_decay=0.1),
                                 loss_fn=lm_loss)
        init_s = time.perf_counter() - t0
        extra["bytes_param_tier"] = int(getattr(engine.param_tier, "stored_bytes", lambda: 0)())
        extra["bytes_optimizer_tier"] = int(getattr(engine.opt_tier, "stored_bytes", lambda: 0)())
        extra["disk_bytes"] = sum(p.stat().st_size for p in Path(args.nvme_dir).rglob("*") if p.is_file())
        engine.close()
    elif args.child == "eager":
        model = ctor()
        jax.block_until_ready(nnx.state(model))
        init_s = time.perf_counter() - t0
    elif args.child == "eager_adamw":
        model = ctor()
        opt = nnx.Optimizer(model, optax.adamw(3e-4, weight_decay=0.1), wrt=nnx.Param)
        jax.block_until_ready((nnx.state(model), nnx.state(opt)))
        init_s = time.perf_counter() - t0
    else:
        raise ValueError(args.child)
    sampler.stop.set()
    sampler.join()
    hwm = _read_status("VmHWM")
    sampled_peak = max(r for _, r in sampler.samples)
    peak = max(sampled_peak, hwm) if reset_ok else sampled_peak
    cap = args.cap_mib * MiB
    state_bytes = n_params * 16
    every = max(1, len(sampler.samples) // 400)
    return {
        "mode": args.child, "params": n_params, "model_state_bytes_16B_per_param": state_bytes,
        "param_bytes_fp32": n_params * 4, "cap_bytes": cap, "state_over_cap": state_bytes / cap,
        "baseline_rss_bytes": baseline, "peak_rss_bytes": peak, "sampled_peak_rss_bytes": sampled_peak,
        "vm_hwm_bytes": hwm if reset_ok else None, "peak_reset_ok": reset_ok,
        "growth_bytes": peak - baseline, "growth_over_cap": (peak - baseline) / cap,
        "under_cap": (peak - baseline) <= cap, "init_s": init_s, "samples": len(sampler.samples),
        "rss_trace_s_mib": [(round(t, 3), round(r / MiB, 1)) for t, r in sampler.samples[::every]],
        **extra,
    }


# --- the parent -------------------------------------------------------------------------------
def parent(args) -> int:
    root = scratch_root(args.dir, "zinf_bench_init_")
    n_params_est = args.layers * (12 * args.d_model ** 2 + 9 * args.d_model) + (256 + args.seq + 2) * args.d_model
    need = n_params_est * 16 * 1.05
    free = shutil.disk_usage(root).free
    if need > min(args.max_disk_gb * 1e9, free):
        shutil.rmtree(root, ignore_errors=True)
        raise SystemExit(f"model state {need / 1e9:.1f} GB exceeds --max-disk-gb {args.max_disk_gb} or free space")
    result = {"benchmark": "bench_init_memory", "argv": sys.argv[1:], "scratch_dir": str(root),
              "scratch_fs": fstype(root), "load_avg_start": os.getloadavg(), "runs": {}}
    try:
        for rep in range(args.reps):
            for mode in args.modes:
                nvme = root / f"{mode}_{rep}"
                nvme.mkdir()
                out = root / f"{mode}_{rep}.json"
                cmd = [sys.executable, __file__, "--child", mode, "--child-out", str(out), "--nvme-dir", str(nvme),
                       "--cap-mib", str(args.cap_mib), "--d-model", str(args.d_model), "--heads", str(args.heads),
                       "--layers", str(args.layers), "--seq", str(args.seq), "--devices", str(args.devices),
                       "--interval", str(args.interval)]
                t0 = time.perf_counter()
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                if p.returncode != 0:
                    print(p.stdout[-3000:], p.stderr[-3000:], sep="\n")
                    raise SystemExit(f"child {mode} failed with rc {p.returncode}")
                r = json.loads(out.read_text())
                r["wall_s"] = time.perf_counter() - t0
                result["runs"].setdefault(mode, []).append(r)
                print(f"{mode:12s} rep {rep}: params {r['params'] / 1e6:.1f}M, state {r['model_state_bytes_16B_per_param'] / GiB:.2f} GiB "
                      f"({r['state_over_cap']:.1f}x cap), baseline {r['baseline_rss_bytes'] / MiB:.0f} MiB, "
                      f"peak {r['peak_rss_bytes'] / MiB:.0f} MiB, growth {r['growth_bytes'] / MiB:.0f} MiB "
                      f"({r['growth_over_cap']:.2f}x cap), init {r['init_s']:.1f}s", flush=True)
                shutil.rmtree(nvme, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    import statistics

    summary = {}
    for mode, runs in result["runs"].items():
        g = statistics.median(r["growth_bytes"] for r in runs)
        summary[mode] = {"median_growth_bytes": g, "median_growth_mib": g / MiB,
                         "median_peak_rss_mib": statistics.median(r["peak_rss_bytes"] for r in runs) / MiB,
                         "median_baseline_rss_mib": statistics.median(r["baseline_rss_bytes"] for r in runs) / MiB,
                         "growth_over_cap": g / (args.cap_mib * MiB),
                         "model_state_over_cap": runs[0]["state_over_cap"],
                         "under_cap_all_reps": all(r["under_cap"] for r in runs),
                         "median_init_s": statistics.median(r["init_s"] for r in runs)}
    result["summary"] = summary
    result["acceptance"] = {
        "cap_mib": args.cap_mib,
        "model_state_at_least_4x_cap": summary.get("zinf", {}).get("model_state_over_cap", 0) >= 4,
        "zinf_growth_under_cap": summary.get("zinf", {}).get("under_cap_all_reps", False),
    }
    result["load_avg_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({"summary": summary, "acceptance": result["acceptance"]}, indent=1))
    print(f"wrote {args.out}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cap-mib", type=int, default=512, help="cap on RSS growth during init")
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--devices", type=int, default=8, help="JAX_NUM_CPU_DEVICES of the children")
    ap.add_argument("--modes", default="zinf,eager,eager_adamw")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--interval", type=float, default=0.005, help="RSS sampling period (s)")
    ap.add_argument("--max-disk-gb", type=float, default=8.0)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--dir", default=None, help="scratch directory for the nvme tiers (a real disk)")
    ap.add_argument("--out", default=str(REPO / "results" / "bench_init_memory.json"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--nvme-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    if args.child:
        r = child(args)
        Path(args.child_out).write_text(json.dumps(r))
        return 0
    return parent(args)


if __name__ == "__main__":
    raise SystemExit(main())
