"""Checkpoint retention: ``max_to_keep`` / ``--keep`` delete the oldest complete checkpoints, and only after a good save."""
import json

import jax
import numpy as np
import pytest
from flax import nnx

import zinf_jax as zinf
from zinf_jax.checkpoint.format import OWNER
import zinf_jax.checkpoint
from zinf_jax.app.cli import main
from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss

CFG = GPTConfig(vocab=256, d_model=32, n_heads=4, n_layers=2, seq=16)
DATA = corpus()
CPU = zinf.ZeroConfig(offload_param=zinf.Offload("cpu"), offload_optimizer=zinf.Offload("cpu"), persistence_threshold=600)


def ctor():
    return GPT(CFG, rngs=nnx.Rngs(0))


def engine():
    return zinf.initialize(ctor, config=CPU, optimizer=zinf.adamw(3e-3), loss_fn=lm_loss)


def step(eng):
    eng.train_step(batch_at(DATA, eng.step, 8, CFG.seq))


def names(ckpt):
    return sorted(p.name for p in ckpt.iterdir() if p.name != OWNER)  # the saving job's lock file aside


def test_keeps_the_newest_n_and_restores_from_the_newest(tmp_path):
    ckpt = tmp_path / "ckpt"
    eng = engine()
    try:
        for _ in range(5):
            step(eng)
            eng.save(ckpt, user_state={"data_step": eng.step}, max_to_keep=2)
        assert names(ckpt) == ["step_00000004", "step_00000005"]
        params = _bytes(eng)
        # saving the same step again applies the policy too, and keeps that checkpoint
        assert eng.save(ckpt, max_to_keep=1).name == "step_00000005"
        assert names(ckpt) == ["step_00000005"]
    finally:
        eng.close()
    again = zinf.restore(ckpt, ctor, config=CPU, optimizer=zinf.adamw(3e-3), loss_fn=lm_loss)
    try:
        assert again.step == 5 and again.user_state == {"data_step": 5}
        assert _bytes(again) == params
        # a newer checkpoint there (another run's step 99): saving an older step is refused unless asked for, and
        # then retention deletes only the past of the step just written, never the newer one; incomplete step
        # dirs are not checkpoints and are left alone; a crash's .del_* leftovers go
        fake = ckpt / "step_00000099"
        fake.mkdir()
        (fake / "zinf_meta.json").write_text("{}")
        (ckpt / "step_00000098").mkdir()  # no zinf_meta.json
        (ckpt / ".del_step_00000001_deadbeef" / "group_0000").mkdir(parents=True)
        step(again)
        with pytest.raises(zinf.CheckpointError, match=r"holds a newer checkpoint \(step 99\) than this one \(step 6\)"):
            again.save(ckpt, max_to_keep=2)
        assert names(ckpt) == [".del_step_00000001_deadbeef", "step_00000005", "step_00000098",
                               "step_00000099"]  # nothing written, nothing gone
        again.save(ckpt, max_to_keep=2, overwrite=True)
        assert names(ckpt) == ["step_00000005", "step_00000006", "step_00000098", "step_00000099"]
        step(again)
        again.save(ckpt, max_to_keep=2, overwrite=True)  # step 7: its past beyond one more (step 5) goes
        assert names(ckpt) == ["step_00000006", "step_00000007", "step_00000098", "step_00000099"]
    finally:
        again.close()


def test_failed_save_deletes_nothing(tmp_path):
    ckpt = tmp_path / "ckpt"
    eng = engine()
    try:
        for _ in range(2):
            step(eng)
            eng.save(ckpt)
        before = names(ckpt)
        step(eng)
        with pytest.raises(TypeError):  # json cannot write tuple keys: raised after the groups were written
            eng.save(ckpt, user_state={"bad": {(1, 2): 0}}, max_to_keep=1)
        assert names(ckpt) == before == ["step_00000001", "step_00000002"]  # nothing deleted, no .tmp_* left
        assert eng.save(ckpt, max_to_keep=1).name == "step_00000003"  # the next good save prunes
        assert names(ckpt) == ["step_00000003"]
    finally:
        eng.close()


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_bad_max_to_keep(tmp_path, bad):
    with pytest.raises(ValueError, match="max_to_keep"):
        zinf.checkpoint.save(None, tmp_path / "ckpt", max_to_keep=bad)  # checked before anything is written
    assert not (tmp_path / "ckpt").exists()


def test_bad_max_to_keep_through_the_engine(tmp_path):
    eng = engine()
    try:
        with pytest.raises(ValueError, match="max_to_keep"):
            eng.save(tmp_path / "ckpt", max_to_keep=0)
    finally:
        eng.close()


TINY = ["--d-model", "32", "--n-layers", "2", "--seq", "32", "--batch", "8", "--no-progress",
        "--param-device", "cpu", "--optimizer-device", "cpu"]


@pytest.mark.slow
def test_cli_keep(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *TINY, "--steps", "5", "--save-every", "2", "--keep", "1"]) == 0
    assert names(run / "ckpt") == ["step_00000005"]
    assert json.loads((run / "summary.json").read_text())["step"] == 5
    assert main(["train", "--run-dir", str(run), *TINY, "--steps", "1", "--keep", "-1"]) == 2
    err = capsys.readouterr().err
    assert "error" in err and "--keep" in err


def _bytes(eng):
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(eng.params())]
