"""Optimizer math for the streamed CPU Adam (re-exports only).

``adam``/``adamw`` build an :class:`AdamSpec`; :func:`adam_update_shard` applies
one step to one float32 shard in place (fused numba kernel, pure-JAX fallback);
:mod:`~zinf_jax.optim.scaling` turns one reduction pass over the gradient into
the clipping/unscaling multiplier, the non-finite skip and the loss-scale update;
:class:`~zinf_jax.optim.driver.StreamedOptimizer` streams the state through a tier, applying an
update rule (:mod:`~zinf_jax.optim.rules`: the fused Adam, or any optax transform: per sub-group where
:mod:`~zinf_jax.optim.optax_split` proves it element-wise on a parameter, per whole tensor where it
couples a tensor's elements, over the whole tree where it couples parameters,
:mod:`~zinf_jax.optim.optax_rule`; packs, whole tensors and the tree are read and written by
:mod:`~zinf_jax.optim.work`).
"""

from zinf_jax.optim.adam import (
    AdamSpec,
    DecayMask,
    Schedule,
    adam,
    adam_coefficients,
    adam_update_shard,
    adam_update_shard_jax,
    adamw,
    bias_correction,
    default_decay_mask,
)
from zinf_jax.optim.driver import StreamedAdam, StreamedOptimizer
from zinf_jax.optim.rules import AdamRule, UpdateRule
from zinf_jax.optim.kernel import NUMBA_AVAILABLE, AdamCoefficients, warmup
from zinf_jax.optim.scaling import (
    GradScale,
    LossScaler,
    clip_scale,
    global_norm_sq,
    grad_scale,
    init_loss_scale,
    is_finite,
    update_loss_scale,
)

__all__ = [
    "AdamSpec",
    "AdamCoefficients",
    "DecayMask",
    "GradScale",
    "LossScaler",
    "NUMBA_AVAILABLE",
    "Schedule",
    "StreamedAdam",
    "StreamedOptimizer",
    "AdamRule",
    "UpdateRule",
    "adam",
    "adam_coefficients",
    "adam_update_shard",
    "adam_update_shard_jax",
    "adamw",
    "bias_correction",
    "clip_scale",
    "default_decay_mask",
    "global_norm_sq",
    "grad_scale",
    "init_loss_scale",
    "is_finite",
    "update_loss_scale",
    "warmup",
]
