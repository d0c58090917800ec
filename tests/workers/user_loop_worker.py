"""One process of a multi-process job whose training loop is the user's own (not the CLI's): join, train, stop.

Usage: python user_loop_worker.py PROCESS_ID NUM_PROCESSES PORT WORK_DIR STEPS PEER_TIMEOUT SAVE_EVERY

What a user's script does with ``zinf.distributed``: each process joins with ``initialize`` (2 CPU devices,
its own nvme directory ``WORK_DIR/nvme_<I>``, checkpoints in ``WORK_DIR/ckpt``), restores the newest
checkpoint if there is one, and steps through the data positions up to STEPS, feeding its share of each
batch; it saves every SAVE_EVERY steps (0: never) and, when ``StopAgreement.reached`` says so, saves that
step and leaves. Prints one JSON line per step (``{"step": N, "loss": x}``) and a last one with the
result; exits with the agreement's status (143 after a signal, 0 at the end).
"""
import json
import os
import sys

pid, nproc, port, work = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
steps, peer_timeout, save_every = int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
os.environ["JAX_NUM_CPU_DEVICES"] = "2"
os.environ["JAX_PLATFORMS"] = "cpu"

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import zinf_jax as zinf  # noqa: E402
from helpers.procs import use_session_jax_cache  # noqa: E402

ckpt = os.path.join(work, "ckpt")
job = zinf.distributed.initialize(f"localhost:{port}", nproc, pid, peer_timeout=peer_timeout, checkpoint_dir=ckpt)
stop = zinf.distributed.StopAgreement()
use_session_jax_cache()

from flax import nnx  # noqa: E402

from zinf_jax.checkpoint.format import list_steps  # noqa: E402
from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss  # noqa: E402

CFG = GPTConfig(vocab=256, d_model=32, n_heads=4, n_layers=2, seq=16)
BATCH = 16  # the whole job's rows a step
nvme = os.path.join(work, f"nvme_{pid}")  # this host's own disk
os.makedirs(nvme, exist_ok=True)
KW = dict(config=zinf.ZeroConfig(offload_param=zinf.Offload("nvme", path=nvme),
                                 offload_optimizer=zinf.Offload("nvme", path=nvme), persistence_threshold=600),
          optimizer=zinf.adamw(3e-3, weight_decay=0.1, clip_norm=1.0), loss_fn=lm_loss)


def ctor():
    return GPT(CFG, rngs=nnx.Rngs(0))


with job:
    if os.path.isdir(ckpt) and list_steps(ckpt):
        engine = zinf.restore(ckpt, ctor, **KW)
        start = engine.user_state["data_step"]
    else:
        engine, start = zinf.initialize(ctor, **KW), 0
    data, losses, saved = corpus(), [], None
    rows = BATCH // nproc
    for pos in range(start, steps):
        batch = batch_at(data, pos, BATCH, CFG.seq)[pid * rows:(pid + 1) * rows]
        loss = engine.train_step(batch)["loss"]
        losses.append(loss)
        print(json.dumps({"step": pos + 1, "loss": loss}), flush=True)
        stopping = stop.reached(pos + 1)  # every process, every step: one agreed step after a signal to any
        if stopping or (save_every and (pos + 1) % save_every == 0):
            saved = str(engine.save(ckpt, user_state={"data_step": pos + 1}))  # one complete checkpoint
        if stopping:
            break
    engine.close()
print(json.dumps({"start": start, "losses": losses, "saved": saved, "exit": stop.exit_code}), flush=True)
sys.exit(stop.exit_code)
