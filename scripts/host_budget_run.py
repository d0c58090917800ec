"""Trains the bundled GPT on nvme tiers under ``host_memory_limit``, as a child process held to a memory cgroup
cap equal to that limit, and again without the cap; writes the losses, RSS and the kernel's peak (issue 47).

One run = one model size. For each of ``--modes`` (``uncapped``, ``capped``) a fresh child process, in its own
folder under ``--dir`` (``--parallel``: both at once): ``zinf_jax.initialize`` with params and optimizer on nvme
(fp32 master and moments) and ``ZeroConfig(host_memory_limit=--limit)``, ``--steps`` steps, a checkpoint
(``engine.save``; ``--uncapped-no-save``: not in the uncapped run, whose losses are only the reference), close.
The child reports its losses, its peak RSS (sampled every 20 ms, and ``VmHWM``) overall and per phase (init,
each step, save) and its growth over the RSS after the backend started, the host plan the engine ran, and the
estimator's plan and host figure for the same model (:attr:`zinf_jax.estimate.MemoryEstimate.planned_host_bytes`).
The parent (root: it needs the cgroup v1 memory controller, ``/sys/fs/cgroup/memory``) puts the ``capped``
child in a memory group capped at ``--limit`` and records the kernel's ``memory.max_usage_in_bytes`` (page
cache included), ``memory.failcnt`` and ``memory.oom_control``, and whether the losses of both children agree
(rtol 1e-6). The result file carries the benchmarks page's fields (``scripts/render_benchmarks.py``);
``--baseline`` (a smaller model's result file) adds the RSS growth over it. The tiers and checkpoint are
deleted when each child ends.

Usage::

    python scripts/host_budget_run.py --layers 32 [--d-model 1024] [--limit 4GiB] [--steps 3] [--devices 8]
        [--seq 64] [--modes uncapped,capped] [--parallel] [--uncapped-no-save] [--baseline FILE]
        [--dir /var/tmp/zinf_hb] [--out benchmarks/host_budget_d1024_L32.json]
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
import uuid
from pathlib import Path

GiB = 1 << 30
MEMCG = Path("/sys/fs/cgroup/memory")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def child(args: argparse.Namespace) -> dict:
    """One run in this process: init, steps, save, close; what it measured."""
    os.environ["JAX_NUM_CPU_DEVICES"] = str(args.devices)
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import numpy as np
    from flax import nnx

    import zinf_jax as zinf
    from zinf_jax.estimate import estimate_from_sizes
    from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss

    peak, phase = [0], [0]  # the whole run's peak, and the current phase's
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.02):
            r = _rss()
            peak[0], phase[0] = max(peak[0], r), max(phase[0], r)

    def phase_peak() -> int:
        top, phase[0] = max(phase[0], _rss()), 0
        return top

    _ = jax.device_put(np.zeros(8))  # backend up before the baseline
    base = _rss()
    threading.Thread(target=sample, daemon=True).start()
    root = Path(args.dir)
    cfg = GPTConfig(d_model=args.d_model, n_heads=args.heads, n_layers=args.layers, seq=args.seq)
    off = zinf.Offload("nvme", path=str(root / "nvme"))
    config = zinf.ZeroConfig(offload_param=off, offload_optimizer=off, compute_dtype="float32",
                             host_memory_limit=args.limit)
    t0 = time.perf_counter()
    eng = zinf.initialize(lambda: GPT(cfg, rngs=nnx.Rngs(0)), config=config, loss_fn=lm_loss,
                          optimizer=zinf.adamw(1e-4))
    init_s = time.perf_counter() - t0
    init_peak = phase_peak()
    plan = eng.components.host_plan
    data, steps = corpus(), []
    for s in range(args.steps):
        m = eng.train_step(batch_at(data, s, args.batch, cfg.seq))
        steps.append({"loss": float(m["loss"]), "step_time_s": m["step_time_s"], "rss": _rss(),
                      "rss_peak": phase_peak()})
        print(f"step {s + 1}: loss {m['loss']:.6f} {m['step_time_s']:.1f} s, RSS {_rss() / GiB:.2f} GiB", flush=True)
    t1 = time.perf_counter()
    if not args.no_save:
        eng.save(str(root / "ckpt"))
    save_s = time.perf_counter() - t1
    save_peak = phase_peak()
    n = sum(lay.size for lay in eng.layouts.values())
    eng.close()
    stop.set()
    top = max(peak[0], _hwm())
    est = estimate_from_sizes(None, args.layers, args.d_model, 256, args.seq, args.batch, n_devices=args.devices,
                              heads=args.heads, config=config, platform="cpu", configurations=[("nvme", "nvme")])[0]
    return {"params": n, "init_s": init_s, "save_s": save_s, "steps": steps, "losses": [s["loss"] for s in steps],
            "rss_base": base, "rss_peak": top, "rss_peak_init": init_peak, "rss_peak_save": save_peak, "rss_growth": top - base,
            "plan": {"total": plan.total, "minimum": plan.minimum, "items": dict(plan.items),
                     "prefetch_depth": plan.prefetch_depth, "buffer_count": plan.buffer_count,
                     "trim_slack": plan.trim_slack, "max_live_bytes": plan.max_live_bytes},
            "estimate": {"planned_host_bytes": est.planned_host_bytes, "plan_total": est.host_plan.total,
                         "step_host_bytes": est.step_host_bytes, "items": dict(est.host_plan.items),
                         "ratio_to_peak_rss": est.planned_host_bytes / top,
                         "engine_plan_ratio_to_peak_rss": (plan.total + est.step_host_bytes) / top}}


def _run_child(args: argparse.Namespace, capped: bool) -> dict:
    where = str(Path(args.dir) / ("capped" if capped else "uncapped"))
    argv = [sys.executable, __file__, "--child", "--layers", str(args.layers), "--d-model", str(args.d_model),
            "--heads", str(args.heads), "--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq),
            "--devices", str(args.devices), "--limit", str(args.limit), "--dir", where]
    argv += ["--no-save"] if args.no_save or (args.uncapped_no_save and not capped) else []
    group = MEMCG / f"zinf_hb_{uuid.uuid4().hex[:8]}" if capped else None
    if group is not None:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(args.limit))

    def enter() -> None:
        with open(group / "cgroup.procs", "w") as f:
            f.write(str(os.getpid()))

    shutil.rmtree(where, ignore_errors=True)
    Path(where, "nvme").mkdir(parents=True)
    t = time.perf_counter()
    try:
        p = subprocess.run(argv, capture_output=True, text=True, preexec_fn=enter if capped else None)
        out: dict = {"exit_code": p.returncode, "wall_s": time.perf_counter() - t, "stderr_tail": p.stderr[-2000:]}
        if p.returncode == 0:
            out.update(json.loads(p.stdout.strip().splitlines()[-1]))
        if group is not None:
            out["cgroup"] = {"limit_in_bytes": int((group / "memory.limit_in_bytes").read_text()),
                             "max_usage_in_bytes": int((group / "memory.max_usage_in_bytes").read_text()),
                             "failcnt": int((group / "memory.failcnt").read_text()),
                             "oom_control": (group / "memory.oom_control").read_text().split("\n")}
        out["disk_bytes"] = int(subprocess.run(["du", "-sb", where], capture_output=True, text=True).stdout.split()[0])
    finally:
        if group is not None:
            group.rmdir()
        shutil.rmtree(where, ignore_errors=True)
    print(f"{'capped' if capped else 'uncapped'}: exit {out['exit_code']}, {out['wall_s']:.0f} s, "
          f"peak RSS {out.get('rss_peak', 0) / GiB:.2f} GiB (+{out.get('rss_growth', 0) / GiB:.2f})"
          + (f", cgroup peak {out['cgroup']['max_usage_in_bytes'] / GiB:.2f} GiB" if capped else ""), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--limit", default="4GiB", help="host_memory_limit, and the cgroup cap of the capped run")
    ap.add_argument("--modes", default="uncapped,capped")
    ap.add_argument("--dir", default="/var/tmp/zinf_hb")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-save", action="store_true", help="no checkpoint after the steps")
    ap.add_argument("--uncapped-no-save", action="store_true",
                    help="the uncapped run (the losses' reference) takes no checkpoint: half the disk when both run at once")
    ap.add_argument("--baseline", default=None, help="a result file of a smaller model: RSS growth over it")
    ap.add_argument("--parallel", action="store_true", help="run the modes' children at once")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    from zinf_jax.config.fields import as_bytes

    args.limit = as_bytes(args.limit)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    out_path = Path(args.out or f"benchmarks/host_budget_d{args.d_model}_L{args.layers}.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {"args": {k: v for k, v in vars(args).items() if k != "child"}, "runs": {}}
    modes = args.modes.split(",")
    if args.parallel:  # both children at once (each in its own folder)
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(modes)) as pool:
            done = list(pool.map(lambda m: _run_child(args, capped=m == "capped"), modes))
        result["runs"].update(zip(modes, done))
    for mode in [] if args.parallel else modes:
        result["runs"][mode] = _run_child(args, capped=mode == "capped")
        out_path.write_text(json.dumps(result, indent=1))
    runs = result["runs"]
    if all(m in runs and runs[m]["exit_code"] == 0 for m in ("uncapped", "capped")):
        import numpy as np

        a, b = runs["uncapped"]["losses"], runs["capped"]["losses"]
        result["losses_equal_rtol_1e-6"] = bool(np.allclose(a, b, rtol=1e-6, atol=0))
        print(f"losses uncapped {a} capped {b}: equal (rtol 1e-6) {result['losses_equal_rtol_1e-6']}")
    result.update(record(result, args))
    out_path.write_text(json.dumps(result, indent=1))
    return 0


MACHINE = ("2-vCPU VM (AMD EPYC Zen3 or Intel Xeon AVX-512), 24 GiB RAM, ext4 on a virtio disk; shared and noisy "
           "(up to 1.8x run to run)")


def record(result: dict, args: argparse.Namespace) -> dict:
    """The benchmarks page's fields (scripts/render_benchmarks.py) of a result."""
    runs, g = result["runs"], lambda b: f"{b / GiB:.2f} GiB"
    capped, free = runs.get("capped", {}), runs.get("uncapped", {})
    params = (capped or free).get("params", 0)
    parts = []
    if capped:
        cg = capped.get("cgroup", {})
        oom = dict(line.split() for line in cg.get("oom_control", []) if line.strip())
        parts.append(f"under a {g(args.limit)} cgroup cap: exit {capped['exit_code']}, {args.steps} steps and a "
                     f"checkpoint, oom_kill {oom.get('oom_kill', '?')}, kernel peak (memory.max_usage_in_bytes, page "
                     f"cache included: the group's cache is reclaimed at the cap) {g(cg.get('max_usage_in_bytes', 0))}")
    if "losses_equal_rtol_1e-6" in result:
        parts.append(f"losses equal to the uncapped run (rtol 1e-6): {result['losses_equal_rtol_1e-6']}")
    for name, r in (("capped", capped), ("uncapped", free)):
        if r.get("exit_code") == 0:
            parts.append(f"{name}: peak RSS {g(r['rss_peak'])} (+{g(r['rss_growth'])} over the started backend), "
                         f"estimator's host figure {g(r['estimate']['planned_host_bytes'])} "
                         f"({r['estimate']['ratio_to_peak_rss']:.2f}x the peak)")
    if args.baseline:
        base = json.loads(Path(args.baseline).read_text())["runs"]["uncapped"]
        ref = free if free.get("exit_code") == 0 else capped
        if ref.get("exit_code") == 0:
            parts.append(f"peak RSS growth {(ref['rss_growth'] - base['rss_growth']) / GiB:+.2f} GiB against the "
                         f"{base['params'] / 1e9:.2f}B run's ({args.baseline})")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    state = f"{16 * params / 1e9:.1f} GB" if params else "?"
    return {"order": 45, "figure": f"Host memory as a budget: bundled GPT d_model {args.d_model} x {args.layers} layers "
            f"({params / 1e9:.2f}B params, {state} of fp32 state), params and optimizer on nvme (fp32 master and "
            f"moments), {args.devices} CPU devices, batch {args.batch} x {args.seq}, host_memory_limit {g(args.limit)}",
            "value": "; ".join(parts), "reference": "the same run without a cap (its losses); the estimator's "
            "MemoryEstimate.planned_host_bytes for the same model and limit",
            "date": time.strftime("%Y-%m-%d"), "commit": commit,
            "command": "python scripts/host_budget_run.py " + " ".join(sys.argv[1:]), "machine": MACHINE,
            "source": "the result JSON the script wrote (this file)"}


if __name__ == "__main__":
    sys.exit(main())
