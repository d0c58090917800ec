"""Streamed forward/backward against plain ``jax.jit(jax.value_and_grad(loss))``.

Two measurements of the GPT in :mod:`zinf_jax.models` on the 8-device CPU mesh
(``JAX_NUM_CPU_DEVICES=8`` is set before JAX starts):

1. Step time. ``StreamedModel.forward_backward`` with the parameters in each
   param tier (``device``, ``cpu``, ``nvme`` and ``nvme_direct``: the nvme tier
   with ``O_DIRECT`` reads, so the page cache does not serve them) against the
   plain model (``nnx.split``/``merge``, parameters replicated on the mesh, the
   batch sharded over it) under ``jax.jit(jax.value_and_grad(loss))``. Same
   model, same parameter values (the unit-by-unit init is bit-exact with eager
   construction), same batch. After warm-up, reps are interleaved (plain, then
   each tier, per rep); the JSON has every rep, medians, and per tier the ratio
   streamed/plain as the median over reps of the per-rep ratio. Targets:
   device <= 1.5x, nvme <= 2x.
2. Peak device bytes against depth (``--depths``): the engine's own accounting
   (``peak_device_bytes``: parameters in flight, gathered unit, activation
   checkpoints, unit state; cpu param tier) with ``offload_activations`` on and
   off, the largest compiled unit program's temporaries added (the accounting
   leaves them out), and ``jax.live_arrays`` peaks above the baseline; for plain
   JAX the compiled program's ``memory_analysis()`` (temp + argument + output)
   and the bytes of its live arguments and outputs. All figures are summed over
   the 8 devices (per-device analysis x 8). A PNG plot goes to ``--plot``.

Usage::

    python scripts/bench_engine.py [--d-model 256] [--layers 4] [--batch 16] [--seq 64]
        [--reps 7] [--warmup 2] [--tiers device,cpu,nvme,nvme_direct] [--depths 2,4,8,16]
        [--dir DIR] [--out results/bench_engine.json] [--plot results/engine_memory_vs_depth.png]
        [--profile results/bench_engine_profile.txt]   # cProfile of the streamed steps
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import cProfile  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import pstats  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from zinf_jax.engine.nnx_adapter import NnxAdapter  # noqa: E402
from zinf_jax.engine.init import init_unit_by_unit  # noqa: E402
from zinf_jax.engine.programs import UnitPrograms  # noqa: E402
from zinf_jax.engine.store import ParamStore  # noqa: E402
from zinf_jax.engine.streamed import StreamedModel  # noqa: E402
from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss  # noqa: E402
from zinf_jax.plan.partition import local_shard_devices, make_mesh, plan_partition  # noqa: E402
from zinf_jax.tiers import CpuTier, DeviceTier, NvmeTier  # noqa: E402
from zinf_jax.plan.units import UnitPolicy  # noqa: E402

from bench_tiers import fstype, scratch_root  # noqa: E402  (same folder)

REPO = Path(__file__).resolve().parents[1]
MiB = 1 << 20


# --- building -------------------------------------------------------------------------
def _tier(kind: str, mesh, root: Path):
    loc = local_shard_devices(mesh)
    place = lambda i: loc[i][0]  # noqa: E731
    if kind == "device":
        return DeviceTier(placement=place)
    if kind == "cpu":
        return CpuTier(placement=place)
    path = root / kind
    path.mkdir()
    return NvmeTier(path, direct_io=(kind == "nvme_direct"))


def _cfg(args, n_layers: int) -> GPTConfig:
    return GPTConfig(d_model=args.d_model, n_heads=args.heads, n_layers=n_layers, seq=args.seq, dropout=0.0)


def build_streamed(args, cfg: GPTConfig, kind: str, mesh, root: Path, **kw) -> StreamedModel:
    adapter = NnxAdapter(lambda: GPT(cfg, rngs=nnx.Rngs(args.seed)), UnitPolicy(), args.threshold)
    lays = plan_partition(adapter.abstract_params, mesh, args.threshold)
    store = ParamStore(_tier(kind, mesh, root), lays, mesh, "float32")
    init_unit_by_unit(adapter, store)
    return StreamedModel(adapter, store, prefetch_depth=args.prefetch_depth, **kw)


def build_plain(args, cfg: GPTConfig, mesh):
    """The unwrapped model: params replicated on the mesh, jitted value_and_grad."""
    model = GPT(cfg, rngs=nnx.Rngs(args.seed))
    gdef, params, rest = nnx.split(model, nnx.Param, ...)
    rep = NamedSharding(mesh, P())
    params = jax.device_put(params, rep)
    rest = jax.device_put(rest, rep)

    def loss(p, batch):
        return lm_loss(nnx.merge(gdef, p, rest), batch)

    return jax.jit(jax.value_and_grad(loss)), params


def make_batch(args, cfg: GPTConfig, mesh, step: int = 0) -> jax.Array:
    tokens = batch_at(corpus(), step, args.batch, cfg.seq, seed=args.seed)
    return jax.device_put(tokens, NamedSharding(mesh, P("fsdp")))


def _live_device_bytes() -> int:
    return sum(sum(s.data.nbytes for s in a.addressable_shards) for a in jax.live_arrays()
               if a.sharding.memory_kind in (None, "device"))


def _tree_device_bytes(tree) -> int:
    return sum(sum(s.data.nbytes for s in x.addressable_shards) for x in jax.tree.leaves(tree)
               if isinstance(x, jax.Array))


# --- 1. step time -----------------------------------------------------------------------
def bench_time(args, mesh, root: Path) -> dict:
    cfg = _cfg(args, args.layers)
    batch = make_batch(args, cfg, mesh)
    plain, params = build_plain(args, cfg, mesh)
    n_params = sum(int(x.size) for x in jax.tree.leaves(params))
    runners = {}

    def plain_step():
        loss, grads = plain(params, batch)
        jax.block_until_ready((loss, grads))
        return loss

    runners["plain"] = plain_step
    models = {}
    for kind in args.tiers:
        t0 = time.perf_counter()
        sm = build_streamed(args, cfg, kind, mesh, root)
        print(f"  built {kind} in {time.perf_counter() - t0:.1f}s", flush=True)
        glue = sm.store.fetch(sm.adapter.glue_paths)
        models[kind] = sm

        def step(sm=sm, glue=glue):
            loss, _, g = sm.forward_backward(lm_loss, batch, glue, has_aux=False)
            jax.block_until_ready((loss, g))
            return loss

        runners[kind] = step

    losses = {}
    for name, fn in runners.items():  # warm-up: plan, compile, caches
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            losses[name] = float(fn())
        print(f"  warm-up {name}: {time.perf_counter() - t0:.1f}s, loss {losses[name]:.6f}", flush=True)
    times = {name: [] for name in runners}
    for rep in range(args.reps):
        for name, fn in runners.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        print(f"  rep {rep}: " + "  ".join(f"{k} {v[-1] * 1e3:.1f}ms" for k, v in times.items()), flush=True)
    profiles = {}
    for name in (args.tiers if args.profile else []):  # after the timed reps: cProfile slows eager Python
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.profile_reps):
            runners[name]()
        prof.disable()
        profiles[name] = prof

    fetches = {k: sm.prefetcher.fetches for k, sm in models.items()}
    unit_calls = {k: len(sm.plan.calls) for k, sm in models.items()}
    for sm in models.values():
        sm.prefetcher.close()
        sm.store.tier.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = {}
    for kind in args.tiers:
        per_rep = [s / p for s, p in zip(times[kind], times["plain"])]
        ratios[kind] = {"median_of_per_rep_ratios": statistics.median(per_rep),
                        "ratio_of_medians": med[kind] / med["plain"], "per_rep": per_rep}
    out = {
        "model": {"d_model": cfg.d_model, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "seq": cfg.seq,
                  "vocab": cfg.vocab, "batch": args.batch, "params": n_params},
        "times_s": times, "median_s": med, "ratio_streamed_over_plain": ratios,
        "targets": {"device": 1.5, "nvme": 2.0},
        "losses": losses, "max_abs_loss_diff_vs_plain": max(abs(v - losses["plain"]) for v in losses.values()),
        "unit_calls_per_pass": unit_calls, "fetches_total": fetches,
    }
    if profiles:
        s = io.StringIO()
        for name, prof in profiles.items():
            s.write(f"===== tier {name}: {args.profile_reps} streamed steps under cProfile =====\n")
            st = pstats.Stats(prof, stream=s)
            st.sort_stats("cumulative").print_stats(40)
            st.sort_stats("tottime").print_stats(25)
        Path(args.profile).parent.mkdir(parents=True, exist_ok=True)
        Path(args.profile).write_text(s.getvalue())
        out["profile"] = str(args.profile)
    return out


# --- 2. memory vs depth -----------------------------------------------------------------
class _MeasuredPrograms(UnitPrograms):
    """Unit programs that record the compiled temporaries of each program on first use."""

    temp_bytes: dict

    def _wrap(self, kind, key, prog):
        def run(*a):
            tag = (kind, key)
            if tag not in self.temp_bytes:
                sds = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                                   if isinstance(x, jax.Array) and len(x.sharding.device_set) > 1
                                   else jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), a)
                self.temp_bytes[tag] = prog.lower(*sds).compile().memory_analysis().temp_size_in_bytes
            return prog(*a)
        return run

    def forward(self, key, layouts, fn):
        return self._wrap("fwd", key, super().forward(key, layouts, fn))

    def backward(self, key, layouts, fn):
        return self._wrap("bwd", key, super().backward(key, layouts, fn))


def zinf_memory(args, mesh, root: Path, n_layers: int, measure_temps: bool) -> dict:
    """Peaks with ``offload_activations`` on and off, one build (the flag is read per call)."""
    cfg = _cfg(args, n_layers)
    sm = build_streamed(args, cfg, args.mem_tier, mesh, root, track_live_arrays=True)
    if measure_temps:
        progs = _MeasuredPrograms(sm.mesh, sm.store.compute_dtype)
        progs.temp_bytes = {}
        sm.programs = progs
    glue = sm.store.fetch(sm.adapter.glue_paths)
    batch = make_batch(args, cfg, mesh)
    model_bytes = sum(u.nbytes for u in sm.units) + sum(
        int(np.prod(sm.store.layouts[p].shape)) * 4 for p in sm.adapter.glue_paths)
    out = {}
    for offload, name in ((True, "offload_activations"), (False, "keep_activations")):
        sm.offload_activations = offload
        sm.forward_backward(lm_loss, batch, glue, has_aux=False)
        baseline = _live_device_bytes()
        sm.reset_peaks()
        sm.forward_backward(lm_loss, batch, glue, has_aux=False)
        out[name] = {"peak_device_bytes": sm.peak_device_bytes,
                     "peak_live_array_bytes_above_baseline": sm.peak_live_array_bytes - baseline,
                     "baseline_live_bytes": baseline, "model_param_bytes": model_bytes}
    if measure_temps:
        n_dev = len(mesh.devices.flat)
        out["unit_program_temp_bytes"] = {f"{k[0]}:{i}": v * n_dev for i, (k, v) in enumerate(progs.temp_bytes.items())}
    sm.prefetcher.close()
    sm.store.tier.close()
    return out


def plain_memory(args, mesh, n_layers: int) -> dict:
    cfg = _cfg(args, n_layers)
    step, params = build_plain(args, cfg, mesh)
    batch = make_batch(args, cfg, mesh)
    ma = step.lower(params, batch).compile().memory_analysis()
    n_dev = len(mesh.devices.flat)
    loss, grads = step(params, batch)
    jax.block_until_ready(grads)
    per_dev = ma.temp_size_in_bytes + ma.argument_size_in_bytes + ma.output_size_in_bytes
    return {
        "compiled_temp_bytes": ma.temp_size_in_bytes * n_dev,
        "compiled_argument_bytes": ma.argument_size_in_bytes * n_dev,
        "compiled_output_bytes": ma.output_size_in_bytes * n_dev,
        "compiled_alias_bytes": ma.alias_size_in_bytes * n_dev,
        "compiled_total_bytes": per_dev * n_dev,
        "live_args_and_outputs_bytes": _tree_device_bytes((params, batch, loss, grads)),
    }


def bench_memory(args, mesh, root: Path) -> dict:
    res = {"depths": args.depths, "param_tier": args.mem_tier, "zinf": {"offload_activations": {}, "keep_activations": {}},
           "plain": {}}
    temps = {}
    for n in args.depths:
        r = zinf_memory(args, mesh, root, n, measure_temps=(n == args.depths[0]))
        temps.update(r.pop("unit_program_temp_bytes", {}))
        for name, v in r.items():
            res["zinf"][name][n] = v
        res["plain"][n] = plain_memory(args, mesh, n)
        z = res["zinf"]
        print(f"  depth {n}: zinf offload {z['offload_activations'][n]['peak_device_bytes'] / MiB:.1f} MiB, "
              f"keep {z['keep_activations'][n]['peak_device_bytes'] / MiB:.1f} MiB, "
              f"plain compiled {res['plain'][n]['compiled_total_bytes'] / MiB:.1f} MiB", flush=True)
    res["zinf_unit_program_temp_bytes"] = temps  # the same programs serve both settings
    t = max(temps.values())
    for name in ("offload_activations", "keep_activations"):
        for n in args.depths:
            r = res["zinf"][name][n]
            r["peak_device_bytes_with_program_temps"] = r["peak_device_bytes"] + t
    return res


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = res["depths"]
    z, p = res["zinf"], res["plain"]
    fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
    series = [
        ("plain JAX: compiled temp+args+outputs", [p[n]["compiled_total_bytes"] for n in d], "o-", "C3"),
        ("plain JAX: live args+outputs", [p[n]["live_args_and_outputs_bytes"] for n in d], "o--", "C1"),
        ("zinf, activations kept on device (+unit temps)",
         [z["keep_activations"][n]["peak_device_bytes_with_program_temps"] for n in d], "s-", "C0"),
        ("zinf, activations offloaded (+unit temps)",
         [z["offload_activations"][n]["peak_device_bytes_with_program_temps"] for n in d], "^-", "C2"),
        ("zinf, activations offloaded (engine accounting)",
         [z["offload_activations"][n]["peak_device_bytes"] for n in d], "^:", "C2"),
        ("zinf, activations kept on device (engine accounting)",
         [z["keep_activations"][n]["peak_device_bytes"] for n in d], "s:", "C0"),
    ]
    for label, ys, style, color in series:
        ax.plot(d, [y / MiB for y in ys], style, color=color, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(d)
    ax.set_xticklabels([str(n) for n in d])
    ax.set_xlabel("transformer layers")
    ax.set_ylabel("peak device bytes, all 8 devices (MiB)")
    m = res["model"]
    ax.set_title(f"Peak device memory vs depth: GPT d_model={m['d_model']}, batch {m['batch']} x seq {m['seq']}, "
                 f"8 CPU devices", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threshold", type=int, default=100_000, help="persistence threshold (elements)")
    ap.add_argument("--prefetch-depth", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tiers", default="device,cpu,nvme,nvme_direct")
    ap.add_argument("--depths", default="2,4,8,16", help="layer counts for the memory sweep ('' to skip)")
    ap.add_argument("--mem-tier", default="cpu", help="param tier of the memory sweep")
    ap.add_argument("--dir", default=None, help="scratch directory for the nvme tiers (a real disk)")
    ap.add_argument("--out", default=str(REPO / "results" / "bench_engine.json"))
    ap.add_argument("--plot", default=str(REPO / "results" / "engine_memory_vs_depth.png"))
    ap.add_argument("--profile", default=None, help="write a cProfile report of the streamed steps here")
    ap.add_argument("--profile-reps", type=int, default=3)
    ap.add_argument("--skip-time", action="store_true")
    args = ap.parse_args(argv)
    args.tiers = [t for t in args.tiers.split(",") if t]
    args.depths = [int(x) for x in args.depths.split(",") if x]

    mesh = make_mesh()
    root = scratch_root(args.dir, "zinf_bench_engine_")
    t_start = time.perf_counter()
    result = {
        "benchmark": "bench_engine", "jax": jax.__version__, "devices": len(jax.devices()),
        "platform": platform.platform(), "cpus": os.cpu_count(), "load_avg_start": os.getloadavg(),
        "scratch_dir": str(root), "scratch_fs": fstype(root), "prefetch_depth": args.prefetch_depth,
        "threshold": args.threshold, "argv": sys.argv[1:],
    }
    try:
        if not args.skip_time:
            print(f"step time: tiers {args.tiers}, {args.reps} reps", flush=True)
            result["time"] = bench_time(args, mesh, root)
            for k, r in result["time"]["ratio_streamed_over_plain"].items():
                print(f"  {k}: median {result['time']['median_s'][k] * 1e3:.1f} ms vs plain "
                      f"{result['time']['median_s']['plain'] * 1e3:.1f} ms -> {r['median_of_per_rep_ratios']:.2f}x")
        if args.depths:
            print(f"memory vs depth {args.depths}", flush=True)
            result["memory"] = bench_memory(args, mesh, root)
            result["memory"]["model"] = {"d_model": args.d_model, "batch": args.batch, "seq": args.seq}
            plot(result["memory"], Path(args.plot))
            result["plot"] = str(args.plot)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["wall_s"] = time.perf_counter() - t_start
    result["load_avg_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {args.out} ({result['wall_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
