"""One process of a 2-process jax.distributed job on CPU (4 devices each) that initialises the test Llama from a
safetensors file: it must read only the slices of its own shards.

Usage: python mp_safetensors_worker.py PROCESS_ID PORT DIR   (DIR holds model.safetensors; nvme tiers go under it)
Prints one JSON line: {"process": i, "bytes_read": n, "ok": whether every local shard equals the file's slice}.
"""
import json
import os
import sys

pid, port, workdir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ["JAX_NUM_CPU_DEVICES"] = "4"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import jax  # noqa: E402

jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid)

import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

import zinf_jax as zinf  # noqa: E402
from helpers.llama import Llama, LlamaConfig, hf_to_flax, lm_loss  # noqa: E402
from zinf_jax.plan.partition import to_stored  # noqa: E402

cfg = LlamaConfig(vocab=256, d_model=64, ffn=128)
nvme = os.path.join(workdir, "nvme")
os.makedirs(nvme, exist_ok=True)
off = zinf.Offload("nvme", path=nvme)
source = zinf.from_safetensors(os.path.join(workdir, "model.safetensors"), rename=hf_to_flax)
eng = zinf.initialize(lambda: Llama(cfg, rngs=nnx.Rngs(0)), params=source, loss_fn=lm_loss,
                      config=zinf.ZeroConfig(offload_param=off, offload_optimizer=off, persistence_threshold=64),
                      optimizer=zinf.adamw(1e-3))
read = source.bytes_read
ok = True
for name, value in load_file(os.path.join(workdir, "model.safetensors")).items():  # the reference reader
    how = hf_to_flax(name)
    how = zinf.TensorMap(how) if isinstance(how, str) else how
    want = value if how.transpose is None else np.transpose(value, how.transpose)
    lay = eng.layouts[how.path]
    stored = to_stored(lay, want)
    for i in eng.store.local_indices(how.path):
        shard = stored if lay.dim is None else np.split(stored, lay.num_shards, axis=lay.dim)[i]
        ok &= bool(np.array_equal(eng.optimizer.read_master(how.path, i), shard))
eng.close()
print(json.dumps({"process": pid, "bytes_read": read, "ok": ok}))
