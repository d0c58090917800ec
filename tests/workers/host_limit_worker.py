"""Trains the bundled GPT on nvme tiers under ``host_memory_limit`` (given in bytes), saves a checkpoint, and
prints one JSON line: the losses, the host plan, the peak RSS. Exits 2 with the ConfigError on stderr when
the plan does not fit (nothing written).

Usage: python host_limit_worker.py DIR LIMIT_BYTES [d_model n_layers steps devices]
"""
import json
import os
import resource
import sys

workdir, limit = sys.argv[1], int(sys.argv[2])
d_model, n_layers, steps, devices = (int(x) for x in (sys.argv[3:7] + ["512", "2", "2", "8"][len(sys.argv[3:7]):]))
os.environ["JAX_NUM_CPU_DEVICES"] = str(devices)
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from flax import nnx  # noqa: E402

import zinf_jax as zinf  # noqa: E402
from helpers.procs import use_session_jax_cache  # noqa: E402
from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss  # noqa: E402

use_session_jax_cache()
cfg = GPTConfig(d_model=d_model, n_heads=8, n_layers=n_layers, seq=32)
os.makedirs(os.path.join(workdir, "nvme"), exist_ok=True)
off = zinf.Offload("nvme", path=os.path.join(workdir, "nvme"))
config = zinf.ZeroConfig(offload_param=off, offload_optimizer=off, compute_dtype="float32", host_memory_limit=limit)
try:
    eng = zinf.initialize(lambda: GPT(cfg, rngs=nnx.Rngs(0)), config=config, loss_fn=lm_loss,
                          optimizer=zinf.adamw(1e-4))
except zinf.ConfigError as e:
    print(f"refused: {e}", file=sys.stderr)
    sys.exit(2)
plan = eng.components.host_plan
data = corpus()
losses = [float(eng.train_step(batch_at(data, s, 8, cfg.seq))["loss"]) for s in range(steps)]
eng.save(os.path.join(workdir, "ckpt"))
eng.close()
print(json.dumps({"losses": losses, "plan_total": plan.total, "plan_minimum": plan.minimum,
                  "runtime": plan.items["runtime"], "prefetch_depth": plan.prefetch_depth,
                  "buffer_count": plan.buffer_count, "trim_slack": plan.trim_slack,
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
