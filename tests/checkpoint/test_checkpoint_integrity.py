"""Checkpoint integrity: checksums verified at restore, damage named, no silent re-save, disk full in one line,
and plain-orbax reading on any device count."""
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import warnings

import jax
import numpy as np
import pytest
from flax import nnx

import zinf_jax as zinf
from zinf_jax.checkpoint.format import OWNER
import zinf_jax.checkpoint as ckpt_mod
from zinf_jax.checkpoint import CheckpointError, read_meta
from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss
from helpers.tmpfs import mounted

CFG = GPTConfig(vocab=256, d_model=32, n_heads=4, n_layers=2, seq=16)
DATA = corpus()
CPU = zinf.ZeroConfig(offload_param=zinf.Offload("cpu"), offload_optimizer=zinf.Offload("cpu"), persistence_threshold=600)


def ctor():
    return GPT(CFG, rngs=nnx.Rngs(0))


def engine(lr=3e-3):
    return zinf.initialize(ctor, config=CPU, optimizer=zinf.adamw(lr), loss_fn=lm_loss)


def step(eng):
    return eng.train_step(batch_at(DATA, eng.step, 8, CFG.seq))["loss"]


def restore(ckpt):
    return zinf.restore(ckpt, ctor, config=CPU, optimizer=zinf.adamw(3e-3), loss_fn=lm_loss)


def files(step_dir):
    return {str(p.relative_to(step_dir)): p.read_bytes() for p in sorted(step_dir.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A checkpoint at step 1, the engine's values then, and the loss of step 2 from there."""
    ckpt = tmp_path_factory.mktemp("good") / "ckpt"
    eng = engine()
    try:
        step(eng)
        step_dir = eng.save(ckpt, user_state={"data_step": 1})
        values = eng.param_arrays()
        loss2 = step(eng)
    finally:
        eng.close()
    return ckpt, step_dir, values, loss2


@pytest.fixture
def copy(good, tmp_path):
    """A copy of the good checkpoint to damage: (ckpt dir, step dir)."""
    shutil.copytree(good[0], tmp_path / "ckpt")
    return tmp_path / "ckpt", tmp_path / "ckpt" / good[1].name


def test_checksums_cover_every_file_and_restore_is_exact(good):
    ckpt, step_dir, values, loss2 = good
    table = json.loads((step_dir / "checksums.json").read_text())
    on_disk = {str(p.relative_to(step_dir)) for p in step_dir.rglob("*") if p.is_file()} - {"checksums.json"}
    assert set(table) == on_disk and "zinf_meta.json" in table
    assert read_meta(step_dir)["format"] == "zinf_jax.checkpoint/2"
    eng = restore(ckpt)
    try:
        assert all(np.array_equal(eng.param_arrays()[p], v) for p, v in values.items())
        assert step(eng) == loss2
    finally:
        eng.close()


def _biggest(step_dir, under):
    return max((p for p in (step_dir / under).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("where", ["group data", "group metadata", "rng", "meta"])
def test_a_flipped_bit_is_an_error_naming_the_file(copy, where):
    ckpt, step_dir = copy
    if where == "meta":  # still valid JSON: a digit of the step count
        target = step_dir / "zinf_meta.json"
        target.write_text(target.read_text().replace('"step": 1,', '"step": 3,', 1))
    else:
        target = {"group data": lambda: _biggest(step_dir, "group_0001"),
                  "group metadata": lambda: step_dir / "group_0002" / "_METADATA",
                  "rng": lambda: _biggest(step_dir, "rng")}[where]()
        raw = bytearray(target.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        target.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=rf"damaged: file '{re.escape(str(target))}' has crc32"):
        restore(ckpt)


def test_missing_files_and_garbage_metadata_name_the_file(copy):
    ckpt, step_dir = copy
    victim = _biggest(step_dir, "group_0000")
    victim.unlink()
    with pytest.raises(CheckpointError, match=rf"file '{re.escape(str(victim))}' is missing"):
        restore(ckpt)
    shutil.rmtree(step_dir / "group_0000")
    with pytest.raises(CheckpointError, match=rf"'{re.escape(str(step_dir / 'group_0000'))}' is missing"):
        restore(ckpt)
    (step_dir / "checksums.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=rf"'{re.escape(str(step_dir / 'checksums.json'))}' is unreadable"):
        restore(ckpt)
    meta = step_dir / "zinf_meta.json"
    named = re.escape(repr(str(meta)))
    for garbage, why in [(b"", "is unreadable or damaged"), (b"\xff\xfe\x00garbage", "is unreadable or damaged"),
                         (b"[]", "is damaged: no step"), (b"{}", "is damaged: no step")]:
        meta.write_bytes(garbage)
        with pytest.raises(CheckpointError, match=f"{named} {why}"):
            read_meta(step_dir)
    with pytest.raises(CheckpointError, match=named):
        restore(step_dir)


def test_saving_a_saved_step_again_needs_the_same_state(tmp_path):
    ckpt = tmp_path / "ckpt"
    a = engine()
    try:
        step(a)
        step_dir = a.save(ckpt, user_state={"data_step": 1})
        before = files(step_dir)
        assert a.save(ckpt, user_state={"data_step": 1}) == step_dir  # the same engine, nothing since: kept
        named = re.escape(repr(str(step_dir)))
        with pytest.raises(CheckpointError, match=rf"{named} already exists.*'user_state' differs"):
            a.save(ckpt, user_state={"data_step": 7})
    finally:
        a.close()
    twin, other = engine(), engine(lr=1e-2)  # the same run again; a run with another learning rate
    try:
        step(twin)
        step(other)
        assert twin.save(ckpt, user_state={"data_step": 1}) == step_dir  # compared array by array: the same
        with pytest.raises(CheckpointError, match=r"is held by pid \d+ on .*one job saves into a checkpoint"):
            other.save(ckpt, user_state={"data_step": 1})  # twin holds the directory until it closes
        twin.close()
        with pytest.raises(CheckpointError, match=rf"'{re.escape(str(step_dir))}' already exists and holds another "
                                                  r"training state \('master' of '.*' differs\)"):
            other.save(ckpt, user_state={"data_step": 1})
    finally:
        twin.close()
        other.close()
    assert files(step_dir) == before  # never rewritten
    again = restore(ckpt)  # a restored engine saves the step it restored without comparing
    try:
        assert again.save(ckpt, user_state={"data_step": 1}) == step_dir
    finally:
        again.close()
    assert files(step_dir) == before


@pytest.mark.parametrize("damage", ["no meta", "garbage meta", "flipped bit"])
def test_a_damaged_step_dir_is_set_aside_and_saved_anew(good, copy, damage):
    ckpt, step_dir = copy
    if damage == "no meta":  # e.g. a copy interrupted, or the file deleted: not a checkpoint
        (step_dir / "zinf_meta.json").unlink()
    elif damage == "garbage meta":
        (step_dir / "zinf_meta.json").write_text("garbage")
    else:
        victim = _biggest(step_dir, "group_0001")
        raw = bytearray(victim.read_bytes())
        raw[0] ^= 1
        victim.write_bytes(bytes(raw))
    eng = engine()
    try:
        step(eng)
        with pytest.warns(RuntimeWarning, match="set it aside as"):
            assert eng.save(ckpt, user_state={"data_step": 1}) == step_dir
    finally:
        eng.close()
    assert len(list(ckpt.glob(".bad_step_00000001_*"))) == 1
    again = restore(ckpt)
    try:
        assert step(again) == good[3]
    finally:
        again.close()


def test_disk_full_is_one_error_and_leaves_nothing(tmp_path, capfd):
    eng = engine()
    try:
        step(eng)
        capfd.readouterr()
        with mounted(tmp_path / "full", "size=64k") as full:
            want = re.escape(repr(str(full / "ckpt" / "step_00000001")))
            with pytest.raises(CheckpointError, match=rf"disk full while saving {want}: .*No space left on device") \
                    as info:
                eng.save(full / "ckpt")
            assert info.value.__cause__ is not None
            assert os.listdir(full / "ckpt") == [OWNER]  # the temporary directory is removed: the space is free again
            del info
            import gc

            gc.collect()
        err = capfd.readouterr().err
        assert "Traceback" not in err and "Event loop is closed" not in err, err[:3000]
        assert eng.save(tmp_path / "ok").name == "step_00000001"  # the engine is fine
    finally:
        eng.close()


def _snippet() -> str:
    doc = ckpt_mod.__doc__
    block = doc[doc.index("Reading without zinf_jax"):].split("::", 1)[1]
    return textwrap.dedent(block)


def test_plain_orbax_reads_a_group_on_one_device(good, tmp_path):
    _, step_dir, values, _ = good
    code = _snippet().replace('"ckpt/step_00000030/group_0003"', repr(str(step_dir / "group_0000")))
    code = code.replace('tree["master"]["blocks"]["3"]["mlp"]["kernel"]', "")
    code += textwrap.dedent(f"""
        assert jax.device_count() == 1
        from flax import traverse_util
        flat = {{"/".join(k): v for k, v in traverse_util.flatten_dict(tree["master"]).items()}}
        np.savez({str(tmp_path / "out.npz")!r}, **{{k.replace("/", "|"): v for k, v in flat.items()}})
    """)
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "1", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = {k.replace("|", "/"): v for k, v in np.load(tmp_path / "out.npz").items()}
    group = read_meta(step_dir)["groups"][0]
    assert sorted(got) == sorted(group) and len(jax.devices()) == 8
    for p in group:
        assert got[p].dtype == np.float32 and np.array_equal(got[p], values[p])


def test_a_failed_delete_is_a_warning_and_loses_nothing(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    eng = engine()
    try:
        for _ in range(3):
            step(eng)
            eng.save(ckpt)
        monkeypatch.setattr(os, "rename", lambda *a: (_ for _ in ()).throw(PermissionError("ro")))
        with pytest.warns(RuntimeWarning, match="max_to_keep=1"):  # the step is saved: only the policy runs
            assert eng.save(ckpt, max_to_keep=1).name == "step_00000003"
        assert sorted(p.name for p in ckpt.iterdir()) == [OWNER, "step_00000001", "step_00000002", "step_00000003"]
        monkeypatch.undo()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            eng.save(ckpt, max_to_keep=1)
        assert sorted(p.name for p in ckpt.iterdir()) == [OWNER, "step_00000003"]
    finally:
        eng.close()
