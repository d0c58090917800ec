"""Open weights in and out: safetensors files with Hugging Face names onto an NNX Llama whose paths differ.

The files are written by ``safetensors.numpy.save_file`` (the reference writer), read back by
``safetensors.numpy.load_file`` (the reference reader); params and optimizer live on nvme tiers.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import zinf_jax as zinf
from helpers.llama import Llama, LlamaConfig, flax_to_hf, hf_tensors, hf_to_flax, lm_loss

CFG = LlamaConfig()
HERE = os.path.dirname(__file__)


def _config(tmp_path, **kw):
    off = zinf.Offload("nvme", path=str(tmp_path / "nvme"))
    return zinf.ZeroConfig(offload_param=off, offload_optimizer=off, persistence_threshold=64, **kw)


def _engine(tmp_path, params, **kw):
    (tmp_path / "nvme").mkdir(exist_ok=True)
    return zinf.initialize(lambda: Llama(CFG, rngs=nnx.Rngs(0)), params=params, loss_fn=lm_loss,
                           config=_config(tmp_path), optimizer=zinf.adamw(1e-3), **kw)


def _as_model(hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The file's tensors under model paths, after the rename's transposes (what the model must hold)."""
    out = {}
    for name, value in hf.items():
        how = hf_to_flax(name)
        if how is None:
            continue
        how = zinf.TensorMap(how) if isinstance(how, str) else how
        out[how.path] = value if how.transpose is None else np.transpose(value, how.transpose)
    return out


def _assert_params_are(eng, want: dict[str, np.ndarray]):
    got = eng.param_arrays()
    assert sorted(got) == sorted(want)
    for p, v in want.items():
        np.testing.assert_array_equal(got[p], v.astype(np.float32), err_msg=p)  # exactly


def test_single_file_loads_exactly_with_renames_and_transposes(tmp_path):
    hf = hf_tensors(CFG)
    hf["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)  # skipped by rename (None)
    save_file(hf, str(tmp_path / "model.safetensors"))
    source = zinf.from_safetensors(tmp_path / "model.safetensors", rename=hf_to_flax)
    assert source.skipped == ["model.layers.0.self_attn.rotary_emb.inv_freq"]
    eng = _engine(tmp_path, source)
    _assert_params_are(eng, _as_model(hf))
    tokens = np.random.default_rng(1).integers(0, CFG.vocab, (8, 9)).astype(np.int32)
    assert np.isfinite(eng.train_step(tokens)["loss"])
    eng.close()


def test_sharded_index_of_two_files_loads_exactly_in_bf16(tmp_path):
    import ml_dtypes

    hf = hf_tensors(CFG, seed=3, dtype=ml_dtypes.bfloat16)
    names = sorted(hf)
    files = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for f, part in files.items():
        save_file({n: hf[n] for n in part}, str(tmp_path / f))
    index = {"metadata": {"total_size": sum(v.nbytes for v in hf.values())},
             "weight_map": {n: f for f, part in files.items() for n in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    eng = _engine(tmp_path, zinf.from_safetensors(tmp_path, rename=hf_to_flax))  # the directory: its index
    _assert_params_are(eng, _as_model(hf))  # bf16 -> the model's float32 exactly
    eng.close()


def test_mismatches_are_errors_naming_the_tensor(tmp_path):
    hf = hf_tensors(CFG)
    partial = {k: v for k, v in hf.items() if k != "model.layers.1.mlp.up_proj.weight"}
    save_file(partial, str(tmp_path / "missing.safetensors"))
    with pytest.raises(zinf.ParamMismatchError, match=r"missing \['layers/1/mlp/up/kernel'\]"):
        _engine(tmp_path, zinf.from_safetensors(tmp_path / "missing.safetensors", rename=hf_to_flax))
    save_file({**hf, "model.layers.0.extra.weight": np.zeros(3, np.float32)}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(zinf.ParamMismatchError, match="not in the model .*layers/0/extra"):
        _engine(tmp_path, zinf.from_safetensors(tmp_path / "extra.safetensors",
                                                rename=lambda n: "layers/0/extra" if "extra" in n else hf_to_flax(n)))
    wrong = dict(hf, **{"model.norm.weight": np.ones(CFG.d_model + 1, np.float32)})
    save_file(wrong, str(tmp_path / "shape.safetensors"))
    with pytest.raises(zinf.ParamMismatchError, match=r"'norm/scale' has shape \(33,\)"):
        _engine(tmp_path, zinf.from_safetensors(tmp_path / "shape.safetensors", rename=hf_to_flax))
    with pytest.raises(ValueError, match="both renamed to 'norm/scale'"):
        zinf.from_safetensors(tmp_path / "shape.safetensors",
                              rename=lambda n: "norm/scale" if "norm" in n else hf_to_flax(n))
    with pytest.raises(FileNotFoundError, match="no such file"):
        zinf.from_safetensors(tmp_path / "nope.safetensors")


def test_save_safetensors_round_trips_exactly_in_capped_shards(tmp_path):
    eng = _engine(tmp_path, None)
    tokens = np.random.default_rng(1).integers(0, CFG.vocab, (8, 9)).astype(np.int32)
    for _ in range(2):
        eng.train_step(tokens)
    params = eng.param_arrays()
    files = eng.save_safetensors(tmp_path / "out", rename=flax_to_hf, max_shard_bytes=24 << 10)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = [f for f in files if f.suffix == ".safetensors"]
    assert len(shards) >= 3 and all(f.stat().st_size <= (24 << 10) + 4096 for f in shards)  # + the header
    loaded = {}
    for f in shards:
        part = load_file(str(f))  # the reference reader, file by file
        assert all(index["weight_map"][n] == f.name for n in part)
        loaded.update(part)
    assert sorted(loaded) == sorted(index["weight_map"]) and "lm_head.weight" in loaded
    _ = [np.testing.assert_array_equal(v, np.transpose(loaded[flax_to_hf(p).path], (1, 0)) if isinstance(
        flax_to_hf(p), zinf.TensorMap) else loaded[flax_to_hf(p)], err_msg=p) for p, v in params.items()]
    eng.close()
    (tmp_path / "nvme2" / "nvme").mkdir(parents=True)
    again = zinf.initialize(lambda: Llama(CFG, rngs=nnx.Rngs(7)), params=zinf.from_safetensors(
        tmp_path / "out", rename=hf_to_flax), loss_fn=lm_loss, config=_config(tmp_path / "nvme2"),
        optimizer=zinf.adamw(1e-3))
    _assert_params_are(again, params)
    bf = again.save_safetensors(tmp_path / "bf16", rename=flax_to_hf, dtype="bfloat16")
    assert [f.name for f in bf] == ["model.safetensors"]
    one = load_file(str(bf[0]))
    import ml_dtypes

    np.testing.assert_array_equal(one["model.norm.weight"], params["norm/scale"].astype(ml_dtypes.bfloat16))
    again.close()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_each_read_only_their_slices(tmp_path):
    hf = hf_tensors(LlamaConfig(vocab=256, d_model=64, ffn=128))
    save_file(hf, str(tmp_path / "model.safetensors"))
    total = sum(v.nbytes for v in hf.values())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    port = str(_port())
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "..", "workers", "mp_safetensors_worker.py"), str(i),
                               port, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
             for i in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    for o in outs:  # the 64-element norm scales are persistent (read whole by both); the rest is sharded 8 ways
        assert 0.45 * total < o["bytes_read"] < 0.55 * total, (o, total)
        assert o["ok"], o


@pytest.mark.slow  # a 1 GB file: the lazy reads are checked at small size in test_open_weights
def test_loading_a_1gb_file_holds_no_more_host_ram_than_the_engines_own_init(tmp_path):
    """Peak RSS of initialising a 1.35 GB (fp32) model from its file vs from its initialisers, each in a fresh process."""
    from helpers.llama import BIG, save_hf

    size = save_hf(BIG, str(tmp_path / "model.safetensors"))
    assert size > 1 << 30
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    modes = ("fresh", "safetensors")  # side by side: each process's own peak RSS
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "..", "workers", "rss_load_worker.py"), mode,
                               str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for mode in modes]
    runs = {}
    for mode, p in zip(modes, procs):
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        runs[mode] = json.loads(out.strip().splitlines()[-1])
    assert runs["safetensors"]["bytes_read"] == size  # one process: every byte once, no more
    extra = runs["safetensors"]["peak_rss"] - runs["fresh"]["peak_rss"]
    assert extra < 0.3 * (1 << 30), runs  # the file is never in RAM whole


def test_lazy_slices_follow_transpose_and_reshape(tmp_path):
    a = np.arange(6 * 4 * 5, dtype=np.float32).reshape(6, 4, 5)
    save_file({"w": a, "b": np.arange(12, dtype=np.float32)}, str(tmp_path / "x.safetensors"))
    src = zinf.from_safetensors(tmp_path / "x.safetensors", rename=lambda n: {
        "w": zinf.TensorMap("w", transpose=(2, 0, 1)), "b": zinf.TensorMap("b", reshape=(3, 4))}[n])
    w, b = src.tensors["w"], src.tensors["b"]
    assert w.shape == (5, 6, 4) and b.shape == (3, 4)
    t = np.transpose(a, (2, 0, 1))
    for idx in [(slice(1, 3), slice(None), slice(2, 4)), (slice(0, 5), slice(4, 6)), (slice(None),)]:
        np.testing.assert_array_equal(w[idx], t[idx])
    before = src.bytes_read
    w[(slice(0, 1),)]  # one of five slices of the last file axis: a fifth of the bytes
    assert src.bytes_read - before == a.nbytes // 5
    np.testing.assert_array_equal(b[(slice(1, 2),)], np.arange(12, dtype=np.float32).reshape(3, 4)[1:2])
    np.testing.assert_array_equal(np.asarray(w), t)
    with pytest.raises(ValueError, match="cannot be reshaped"):
        zinf.from_safetensors(tmp_path / "x.safetensors", rename=lambda n: zinf.TensorMap(n, reshape=(7,)))
