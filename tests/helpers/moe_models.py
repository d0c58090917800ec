"""A mixture-of-experts LM as expert-parallel public code writes it (our own code, written for the tests).

The idioms: the experts of a layer are one stacked parameter per projection, ``(E, D, F)`` and ``(E, F, D)``,
declaring their expert axis through Flax metadata (``nnx.with_partitioning(init, ("expert", None, None))``);
a linear router, top-k gates renormalised by a softmax over the chosen experts; every expert applied to
every token of its batch shard (the tokens replicated over the expert axis, the experts' activations
split over it, by bare ``PartitionSpec`` s: ``jax.lax.with_sharding_constraint`` under the mesh in
context), the gates combining the experts' outputs (a sum over the expert axis). Run on a ``(fsdp, expert)`` mesh.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P, get_abstract_mesh


def _constrain(x: jax.Array, experts: bool) -> jax.Array:
    """``x`` with its batch split over the mesh's axes but ``expert`` (and, with ``experts``, its leading
    expert dimension split over ``expert``), when the mesh in context has an ``expert`` axis."""
    mesh = get_abstract_mesh()
    if mesh.empty or "expert" not in mesh.axis_names:
        return x
    batch = tuple(a for a in mesh.axis_names if a != "expert") or None
    return jax.lax.with_sharding_constraint(x, P("expert", batch) if experts else P(batch))


class MoEBlock(nnx.Module):
    """Pre-norm residual block: a top-``k`` mixture of ``experts`` two-layer MLPs."""

    def __init__(self, d: int, f: int, experts: int, k: int, rngs: nnx.Rngs, split: bool = True):
        self.k, self.experts = k, experts
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.router = nnx.Linear(d, experts, use_bias=False, rngs=rngs)
        init = nnx.initializers.lecun_normal(in_axis=1, out_axis=2)
        if split:  # the stacks declare their expert axis; else they are plain parameters
            init = nnx.with_partitioning(init, ("expert", None, None))
        self.w_in = nnx.Param(init(rngs.params(), (experts, d, f)))
        self.w_out = nnx.Param(init(rngs.params(), (experts, f, d)))

    def __call__(self, x: jax.Array) -> jax.Array:
        h = _constrain(self.norm(x), experts=False)  # each expert group sees its fsdp shard's tokens
        top, idx = jax.lax.top_k(self.router(h), self.k)                      # (b, t, k)
        gates = jnp.sum(jax.nn.one_hot(idx, self.experts) * jax.nn.softmax(top, -1)[..., None], axis=-2)
        up = _constrain(jnp.einsum("btd,edf->ebtf", h, self.w_in[...]), experts=True)
        out = _constrain(jnp.einsum("ebtf,efd->ebtd", jax.nn.gelu(up), self.w_out[...]), experts=True)
        return x + jnp.einsum("ebtd,bte->btd", out, gates)


class MoELM(nnx.Module):
    """Token embedding, ``layers`` MoE blocks, a final norm and an untied head (``split=False``: the expert
    stacks declare no expert axis)."""

    def __init__(self, rngs: nnx.Rngs, *, vocab: int = 64, d: int = 32, f: int = 64, experts: int = 8,
                 k: int = 2, layers: int = 2, split: bool = True):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([MoEBlock(d, f, experts, k, rngs, split) for _ in range(layers)])
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def moe_loss(model: MoELM, tokens: jax.Array) -> jax.Array:
    """Next-token cross-entropy."""
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
