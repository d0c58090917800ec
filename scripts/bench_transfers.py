"""What the compiled step moves between host and device memory, as XLA's GPU and TPU compilers schedule it.

No accelerator needed (the compilers ``scripts/setup_compilers.sh`` installs): each configuration's train and
eval programs of the bundled GPT are compiled for the targets (``engine.compile_for``), and the compiled
programs are read (``zinf_jax.xla.hlo``): bytes moved per device per step against the engine's
``transfer_budget`` (the fewest the step can move), the share of a loop's host-to-device bytes whose move
overlaps compute in the schedule, the types of the gradient reductions, the compile time.

    python scripts/bench_transfers.py --out /tmp/transfers.json
    python scripts/bench_transfers.py --d-model 512 --layers 4 --targets h100,v5e --configs cpu/cpu,cpu/cpu:bfloat16

The JSON holds one row per (configuration, target, program), and ``worst``: the largest bytes-to-budget ratio
and the smallest overlap share over them.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--targets", default="h100,v5e")
    ap.add_argument("--configs", default="cpu/cpu,cpu/cpu:bfloat16,none/cpu,cpu/none",
                    help="param/optimizer tiers, optionally :compute_dtype")
    ap.add_argument("--out", type=Path, default=Path("transfers.json"))
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(REPO))
    from flax import nnx

    import zinf_jax as zinf
    from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss
    from zinf_jax.xla import compile_programs, hlo, target

    cfg = GPTConfig(d_model=args.d_model, n_layers=args.layers, n_heads=max(1, args.d_model // 64), seq=args.seq)
    batch = batch_at(corpus(), 0, args.batch, cfg.seq)
    rows = []
    for spec in args.configs.split(","):
        tiers, _, dtype = spec.partition(":")
        param, opt = tiers.split("/")
        config = zinf.ZeroConfig(offload_param=zinf.Offload(param), offload_optimizer=zinf.Offload(opt),
                                 compute_dtype=dtype or None)
        eng = zinf.initialize(lambda: GPT(cfg, rngs=nnx.Rngs(0)), config=config, loss_fn=lm_loss,
                              optimizer=zinf.adamw(1e-4))
        try:
            budgets = {p: eng.transfer_budget(batch, program=p) for p in ("train", "eval")}
            for name in args.targets.split(","):
                t = target(name)
                lowered = [(p, eng.lower(batch, program=p, platforms=(t.platform,))) for p in ("train", "eval")]
                for r in compile_programs(lowered, t, options=eng.passes.compiler_options(t.platform)):
                    s = r.summary
                    b = budgets[r.label]
                    row = {"config": spec, "target": name, "program": r.label, "ok": r.ok, "error": r.error,
                           "compile_s": round(r.seconds, 2), "warnings": len(r.warnings)}
                    if r.ok:
                        grads = [x for x in hlo.reductions(r.module) if "transpose(" in x.op_name]
                        row.update(h2d_bytes=s["h2d_bytes"], d2h_bytes=s["d2h_bytes"], budget_h2d_bytes=b.h2d_bytes,
                                   budget_d2h_bytes=b.d2h_bytes,
                                   h2d_over_budget=s["h2d_bytes"] / b.h2d_bytes if b.h2d_bytes else None,
                                   d2h_over_budget=s["d2h_bytes"] / b.d2h_bytes if b.d2h_bytes else None,
                                   in_loop_h2d_bytes=s["in_loop_h2d_bytes"],
                                   in_loop_h2d_overlapped=s["in_loop_h2d_overlapped"],
                                   host_compute=len(s["host_compute"]),
                                   gradient_reduction_dtypes=sorted({d for x in grads for d in x.dtypes}))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            eng.close()
    ok = [r for r in rows if r["ok"]]
    out = {"model": {"d_model": args.d_model, "n_layers": args.layers, "batch": args.batch, "seq": args.seq},
           "devices": 8, "rows": rows,
           "worst": {"h2d_over_budget": max((r["h2d_over_budget"] for r in ok if r["h2d_over_budget"]), default=None),
                     "d2h_over_budget": max((r["d2h_over_budget"] for r in ok if r["d2h_over_budget"]), default=None),
                     "in_loop_h2d_overlapped": min((r["in_loop_h2d_overlapped"] for r in ok if r["in_loop_h2d_bytes"]),
                                                   default=None),
                     "all_compiled": len(ok) == len(rows), "host_compute": sum(r.get("host_compute", 0) for r in ok)},
           "date": time.strftime("%Y-%m-%d"), "commit": _commit()}
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps(out["worst"]))
    return 0


def _commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
