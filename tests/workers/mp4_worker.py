"""One process of an N-process jax.distributed job on CPU (8 / N devices each), each process with its own
nvme directory as separate hosts have: trains STEPS steps, saving a checkpoint after SAVE_AT and at the end.

Usage: python mp4_worker.py PROCESS_ID NUM_PROCESSES PORT WORKDIR STEPS SAVE_AT
The tiers live under WORKDIR/host_<PROCESS_ID>; checkpoints under WORKDIR/ckpt (shared by all).
Prints one JSON line: {"process": i, "losses": [...], "nvme_bytes": ..., "devices": ..., "local": ...}.
"""
import json
import os
import sys

pid, nproc, port, workdir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
steps, save_at = int(sys.argv[5]), int(sys.argv[6])
os.environ["JAX_NUM_CPU_DEVICES"] = str(8 // nproc)
os.environ["JAX_PLATFORMS"] = "cpu"
import jax  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from helpers.procs import use_session_jax_cache  # noqa: E402

use_session_jax_cache()  # the test run's compilation cache: later engines compile nothing
jax.distributed.initialize(f"localhost:{port}", num_processes=nproc, process_id=pid)

from flax import nnx  # noqa: E402

import zinf_jax as zinf  # noqa: E402
from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss  # noqa: E402

cfg = GPTConfig(vocab=256, d_model=32, n_heads=4, n_layers=2, seq=16)
host = os.path.join(workdir, f"host_{pid}")
os.makedirs(host, exist_ok=True)
off = zinf.Offload("nvme", path=host)
eng = zinf.initialize(lambda: GPT(cfg, rngs=nnx.Rngs(0)), loss_fn=lm_loss,
                      config=zinf.ZeroConfig(offload_param=off, offload_optimizer=off, persistence_threshold=600),
                      optimizer=zinf.adamw(3e-3, weight_decay=0.1, clip_norm=1.0))
data = corpus()
rows = 8 // nproc


def local(s):
    return batch_at(data, s, 8, cfg.seq)[pid * rows:(pid + 1) * rows]  # each process feeds its rows of the batch


losses = []
for s in range(steps):
    losses.append(eng.train_step(local(s))["loss"])
    if eng.step in (save_at, steps):
        eng.save(os.path.join(workdir, "ckpt"))
mode = eng.mode
eng.close()
nbytes = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(host) for f in fs)
print(json.dumps({"process": pid, "mode": mode, "losses": losses, "nvme_bytes": nbytes,
                  "devices": jax.device_count(), "local": jax.local_device_count()}), flush=True)
jax.distributed.shutdown()
