"""Deep models written the way Flax documents fast-to-compile stacks: the layers' parameters stacked along a
leading layer axis and applied by a scan. Our own code, for the tests.

- :class:`VmapScanMLP` (NNX): blocks (Linear, BatchNorm, Dropout) made by ``nnx.split_rngs`` +
  ``nnx.vmap`` (each layer its own init key and dropout stream), applied by ``nnx.scan`` with the layer
  state scanned (axis 0) and the activations carried.
- :class:`LaxScanLM` (NNX): decoder blocks made by ``nnx.split_rngs`` + ``nnx.vmap``, applied by a plain
  ``jax.lax.scan`` over their ``nnx.split`` state, each layer's call under ``nnx.remat``.
- :class:`LinenScanLM` (Linen): an ``nn.scan`` over a rematerialised decoder block
  (``nn.remat``; ``variable_axes={"params": 0}``, ``split_rngs={"params": True, "dropout": True}``).

The stack lives in a module of its own (``stack``) whose call holds the scan: that module is the unit
(``STACK_POLICY``), so the engine shards the stacked leaves at rest and gathers them for the scan.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import zinf_jax as zinf

STACK_POLICY = zinf.UnitPolicy(patterns=(r"stack",))
"""The module that holds a scan over stacked layers is a unit (with the default units beside it)."""


class MLPBlock(nnx.Module):
    def __init__(self, d: int, rngs: nnx.Rngs):
        self.lin = nnx.Linear(d, d, rngs=rngs)
        self.bn = nnx.BatchNorm(d, momentum=0.9, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.drop(nnx.relu(self.bn(self.lin(x))))


class MLPStack(nnx.Module):
    """``n`` :class:`MLPBlock` s made at once by ``nnx.vmap`` and applied by ``nnx.scan``."""

    def __init__(self, n: int, d: int, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=n)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs: nnx.Rngs) -> MLPBlock:
            return MLPBlock(d, rngs)

        self.layers = make(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def step(x: jax.Array, layer: MLPBlock) -> jax.Array:
            return layer(x)

        return step(x, self.layers)


class VmapScanMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, d_in: int = 8, d: int = 32, n: int = 4, classes: int = 10):
        self.inp = nnx.Linear(d_in, d, rngs=rngs)
        self.stack = MLPStack(n, d, rngs)
        self.head = nnx.Linear(d, classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.head(self.stack(self.inp(x)))


class DecoderBlock(nnx.Module):
    def __init__(self, d: int, heads: int, rngs: nnx.Rngs):
        self.heads = heads
        self.norm1, self.norm2 = nnx.RMSNorm(d, rngs=rngs), nnx.RMSNorm(d, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, use_bias=False, rngs=rngs)
        self.o = nnx.Linear(d, d, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        q, k, v = (a.reshape(b, t, self.heads, d // self.heads) for a in jnp.split(self.qkv(self.norm1(x)), 3, -1))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (d // self.heads) ** -0.5
        att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
        x = x + self.o(jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(att, -1), v).reshape(b, t, d))
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class DecoderStack(nnx.Module):
    """``n`` :class:`DecoderBlock` s made by ``nnx.split_rngs`` + ``nnx.vmap``, applied by ``jax.lax.scan``."""

    def __init__(self, n: int, d: int, heads: int, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=n)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs: nnx.Rngs) -> DecoderBlock:
            return DecoderBlock(d, heads, rngs)

        self.layers = make(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        gdef, state = nnx.split(self.layers)

        @nnx.remat
        def layer(x: jax.Array, s: nnx.State) -> jax.Array:
            return nnx.merge(gdef, s)(x)

        x, _ = jax.lax.scan(lambda x, s: (layer(x, s), None), x, state)
        return x


class LaxScanLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, vocab: int = 64, d: int = 32, heads: int = 4, n: int = 4):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.stack = DecoderStack(n, d, heads, rngs)
        self.norm = nnx.RMSNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.head(self.norm(self.stack(self.embed(tokens))))


class LinenBlock(nn.Module):
    d: int
    heads: int
    rate: float = 0.1

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> tuple[jax.Array, None]:
        b, t, d = x.shape
        y = nn.RMSNorm()(x)
        q, k, v = (a.reshape(b, t, self.heads, d // self.heads)
                   for a in jnp.split(nn.Dense(3 * d, use_bias=False)(y), 3, -1))
        att = nn.dot_product_attention(q, k, v, mask=nn.make_causal_mask(jnp.ones((b, t))))
        x = x + nn.Dropout(self.rate, deterministic=not train)(nn.Dense(d, use_bias=False)(att.reshape(b, t, d)))
        return x + nn.Dense(d)(nn.gelu(nn.Dense(4 * d)(nn.RMSNorm()(x)))), None


class LinenStack(nn.Module):
    d: int
    heads: int
    n: int

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        scanned = nn.scan(nn.remat(LinenBlock, static_argnums=(2,)), variable_axes={"params": 0},
                          split_rngs={"params": True, "dropout": True}, in_axes=nn.broadcast, length=self.n)
        x, _ = scanned(self.d, self.heads, name="layers")(x, train)
        return x


class LinenScanLM(nn.Module):
    vocab: int = 64
    d: int = 32
    heads: int = 4
    n: int = 4

    @nn.compact
    def __call__(self, tokens: jax.Array, train: bool = True) -> jax.Array:
        x = nn.Embed(self.vocab, self.d, name="embed")(tokens)
        x = LinenStack(self.d, self.heads, self.n, name="stack")(x, train)
        return nn.Dense(self.vocab, use_bias=False, name="head")(nn.RMSNorm(name="norm")(x))


class TopLevelScanMLP(nnx.Module):
    """The stack is a direct child, scanned in the model's own call: a unit cannot hold the scan."""

    def __init__(self, rngs: nnx.Rngs, d: int = 32, n: int = 4):
        self.inp = nnx.Linear(8, d, rngs=rngs)
        self.stack = MLPStack(n, d, rngs)
        self.head = nnx.Linear(d, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def step(x: jax.Array, layer: MLPBlock) -> jax.Array:
            return layer(x)

        return self.head(step(self.inp(x), self.stack.layers))


class ScannedDecoderLM(nnx.Module):
    """A GPT-like decoder whose ``n`` blocks are one stack (``nnx.split_rngs`` + ``nnx.vmap``) applied by ``nnx.scan``
    in the model's own call; the stack (``blocks``) is called inside the scan, one layer per iteration."""

    def __init__(self, rngs: nnx.Rngs, n: int = 4, d: int = 64, heads: int = 4, vocab: int = 64):
        @nnx.split_rngs(splits=n)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs: nnx.Rngs) -> DecoderBlock:
            return DecoderBlock(d, heads, rngs)

        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = make(rngs)
        self.norm = nnx.RMSNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def layer(x: jax.Array, block: DecoderBlock) -> jax.Array:
            return block(x)

        return self.head(self.norm(layer(self.embed(tokens), self.blocks)))


class LoopDecoderLM(nnx.Module):
    """:class:`ScannedDecoderLM` with its blocks in a list, applied by a Python loop (unrolled)."""

    def __init__(self, rngs: nnx.Rngs, n: int = 4, d: int = 64, heads: int = 4, vocab: int = 64):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([DecoderBlock(d, heads, rngs) for _ in range(n)])
        self.norm = nnx.RMSNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))
