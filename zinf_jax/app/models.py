"""A small GPT-style Flax NNX model and a corpus that needs no download.

Used by the main job (``zinf-jax train``), the examples and the benchmarks. The
corpus is the English help text that ships with every CPython
(``pydoc_data.topics``, about 460 kB), read as bytes: vocabulary 256.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = ["GPTConfig", "Block", "GPT", "lm_loss", "corpus", "batch_at"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of the model.

    Attributes:
      vocab: vocabulary size (256 for bytes).
      d_model: width.
      n_heads: attention heads.
      n_layers: transformer blocks.
      seq: maximum sequence length.
      dropout: dropout rate inside blocks.
    """

    vocab: int = 256
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 4
    seq: int = 64
    dropout: float = 0.0


class Block(nnx.Module):
    """Pre-norm transformer block: causal self-attention and an MLP."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        d = cfg.d_model
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=cfg.n_heads, in_features=d, decode=False, use_bias=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)
        self.drop = nnx.Dropout(cfg.dropout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + self.drop(self.attn(self.ln1(x), mask=mask))
        return x + self.drop(self.down(jax.nn.gelu(self.up(self.ln2(x)))))


class GPT(nnx.Module):
    """Token embedding, learned positions, N blocks, final norm, head tied to the embedding."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, rngs=rngs)
        self.pos = nnx.Embed(cfg.seq, cfg.d_model, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.ln_f = nnx.LayerNorm(cfg.d_model, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos(jnp.arange(tokens.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.embed.attend(self.ln_f(x))


def lm_loss(model, batch: jax.Array) -> jax.Array:
    """Mean next-token cross entropy of ``batch`` (tokens, shape ``[B, T+1]``)."""
    logits = model(batch[:, :-1])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1).mean()


def corpus() -> np.ndarray:
    """The bytes of CPython's bundled help topics as ``uint8``."""
    import pydoc_data.topics as topics

    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def batch_at(data: np.ndarray, step: int, batch: int, seq: int, seed: int = 0) -> np.ndarray:
    """The batch of ``step``: a pure function of (seed, step), so a resumed run sees the same data."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(data) - seq - 1, size=batch)
    return np.stack([data[s: s + seq + 1] for s in starts]).astype(np.int32)
