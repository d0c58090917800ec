"""Models whose compiled steps the deviceless GPU and TPU compile tests read. Our own code, for the tests.

- the bundled GPT (:mod:`zinf_jax.models`): a head tied to the embedding (a parameter read by two units), its
  blocks one run of alike calls;
- :class:`ClassTokenViT` (NNX): patches embedded by a Linear, a class-token parameter broadcast over the
  batch and concatenated in front (its gradient a sum over the batch), learned positions, pre-norm blocks, a
  head on the class token; ``dtype`` sets the activations' dtype (``bfloat16``: the model's own mixed
  precision, parameters float32);
- :class:`~helpers.scan_models.LaxScanLM`: a stack of decoder layers made by ``nnx.vmap`` and applied by the
  model's own ``jax.lax.scan`` (the stack is the unit: :data:`LAYER_POLICY`).

:data:`CONFIGS` are the engine settings each is compiled with; :func:`build` makes an engine and a batch.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import zinf_jax as zinf
from helpers.scan_models import LaxScanLM
from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss

LAYER_POLICY = zinf.UnitPolicy(patterns=("stack/layers",))
"""The stack of layers is the unit, called inside the model's scan."""


class ViTBlock(nnx.Module):
    def __init__(self, d: int, heads: int, dtype: Any, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=d, decode=False, dtype=dtype, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
        self.up = nnx.Linear(d, 2 * d, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(2 * d, d, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x))
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class PatchEmbed(nnx.Module):
    """Patches through a Linear, the class token broadcast over the batch in front, learned positions added."""

    def __init__(self, patch: int, patches: int, d: int, dtype: Any, rngs: nnx.Rngs):
        self.proj = nnx.Linear(patch, d, dtype=dtype, rngs=rngs)
        self.cls = nnx.Param(jax.random.normal(rngs.params(), (1, 1, d)) * 0.02)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (1, patches + 1, d)) * 0.02)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.proj(x)
        cls = jnp.broadcast_to(self.cls[...].astype(h.dtype), (h.shape[0], 1, h.shape[2]))
        return jnp.concatenate([cls, h], axis=1) + self.pos[...].astype(h.dtype)


class ClassTokenViT(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, *, patch: int = 128, patches: int = 8, d: int = 128, heads: int = 4,
                 n: int = 4, classes: int = 10, dtype: Any = jnp.float32):
        self.embed = PatchEmbed(patch, patches, d, dtype, rngs)
        self.blocks = nnx.List([ViTBlock(d, heads, dtype, rngs) for _ in range(n)])
        self.norm = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(d, classes, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.embed(x)
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.norm(h)[:, 0])


def vit_loss(model: Any, batch: tuple) -> jax.Array:
    x, y = batch
    logits = model(x).astype(jnp.float32)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], -1))


def lm_xent(model: Any, tokens: jax.Array) -> jax.Array:
    logits = model(tokens[:, :-1]).astype(jnp.float32)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))


CONFIGS: dict[str, dict] = {
    "cpu-cpu": dict(param="cpu", opt="cpu"),
    "cpu-none": dict(param="cpu", opt="none"),
    "none-cpu": dict(param="none", opt="cpu"),
    "no-remat": dict(param="cpu", opt="cpu", activation_checkpointing=False),
    "bf16": dict(param="cpu", opt="cpu", compute_dtype="bfloat16"),
    "bf16-activations": dict(param="cpu", opt="cpu", model_dtype=jnp.bfloat16),
    "device-update": dict(param="none", opt="cpu", optimizer_update="device"),
}
"""Engine settings the step is compiled with (``model_dtype``: the model's own activation dtype, where it has one)."""


def build(model: str, config: str, devices: int = 8, **settings: Any) -> tuple[Any, Any]:
    """An engine for ``model`` (``gpt``, ``vit``, ``scan``) with ``CONFIGS[config]`` (and other ``ZeroConfig``
    ``settings``), and a batch."""
    kw = {**CONFIGS[config], **settings}
    param, opt, dtype = kw.pop("param"), kw.pop("opt"), kw.pop("model_dtype", jnp.float32)
    cfg = zinf.ZeroConfig(offload_param=zinf.Offload(param), offload_optimizer=zinf.Offload(opt),
                          persistence_threshold=0, **kw)
    mesh = zinf.make_mesh(devices=jax.devices()[:devices])
    extra: dict = {}
    if model == "gpt":
        gcfg = GPTConfig(vocab=128, d_model=128, n_heads=4, n_layers=4, seq=16)
        ctor: Callable = lambda: GPT(gcfg, rngs=nnx.Rngs(0))  # noqa: E731
        loss, batch = lm_loss, batch_at(corpus(), 0, 8, gcfg.seq)
    elif model == "vit":
        ctor = lambda: ClassTokenViT(nnx.Rngs(0), dtype=dtype)  # noqa: E731
        rng = np.random.default_rng(0)
        loss = vit_loss
        batch = (rng.normal(size=(8, 8, 128)).astype(np.float32), rng.integers(0, 10, size=(8,)).astype(np.int32))
    elif model == "scan":
        ctor = lambda: LaxScanLM(nnx.Rngs(0), d=128)  # noqa: E731
        loss, batch = lm_xent, np.asarray(np.random.default_rng(0).integers(0, 64, size=(8, 17)), np.int32)
        extra["unit_policy"] = LAYER_POLICY
    else:
        raise ValueError(model)
    eng = zinf.initialize(ctor, config=cfg, loss_fn=loss, mesh=mesh, optimizer=zinf.adamw(1e-3), **extra)
    return eng, batch
