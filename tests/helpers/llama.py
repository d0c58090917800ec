"""A small NNX Llama-style LM whose parameter paths differ from Hugging Face's names.

Its params (``embed/embedding``, ``layers/0/attn/q/kernel`` [in, out], ``layers/0/norm1/scale``,
``lm_head/kernel``...) map onto HF Llama tensor names (``model.embed_tokens.weight``,
``model.layers.0.self_attn.q_proj.weight`` [out, in], ``model.layers.0.input_layernorm.weight``,
``lm_head.weight`` [vocab, d]) with :func:`hf_to_flax` / :func:`flax_to_hf`.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import zinf_jax as zinf


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 96
    d_model: int = 32
    n_heads: int = 4
    ffn: int = 64
    n_layers: int = 2


class RMSNorm(nnx.Module):
    def __init__(self, d: int):
        self.scale = nnx.Param(jnp.ones((d,)))

    def __call__(self, x):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * self.scale[...]


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.q, self.k, self.v, self.o = (nnx.Linear(d, d, use_bias=False, rngs=rngs) for _ in range(4))

    def __call__(self, x):
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = (f(x).reshape(b, t, h, d // h) for f in (self.q, self.k, self.v))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // h)
        att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
        return self.o(jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(att, -1), v).reshape(b, t, d))


class MLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.gate = nnx.Linear(cfg.d_model, cfg.ffn, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(cfg.d_model, cfg.ffn, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(cfg.ffn, cfg.d_model, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Layer(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.norm1, self.attn = RMSNorm(cfg.d_model), Attention(cfg, rngs)
        self.norm2, self.mlp = RMSNorm(cfg.d_model), MLP(cfg, rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Llama(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, rngs=rngs)
        self.layers = nnx.List([Layer(cfg, rngs) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.d_model)
        self.lm_head = nnx.Linear(cfg.d_model, cfg.vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def lm_loss(model, tokens):
    logits = model(tokens[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))


_PROJ = {"attn/q": "self_attn.q_proj", "attn/k": "self_attn.k_proj", "attn/v": "self_attn.v_proj",
         "attn/o": "self_attn.o_proj", "mlp/gate": "mlp.gate_proj", "mlp/up": "mlp.up_proj", "mlp/down": "mlp.down_proj"}
_NORM = {"norm1": "input_layernorm", "norm2": "post_attention_layernorm"}


def flax_to_hf(path: str) -> str | zinf.TensorMap:
    """Model path -> HF tensor name (kernels transposed back to [out, in])."""
    if path == "embed/embedding":
        return "model.embed_tokens.weight"
    if path == "norm/scale":
        return "model.norm.weight"
    if path == "lm_head/kernel":
        return zinf.TensorMap("lm_head.weight", transpose=(1, 0))
    _, i, rest = path.split("/", 2)
    for mine, theirs in _NORM.items():
        if rest == f"{mine}/scale":
            return f"model.layers.{i}.{theirs}.weight"
    module = rest.rsplit("/", 1)[0]
    return zinf.TensorMap(f"model.layers.{i}.{_PROJ[module]}.weight", transpose=(1, 0))


def hf_to_flax(name: str) -> str | zinf.TensorMap | None:
    """HF tensor name -> model path (``[out, in]`` weights transposed to ``[in, out]`` kernels)."""
    if name.endswith("rotary_emb.inv_freq"):
        return None  # a buffer, not a parameter
    if name == "model.embed_tokens.weight":
        return "embed/embedding"
    if name == "model.norm.weight":
        return "norm/scale"
    if name == "lm_head.weight":
        return zinf.TensorMap("lm_head/kernel", transpose=(1, 0))
    _, _, i, rest = name.split(".", 3)
    for mine, theirs in _NORM.items():
        if rest == f"{theirs}.weight":
            return f"layers/{i}/{mine}/scale"
    module = next(m for m, t in _PROJ.items() if rest == f"{t}.weight")
    return zinf.TensorMap(f"layers/{i}/{module}/kernel", transpose=(1, 0))


def hf_tensors(cfg: LlamaConfig, seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    """Random weights under HF names and layouts (what a downloaded checkpoint holds)."""
    rng = np.random.default_rng(seed)
    d, f, v = cfg.d_model, cfg.ffn, cfg.vocab

    def normal(scale, *shape):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)

    out = {"model.embed_tokens.weight": normal(0.02, v, d), "model.norm.weight": 1 + normal(0.1, d),
           "lm_head.weight": normal(0.02, v, d)}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        for name in ("q", "k", "v", "o"):
            out[p + f"self_attn.{name}_proj.weight"] = normal(0.05, d, d)
        out[p + "mlp.gate_proj.weight"] = normal(0.05, f, d)
        out[p + "mlp.up_proj.weight"] = normal(0.05, f, d)
        out[p + "mlp.down_proj.weight"] = normal(0.05, d, f)
        out[p + "input_layernorm.weight"] = 1 + normal(0.1, d)
        out[p + "post_attention_layernorm.weight"] = 1 + normal(0.1, d)
    return {k: np.asarray(a, dtype) for k, a in out.items()}


BIG = LlamaConfig(vocab=32000, d_model=2048, n_heads=16, ffn=5632, n_layers=4)
"""About 271M params (1.08 GB in fp32): the host-RAM check of a lazy load."""


def save_hf(cfg: LlamaConfig, path: str, seed: int = 0) -> int:
    """Writes random HF-named weights of ``cfg`` to one safetensors file; returns its tensor bytes."""
    from safetensors.numpy import save_file

    tensors = hf_tensors(cfg, seed)
    save_file(tensors, path)
    return sum(v.nbytes for v in tensors.values())
