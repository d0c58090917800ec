"""Nothing lost, nothing silent: a step is a transaction, checkpoint directories have one owner, bad batches are
refused before anything moves, and the failures that remain tell the truth (docs/guides/reliability.md).

Each case uses the real mechanism (a small tmpfs for a full disk: root only, skipped with the reason elsewhere; a
second process for a second job; SIGKILL inside an in-place write) and compares with an uninterrupted run.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zinf_jax as zinf
from helpers.engine_utils import optax_run
from helpers.procs import WORKERS, job_env
from helpers.tmpfs import mounted
from zinf_jax.checkpoint.format import OWNER
from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss

CFG = GPTConfig(vocab=256, d_model=32, n_heads=4, n_layers=2, seq=16, dropout=0.1)  # dropout: the RNG matters


def ctor():
    return GPT(CFG, rngs=nnx.Rngs(0, dropout=1))


def batches(n, start=0):
    return [batch_at(corpus(), s, 8, CFG.seq) for s in range(start, start + n)]


def nvme_engine(path: Path):
    path.mkdir(parents=True, exist_ok=True)
    off = zinf.Offload("nvme", path=str(path))
    return zinf.initialize(ctor, config=zinf.ZeroConfig(offload_param=off, offload_optimizer=off), loss_fn=lm_loss,
                           optimizer=zinf.adamw(1e-3))


def _fill(root: Path, keep: int = 4096) -> Path:
    """Fills the file system of ``root`` but ``keep`` bytes."""
    filler = root / "filler"
    with open(filler, "wb") as f:
        try:
            f.write(b"\0" * max(0, shutil.disk_usage(root).free - keep))
        except OSError:
            pass
    return filler


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    eng = nvme_engine(tmp_path_factory.mktemp("ref") / "nvme")
    losses = [eng.train_step(b)["loss"] for b in batches(5)]
    params = eng.param_arrays()
    eng.close()
    return losses, params


def test_a_full_nvme_disk_mid_step_fails_the_step_and_the_retry_equals_an_uninterrupted_run(tmp_path, uninterrupted):
    with mounted(tmp_path / "disk", "size=8m") as disk:
        eng = nvme_engine(disk / "nvme")
        try:
            got = [eng.train_step(b)["loss"] for b in batches(2)]
            filler = _fill(disk)
            with pytest.raises(zinf.TierError, match="disk full"):
                eng.train_step(batches(1, 2)[0])
            assert eng.step == 2  # nothing advanced: the step counter, the RNG, the optimizer's counters
            filler.unlink()
            got += [eng.train_step(b)["loss"] for b in batches(3, 2)]  # the same batch again, then on
            assert got == uninterrupted[0]  # bit for bit
            for k, v in eng.param_arrays().items():
                np.testing.assert_array_equal(v, uninterrupted[1][k], err_msg=k)
        finally:
            eng.close()


def test_a_failed_init_on_a_full_disk_leaves_a_directory_that_initialises_once_space_is_freed(tmp_path):
    with mounted(tmp_path / "disk", "size=16m") as disk:
        filler = _fill(disk, keep=256 << 10)
        with pytest.raises(zinf.TierError, match="Nothing was committed yet"):
            nvme_engine(disk / "nvme")
        filler.unlink()
        eng = nvme_engine(disk / "nvme")  # the same directory: opened empty, not "half-updated"
        try:
            assert eng.step == 0 and np.isfinite(eng.train_step(batches(1)[0])["loss"])
        finally:
            eng.close()


def test_a_second_job_saving_into_a_held_checkpoint_directory_is_refused_and_touches_nothing(tmp_path):
    ckpt = tmp_path / "ckpt"
    holder = subprocess.Popen([sys.executable, str(WORKERS / "ckpt_holder.py"), str(ckpt)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=job_env(jax_cache=True))
    try:
        line = holder.stdout.readline()
        assert line.startswith("saved"), line + holder.stderr.read()
        before = {p.name: (p / "zinf_meta.json").read_bytes() for p in ckpt.iterdir() if p.name != OWNER}
        assert sorted(before) == ["step_00000002", "step_00000004"]
        mine = zinf.initialize(ctor, loss_fn=lm_loss, optimizer=zinf.adamw(1e-3))
        try:
            mine.train_step(batches(1)[0])
            with pytest.raises(zinf.CheckpointError, match=rf"is held by pid {holder.pid} on "):
                mine.save(ckpt, max_to_keep=1)  # its retention would have deleted the other job's step_4
            after = {p.name: (p / "zinf_meta.json").read_bytes() for p in ckpt.iterdir() if p.name != OWNER}
            assert after == before
        finally:
            mine.close()
    finally:
        holder.stdin.write("\n")
        holder.stdin.close()
        assert holder.wait(timeout=120) == 0, holder.stderr.read()
        holder.stdout.close()
        holder.stderr.close()


def test_a_save_of_an_older_step_is_refused_unless_asked_and_never_deletes_a_newer_one(tmp_path):
    ckpt = tmp_path / "ckpt"
    eng = zinf.initialize(ctor, loss_fn=lm_loss, optimizer=zinf.adamw(1e-3))
    try:
        for b in batches(4):
            eng.train_step(b)
            eng.save(ckpt, max_to_keep=3)
    finally:
        eng.close()
    again = zinf.restore(ckpt / "step_00000002", ctor, loss_fn=lm_loss, optimizer=zinf.adamw(1e-3))
    try:
        again.train_step(batches(1, 2)[0])
        with pytest.raises(zinf.CheckpointError, match=r"holds a newer checkpoint \(step 4\) than this one \(step 3\)"):
            again.save(ckpt, max_to_keep=1)
        again.save(ckpt, max_to_keep=1, overwrite=True)  # step 3 replaces nothing newer
        assert sorted(p.name for p in ckpt.iterdir() if p.name != OWNER) == ["step_00000003", "step_00000004"]
    finally:
        again.close()


@pytest.mark.parametrize("bad", [np.zeros((0, CFG.seq + 1), np.int32), np.zeros((8, 0), np.int32)],
                         ids=["no-rows", "empty-sequence"])
def test_an_empty_batch_is_refused_before_anything_changes(bad):
    eng = zinf.initialize(ctor, loss_fn=lm_loss, optimizer=zinf.adamw(1e-3))
    try:
        eng.train_step(batches(1)[0])
        before, state = eng.param_arrays(), eng.passes.state
        with pytest.raises(ValueError, match="an empty axis"):
            eng.train_step(bad)
        with pytest.raises(ValueError, match="an empty axis"):
            eng.eval_step(bad)
        assert eng.step == 1 and eng.passes.state is state
        for k, v in eng.param_arrays().items():
            np.testing.assert_array_equal(v, before[k], err_msg=k)
    finally:
        eng.close()


@pytest.mark.parametrize("engine", ["compiled", "streamed"])
def test_a_scalar_batch_leaf_is_shared_by_every_device_in_both_engines_as_in_plain_jit(tmp_path, engine):
    cfg = GPTConfig(vocab=256, d_model=32, n_heads=4, n_layers=2, seq=16)

    def loss(model, batch):
        return lm_loss(model, batch["tokens"]) * batch["scale"]

    data = [{"tokens": b, "scale": np.float32(0.5 + s)} for s, b in enumerate(batches(3))]
    ref_losses, ref = optax_run(GPT(cfg, rngs=nnx.Rngs(0)), optax.adamw(1e-3), data, loss_fn=loss,
                                place=lambda x: jax.tree.map(jnp.asarray, x))
    off = zinf.Offload("nvme", path=str(tmp_path)) if engine == "streamed" else zinf.Offload("cpu")
    eng = zinf.initialize(lambda: GPT(cfg, rngs=nnx.Rngs(0)), loss_fn=loss, optimizer=optax.adamw(1e-3),
                          config=zinf.ZeroConfig(offload_param=off, offload_optimizer=off, engine=engine))
    try:
        assert eng.mode == engine
        np.testing.assert_allclose([eng.train_step(b)["loss"] for b in data], ref_losses, rtol=1e-5)
        got = eng.param_arrays()
        for k, v in ref.items():
            np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
    finally:
        eng.close()


def test_a_loss_that_raises_in_train_steps_yields_every_completed_step_and_the_retry_is_exact():
    def flaky(model, batch):
        if batch.shape[1] != CFG.seq + 1:  # raised when the loss meets this batch (traced for its new shape)
            raise RuntimeError("the loss failed")
        return lm_loss(model, batch)

    eng = zinf.initialize(ctor, loss_fn=flaky, optimizer=zinf.adamw(1e-3))
    ref = zinf.initialize(ctor, loss_fn=lm_loss, optimizer=zinf.adamw(1e-3))
    try:
        want = [ref.train_step(b)["loss"] for b in batches(5)]
        got = []
        odd = batch_at(corpus(), 3, 8, CFG.seq + 1)  # the 4th batch: its forward runs while step 3's update does
        with pytest.raises(RuntimeError, match="the loss failed"):
            for m in eng.train_steps([*batches(3), odd, *batches(1, 4)]):
                got.append(m["loss"])
        assert got == want[:3] and eng.step == 3  # steps 1-3 were yielded; the 4th's forward failed
        got += [m["loss"] for m in eng.train_steps(batches(2, 3))]  # the same batches again
        assert got == want  # bit for bit: the failed forward changed nothing
    finally:
        eng.close()
        ref.close()


def _kill_in_place_write(work: Path, steps: int) -> list[tuple[int, str]]:
    """Runs the guide's loop (workers/inplace_loop.py) and SIGKILLs it while a tier's in-place update is in
    progress (its manifest marked); returns the steps it printed."""
    env = job_env(jax_cache=True)
    proc = subprocess.Popen([sys.executable, str(WORKERS / "inplace_loop.py"), str(work), str(steps)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    printed: list[tuple[int, str]] = []
    try:
        line = proc.stdout.readline()  # the first step done: the next ones write in place
        assert line.startswith("step"), line + proc.stderr.read()
        printed.append((int(line.split()[1]), line.split()[2]))
        manifests = [work / "nvme" / t / "process_0" / "MANIFEST.json" for t in ("params", "optimizer")]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            marked = False
            for m in manifests:
                try:
                    marked |= bool(json.loads(m.read_text()).get("in_progress"))
                except (OSError, ValueError):
                    pass
            if marked:
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.0005)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    printed += [(int(l.split()[1]), l.split()[2]) for l in proc.stdout.read().splitlines() if l.startswith("step")]
    proc.stdout.close()
    proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL, "the loop finished before a kill landed in an in-place write"
    return printed


def test_a_kill_inside_an_in_place_nvme_write_then_the_guides_restore_loop_continues_bitwise(tmp_path):
    steps = 5
    ref = subprocess.run([sys.executable, str(WORKERS / "inplace_loop.py"), str(tmp_path / "ref"), str(steps)],
                         capture_output=True, text=True, env=job_env(jax_cache=True), timeout=600)
    assert ref.returncode == 0, ref.stderr[-2000:]
    want = [(int(l.split()[1]), l.split()[2]) for l in ref.stdout.splitlines() if l.startswith("step")]
    work = tmp_path / "run"
    before = _kill_in_place_write(work, steps)
    halves = [m for m in (work / "nvme").glob("*/process_0/MANIFEST.json") if json.loads(m.read_text()).get("in_progress")]
    assert halves, "the kill left no half-updated tier"
    rest = subprocess.run([sys.executable, str(WORKERS / "inplace_loop.py"), str(work), str(steps)],
                          capture_output=True, text=True, env=job_env(jax_cache=True), timeout=600)
    assert rest.returncode == 0, rest.stderr[-2000:]  # zinf.restore rebuilds the half-updated tier
    after = [(int(l.split()[1]), l.split()[2]) for l in rest.stdout.splitlines() if l.startswith("step")]
    assert after[0][0] == len(before) + 1  # from the last checkpoint, saved after the last step printed
    assert before + after == want  # every step, its loss bit for bit (float.hex)
