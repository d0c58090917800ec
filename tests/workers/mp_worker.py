"""One process of a 2-process jax.distributed job on CPU (4 devices each): trains a few zinf steps
(the first half with ``train_step``, the rest with ``train_steps``) once per tier, one engine after the other.

Usage: python mp_worker.py PROCESS_ID NUM_PROCESSES PORT WORKDIR STEPS [TIERS]
TIERS: comma-separated, each ``nvme`` (the streamed engine) or ``cpu`` (params and optimizer in host RAM: the
compiled engine), zinf's AdamW; or ``nvme-lamb`` (nvme, ``optax.lamb``: a whole-tensor rule), ``cpu-prodigy``
(``optax.contrib.prodigy``: one update over the whole tree), or ``nvme-device`` (params in device memory, the
optimizer state on nvme updated in the step's program); default ``nvme``.
Prints one JSON line: {tier: {"process": i, "mode": ..., "losses": [...], "manifests": [...], ...}}.
"""
import json
import os
import sys

pid, nproc, port, workdir, steps = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
tiers_list = (sys.argv[6] if len(sys.argv) > 6 else "nvme").split(",")
os.environ["JAX_NUM_CPU_DEVICES"] = "4"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from helpers.procs import use_session_jax_cache  # noqa: E402

use_session_jax_cache()  # the test run's compilation cache: later engines compile nothing
jax.distributed.initialize(f"localhost:{port}", num_processes=nproc, process_id=pid)

import optax  # noqa: E402
import optax.contrib  # noqa: E402
from flax import nnx  # noqa: E402

import zinf_jax as zinf  # noqa: E402
from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss  # noqa: E402

cfg = GPTConfig(vocab=256, d_model=32, n_heads=4, n_layers=2, seq=16)
data = corpus()


def local(s):
    return batch_at(data, s, 8, cfg.seq)[pid * 4:(pid + 1) * 4]  # each process feeds its half of the global batch


def run(tiers):
    """Trains ``steps`` steps with params and optimizer on ``tiers``: what this process saw."""
    work = os.path.join(workdir, tiers)  # (exists for nvme: the test made it)
    tier, _, rule = tiers.partition("-")
    off = zinf.Offload("nvme", path=work) if tier == "nvme" else zinf.Offload(tier)
    tx = {"lamb": lambda: optax.lamb(3e-3, eps=1e-4), "prodigy": lambda: optax.contrib.prodigy(3.0, estim_lr0=1e-4)}.get(
        rule, lambda: zinf.adamw(3e-3, weight_decay=0.1, clip_norm=1.0))()
    config = (zinf.ZeroConfig(offload_optimizer=off, optimizer_update="device", persistence_threshold=600)
              if rule == "device" else
              zinf.ZeroConfig(offload_param=off, offload_optimizer=off, persistence_threshold=600))
    eng = zinf.initialize(lambda: GPT(cfg, rngs=nnx.Rngs(0)), loss_fn=lm_loss, config=config, optimizer=tx)
    half = steps // 2  # then the same steps with the optimizer overlapped with the next forward: the same numbers
    mode = eng.mode
    losses = [eng.train_step(local(s))["loss"] for s in range(half)]
    losses += [m["loss"] for m in eng.train_steps(local(s) for s in range(half, steps))]
    in_program = eng.optimizer.last_stats.get("in_program", 0.0)
    eng.close()
    files = sorted(os.path.relpath(os.path.join(r, f), work) for r, _, fs in os.walk(work) for f in fs
                   if f == "MANIFEST.json")
    return {"process": pid, "mode": mode, "losses": losses, "manifests": files, "devices": jax.device_count(),
            "local": jax.local_device_count(), "in_program": in_program}


print(json.dumps({tiers: run(tiers) for tiers in tiers_list}), flush=True)
jax.distributed.shutdown()
