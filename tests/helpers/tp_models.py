"""An NNX LM written for sharding-in-types (FSDP + tensor parallelism on an Explicit mesh), as public LLM code is.

The idioms: a frozen dataclass of ``PartitionSpec`` s per parameter role and activation (``Specs``, with a
``no_sharding()``), parameters declaring their spec through Flax metadata (``kernel_metadata={"out_sharding":
...}``, ``embedding_metadata``, ``scale_metadata``), ``out_sharding=`` on every einsum and projection,
``jax.sharding.reshard`` of activations when a mesh is set, the token lookup ``embedding[...].at[(tokens,)].get(
out_sharding=...)`` and the tied head reading the table in the top-level call, grouped-query attention, a
final norm outside every block; an initialiser given ``out_sharding=`` directly (no metadata), a position table
with its ids held as ``nnx.data(jnp.arange(...))``, and a frozen config with a list field held by every block
(unhashable, as ``nnx.jit`` allows). Our own code, written for the tests.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P, get_abstract_mesh, reshard


@dataclasses.dataclass(frozen=True)
class Specs:
    """Where each parameter role and activation is split (``None``: not at all)."""

    table: P | None = None    # embedding (vocab, d)
    qkv: P | None = None      # (d, heads, head_dim)
    out: P | None = None      # (heads, head_dim, d)
    up: P | None = None       # (d, f)
    down: P | None = None     # (f, d)
    norm: P | None = None     # (d,)
    act: P | None = None      # (batch, time, d)
    act_heads: P | None = None  # (batch, time, heads, head_dim)

    @staticmethod
    def fsdp_tp() -> Specs:
        return Specs(table=P("tp", "fsdp"), qkv=P("fsdp", "tp", None), out=P("tp", None, "fsdp"),
                     up=P("fsdp", "tp"), down=P("tp", "fsdp"), norm=P("tp"), act=P("fsdp", None, "tp"),
                     act_heads=P("fsdp", None, "tp", None))

    @staticmethod
    def no_sharding() -> Specs:
        return Specs()


def shard(x: jax.Array, spec: P | None) -> jax.Array:
    """``reshard`` when a mesh is set and a spec is given (as public model code does)."""
    if spec is None or get_abstract_mesh().empty:
        return x
    return reshard(x, spec)


def _meta(spec: P | None) -> dict:
    return {"out_sharding": spec} if spec is not None else {}


class Attention(nnx.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, specs: Specs, rngs: nnx.Rngs, max_len: int = 32):
        hd = d // heads
        self.specs, self.heads, self.kv_heads = specs, heads, kv_heads
        self.causal = nnx.data(jnp.tril(jnp.ones((max_len, max_len), bool)))  # a plain array attribute
        self.q = nnx.Einsum("btd,dnh->btnh", (d, heads, hd), kernel_metadata=_meta(specs.qkv), rngs=rngs)
        self.k = nnx.Einsum("btd,dnh->btnh", (d, kv_heads, hd), kernel_metadata=_meta(specs.qkv), rngs=rngs)
        self.v = nnx.Einsum("btd,dnh->btnh", (d, kv_heads, hd), kernel_metadata=_meta(specs.qkv), rngs=rngs)
        self.o = nnx.Einsum("btnh,nhd->btd", (heads, hd, d), kernel_metadata=_meta(specs.out), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        s = self.specs
        q = self.q(x, out_sharding=s.act_heads)
        k = self.k(x, out_sharding=s.act_heads)
        v = self.v(x, out_sharding=s.act_heads)
        b, t, n, h = q.shape
        rep = self.heads // self.kv_heads
        q = q.reshape((b, t, self.kv_heads, rep, h))
        logits = jnp.einsum("btkgh,bskh->btskg", q, k) * h ** -0.5
        mask = self.causal[:t, :t][None, :, :, None, None]
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
        w = jax.nn.softmax(logits, axis=2)
        ctx = jnp.einsum("btskg,bskh->btkgh", w, v).reshape((b, t, n, h))
        return self.o(ctx, out_sharding=s.act)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Per-layer choices, a list field: unhashable, as many model configs are."""

    gated: list[bool] = dataclasses.field(default_factory=lambda: [True, True])


class Block(nnx.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, specs: Specs, rngs: nnx.Rngs, layout: Layout = Layout(),
                 max_len: int = 32):
        self.specs, self.layout = specs, layout
        self.ln1 = nnx.RMSNorm(d, scale_metadata=_meta(specs.norm), rngs=rngs)
        self.attn = Attention(d, heads, kv_heads, specs, rngs, max_len)
        self.ln2 = nnx.RMSNorm(d, scale_metadata=_meta(specs.norm), rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, use_bias=False, kernel_metadata=_meta(specs.up), rngs=rngs)
        init = nnx.initializers.lecun_normal()  # the gate's kernel is made split, by its initialiser alone
        init = init if specs.up is None else functools.partial(init, out_sharding=specs.up)
        self.gate = nnx.Linear(d, 4 * d, use_bias=False, kernel_init=init, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, use_bias=False, kernel_metadata=_meta(specs.down), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x))
        h = self.ln2(x)
        act_f = self.specs.act
        up = self.up(h, out_sharding=act_f)
        h = nnx.silu(self.gate(h, out_sharding=act_f)) * up if self.layout.gated[0] else nnx.silu(up)
        return shard(x + self.down(h, out_sharding=self.specs.act), self.specs.act)


class TPLM(nnx.Module):
    """A decoder LM with a tied head; ``specs`` decides where it splits its parameters and activations."""

    def __init__(self, rngs: nnx.Rngs, specs: Specs = Specs.fsdp_tp(), vocab: int = 64, d: int = 32,
                 heads: int = 4, kv_heads: int = 2, layers: int = 2, max_len: int = 32):
        self.specs = specs
        self.embed = nnx.Embed(vocab, d, embedding_metadata=_meta(specs.table), rngs=rngs)
        self.blocks = nnx.List([Block(d, heads, kv_heads, specs, rngs, max_len=max_len) for _ in range(layers)])
        self.final_norm = nnx.RMSNorm(d, scale_metadata=_meta(specs.norm), rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed.embedding[...].at[(tokens,)].get(out_sharding=self.specs.act)
        for block in self.blocks:
            x = block(x)
        x = self.final_norm(x)
        logits_spec = None if self.specs.act is None else P(self.specs.act[0], None, None)
        return jnp.einsum("btd,vd->btv", x, self.embed.embedding[...], out_sharding=logits_spec)


def tp_loss(model: TPLM, tokens: jax.Array) -> jax.Array:
    logits = model(tokens[:, :-1])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))


import flax.linen as nn  # noqa: E402  (the Linen model below)

LOGICAL_RULES = (("batch", "fsdp"), ("length", None), ("embed", "fsdp"), ("vocab", "tensor"), ("mlp", "tensor"),
                 ("heads", "tensor"))
"""MaxText-style logical axis rules for a (fsdp, tensor) mesh: FSDP on ``embed``, tensor parallelism on the rest."""


def _logical(init, names):
    return nn.with_logical_partitioning(init, names)


class LinenTPBlock(nn.Module):
    d: int
    heads: int

    @nn.compact
    def __call__(self, x):
        b, t, d = x.shape
        y = nn.LayerNorm(scale_init=_logical(nn.initializers.ones, ("embed",)), use_bias=False)(x)
        q, k, v = (nn.Dense(d, use_bias=False, name=n, kernel_init=_logical(nn.initializers.xavier_uniform(),
                                                                          ("embed", "heads")))(y).reshape(
            b, t, self.heads, d // self.heads) for n in ("q", "k", "v"))
        att = nn.dot_product_attention(q, k, v, mask=nn.make_causal_mask(jnp.ones((b, t))))
        att = nn.with_logical_constraint(att.reshape(b, t, d), ("batch", "length", "heads"))
        y = nn.Dense(d, use_bias=False, name="o", kernel_init=_logical(nn.initializers.xavier_uniform(),
                                                                      ("heads", "embed")))(att)
        x = nn.with_logical_constraint(x + y, ("batch", "length", "embed"))
        h = nn.Dense(4 * self.d, use_bias=False, kernel_init=_logical(nn.initializers.xavier_uniform(),
                                                                        ("embed", "mlp")))(x)
        h = nn.with_logical_constraint(nn.gelu(h), ("batch", "length", "mlp"))
        h = nn.Dense(self.d, use_bias=False, kernel_init=_logical(nn.initializers.xavier_uniform(), ("mlp", "embed")))(h)
        return nn.with_logical_constraint(x + h, ("batch", "length", "embed"))


class LinenTPLM(nn.Module):
    """A Linen LM in MaxText's style: logically partitioned kernels and ``nn.with_logical_constraint`` on activations."""

    vocab: int = 64
    d: int = 32
    heads: int = 4
    layers: int = 2

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(self.vocab, self.d, embedding_init=_logical(nn.initializers.normal(1.0), ("vocab", "embed")))
        x = nn.with_logical_constraint(embed(tokens), ("batch", "length", "embed"))
        for i in range(self.layers):
            x = LinenTPBlock(self.d, self.heads, name=f"block_{i}")(x)
        return embed.attend(nn.LayerNorm(use_bias=False)(x))


def linen_tp_loss(model, tokens):
    logits = model(tokens[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))
