"""Open weights that are not one file tensor per parameter: tied embeddings (a checkpoint without
``lm_head.weight``) into a model with its own head and into a tied one, export of tied tensors, and
reshaped (split-into-heads) loads that read each byte of the file once per process.

Params and optimizer on nvme tiers; files written and read by safetensors' own numpy functions.
"""
from __future__ import annotations

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import zinf_jax as zinf
from helpers.llama import Llama, LlamaConfig, flax_to_hf, hf_tensors, hf_to_flax, lm_loss
from helpers.open_weights import HeadsLM, TiedLlama, head_from_embedding, heads_hf_tensors, heads_hf_to_flax

CFG = LlamaConfig()


def _engine(tmp_path, model, params, name="nvme"):
    off = zinf.Offload("nvme", path=str(tmp_path / name))
    (tmp_path / name).mkdir(exist_ok=True)
    return zinf.initialize(lambda: model(CFG, rngs=nnx.Rngs(0)), params=params, loss_fn=lm_loss,
                           config=zinf.ZeroConfig(offload_param=off, offload_optimizer=off, persistence_threshold=16),
                           optimizer=zinf.adamw(1e-3))


@pytest.fixture
def tied_file(tmp_path):
    """A Llama checkpoint with tied embeddings: no ``lm_head.weight``."""
    hf = hf_tensors(CFG, seed=5)
    del hf["lm_head.weight"]
    save_file(hf, str(tmp_path / "model.safetensors"))
    return tmp_path / "model.safetensors", hf


def _tokens():
    return np.random.default_rng(1).integers(0, CFG.vocab, (8, 9)).astype(np.int32)


def test_tied_checkpoint_into_a_model_with_its_own_head(tmp_path, tied_file):
    path, hf = tied_file
    embed = hf["model.embed_tokens.weight"]
    with pytest.raises(zinf.ParamMismatchError, match="lm_head/kernel"):  # without the rule: named as missing
        _engine(tmp_path, Llama, zinf.from_safetensors(path, rename=hf_to_flax))
    src = zinf.from_safetensors(path, rename=hf_to_flax, fill=zinf.TIED_EMBEDDINGS)
    assert src.filled == ["lm_head.weight"]
    eng = _engine(tmp_path, Llama, src)
    got = eng.param_arrays()
    np.testing.assert_array_equal(got["lm_head/kernel"], embed.T)  # lazily, transposed, bitwise
    np.testing.assert_array_equal(got["embed/embedding"], embed)
    files = eng.save_safetensors(tmp_path / "out", rename=head_from_embedding)  # tied: written once
    back = load_file(str(files[0]))
    assert "lm_head.weight" not in back and sorted(back) == sorted(hf)
    assert all(np.array_equal(back[n], hf[n]) for n in hf)  # bitwise round trip
    eng.train_step(_tokens())  # now the head and the table differ: no longer one tensor
    with pytest.raises(ValueError, match="values differ"):
        eng.save_safetensors(tmp_path / "out2", rename=head_from_embedding)
    eng.close()


def test_one_file_tensor_feeds_several_parameters(tmp_path, tied_file):
    path, hf = tied_file

    def rename(name):
        if name == "model.embed_tokens.weight":
            return ["embed/embedding", zinf.TensorMap("lm_head/kernel", transpose=(1, 0))]
        return hf_to_flax(name)

    eng = _engine(tmp_path, Llama, zinf.from_safetensors(path, rename=rename))
    np.testing.assert_array_equal(eng.param_arrays()["lm_head/kernel"], hf["model.embed_tokens.weight"].T)
    eng.close()


def test_tied_checkpoint_into_a_tied_model_round_trips_bitwise(tmp_path, tied_file):
    path, hf = tied_file
    eng = _engine(tmp_path, TiedLlama, zinf.from_safetensors(path, rename=hf_to_flax))
    got = eng.param_arrays()
    assert "lm_head/kernel" not in got
    np.testing.assert_array_equal(got["embed/embedding"], hf["model.embed_tokens.weight"])
    assert np.isfinite(eng.train_step(_tokens())["loss"])
    trained = eng.param_arrays()
    files = eng.save_safetensors(tmp_path / "out", rename=flax_to_hf)
    eng.close()
    assert sorted(load_file(str(files[0]))) == sorted(hf)  # the table once, no head
    again = _engine(tmp_path, TiedLlama, zinf.from_safetensors(tmp_path / "out", rename=hf_to_flax), "nvme2")
    for p, v in again.param_arrays().items():
        np.testing.assert_array_equal(v, trained[p], err_msg=p)
    again.close()


def test_reshaped_and_transposed_loads_read_each_byte_once(tmp_path):
    hf = heads_hf_tensors(CFG, seed=2)
    save_file(hf, str(tmp_path / "model.safetensors"))
    rename = heads_hf_to_flax(CFG)
    src = zinf.from_safetensors(tmp_path / "model.safetensors", rename=rename)
    eng = _engine(tmp_path, HeadsLM, src)
    file_bytes = sum(v.nbytes for v in hf.values())
    assert src.bytes_read <= 1.1 * file_bytes, (src.bytes_read, file_bytes)
    got = eng.param_arrays()
    h, hd, d = CFG.n_heads, CFG.d_model // CFG.n_heads, CFG.d_model
    for i in range(CFG.n_layers):
        p = f"model.layers.{i}.self_attn."
        np.testing.assert_array_equal(got[f"layers/{i}/q"], hf[p + "q_proj.weight"].T.reshape(d, h, hd))
        np.testing.assert_array_equal(got[f"layers/{i}/q_bias"], hf[p + "q_proj.bias"].reshape(h, hd))
    eng.close()


def test_read_slices_reads_a_slice_shared_by_devices_once(tmp_path):
    a = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    save_file({"w": a}, str(tmp_path / "x.safetensors"))
    src = zinf.from_safetensors(tmp_path / "x.safetensors", rename=lambda n: zinf.TensorMap("w", transpose=(1, 0)))
    t = src.tensors["w"]
    halves = [(slice(0, 3), slice(None)), (slice(3, 6), slice(None))] * 4  # 8 devices, 2 shards
    parts = t.read_slices(halves)
    assert src.bytes_read == a.nbytes
    for idx, part in zip(halves, parts):
        np.testing.assert_array_equal(part, a.T[idx])
