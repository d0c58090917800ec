"""The whole training step against plain ``jax.jit`` + ``optax.adamw``, per tier.

``engine.train_step`` (streamed forward/backward, streamed CPU AdamW, tier
commit) of the bundled GPT on the 8-device CPU mesh against one jitted plain
step on the same mesh: ``jax.value_and_grad`` of the unwrapped model (params
replicated, batch sharded over the mesh) followed by ``optax.adamw`` with the
same hyper-parameters, the batch placed on the mesh inside the timed region on
both sides. Same model, same initial values, same batches.

Tiers: ``device`` (params and optimizer state in device memory), ``cpu`` (host
RAM) and ``nvme`` (both on the nvme tier under ``--dir``, in place, the
default), all three with the streamed engine; or ``ENGINE:PARAM/OPT`` for any
engine and tier pair (``compiled:none/cpu``: the compiled engine, params in
device memory, the optimizer on the host); each twice: ``engine.train_step`` in a loop, and
``engine.train_steps`` (``+overlap``: the optimizer overlapped with the next
step's forward). A rep is ``--steps-per-rep`` consecutive steps of each runner
in turn (plain first); the per-step time is the rep's time over its steps.
After warm-up reps, the JSON holds every rep, medians, and per runner the
median over reps of the per-rep ratio zinf/plain.

Usage::

    python scripts/bench_step.py [--d-model 128] [--layers 4] [--batch 16] [--seq 64]
        [--reps 7] [--warmup 2] [--steps-per-rep 5] [--tiers device,cpu,nvme] [--no-overlap]
        [--keep-activations] [--threshold 100000] [--compute-dtype bfloat16] [--dir DIR]
        [--out results/bench_step_d128_L4.json]

``--compute-dtype bfloat16`` runs the engines in bfloat16 (plain jit stays float32: the times then
compare unlike steps); the host copies are counted in passes over the parameters' bfloat16 bytes.

The README's "before" figures ran this script against the older code with
``PYTHONPATH=<a worktree of that commit>`` and ``--no-overlap`` (the JSON
records which ``zinf_jax`` it timed).
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import zinf_jax as zinf  # noqa: E402
from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
LR, WD = 1e-3, 0.1
TIERS = {"device": "none", "cpu": "cpu", "nvme": "nvme"}


def build_plain(cfg: GPTConfig, mesh, seed: int):
    """One jitted step: value_and_grad of the unwrapped model, then optax.adamw."""
    model = GPT(cfg, rngs=nnx.Rngs(seed))
    gdef, params, rest = nnx.split(model, nnx.Param, ...)
    rep = NamedSharding(mesh, P())
    params, rest = jax.device_put((params, rest), rep)
    # zinf.adamw's default mask: matrices decayed, vectors (biases, norm scales) not; so the losses compare
    tx = optax.adamw(LR, weight_decay=WD, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))
    opt = jax.device_put(tx.init(params), rep)

    @jax.jit
    def step(params, opt, batch):
        loss, grads = jax.value_and_grad(lambda p: lm_loss(nnx.merge(gdef, p, rest), batch))(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    state = {"params": params, "opt": opt}
    data_sharding = NamedSharding(mesh, P("fsdp"))

    def run(batches: list[np.ndarray]) -> list[float]:
        losses = []
        for batch in batches:  # dispatched asynchronously, read at the end: plain JAX at its best
            b = jax.device_put(batch, data_sharding)
            state["params"], state["opt"], loss = step(state["params"], state["opt"], b)
            losses.append(loss)
        return [float(x) for x in losses]

    return run


def build_zinf(cfg: GPTConfig, mesh, tier: str, root: Path, seed: int, checkpointing: bool = True,
               threshold: int = 100_000, compute_dtype: str | None = None):
    """``tier``: ``device``/``cpu``/``nvme`` (both tiers there, streamed), or ``ENGINE:PARAM/OPT`` (e.g.
    ``compiled:none/cpu``, ``streamed:cpu/cpu``; tiers none/cpu/nvme)."""
    engine = None
    if ":" in tier:
        engine, pair = tier.split(":")
        param, opt = pair.split("/")
    else:
        param = opt = TIERS[tier]
        engine = "streamed"
    path = None
    if "nvme" in (param, opt):
        path = root / tier.replace("/", "_").replace(":", "_")
        path.mkdir(parents=True)
    kw = {} if checkpointing else {"activation_checkpointing": False}  # (the default; older versions lack it)
    if compute_dtype is not None:
        kw["compute_dtype"] = compute_dtype
    if "engine" in {f.name for f in dataclasses.fields(zinf.ZeroConfig)}:  # older versions: streamed only
        kw["engine"] = engine
    config = zinf.ZeroConfig(offload_param=zinf.Offload(param, path=path if param == "nvme" else None),
                             offload_optimizer=zinf.Offload(opt, path=path if opt == "nvme" else None),
                             persistence_threshold=threshold, **kw)
    engine = zinf.initialize(lambda: GPT(cfg, rngs=nnx.Rngs(seed)), config=config, mesh=mesh,
                             optimizer=zinf.adamw(LR, weight_decay=WD), loss_fn=lm_loss)
    return engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--tiers", default="device,cpu,nvme",
                    help="runners: device|cpu|nvme (streamed, both tiers there) or ENGINE:PARAM/OPT, "
                         "e.g. compiled:none/cpu,compiled:cpu/cpu,streamed:none/cpu")
    ap.add_argument("--steps-per-rep", type=int, default=5, help="consecutive steps timed as one rep")
    ap.add_argument("--no-overlap", action="store_true", help="skip engine.train_steps (optimizer overlapped)")
    ap.add_argument("--keep-activations", action="store_true",
                    help="ZeroConfig(activation_checkpointing=False): no recompute in the backward")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compute-dtype", default=None, choices=["float32", "bfloat16"],
                    help="the engines' compute dtype (default: the engine's, float32 on CPU); plain jit stays float32")
    ap.add_argument("--threshold", type=int, default=100_000,
                    help="persistence_threshold (1024: the main job's, every block parameter sharded)")
    ap.add_argument("--dir", type=Path, default=None, help="scratch dir for the nvme tier (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    tiers = [t for t in args.tiers.split(",") if t]
    out_path = args.out or REPO / "results" / f"bench_step_d{args.d_model}_L{args.layers}.json"
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)  # a scratch dir named on the command line may not exist yet
    root = Path(tempfile.mkdtemp(prefix="zinf-bench-step-", dir=args.dir))
    cfg = GPTConfig(d_model=args.d_model, n_heads=args.heads, n_layers=args.layers, seq=args.seq, dropout=0.0)
    mesh = zinf.make_mesh()
    data = corpus()
    runners = {"plain": build_plain(cfg, mesh, args.seed)}
    engines = {}
    n = args.steps_per_rep
    batches = [batch_at(data, i, args.batch, args.seq, seed=args.seed) for i in range((args.warmup + args.reps) * n)]
    try:
        for t in tiers:
            ck = not args.keep_activations
            engines[t] = e = build_zinf(cfg, mesh, t, root, args.seed, ck, args.threshold, args.compute_dtype)
            runners[t] = lambda bs, e=e: [e.train_step(b)["loss"] for b in bs]
            if not args.no_overlap and hasattr(e, "train_steps"):
                engines[t + "+overlap"] = e = build_zinf(cfg, mesh, t, root / "overlap", args.seed, ck, args.threshold,
                                                         args.compute_dtype)
                runners[t + "+overlap"] = lambda bs, e=e: [m["loss"] for m in e.train_steps(bs)]
        copies0 = {k: _host_copies(e) for k, e in engines.items()}
        losses: dict[str, list[float]] = {k: [] for k in runners}
        times: dict[str, list[float]] = {k: [] for k in runners}
        for r in range(args.warmup + args.reps):
            chunk = batches[r * n:(r + 1) * n]
            for name, run in runners.items():
                t0 = time.perf_counter()
                losses[name] += run(chunk)
                dt = (time.perf_counter() - t0) / n
                if r >= args.warmup:
                    times[name].append(dt)
            if r >= args.warmup:
                print(f"rep {r - args.warmup}: " + "  ".join(f"{k} {v[-1] * 1e3:.1f}ms" for k, v in times.items()),
                      flush=True)
        steps = (args.warmup + args.reps) * n
        copies = {k: (_host_copies(e) - copies0[k]) / steps for k, e in engines.items()}
    finally:
        for e in engines.values():
            e.close()
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = {k: statistics.median([z / p for z, p in zip(times[k], times["plain"])]) for k in times if k != "plain"}
    itemsize = 2 if args.compute_dtype == "bfloat16" else 4
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(
        nnx.state(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))), nnx.Param)))
    res = {
        "what": "engine.train_step vs jit(value_and_grad)+optax.adamw, same mesh, interleaved reps",
        "model": {"d_model": cfg.d_model, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads, "seq": cfg.seq,
                  "vocab": cfg.vocab, "batch": args.batch, "params": n_params},
        "activation_checkpointing": not args.keep_activations, "persistence_threshold": args.threshold,
        "devices": len(jax.devices()), "jax": jax.__version__, "python": platform.python_version(),
        "commit": _commit(), "zinf_jax": str(Path(zinf.__file__).parent),
        "times_s": times, "median_s": med, "ratio_median_of_per_rep": ratios,
        "tokens_per_s_median": {k: args.batch * args.seq / v for k, v in med.items()},
        "compute_dtype": args.compute_dtype or "float32",
        "param_bytes": n_params * itemsize,  # in the compute dtype
        "host_param_bytes_copied_per_step": copies,
        "host_param_passes_per_step": {k: v / (n_params * itemsize) for k, v in copies.items()},
        "max_abs_loss_diff_vs_plain": {k: max(abs(a - b) for a, b in zip(v, losses["plain"]))
                                       for k, v in losses.items() if k != "plain"},
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(res, indent=1))
    print(json.dumps({"median_s": med, "ratio": ratios, "host_param_passes_per_step": res["host_param_passes_per_step"]},
                     indent=1))
    print(f"wrote {out_path}")


def _host_copies(engine) -> int:
    """Bytes copied on the host so far for the parameters: the param tier's puts (the optimizer's new values)
    and the compiled engine's restacking of scanned runs' host shards (0 where a version lacks the counters)."""
    tier = getattr(engine.store, "tier", None)
    args = getattr(engine.passes, "args", None)
    return getattr(tier, "copied_bytes", 0) + getattr(args, "host_copy_bytes", 0)


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()
