"""One process of a 2-process jax.distributed job on CPU (4 devices each) that saves and restores checkpoints.

Usage: python mp_ckpt_worker.py PROCESS_ID NUM_PROCESSES PORT CKPT_DIR MODE [SLOW_S]

Modes (each prints JSON lines; the last one is the result):
  save     train 1 step, save step_1, train 1 more step (the "next loss"), then restore step_1 into a new
           engine on the same 2 x 4 mesh and train that step again.
  kill     train 1 step, save step_1, train 1 more step, then save step_2 slowly: once the first group of
           step_2 is written, every read of the optimizer state on process 1 sleeps SLOW_S seconds (a worker
           wrapper, not a library hook), so the test can SIGKILL it mid-save. Prints {"saving": ...} first.
  restore  restore the newest checkpoint under CKPT_DIR and train one step.
Each result holds "digest": {"state/path/shard": sha1} of this process's shards, and the losses.
"""
import hashlib
import json
import os
import sys
import time

T0 = time.time()

pid, nproc, port, ckpt, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
slow_s = float(sys.argv[6]) if len(sys.argv) > 6 else 0.0
os.environ["JAX_NUM_CPU_DEVICES"] = "4"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from helpers.procs import use_session_jax_cache  # noqa: E402

use_session_jax_cache()  # the test run's compilation cache: later engines compile nothing
jax.distributed.initialize(f"localhost:{port}", num_processes=nproc, process_id=pid)

from flax import nnx  # noqa: E402

import zinf_jax as zinf  # noqa: E402
from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss  # noqa: E402
from zinf_jax.checkpoint.state import TrainingState  # noqa: E402

CFG = GPTConfig(vocab=256, d_model=32, n_heads=4, n_layers=2, seq=16)
KW = dict(config=zinf.ZeroConfig(offload_param=zinf.Offload("cpu"), offload_optimizer=zinf.Offload("cpu"),
                                 persistence_threshold=600),
          optimizer=zinf.adamw(3e-3, weight_decay=0.1, clip_norm=1.0), loss_fn=lm_loss)
DATA = corpus()


def ctor():
    return GPT(CFG, rngs=nnx.Rngs(0))


def step(eng):
    full = batch_at(DATA, eng.step, 8, CFG.seq)
    return eng.train_step(full[pid * 4:(pid + 1) * 4])["loss"]  # each process feeds its half of the global batch


def digest(eng):
    view = TrainingState(eng.components)
    return {f"{s}/{p}/{i}": hashlib.sha1(view.read(p, i, s).tobytes()).hexdigest()
            for p in view.layouts for s in view.states(p) for i in view.local_indices(p)}


def emit(**kw):
    print(json.dumps({"process": pid, **kw, "t": round(time.time() - T0, 2)}), flush=True)


out = {}
if mode in ("save", "kill"):
    eng = zinf.initialize(ctor, **KW)
    out["loss1"] = step(eng)
    out["saved"] = str(eng.save(ckpt, user_state={"data_step": 1}))
    out["digest"] = digest(eng)
    out["loss2"] = step(eng)
    emit(**out)
    if mode == "kill":
        view, real, calls = TrainingState(eng.components), eng.optimizer.read_state, [0]
        first_group = sum(len(view.states(p)) * len(view.local_indices(p)) for p in view.groups[0])

        def slow_read(path, index, name):
            calls[0] += 1
            if pid == 1 and calls[0] > first_group:
                time.sleep(slow_s)
            return real(path, index, name)

        eng.optimizer.read_state = slow_read
        emit(saving=2)
        eng.save(ckpt, user_state={"data_step": 2})
        emit(saved_2=True)  # not reached when the test kills the job
    else:
        again = zinf.restore(ckpt, ctor, **KW)
        emit(restored_digest=digest(again), restored_loss2=step(again), **out)
        again.close()
    eng.close()
else:
    eng = zinf.restore(ckpt, ctor, **KW)
    emit(step=eng.step, user_state=eng.user_state, digest=digest(eng), loss2=step(eng))
    eng.close()
jax.distributed.shutdown()
