"""A job that saves into a checkpoint directory and keeps running: ``python ckpt_holder.py CKPT``.

Builds the small GPT (cpu tiers), takes two steps, saves them (``max_to_keep=2``), prints ``saved <steps>`` and
waits for a line on stdin before it closes its engine (releasing the directory) and exits.
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

cfg = GPTConfig(vocab=256, d_model=32, n_heads=4, n_layers=2, seq=16)
engine = zinf.initialize(lambda: GPT(cfg, rngs=nnx.Rngs(0)), loss_fn=lm_loss, optimizer=zinf.adamw(1e-3),
                         config=zinf.ZeroConfig(offload_param=zinf.Offload("cpu"), offload_optimizer=zinf.Offload("cpu")))
saved = []
for s in range(4):
    engine.train_step(batch_at(corpus(), s, 8, cfg.seq))
    if engine.step % 2 == 0:
        saved.append(engine.save(sys.argv[1], max_to_keep=2).name)
print("saved", *saved, flush=True)
sys.stdin.readline()
engine.close()
