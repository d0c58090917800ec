"""Optimizers other than zinf's Adam: their host time, their in-program step, their bytes on disk.

Three measurements, each a ratio taken in one run (reps interleaved, medians):

* ``host``: the bundled GPT (``--d-model`` x ``--layers``) on the 8-device CPU mesh, compiled engine, params
  in device memory, optimizer state on the host (``offload_optimizer="cpu"``, the streamed CPU update). The
  optimizer's own time per step (``time_split["optimizer_total_s"]``) of ``optax.adamw`` (element-wise,
  chunk by chunk) and of ``optax.lamb`` (whole tensor by tensor) against ``zinf.adamw`` (the fused kernel)
  and against each other.
* ``program``: the whole step with params and an ``optax.adamw`` state in device memory (the update inside
  the step's program) against plain ``jax.jit(value_and_grad)`` + the same ``optax.adamw`` on the unwrapped
  model (params replicated, batch sharded over the mesh; ``bench_step.py``'s reference); and, beside it,
  the same step with the state on cpu and on nvme moved to the devices for the update
  (``optimizer_update="device"``).
* ``disk``: a GPT of at least ``--disk-params`` parameters with params and optimizer on an nvme tier under
  ``--dir``, one step each of ``optax.adafactor`` and ``optax.adamw``: the bytes the optimizer and gradient
  tiers hold on disk per trained parameter (float32 master, scratch gradient, and the transform's state:
  Adafactor's factored moments keep their own small shapes).

Usage::

    python scripts/bench_optimizers.py [--parts host,program,disk] [--d-model 512] [--layers 4]
        [--reps 5] [--steps-per-rep 3] [--disk-params 100e6] [--dir DIR] [--out results/bench_optimizers.json]
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import LR, WD, _commit, build_plain  # noqa: E402  (same folder: the plain jit reference)

import zinf_jax as zinf  # noqa: E402
from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _engine(cfg: GPTConfig, mesh, tx, *, param: str = "none", opt: str = "cpu", update: str = "host",
            path: Path | None = None, threshold: int = 100_000) -> zinf.Engine:
    off = lambda d: zinf.Offload(d, path=str(path)) if d == "nvme" else zinf.Offload(d)  # noqa: E731
    config = zinf.ZeroConfig(offload_param=off(param), offload_optimizer=off(opt), optimizer_update=update,
                             persistence_threshold=threshold)
    return zinf.initialize(lambda: GPT(cfg, rngs=nnx.Rngs(0)), config=config, mesh=mesh, optimizer=tx,
                           loss_fn=lm_loss)


def _batches(cfg: GPTConfig, batch: int, start: int, n: int) -> list:
    data = corpus()
    return [batch_at(data, s, batch, cfg.seq) for s in range(start, start + n)]


def host_part(cfg: GPTConfig, mesh, args) -> dict:
    """The optimizer's own time per step on the host, per transform, interleaved reps."""
    txs = {"zinf.adamw": zinf.adamw(LR, weight_decay=WD), "optax.adamw": optax.adamw(LR, weight_decay=WD),
           "optax.lamb": optax.lamb(LR, weight_decay=WD)}
    engines = {k: _engine(cfg, mesh, tx) for k, tx in txs.items()}
    for k, e in engines.items():  # warm-up: compile, first buffers
        for b in _batches(cfg, args.batch, 0, 2):
            e.train_step(b)
    reps: dict[str, list[float]] = {k: [] for k in engines}
    for r in range(args.reps):
        for k, e in engines.items():
            ts = [e.train_step(b)["time_split"]["optimizer_total_s"]
                  for b in _batches(cfg, args.batch, 2 + r * args.steps_per_rep, args.steps_per_rep)]
            reps[k].append(statistics.median(ts))
    for e in engines.values():
        e.close()
    med = {k: statistics.median(v) for k, v in reps.items()}
    ratio = lambda a, b: statistics.median(x / y for x, y in zip(reps[a], reps[b]))  # noqa: E731
    return {"optimizer_s_per_rep": reps, "median_s": med,
            "optax_adamw_vs_zinf_adamw": ratio("optax.adamw", "zinf.adamw"),
            "lamb_vs_optax_adamw": ratio("optax.lamb", "optax.adamw"),
            "lamb_vs_zinf_adamw": ratio("optax.lamb", "zinf.adamw")}


def program_part(cfg: GPTConfig, mesh, args, root: Path) -> dict:
    """The whole step, optax.adamw in the program, against plain jit + optax.adamw."""
    tx = lambda: optax.adamw(LR, weight_decay=WD)  # noqa: E731
    (root / "dev_nvme").mkdir()
    runners = {"plain": build_plain(cfg, mesh, 0)}
    engines = {"none/none": _engine(cfg, mesh, tx(), opt="none"),
               "none/cpu, device update": _engine(cfg, mesh, tx(), opt="cpu", update="device"),
               "none/nvme, device update": _engine(cfg, mesh, tx(), opt="nvme", update="device",
                                                   path=root / "dev_nvme")}
    for k, e in engines.items():
        runners[k] = lambda bs, e=e: [e.train_step(b)["loss"] for b in bs]
    for run in runners.values():
        run(_batches(cfg, args.batch, 0, 2))
    reps: dict[str, list[float]] = {k: [] for k in runners}
    losses: dict[str, list[float]] = {k: [] for k in runners}
    for r in range(args.reps):
        bs = _batches(cfg, args.batch, 2 + r * args.steps_per_rep, args.steps_per_rep)
        for k, run in runners.items():
            t = time.perf_counter()
            losses[k] += run(bs)
            reps[k].append((time.perf_counter() - t) / len(bs))
    for e in engines.values():
        e.close()
    ratio = {k: statistics.median(x / y for x, y in zip(reps[k], reps["plain"])) for k in engines}
    # every runner starts from the same values and sees the same batches: the same losses, up to rounding
    drift = {k: max(abs(a - b) / abs(b) for a, b in zip(losses[k], losses["plain"])) for k in engines}
    return {"step_s_per_rep": reps, "median_s": {k: statistics.median(v) for k, v in reps.items()},
            "ratio_to_plain": ratio, "max_loss_rel_diff_to_plain": drift}


def _disk_bytes(folder: Path) -> tuple[int, int]:
    """Bytes of the files under ``folder``: (their sizes, the blocks allocated for them)."""
    size = blocks = 0
    for f in folder.rglob("*"):
        if f.is_file():
            st = f.stat()
            size, blocks = size + st.st_size, blocks + st.st_blocks * 512
    return size, blocks


def disk_part(args, root: Path) -> dict:
    """Optimizer and gradient tier bytes on nvme per trained parameter, adafactor against adamw."""
    cfg = GPTConfig(vocab=32_000, d_model=1024, n_heads=16, n_layers=1, seq=16)
    per_layer = 12 * cfg.d_model ** 2
    cfg = GPTConfig(vocab=32_000, d_model=1024, n_heads=16, seq=16,
                    n_layers=max(1, -(-int(args.disk_params - cfg.vocab * cfg.d_model) // per_layer)))
    out = {"model": {"d_model": cfg.d_model, "n_layers": cfg.n_layers, "vocab": cfg.vocab}}
    for name, tx in [("optax.adafactor", optax.adafactor(1e-2)), ("optax.adamw", optax.adamw(LR, weight_decay=WD))]:
        path = root / name.replace(".", "_")
        path.mkdir()
        t = time.perf_counter()
        e = _engine(cfg, zinf.make_mesh(), tx, param="nvme", opt="nvme", path=path)
        params = sum(math.prod(lay.shape) for p, lay in e.layouts.items() if p in e.trainable)
        m = e.train_step(_batches(cfg, 8, 0, 1)[0])
        e.close()
        tiers = {d.name: _disk_bytes(d) for d in path.iterdir() if d.is_dir()}
        opt = sum(v[0] for k, v in tiers.items() if k in ("optimizer", "grads"))
        out[name] = {"trained_params": params, "tier_bytes": tiers, "loss": m["loss"],
                     "optimizer_and_grad_bytes_per_param": opt / params, "seconds": time.perf_counter() - t}
        shutil.rmtree(path)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="host,program,disk")
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps-per-rep", type=int, default=3)
    ap.add_argument("--disk-params", type=float, default=100e6)
    ap.add_argument("--dir", default=None, help="folder for the nvme tiers (default: a temporary one under /tmp)")
    ap.add_argument("--out", default=str(REPO / "results" / "bench_optimizers.json"))
    args = ap.parse_args()
    cfg = GPTConfig(vocab=256, d_model=args.d_model, n_heads=max(1, args.d_model // 64), n_layers=args.layers,
                    seq=args.seq)
    mesh = zinf.make_mesh()
    root = Path(tempfile.mkdtemp(prefix="bench_optimizers_", dir=args.dir))
    res = {"what": __doc__.split("\n\n")[0], "commit": _commit(), "date": time.strftime("%Y-%m-%d"),
           "machine": f"{platform.machine()}, {os.cpu_count()} cpus", "jax": jax.__version__, "optax": optax.__version__,
           "args": vars(args), "n_devices": jax.device_count()}
    try:
        parts = args.parts.split(",")
        if "host" in parts:
            res["host"] = host_part(cfg, mesh, args)
            print(json.dumps({k: v for k, v in res["host"].items() if k != "optimizer_s_per_rep"}, indent=1))
        if "program" in parts:
            res["program"] = program_part(cfg, mesh, args, root)
            print(json.dumps({"ratio_to_plain": res["program"]["ratio_to_plain"]}, indent=1))
        if "disk" in parts:
            res["disk"] = disk_part(args, root)
            print(json.dumps({k: v.get("optimizer_and_grad_bytes_per_param", v) for k, v in res["disk"].items()},
                             indent=1))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
