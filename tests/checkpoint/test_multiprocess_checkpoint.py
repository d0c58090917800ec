"""Checkpoints of a real 2-process jax.distributed job on CPU (2 processes x 4 devices, tests/mp_ckpt_worker.py).

Process 0 alone creates the temporary step directory, writes the metadata and the checksums and renames it
into place; every process writes its own shards. A checkpoint restores bitwise on 2 x 4 and on 1 x 8 devices,
and a SIGKILL of one process mid-save leaves the previous checkpoint intact and no half step directory.
"""
import json
import signal
import subprocess
import time

import numpy as np
import pytest
from flax import nnx

import zinf_jax as zinf
from zinf_jax.checkpoint.format import OWNER
from helpers.procs import WORKERS, free_port, job_env, last_json, start
from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss
from zinf_jax.checkpoint.state import TrainingState

CFG = GPTConfig(vocab=256, d_model=32, n_heads=4, n_layers=2, seq=16)
KW = dict(config=zinf.ZeroConfig(offload_param=zinf.Offload("cpu"), offload_optimizer=zinf.Offload("cpu"),
                                 persistence_threshold=600),
          optimizer=zinf.adamw(3e-3, weight_decay=0.1, clip_norm=1.0), loss_fn=lm_loss)


def _start(ckpt, mode, *extra):
    port = str(free_port())
    return start([[str(WORKERS / "mp_ckpt_worker.py"), str(i), "2", port, str(ckpt), mode, *extra] for i in range(2)],
                 job_env(jax_cache=True))



def _union(outs, key="digest"):
    merged = {}
    for o in outs:
        for k, v in o[key].items():
            assert merged.setdefault(k, v) == v  # a shard both processes hold is the same on both
    return merged


def _one_process_restore(ckpt):
    """Restores on this pytest process (1 process x 8 devices): every shard's digest and the next loss."""
    import hashlib

    eng = zinf.restore(ckpt, lambda: GPT(CFG, rngs=nnx.Rngs(0)), **KW)
    try:
        view = TrainingState(eng.components)
        digest = {f"{s}/{p}/{i}": hashlib.sha1(view.read(p, i, s).tobytes()).hexdigest()
                  for p in view.layouts for s in view.states(p) for i in view.local_indices(p)}
        return digest, eng.train_step(batch_at(corpus(), eng.step, 8, CFG.seq))["loss"]
    finally:
        eng.close()


@pytest.mark.slow  # ~20-40 s; the default suite keeps tests/test_multiprocess.py
def test_two_processes_save_and_restore(tmp_path):
    ckpt = tmp_path / "ckpt"
    outs = last_json(_start(ckpt, "save"))
    step_dir = ckpt / "step_00000001"
    assert sorted(p.name for p in ckpt.iterdir()) == [OWNER, "step_00000001"]  # no .tmp_* left, one step dir
    # every process wrote its own shards into the same group directories; one table of checksums
    assert {p.name for p in (step_dir / "group_0000").glob("ocdbt.process_*")} == {"ocdbt.process_0",
                                                                                   "ocdbt.process_1"}
    table = json.loads((step_dir / "checksums.json").read_text())
    assert "zinf_meta.json" in table and any(n.startswith("group_0000/ocdbt.process_1/") for n in table)
    assert not list(step_dir.glob(".crc_process_*"))
    saved = _union(outs)
    assert set(saved) == {k for k in _union(outs, "restored_digest")}
    for o in outs:  # restored on 2 x 4 in the same job: bitwise, and the next step's loss is the same
        assert o["restored_digest"] == o["digest"] and o["restored_loss2"] == o["loss2"]
    # (restoring on 1 x 8 devices: see the slow test below)


@pytest.mark.slow
def test_sigkill_of_one_process_mid_save_keeps_the_previous_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    procs = _start(ckpt, "kill", "2.0")
    try:
        deadline = time.monotonic() + 400
        # the second save is under way once its first group is committed by orbax inside the temporary dir
        while not list(ckpt.glob(".tmp_step_00000002_*/group_0000")):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                [p.communicate()[1][-2000:] for p in procs if p.poll() is not None]
            time.sleep(0.2)
        time.sleep(1.0)
        procs[1].send_signal(signal.SIGKILL)  # mid-save: process 1 is still reading its shards of group 1
        procs[1].wait(timeout=60)
        try:  # process 0 fails at its next barrier (then removes the temporary dir) or waits there: killed too
            procs[0].wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        printed = [p.communicate(timeout=60)[0] for p in procs]
    assert procs[0].returncode != 0 and not any('"saved_2"' in out for out in printed)
    before = [json.loads(next(ln for ln in out.splitlines() if ln.startswith('{"process"'))) for out in printed]
    names = sorted(p.name for p in ckpt.iterdir() if p.name != OWNER)  # nothing of step 2 but maybe its hidden tmp
    assert names[-1] == "step_00000001" and all(n.startswith(".tmp_step_00000002_") for n in names[:-1])
    assert not (ckpt / "step_00000002").exists()

    # the previous checkpoint is intact: restored on 2 x 4 and on 1 x 8, bitwise, with the next loss
    outs = last_json(_start(ckpt, "restore"))
    assert [o["step"] for o in outs] == [1, 1] and outs[0]["user_state"] == {"data_step": 1}
    assert _union(outs) == _union(before)  # what each process held right after saving step 1
    assert [o["loss2"] for o in outs] == [b["loss2"] for b in before]  # the uninterrupted run's next loss
    digest, loss2 = _one_process_restore(ckpt)
    assert digest == _union(before)
    np.testing.assert_allclose(loss2, before[0]["loss2"], rtol=1e-6)
