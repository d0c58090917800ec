"""NNX LMs that read a unit's parameter outside the unit's own call, as public LLM code does.

``TiedHeadLM``: the head is ``h @ self.embed.embedding[...].T`` in the top-level call (Mamba-2 style).
``LookupLM``: tokens are looked up with ``embedding[...].at[(tokens,)].get()`` and the head reads
``w.T`` / ``w[:]`` / ``w.value`` of the same Variable (Qwen3 style). Both tie the table to the head,
so its gradient is the sum of the lookup's and the head's.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class Block(nnx.Module):
    def __init__(self, d: int, rngs: nnx.Rngs):
        self.ln = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.ln(x))))


class TiedHeadLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, vocab: int = 64, d: int = 32, layers: int = 2):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, rngs) for _ in range(layers)])
        self.ln = nnx.LayerNorm(d, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.ln(x) @ self.embed.embedding[...].T


class LookupLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, vocab: int = 64, d: int = 32, layers: int = 2):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, rngs) for _ in range(layers)])
        self.ln = nnx.LayerNorm(d, rngs=rngs)
        self.scale = nnx.Param(jnp.ones(()))

    def __call__(self, tokens):
        x = self.embed.embedding[...].at[(tokens,)].get(mode="clip")
        for b in self.blocks:
            x = b(x)
        w = self.embed.embedding
        return self.ln(x) @ w.T * self.scale[...] + 1e-3 * jnp.mean(w[:]) - 1e-3 * jnp.mean(w.get_value())


def lm_loss(model, tokens):
    logits = model(tokens[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))


import flax.linen as nn  # noqa: E402  (the Linen models below)


class LinenBlock(nn.Module):
    d: int

    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(self.d)(jax.nn.gelu(nn.Dense(4 * self.d)(nn.LayerNorm()(x))))


class LinenTiedLM(nn.Module):
    """A Linen LM whose head shares the embedding: read as ``self.embed.embedding`` (``read="attr"``),
    through ``self.variables`` (``"variables"``), or with ``embed.attend`` (``"attend"``)."""

    vocab: int = 64
    d: int = 32
    read: str = "attr"

    def setup(self):
        self.embed = nn.Embed(self.vocab, self.d)
        self.blocks = [LinenBlock(self.d) for _ in range(2)]
        self.ln = nn.LayerNorm()

    def __call__(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        h = self.ln(x)
        if self.read == "attend":
            return self.embed.attend(h)
        table = self.embed.embedding if self.read == "attr" else self.variables["params"]["embed"]["embedding"]
        return h @ table.T


def linen_loss(model, tokens):
    logits = model(tokens[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))
