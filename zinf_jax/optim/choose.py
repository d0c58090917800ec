"""The optimizer an engine runs, from ``initialize``'s arguments and the config, honestly.

Every optimizer-related setting is either used or refused, never dropped:

* ``optimizer=`` given and ``config.optimizer`` set (a DeepSpeed ``optimizer``
  section) is ambiguous: an error names both;
* ``config.gradient_clipping`` applies to any optimizer (an
  :class:`~zinf_jax.optim.AdamSpec` or an optax transform); an optimizer that
  already clips at another norm is an error;
* loss scaling is on with float16 compute unless ``LossScaleConfig(enabled=False)``
  says otherwise (DeepSpeed's fp16 default: dynamic scaling).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from zinf_jax.config import ConfigError, LossScaleConfig, ZeroConfig
from zinf_jax.optim.adam import AdamSpec, adam, adamw

__all__ = ["choose_optimizer", "with_clipping", "loss_scaling"]


def choose_optimizer(optimizer: Any, config: ZeroConfig) -> Any:
    """``optimizer`` if given, else the config's ``optimizer`` section, else AdamW(1e-3).

    Raises:
      ConfigError: both ``optimizer=`` and ``config.optimizer`` are set.
    """
    o = config.optimizer
    if optimizer is not None:
        if o is not None:
            raise ConfigError("optimizer: both initialize(optimizer=...) and ZeroConfig.optimizer (a DeepSpeed "
                              "'optimizer' section) are set; keep one of them", field="optimizer")
        return optimizer
    if o is None:
        return adamw(1e-3)
    lr = o.learning_rate()  # the constant lr, or the DeepSpeed scheduler's schedule (an optax schedule)
    if o.name == "adamw":
        return adamw(lr, o.b1, o.b2, o.eps, weight_decay=o.weight_decay)
    return adam(lr, o.b1, o.b2, o.eps)


def with_clipping(optimizer: Any, clip: float) -> Any:
    """``optimizer`` clipping gradients to the global norm ``clip`` (0: unchanged); an ``optax.MultiSteps`` as
    its ``gradient_transformation()``.

    Raises:
      ConfigError: the optimizer clips at another norm already.
    """
    if not isinstance(optimizer, AdamSpec) and type(optimizer).__name__ == "MultiSteps":
        from zinf_jax.optim.optax_rule import as_transform

        optimizer = as_transform(optimizer)  # an optax.MultiSteps as its GradientTransformation
    if not clip:
        return optimizer
    if isinstance(optimizer, AdamSpec):
        have = optimizer.clip_norm
        if have is None:
            return dataclasses.replace(optimizer, clip_norm=float(clip))
    else:
        import optax

        from zinf_jax.optim.optax_rule import leading_global_clip

        have = leading_global_clip(optimizer)
        if have is None:
            return optax.chain(optax.clip_by_global_norm(float(clip)), optimizer)
    if float(have) != float(clip):
        raise ConfigError(f"gradient_clipping: the config clips at {clip} but the optimizer clips at {have}; "
                          "set one of them", field="gradient_clipping")
    return optimizer


def loss_scaling(config: ZeroConfig, compute_dtype: str) -> LossScaleConfig | None:
    """The loss scaling to run (``None``: none): on with float16 compute unless explicitly disabled."""
    ls = config.loss_scale
    on = ls.enabled if ls.enabled is not None else compute_dtype == "float16"
    return dataclasses.replace(ls, enabled=True) if on else None
