"""An NNX decoder whose shardings live only in its arrays' types (JAX's sharding-in-types, the way
jax-ml/bonsai's LLaDA is written): every initialiser is given ``out_sharding=P(...)``, no parameter
carries Flax sharding metadata, and the forward names the sharding of each projection, lookup and
activation (``jnp.matmul(..., out_sharding=...)``, ``.at[tokens].get(out_sharding=...)``). It runs
only on a mesh with Explicit ``fsdp`` and ``tp`` axes set (``jax.set_mesh``). Our own code.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class TypedSpecs:
    """Where each parameter role and activation is split."""

    table: P = P(None, "tp")       # embedding (vocab, d)
    col: P = P("fsdp", "tp")       # (d, f): column-parallel kernels
    row: P = P("tp", "fsdp")       # (f, d): row-parallel kernels
    vec: P = P("tp")               # biases and norm scales
    act: P = P("fsdp", None, None)  # (batch, time, d)
    hidden: P = P("fsdp", None, "tp")  # (batch, time, f)


class TypedLinear(nnx.Module):
    """A dense layer whose kernel and bias are made split by their initialisers."""

    def __init__(self, d_in: int, d_out: int, kernel: P, bias: P, rngs: nnx.Rngs):
        self.kernel = nnx.Param(jax.nn.initializers.lecun_normal()(rngs.params(), (d_in, d_out), jnp.float32,
                                                                   out_sharding=kernel))
        self.bias = nnx.Param(jnp.zeros((d_out,), jnp.float32, out_sharding=bias))

    def __call__(self, x: jax.Array, out: P) -> jax.Array:
        return jnp.matmul(x, self.kernel[...], out_sharding=out) + self.bias[...]


class TypedNorm(nnx.Module):
    def __init__(self, d: int, spec: P, rngs: nnx.Rngs):
        self.scale = nnx.Param(jax.nn.initializers.ones(rngs.params(), (d,), jnp.float32, out_sharding=spec))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * self.scale[...]


class TypedEmbed(nnx.Module):
    def __init__(self, vocab: int, d: int, spec: P, rngs: nnx.Rngs):
        self.table = nnx.Param(jax.nn.initializers.normal(1.0)(rngs.params(), (vocab, d), jnp.float32,
                                                              out_sharding=spec))

    def __call__(self, tokens: jax.Array, out: P) -> jax.Array:
        return self.table[...].at[tokens].get(out_sharding=out)


class TypedBlock(nnx.Module):
    """Causal self-attention (one projection for q, k and v) and a two-layer MLP, pre-norm."""

    def __init__(self, d: int, heads: int, s: TypedSpecs, rngs: nnx.Rngs):
        self.s, self.heads = s, heads
        self.norm1, self.norm2 = TypedNorm(d, s.vec, rngs), TypedNorm(d, s.vec, rngs)
        self.qkv = TypedLinear(d, 3 * d, s.col, s.vec, rngs)
        self.proj = TypedLinear(d, d, s.row, P(), rngs)
        self.up = TypedLinear(d, 4 * d, s.col, s.vec, rngs)
        self.down = TypedLinear(4 * d, d, s.row, P(), rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(self.norm1(x), self.s.hidden), 3, axis=-1)
        q, k, v = (a.reshape(b, t, self.heads, d // self.heads) for a in (q, k, v))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (d // self.heads) ** -0.5
        att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
        y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(att, -1), v).reshape(b, t, d)
        x = x + self.proj(y, self.s.act)
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x), self.s.hidden)), self.s.act)


class TypedDecoder(nnx.Module):
    """Embedding, blocks, final norm and a head, every array split by its type."""

    def __init__(self, rngs: nnx.Rngs, vocab: int = 64, d: int = 32, heads: int = 4, layers: int = 2,
                 specs: TypedSpecs = TypedSpecs()):
        self.s = specs
        self.embed = TypedEmbed(vocab, d, specs.table, rngs)
        self.blocks = nnx.List([TypedBlock(d, heads, specs, rngs) for _ in range(layers)])
        self.norm = TypedNorm(d, specs.vec, rngs)
        self.head = TypedLinear(d, vocab, specs.col, P(), rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens, self.s.act)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x), self.s.act)


def typed_loss(model: TypedDecoder, tokens: jax.Array) -> jax.Array:
    logits = model(tokens[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))
