"""Models for open-weights loads that are not one file tensor per parameter.

:class:`TiedLlama` is :class:`~helpers.llama.Llama` with tied embeddings (its head is the embedding
table, read through ``embed.attend``: Qwen3 0.6B-4B, Gemma and Llama 3.2 1B/3B are built so, and their
checkpoints hold no ``lm_head.weight``). :class:`HeadsLM` keeps its attention projections per head
(``[d_model, n_heads, head_dim]``), so Hugging Face's ``[out, in]`` weights reach it transposed *and*
reshaped (:func:`heads_hf_to_flax`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import zinf_jax as zinf
from helpers.llama import Layer, LlamaConfig, RMSNorm, flax_to_hf


class TiedLlama(nnx.Module):
    """A Llama-style LM whose output head is its embedding table (``embed.attend``)."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, rngs=rngs)
        self.layers = nnx.List([Layer(cfg, rngs) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.d_model)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.embed.attend(self.norm(x))


def head_from_embedding(path: str) -> str | zinf.TensorMap:
    """Model path -> HF name for a :class:`~helpers.llama.Llama` whose head was loaded from the embedding:
    both parameters are the one tensor ``model.embed_tokens.weight``."""
    if path == "lm_head/kernel":
        return zinf.TensorMap("model.embed_tokens.weight", transpose=(1, 0))
    return flax_to_hf(path)


class HeadsAttention(nnx.Module):
    """Self-attention with per-head projection kernels ``[d_model, heads, head_dim]`` and biases ``[heads, head_dim]``."""

    def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal(in_axis=0, out_axis=(1, 2))
        self.q = nnx.Param(init(rngs.params(), (d, heads, d // heads)))
        self.k = nnx.Param(init(rngs.params(), (d, heads, d // heads)))
        self.v = nnx.Param(init(rngs.params(), (d, heads, d // heads)))
        self.q_bias = nnx.Param(jnp.zeros((heads, d // heads)))
        self.o = nnx.Linear(d, d, use_bias=False, rngs=rngs)

    def __call__(self, x):
        b, t, d = x.shape
        q = jnp.einsum("btd,dhk->bthk", x, self.q[...]) + self.q_bias[...]
        k = jnp.einsum("btd,dhk->bthk", x, self.k[...])
        v = jnp.einsum("btd,dhk->bthk", x, self.v[...])
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
        att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
        return self.o(jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(att, -1), v).reshape(b, t, d))


class HeadsLM(nnx.Module):
    """Embedding, ``n_layers`` blocks of :class:`HeadsAttention`, a head."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, rngs=rngs)
        self.layers = nnx.List([HeadsAttention(cfg.d_model, cfg.n_heads, rngs) for _ in range(cfg.n_layers)])
        self.lm_head = nnx.Linear(cfg.d_model, cfg.vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = x + layer(x)
        return self.lm_head(x)


def heads_hf_tensors(cfg: LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Random HF-named weights for :class:`HeadsLM` (``[out, in]`` projections, flat biases)."""
    rng = np.random.default_rng(seed)
    d, v = cfg.d_model, cfg.vocab
    out = {"model.embed_tokens.weight": rng.standard_normal((v, d), np.float32) * 0.02,
           "lm_head.weight": rng.standard_normal((v, d), np.float32) * 0.02}
    for i in range(cfg.n_layers):
        for n in "qkvo":
            out[f"model.layers.{i}.self_attn.{n}_proj.weight"] = rng.standard_normal((d, d), np.float32) * 0.05
        out[f"model.layers.{i}.self_attn.q_proj.bias"] = rng.standard_normal((d,), np.float32) * 0.05
    return out


def heads_hf_to_flax(cfg: LlamaConfig):
    """HF name -> :class:`HeadsLM` path: q/k/v ``[out, in]`` transposed and split into heads, the q bias split."""
    h, hd, d = cfg.n_heads, cfg.d_model // cfg.n_heads, cfg.d_model

    def rename(name: str) -> str | zinf.TensorMap:
        if name == "model.embed_tokens.weight":
            return "embed/embedding"
        if name == "lm_head.weight":
            return zinf.TensorMap("lm_head/kernel", transpose=(1, 0))
        _, _, i, _, proj, kind = name.split(".")
        n = proj[0]
        if n == "o":
            return zinf.TensorMap(f"layers/{i}/o/kernel", transpose=(1, 0))
        if kind == "bias":
            return zinf.TensorMap(f"layers/{i}/q_bias", reshape=(h, hd))
        return zinf.TensorMap(f"layers/{i}/{n}", transpose=(1, 0), reshape=(d, h, hd))

    return rename
