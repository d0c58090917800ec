"""Test models written the way public Flax code is written (one idiom each, see test_idioms.py).

- LinenLM: a Linen decoder LM in the T5X/MaxText style: kernels boxed with
  ``nn.with_logical_partitioning``, the embedding and the layers built in
  ``setup()``, the embedding shared with the output (``attend``), blocks called
  with an array keyword argument (``decoder_mask=``) and a Python flag,
  dropout through ``apply(..., rngs={'dropout': key})``.
- LinenEncDec: a shared embedding built in the parent's ``setup()`` and handed
  to a child module that calls it (the child cannot run alone).
- LinenResNet: Conv + BatchNorm blocks with ``batch_stats`` through
  ``apply(..., mutable=['batch_stats'])`` and a ``train`` flag.
- NnxCNN: NNX Conv + BatchNorm + Dropout blocks, a BatchNorm and a Dropout in
  the glue, all with their own forked RNG streams.
- NnxSowLM: an NNX transformer whose blocks sow intermediates and share one
  ``nnx.Rngs`` held by the model (or take one passed in by the caller).
"""
from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True)
class LMConfig:
    vocab: int = 48
    emb: int = 32
    heads: int = 4
    mlp: int = 64
    layers: int = 2
    dropout: float = 0.1


def _logical(init, names):
    return nn.with_logical_partitioning(init, names)


class LinenMlp(nn.Module):
    cfg: LMConfig

    @nn.compact
    def __call__(self, x, deterministic: bool):
        c = self.cfg
        h = nn.Dense(c.mlp, kernel_init=_logical(nn.initializers.xavier_uniform(), ("embed", "mlp")))(x)
        h = nn.Dropout(c.dropout)(nn.gelu(h), deterministic=deterministic)
        return nn.Dense(c.emb, kernel_init=_logical(nn.initializers.xavier_uniform(), ("mlp", "embed")))(h)


class LinenDecoderLayer(nn.Module):
    cfg: LMConfig

    @nn.compact
    def __call__(self, x, decoder_mask=None, deterministic: bool = False):
        c = self.cfg
        y = nn.LayerNorm(scale_init=_logical(nn.initializers.ones, ("embed",)))(x)
        y = nn.SelfAttention(num_heads=c.heads, dropout_rate=c.dropout, deterministic=deterministic, use_bias=False,
                             kernel_init=_logical(nn.initializers.xavier_uniform(), ("embed", "heads", "kv")))(
            y, mask=decoder_mask)
        x = x + nn.Dropout(c.dropout)(y, deterministic=deterministic)
        y = nn.LayerNorm()(x)
        return x + LinenMlp(c)(y, deterministic)


class LinenLM(nn.Module):
    cfg: LMConfig

    def setup(self):
        c = self.cfg
        self.embed = nn.Embed(c.vocab, c.emb, embedding_init=_logical(nn.initializers.normal(1.0), ("vocab", "embed")))
        self.layers = [LinenDecoderLayer(c) for _ in range(c.layers)]
        self.norm = nn.LayerNorm()

    def __call__(self, tokens, deterministic: bool = False):
        x = self.embed(tokens)
        mask = nn.make_causal_mask(tokens)
        for layer in self.layers:
            x = layer(x, decoder_mask=mask, deterministic=deterministic)
        return self.embed.attend(self.norm(x))


class LinenDecoder(nn.Module):
    cfg: LMConfig
    shared_embedding: nn.Module

    @nn.compact
    def __call__(self, tokens):
        x = self.shared_embedding(tokens)
        for i in range(self.cfg.layers):
            x = LinenDecoderLayer(self.cfg, name=f"layers_{i}")(x, deterministic=True)
        return self.shared_embedding.attend(nn.LayerNorm()(x))


class LinenEncDec(nn.Module):
    cfg: LMConfig

    def setup(self):
        self.shared = nn.Embed(self.cfg.vocab, self.cfg.emb)
        self.decoder = LinenDecoder(self.cfg, shared_embedding=self.shared)

    def __call__(self, tokens):
        return self.decoder(tokens)


class LinenResBlock(nn.Module):
    filters: int

    @nn.compact
    def __call__(self, x, train: bool = True):
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5)
        y = nn.relu(norm()(nn.Conv(self.filters, (3, 3), use_bias=False)(x)))
        y = norm()(nn.Conv(self.filters, (3, 3), use_bias=False)(y))
        return nn.relu(x + y)


class LinenBNMlp(nn.Module):
    """Dense, BatchNorm and Dropout directly in one compact module, their modes set per call from ``train`` (the
    Flax docs' idiom): the repeated ``Dense_k`` and ``BatchNorm_k`` children are units, each run in the mode of the
    call that reaches it."""

    width: int = 128

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = x.reshape(x.shape[0], -1)
        for _ in range(2):
            x = nn.Dense(self.width)(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5)(x)
            x = nn.Dropout(0.2, deterministic=not train)(nn.relu(x))
        return nn.Dense(10)(x)


class LinenResNet(nn.Module):
    filters: int = 8
    classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(self.filters, (3, 3), use_bias=False, name="conv_init")(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, name="bn_init")(x))
        for _ in range(2):
            x = LinenResBlock(self.filters)(x, train=train)
        return nn.Dense(self.classes)(jnp.mean(x, axis=(1, 2)))


class NnxConvBlock(nnx.Module):
    def __init__(self, cin: int, cout: int, *, rngs: nnx.Rngs):
        self.conv = nnx.Conv(cin, cout, (3, 3), use_bias=False, rngs=rngs)  # BatchNorm follows
        self.bn = nnx.BatchNorm(cout, momentum=0.9, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)

    def __call__(self, x):
        return self.drop(nnx.relu(self.bn(self.conv(x))))


class NnxCNN(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.stem_bn = nnx.BatchNorm(1, momentum=0.9, rngs=rngs)  # small: stays in the glue
        self.blocks = nnx.List([NnxConvBlock(1, 8, rngs=rngs), NnxConvBlock(8, 8, rngs=rngs)])
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.head = nnx.Linear(8, 10, rngs=rngs)

    def __call__(self, x):
        x = self.stem_bn(x)
        for b in self.blocks:
            x = b(x)
        return self.head(self.drop(jnp.mean(x, axis=(1, 2))))


class NnxSowBlock(nnx.Module):
    def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
        self.rngs = rngs  # one Rngs shared by the model and every block
        self.ln = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=d, decode=False, dropout_rate=0.0,
                                           use_bias=False, rngs=rngs)  # a key bias has zero gradient
        self.up = nnx.Linear(d, 2 * d, rngs=rngs)
        self.down = nnx.Linear(2 * d, d, rngs=rngs)
        self.drop = nnx.Dropout(0.1)

    def __call__(self, x, *, mask, rngs=None):
        h = self.attn(self.ln(x), mask=mask)
        self.sow(nnx.Intermediate, "attn_out", h)
        x = x + self.drop(h, rngs=rngs if rngs is not None else self.rngs)
        return x + self.down(jax.nn.gelu(self.up(x)))


class NnxSowLM(nnx.Module):
    def __init__(self, cfg: LMConfig, *, rngs: nnx.Rngs):
        self.rngs = rngs
        self.embed = nnx.Embed(cfg.vocab, cfg.emb, rngs=rngs)
        self.blocks = nnx.List([NnxSowBlock(cfg.emb, cfg.heads, rngs) for _ in range(cfg.layers)])
        self.ln_f = nnx.LayerNorm(cfg.emb, rngs=rngs)
        self.drop = nnx.Dropout(0.1)

    def __call__(self, tokens, rngs=None):
        x = self.drop(self.embed(tokens), rngs=rngs if rngs is not None else self.rngs)
        mask = nnx.make_causal_mask(tokens)
        for b in self.blocks:
            x = b(x, mask=mask, rngs=rngs)
        return self.embed.attend(self.ln_f(x))


def xent(logits, labels):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def sow_penalty(model):
    """The mean square of every sown attention output (an auxiliary loss over intermediates)."""
    inter = nnx.pop(model, nnx.Intermediate)
    return sum(jnp.mean(h ** 2) for h in jax.tree.leaves(inter))


class NnxRootTable(nnx.Module):
    """A DiT-like table on the model itself (a learned position embedding, 8 x 64 elements), beside the blocks:
    above the tests' persistence threshold and in no unit, it belongs to the root."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.pos_embed = nnx.Param(jax.random.normal(rngs.params(), (8, 64)) * 0.02)
        self.proj = nnx.Linear(8, 64, rngs=rngs)
        self.blocks = nnx.List([NnxPlainBlock(64, rngs) for _ in range(2)])
        self.head = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        h = self.proj(x.reshape(x.shape[0], 8, 8)) + self.pos_embed[...]
        for b in self.blocks:
            h = b(h)
        return self.head(h.mean(1))


class NnxPlainBlock(nnx.Module):
    def __init__(self, d: int, rngs: nnx.Rngs):
        self.up, self.down = nnx.Linear(d, 2 * d, rngs=rngs), nnx.Linear(2 * d, d, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(x)))


class NnxStemEncoder(nnx.Module):
    """A Whisper-like encoder: a convolution stem next to the blocks inside the same parent (``encoder``), which
    is no unit because its blocks are: the stem's kernels belong to the root."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(32, 32, (3, 3), rngs=rngs)
        self.blocks = nnx.List([NnxPlainBlock(32, rngs) for _ in range(2)])

    def __call__(self, x):
        h = jax.nn.gelu(self.conv2(jax.nn.gelu(self.conv1(x))))
        h = h.reshape(h.shape[0], -1, h.shape[-1])
        for b in self.blocks:
            h = b(h)
        return h


class NnxWhisperLike(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.encoder = NnxStemEncoder(rngs=rngs)
        self.head = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        return self.head(self.encoder(x).mean(1))


class LinenRnnEncoder(nn.Module):
    """A module that runs an ``nn.RNN`` over its own LSTM cell (Flax's seq2seq example): the cell runs under the
    RNN's lifted scan, never alone; this module, which runs the scan, holds the cell's parameters as a unit."""

    hidden: int = 32

    @nn.compact
    def __call__(self, x):
        return nn.RNN(nn.LSTMCell(self.hidden))(nn.Dense(self.hidden)(x))


class LinenRnnSeq(nn.Module):
    """The encoder above, then a GRU cell run by an ``nn.RNN`` on the root (its parameters belong to the root)
    and a head."""

    @nn.compact
    def __call__(self, x):
        x = x.reshape(x.shape[0], 8, 8)
        h = LinenRnnEncoder()(x)
        h = nn.RNN(nn.GRUCell(32))(h)
        return nn.Dense(10)(h[:, -1])
