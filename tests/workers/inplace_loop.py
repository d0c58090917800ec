"""The checkpoints guide's own resume loop with both tiers on nvme (in-place updates), one step a save:
``python inplace_loop.py WORK STEPS``.

Restores the newest checkpoint under ``WORK/ckpt`` with the nvme tiers at ``WORK/nvme`` (a tier a kill left
half-updated included), else initialises; trains to STEPS, saving after every step; prints ``step <N> <loss>``
(the loss as ``float.hex``) after each step and ``done`` at the end. The parent kills it with SIGKILL inside an
optimizer step's in-place writes.
"""
import os
import sys

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import zinf_jax as zinf  # noqa: E402
from helpers.procs import use_session_jax_cache  # noqa: E402

use_session_jax_cache()
from flax import nnx  # noqa: E402

from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss  # noqa: E402

work, steps = sys.argv[1], int(sys.argv[2])
ckpt, nvme = os.path.join(work, "ckpt"), os.path.join(work, "nvme")
os.makedirs(nvme, exist_ok=True)
cfg = GPTConfig(vocab=256, d_model=64, n_heads=4, n_layers=2, seq=16, dropout=0.1)
off = zinf.Offload("nvme", path=nvme)
args = dict(loss_fn=lm_loss, optimizer=zinf.adamw(1e-3),
            config=zinf.ZeroConfig(offload_param=off, offload_optimizer=off, persistence_threshold=0))
ctor = lambda: GPT(cfg, rngs=nnx.Rngs(0, dropout=1))  # noqa: E731
if os.path.isdir(ckpt) and any(n.startswith("step_") for n in os.listdir(ckpt)):
    engine = zinf.restore(ckpt, ctor, **args)
else:
    engine = zinf.initialize(ctor, **args)
while engine.step < steps:
    loss = engine.train_step(batch_at(corpus(), engine.step, 8, cfg.seq))["loss"]
    engine.save(ckpt, max_to_keep=2)
    print("step", engine.step, float(loss).hex(), flush=True)
engine.close()
print("done", flush=True)
