"""The engines on whatever accelerator JAX sees, against plain jit: one command, one folder of JSON.

Run from a fresh copy of the tree (nothing to install where JAX, Flax, optax, orbax and tensorstore
are; the script puts the tree on the path itself)::

    python3 scripts/bench_device.py                 # results in $OUT, else ./bench_device_out
    python3 scripts/bench_device.py --small         # a CPU smoke run of the same code (about a minute)

Each runner runs in its own process under a timeout (``--runner-timeout``), and writes its JSON
(``<runner>.json``) at the top of the output folder as it finishes; ``summary.json`` is rewritten
after every runner, so a runner that aborts or hangs loses only itself. The runners:

* ``transfers``: the copies the engine really makes, against the link's peak (``--link-gbps``): a
  ``pinned_host`` array moved to device memory and back inside a jitted program (the compiled
  engine's staging), and a numpy array put into ``pinned_host`` (the cpu tier's write);
* ``plain``: ``jit(value_and_grad)`` + ``optax.adamw`` with fp32 params on the device, computed in
  ``--dtype`` (what a JAX user writes when the model fits);
* ``compiled``: zinf, params and optimizer on the host (``offload_param="cpu"``), one XLA program a
  step; its profiler trace is ``trace_compiled.json.gz`` (Perfetto) at the top of the folder;
* ``compiled_device``: zinf, params in device memory, optimizer on the host: with ``compiled``, the
  program-only time with and without parameter offload (``time_split.forward_backward_s``);
* ``streamed``: the same tiers as ``compiled`` with ``ZeroConfig(engine="streamed")``.

Every runner trains the bundled GPT from the same initial values on the same batches; each zinf
runner's per-step losses are checked against ``plain``'s (rtol 1e-5 in float32, 2e-2 in bfloat16).
The summary holds the ratios to plain (median step time), the offload ratio, the link fractions, the
loss checks, the versions and the XLA flags in effect.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNNERS = ("transfers", "plain", "compiled", "compiled_device", "streamed")
LR, WD = 1e-4, 0.1
RTOL = {"float32": 1e-5, "bfloat16": 2e-2}


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-model", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=7, help="steps per runner; the first --warmup are not timed")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--dtype", default=None, help="compute dtype (default: bfloat16, float32 with --small)")
    ap.add_argument("--link-gbps", type=float, default=64.0, help="the link's peak a direction (GB/s)")
    ap.add_argument("--runners", default=",".join(RUNNERS))
    ap.add_argument("--runner-timeout", type=float, default=150.0, help="seconds each runner may take")
    ap.add_argument("--small", action="store_true", help="d_model 64 x 2, batch 8 x 32, float32: a smoke run")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default: $OUT, else ./bench_device_out)")
    ap.add_argument("--runner", default=None, help=argparse.SUPPRESS)  # one runner, in this process
    ap.add_argument("--small-sized", action="store_true", help=argparse.SUPPRESS)  # --small's runner: sizes given
    args = ap.parse_args(argv)
    if args.small and not args.small_sized:
        args.d_model, args.layers, args.heads, args.batch, args.seq = 64, 2, 4, 8, 32
        args.steps, args.warmup = 4, 1
    args.small = args.small or args.small_sized
    args.dtype = args.dtype or ("float32" if args.small else "bfloat16")
    args.out = args.out or Path(os.environ.get("OUT") or "bench_device_out")
    return args


# --- one runner, in its own process ------------------------------------------------------------
def _transfers(args: argparse.Namespace) -> dict:
    import jax
    import numpy as np

    dev = jax.devices()[0]
    nbytes = (1 << 30) if not args.small else (1 << 24)
    pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    on_dev = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    host = np.ones(nbytes // 4, np.float32)
    x = jax.device_put(host, pinned).block_until_ready()
    to_dev = jax.jit(lambda a: jax.device_put(a, on_dev), out_shardings=on_dev)
    to_host = jax.jit(lambda a: jax.device_put(a, pinned), out_shardings=pinned)
    y = to_dev(x).block_until_ready()
    to_host(y).block_until_ready()
    out: dict = {}
    for name, fn, arg in (("pinned_to_device_in_program", to_dev, x), ("device_to_pinned_in_program", to_host, y),
                          ("numpy_to_pinned_put", lambda a: jax.device_put(a, pinned), host)):
        best = min(_timed(lambda: fn(arg).block_until_ready()) for _ in range(3))
        out[name + "_gbps"] = nbytes / best / 1e9
    out["bytes"] = nbytes
    out["fraction_of_peak"] = {k: v / args.link_gbps for k, v in out.items() if k.endswith("_gbps")}
    return out


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _model(args: argparse.Namespace):
    from zinf_jax.models import GPTConfig

    return GPTConfig(d_model=args.d_model, n_heads=args.heads, n_layers=args.layers, seq=args.seq, dropout=0.0)


def _batches(args: argparse.Namespace) -> list:
    from zinf_jax.models import batch_at, corpus

    data = corpus()
    return [batch_at(data, i, args.batch, args.seq) for i in range(args.steps)]


def _plain(args: argparse.Namespace) -> dict:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from zinf_jax.models import GPT, lm_loss

    gdef, params, rest = nnx.split(GPT(_model(args), rngs=nnx.Rngs(0)), nnx.Param, ...)
    tx = optax.adamw(LR, weight_decay=WD)
    state = {"p": params, "o": tx.init(params)}

    @jax.jit
    def step(p, o, batch):
        def loss(p):
            low = jax.tree.map(lambda x: x.astype(args.dtype), p)
            return lm_loss(nnx.merge(gdef, low, rest), batch)

        value, g = jax.value_and_grad(loss)(p)
        upd, o = tx.update(g, o, p)
        return optax.apply_updates(p, upd), o, value

    times, losses = [], []
    for b in _batches(args):
        t0 = time.perf_counter()
        state["p"], state["o"], value = step(state["p"], state["o"], jnp.asarray(b))
        losses.append(float(value))
        times.append(time.perf_counter() - t0)
    return {"step_s": times, "losses": losses}


def _zinf(args: argparse.Namespace, param: str, engine: str, trace: Path | None) -> dict:
    import jax
    from flax import nnx

    import zinf_jax as zinf
    from zinf_jax.models import GPT, lm_loss

    config = zinf.ZeroConfig(offload_param=zinf.Offload(param), offload_optimizer=zinf.Offload("cpu"),
                             compute_dtype=args.dtype, engine=engine, persistence_threshold=100_000)
    eng = zinf.initialize(lambda: GPT(_model(args), rngs=nnx.Rngs(0)), config=config, loss_fn=lm_loss,
                          optimizer=zinf.adamw(LR, weight_decay=WD))
    out: dict = {"mode": eng.mode, "step_s": [], "losses": [], "forward_backward_s": []}
    try:
        batches = _batches(args)
        if eng.mode == "compiled":
            from zinf_jax.xla import hlo

            compiled = eng.lower(batches[0]).compile()
            mem = compiled.memory_analysis()
            out["memory_analysis"] = None if mem is None else {
                k: int(getattr(mem, k)) for k in ("temp_size_in_bytes", "argument_size_in_bytes",
                                                  "output_size_in_bytes", "host_argument_size_in_bytes")
                if hasattr(mem, k)}
            # what the program moves between host and device memory per device per step, and how much of a loop's
            # moves overlap compute (from the compiled schedule), beside the fewest bytes it needs to move
            budget = eng.transfer_budget(batches[0])
            program = hlo.summary(hlo.parse(compiled.as_text()))
            out["program_transfers"] = {k: program[k] for k in ("h2d_bytes", "d2h_bytes", "in_loop_h2d_bytes",
                                                                "in_loop_h2d_overlapped", "reduction_dtypes")}
            out["program_transfers"]["budget_h2d_bytes"] = budget.h2d_bytes
            out["program_transfers"]["budget_d2h_bytes"] = budget.d2h_bytes
            out["compiler_options"] = eng.passes.compiler_options(jax.devices()[0].platform)
        for k, b in enumerate(batches):
            traced = trace is not None and k == args.warmup
            tmp = Path(tempfile.mkdtemp(prefix="zinf-trace-")) if traced else None
            if traced:
                jax.profiler.start_trace(str(tmp), create_perfetto_trace=True)
            m = eng.train_step(b)
            if traced:
                jax.profiler.stop_trace()
                found = sorted(tmp.rglob("*.json.gz"))
                if found:
                    shutil.copyfile(found[0], trace)
                    out["trace"] = trace.name
                shutil.rmtree(tmp, ignore_errors=True)
            out["step_s"].append(m["step_time_s"])
            out["losses"].append(float(m["loss"]))
            out["forward_backward_s"].append(m["time_split"]["forward_backward_s"])
        stats = jax.devices()[0].memory_stats()
        out["peak_device_bytes"] = None if not stats else int(stats.get("peak_bytes_in_use", 0))
    finally:
        eng.close()
    return out


def run_one(args: argparse.Namespace) -> None:
    """Runs ``args.runner`` here and writes ``<runner>.json`` into the output folder."""
    sys.path.insert(0, str(REPO))
    import jax

    name = args.runner
    t0 = time.perf_counter()
    if name == "transfers":
        res = _transfers(args)
    elif name == "plain":
        res = _plain(args)
    elif name in ("compiled", "compiled_device", "streamed"):
        param = "none" if name == "compiled_device" else "cpu"
        trace = args.out / "trace_compiled.json.gz" if name == "compiled" else None
        res = _zinf(args, param, "streamed" if name == "streamed" else "compiled", trace)
    else:
        raise SystemExit(f"unknown runner {name!r}; runners: {', '.join(RUNNERS)}")
    res.update(runner=name, wall_s=time.perf_counter() - t0, platform=jax.devices()[0].platform,
               device=str(jax.devices()[0].device_kind), devices=jax.device_count())
    (args.out / f"{name}.json").write_text(json.dumps(res, indent=1))


# --- the driver -------------------------------------------------------------------------------
def _versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "tensorstore", "numpy"):
        try:
            from importlib.metadata import version

            out[pkg] = version(pkg)
        except Exception:  # noqa: BLE001 - a package missing is recorded as missing
            out[pkg] = None
    return out


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def summarize(args: argparse.Namespace, status: dict) -> dict:
    """The summary of the runners' JSON files written so far."""
    got = {}
    for name in status:
        path = args.out / f"{name}.json"
        if path.exists():
            got[name] = json.loads(path.read_text())
    med = {n: statistics.median(r["step_s"][args.warmup:]) for n, r in got.items() if r.get("step_s")}
    res: dict = {
        "model": {"d_model": args.d_model, "n_layers": args.layers, "n_heads": args.heads, "seq": args.seq,
                  "batch": args.batch}, "dtype": args.dtype, "steps": args.steps, "warmup": args.warmup,
        "runners": status, "median_step_s": med, "commit": _commit(), "versions": _versions(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }
    if "plain" in med:
        res["ratio_vs_plain"] = {n: v / med["plain"] for n, v in med.items() if n != "plain"}
        ref = got["plain"]["losses"]
        rtol = RTOL.get(args.dtype, 2e-2)
        res["loss_check"] = {}
        for n, r in got.items():
            if n in ("plain", "transfers") or "losses" not in r:
                continue
            worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["losses"], ref))
            res["loss_check"][n] = {"max_rel_diff": worst, "rtol": rtol, "ok": worst <= rtol}
    fb = {n: statistics.median(r["forward_backward_s"][args.warmup:]) for n, r in got.items()
          if r.get("forward_backward_s")}
    res["program_s"] = fb
    if "compiled" in fb and "compiled_device" in fb:
        res["offload_program_ratio"] = fb["compiled"] / fb["compiled_device"]
    if "transfers" in got:
        res["transfers"] = got["transfers"]
    for n, r in got.items():  # the program's bytes a step against the link's measured rate: the time they need
        t = r.get("program_transfers")
        if t is None:
            continue
        res.setdefault("program_transfers", {})[n] = t
        rate = (got.get("transfers") or {}).get("pinned_to_device_in_program_gbps")
        if rate and n in fb:
            t["h2d_seconds_at_link_rate"] = t["h2d_bytes"] / (rate * 1e9)
            t["program_s"] = fb[n]
    for n, r in got.items():
        if "platform" in r:
            res.setdefault("platform", r["platform"])
            res.setdefault("device", r["device"])
    return res


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.runner:
        run_one(args)
        return 0
    names = [n for n in args.runners.split(",") if n]
    unknown = sorted(set(names) - set(RUNNERS))
    if unknown:
        raise SystemExit(f"unknown runner(s) {', '.join(unknown)}; runners: {', '.join(RUNNERS)}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1"}
    passed = [f"--{k}={getattr(args, k.replace('-', '_'))}" for k in ("d-model", "layers", "heads", "batch", "seq",
                                                                     "steps", "warmup", "dtype", "link-gbps")]
    passed += ["--small-sized"] if args.small else []
    status: dict = {}
    with open(args.out / "log.txt", "a", encoding="utf-8") as log:
        for name in names:
            (args.out / f"{name}.json").unlink(missing_ok=True)
            cmd = [sys.executable, str(Path(__file__).resolve()), *passed, "--out", str(args.out), "--runner", name]
            t0 = time.perf_counter()
            log.write(f"=== {name}: {' '.join(cmd)}\n")
            log.flush()
            try:
                rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    timeout=args.runner_timeout).returncode
                status[name] = "ok" if rc == 0 and (args.out / f"{name}.json").exists() else f"exit {rc}"
            except subprocess.TimeoutExpired:
                status[name] = f"timeout after {args.runner_timeout:.0f}s"
            log.write(f"=== {name}: {status[name]} in {time.perf_counter() - t0:.1f}s\n")
            log.flush()
            summary = summarize(args, status)
            (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
            print(f"{name}: {status[name]} ({time.perf_counter() - t0:.0f}s)", flush=True)
    print(json.dumps({k: summary.get(k) for k in ("median_step_s", "ratio_vs_plain", "offload_program_ratio",
                                                  "loss_check")}, indent=1))
    print(f"wrote {args.out}")
    return 0 if all(v == "ok" for v in status.values()) and all(
        c["ok"] for c in summary.get("loss_check", {}).values()) else 1


if __name__ == "__main__":
    sys.exit(main())
