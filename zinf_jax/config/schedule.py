"""DeepSpeed's learning-rate schedulers as plain data that evaluates like an optax schedule.

:class:`LRSchedule` holds a DeepSpeed ``scheduler`` section (``WarmupLR``, ``WarmupDecayLR``,
``WarmupCosineLR``) and, called with the optimizer's update count, returns the learning rate that
DeepSpeed's engine would use for that update, so a run reading the file follows its schedule:

* DeepSpeed sets the scheduler's value for iteration -1 when it is built (``warmup_min_lr``; for
  ``WarmupCosineLR`` zero) and steps the scheduler *after* each applied optimizer step, so update
  ``n`` (1-based) runs at the scheduler's iteration ``n - 2``. zinf evaluates a schedule at the count
  before the increment (``n - 1``), hence ``iteration = count - 1`` here.
* warmup: ``log`` (DeepSpeed's default: ``log(i + 1) / log(W)``) or ``linear`` (``i / W``), over
  ``W = max(2, warmup_num_steps)`` iterations; then constant (``WarmupLR``), linear decay to zero at
  ``total_num_steps`` (``WarmupDecayLR``) or cosine decay to ``cos_min_ratio`` (``WarmupCosineLR``, whose
  rates are ratios of the optimizer's ``lr``).

Nothing here imports JAX at import time; calling the schedule with a JAX array computes with ``jax.numpy``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from zinf_jax.config.fields import NONNEG, as_float, as_int, as_other, checked, one_of, validate
from zinf_jax.errors import ConfigError

__all__ = ["LRSchedule", "SCHEDULES"]

SCHEDULES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
"""DeepSpeed scheduler types a run follows (``OneCycle`` and ``LRRangeTest`` are refused)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LRSchedule:
    """A DeepSpeed ``scheduler`` section; ``schedule(count)`` is the learning rate of update ``count + 1``."""

    kind: str = checked("WarmupLR", as_other, *one_of(SCHEDULES))
    """DeepSpeed's ``scheduler.type``."""
    warmup_min_lr: float = checked(0.0, as_float, *NONNEG)
    """``WarmupLR``/``WarmupDecayLR``: the rate at the start of the warmup."""
    warmup_max_lr: float = checked(1e-3, as_float, *NONNEG)
    """``WarmupLR``/``WarmupDecayLR``: the rate at the end of the warmup; ``WarmupCosineLR``: the optimizer's
    ``lr`` (its ratios multiply it)."""
    warmup_num_steps: int = checked(1000, as_int, 1)
    """Scheduler iterations of the warmup (DeepSpeed uses at least 2)."""
    warmup_type: str = checked("log", as_other, *one_of(("log", "linear")))
    """Shape of the warmup: ``log`` (DeepSpeed's default) or ``linear``."""
    total_num_steps: int | None = checked(None, as_int, 1, optional=True)
    """``WarmupDecayLR``/``WarmupCosineLR``: the iteration at which the decay ends."""
    warmup_min_ratio: float = checked(0.0, as_float, *NONNEG)
    """``WarmupCosineLR``: the ratio of ``lr`` the warmup starts from."""
    cos_min_ratio: float = checked(1e-4, as_float, *NONNEG)
    """``WarmupCosineLR``: the ratio of ``lr`` the cosine decay ends at."""

    def __post_init__(self) -> None:
        validate(self)
        if self.kind != "WarmupLR" and self.total_num_steps is None:
            detail = f"required by {self.kind} (the iteration at which its decay ends)"
            raise ConfigError(f"LRSchedule.total_num_steps: {detail}", field="total_num_steps", detail=detail)

    def describe(self) -> str:
        """One line: the type and its numbers (for the printed resolution)."""
        w = f"{self.warmup_type} warmup over {max(2, self.warmup_num_steps)} steps"
        if self.kind == "WarmupCosineLR":
            return (f"WarmupCosineLR: {w} from {self.warmup_min_ratio:g}x to 1x lr {self.warmup_max_lr:g}, cosine to "
                    f"{self.cos_min_ratio:g}x at step {self.total_num_steps}")
        tail = "" if self.kind == "WarmupLR" else f", linear decay to 0 at step {self.total_num_steps}"
        return f"{self.kind}: {w} from {self.warmup_min_lr:g} to {self.warmup_max_lr:g}{tail}"

    def lr_at(self, count: int) -> float:
        """The learning rate of update ``count + 1`` in float64 (the reference the schedule is tested against)."""
        import numpy as np

        return float(self._evaluate(np.float64(count), np))

    def __call__(self, count: Any) -> Any:
        """The learning rate of update ``count + 1`` (an optax schedule: ``count`` is an int32 array)."""
        import jax.numpy as jnp

        return self._evaluate(jnp.asarray(count, jnp.int32).astype(jnp.float32), jnp)

    def _evaluate(self, count: Any, xp: Any) -> Any:
        """The rate at ``count`` with ``xp`` (numpy or jax.numpy): DeepSpeed's formulas at iteration ``count - 1``."""
        i = count - 1
        w = max(2, self.warmup_num_steps)
        i_warm = xp.clip(i, 0, w)
        ramp = xp.log(i_warm + 1) / math.log(w) if self.warmup_type == "log" else i_warm / w
        if self.kind == "WarmupCosineLR":
            progress = xp.clip((i - w + 1) / max(1, self.total_num_steps - w), 0.0, 1.0)
            cosine = self.cos_min_ratio + (1 - self.cos_min_ratio) * (1 + xp.cos(math.pi * progress)) / 2
            ratio = xp.where(i < w, self.warmup_min_ratio + ramp * (1 - self.warmup_min_ratio),
                             xp.maximum(cosine, 0.0))
            return xp.where(i < 0, 0.0, self.warmup_max_lr * ratio)
        if self.kind == "WarmupLR":
            after = 1.0
        else:
            after = xp.maximum((self.total_num_steps - i) / max(1, self.total_num_steps - w), 0.0)
        gamma = xp.where(i < w, ramp, after)
        return xp.where(i < 0, self.warmup_min_lr, self.warmup_min_lr + (self.warmup_max_lr - self.warmup_min_lr) * gamma)
