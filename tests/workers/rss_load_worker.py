"""Builds the test Llama at ~1 GB (fp32) on nvme tiers, from its initialisers or from a safetensors file, and
prints the process's peak RSS: the safetensors load must hold no more host RAM than the engine's own init.

Usage: python rss_load_worker.py fresh|safetensors DIR   (DIR holds model.safetensors; the tiers go under DIR/<mode>)
Prints one JSON line: {"mode": ..., "peak_rss": bytes, "bytes_read": n, "seconds": s}.
"""
import json
import os
import resource
import sys
import time

mode, workdir = sys.argv[1], sys.argv[2]
os.environ.setdefault("JAX_NUM_CPU_DEVICES", "2")
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from flax import nnx  # noqa: E402

import zinf_jax as zinf  # noqa: E402
from helpers.llama import BIG, Llama, hf_to_flax, lm_loss  # noqa: E402

nvme = os.path.join(workdir, mode)
os.makedirs(nvme, exist_ok=True)
off = zinf.Offload("nvme", path=nvme)
source = zinf.from_safetensors(os.path.join(workdir, "model.safetensors"), rename=hf_to_flax) \
    if mode == "safetensors" else None
t0 = time.perf_counter()
eng = zinf.initialize(lambda: Llama(BIG, rngs=nnx.Rngs(0)), params=source, loss_fn=lm_loss,
                      config=zinf.ZeroConfig(offload_param=off, offload_optimizer=off),
                      trainable=nnx.PathContains("norm"), optimizer=zinf.adamw(1e-3))  # frozen base: 1 GB of params
seconds = time.perf_counter() - t0
eng.close()
print(json.dumps({"mode": mode, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "bytes_read": 0 if source is None else source.bytes_read, "seconds": seconds}))
