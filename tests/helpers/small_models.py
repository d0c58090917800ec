"""Small real Flax models used across the tests.

``TinyLM`` is a GPT-style LM with dropout and a learned position table (the demo model of the
library is :class:`zinf_jax.models.GPT`; this one is smaller and exercises dropout).
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True)
class TinyLMConfig:
    vocab: int = 61
    d_model: int = 32
    n_heads: int = 4
    n_layers: int = 2
    seq: int = 16
    dropout: float = 0.1


class TinyBlock(nnx.Module):
    """Pre-norm transformer block: attention + MLP, layer norms, dropout."""

    def __init__(self, cfg: TinyLMConfig, *, rngs: nnx.Rngs):
        d = cfg.d_model
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=cfg.n_heads, in_features=d, decode=False, dropout_rate=0.0, rngs=rngs
        )
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)
        self.drop = nnx.Dropout(cfg.dropout, rngs=rngs)

    def __call__(self, x):
        t = x.shape[1]
        mask = nnx.make_causal_mask(jnp.ones((x.shape[0], t)))
        x = x + self.drop(self.attn(self.ln1(x), mask=mask))
        return x + self.drop(self.down(jax.nn.gelu(self.up(self.ln2(x)))))


class TinyLM(nnx.Module):
    """Token embedding, N blocks, final norm, output head tied to the embedding."""

    def __init__(self, cfg: TinyLMConfig, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, rngs=rngs)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (cfg.seq, cfg.d_model)) * 0.02)
        self.blocks = nnx.List([TinyBlock(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.ln_f = nnx.LayerNorm(cfg.d_model, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos[...][: tokens.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.embed.attend(self.ln_f(x))


def lm_loss(model, batch):
    """Next-token cross entropy."""
    logits = model(batch[:, :-1])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    nll = -jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1)
    return nll.mean()


class ConvNet(nn.Module):
    """Linen CNN whose parameter shapes do not divide by 8."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(5, (3, 3))(x))
        x = nn.relu(nn.Conv(7, (3, 3))(x))
        x = x.reshape(x.shape[0], -1)
        x = nn.relu(nn.Dense(13)(x))
        return nn.Dense(3)(x)


def mse_loss(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


class LinenBlock(nn.Module):
    """A residual MLP block with its own Dense children and dropout, called with a positional ``train`` flag."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        h = nn.Dropout(0.5, deterministic=not train)(nn.relu(nn.Dense(24)(x)))
        return x + nn.Dense(x.shape[-1])(h)


class LinenMLP(nn.Module):
    """Top-level Dense children whose names repeat inside the blocks (``Dense_0`` at both levels)."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Dense(16)(x)
        for i in range(2):
            x = LinenBlock(name=f"block_{i}")(x, train)
        return nn.Dense(3)(x)
