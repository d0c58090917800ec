"""Gradient scaling around the Adam step: global-norm clipping, non-finite skip,
dynamic loss scaling.

The streamed optimizer makes one reduction pass over the gradient shards
(:func:`global_norm_sq`), derives a single multiplier from it
(:func:`grad_scale`: loss-scale unscaling times the clipping factor) and hands
that multiplier to every shard update, so neither clipping nor unscaling costs
a pass of its own. A non-finite sum of squares means some gradient is NaN or
Inf: the whole step is skipped (no shard touched, the step count not advanced)
and the loss scaler reacts (:func:`update_loss_scale`).

The loss scaler follows DeepSpeed's ``DynamicLossScaler`` rules exactly:

* the scale starts at ``2**initial_scale_power``;
* on an overflow, if hysteresis is 1 (or exhausted down to 1), the scale is
  halved, never below ``min_scale`` (and it is an error to overflow while
  already at ``min_scale``, when ``raise_at_min_scale``); otherwise only the
  hysteresis counter drops by one (a delayed shift);
* on a good step, with ``consecutive_hysteresis`` the counter is refilled at
  once; after every ``window`` consecutive good steps since the last overflow,
  the scale doubles (and, without ``consecutive_hysteresis``, the counter is
  refilled then).

Keyword arguments use the field names of ``zinf_jax.config.LossScaleConfig``
(``enabled, static_scale, initial_scale_power, window, hysteresis, min_scale,
consecutive_hysteresis``), so ``init_loss_scale(**dataclasses.asdict(cfg))``
and ``update_loss_scale(state, overflow, **dataclasses.asdict(cfg))`` work
without this module importing the config.
"""

from __future__ import annotations

import math
from typing import Iterable, NamedTuple, Optional, Union

import jax
import numpy as np

from zinf_jax.optim import kernel

__all__ = [
    "global_norm_sq",
    "clip_scale",
    "is_finite",
    "GradScale",
    "grad_scale",
    "LossScaler",
    "init_loss_scale",
    "update_loss_scale",
]

ArrayOrArrays = Union[np.ndarray, jax.Array, Iterable[Union[np.ndarray, jax.Array]]]

_SCALE_FACTOR = 2.0


def _as_list(arrays: ArrayOrArrays) -> list:
    if isinstance(arrays, (np.ndarray, jax.Array)):
        return [arrays]
    return list(arrays)


def global_norm_sq(shard_arrays: ArrayOrArrays) -> float:
    """Squared global L2 norm of a set of float32 buffers (float64 accumulation).

    Shards of one gradient on one host add up: the global norm of a sharded
    gradient is ``sqrt`` of the sum of the per-shard (and, across hosts,
    all-reduced) results.

    Args:
      shard_arrays: A float32 array or an iterable of them (numpy or host
        ``jax.Array``).

    Returns:
      ``sum(x**2)`` over every element, as a Python float; ``inf`` or ``nan``
      when any element is non-finite.
    """
    return math.fsum(kernel.sum_squares(np.asarray(a)) for a in _as_list(shard_arrays))


def clip_scale(global_norm: float, clip_norm: Optional[float]) -> float:
    """Factor that ``optax.clip_by_global_norm(clip_norm)`` applies to every gradient.

    optax leaves the gradient unchanged when ``global_norm < clip_norm`` and
    otherwise maps ``g -> (g / global_norm) * clip_norm``.

    Args:
      global_norm: Global L2 norm of the (unscaled) gradient.
      clip_norm: Clipping threshold, or ``None`` for no clipping.

    Returns:
      ``1.0`` or ``clip_norm / global_norm``.
    """
    if clip_norm is None or global_norm < clip_norm:
        return 1.0
    return clip_norm / global_norm


def is_finite(arrays: ArrayOrArrays) -> bool:
    """Whether every element of one array, or of every array given, is finite.

    Args:
      arrays: A float32 array or an iterable of them.

    Returns:
      ``False`` if any element anywhere is NaN or +-Inf.
    """
    return all(kernel.all_finite(np.asarray(a)) for a in _as_list(arrays))


class GradScale(NamedTuple):
    """What one step does with its gradient, derived from one reduction pass.

    Attributes:
      multiplier: float32 factor for ``adam_update_shard(grad_scale=...)``:
        ``clip_scale(norm, clip_norm) / loss_scale``.
      norm: Global L2 norm of the unscaled gradient (reported as ``grad_norm``).
      finite: ``False`` when the gradient holds NaN/Inf: skip the step.
    """

    multiplier: np.float32
    norm: float
    finite: bool


def grad_scale(norm_sq: float, *, loss_scale: float = 1.0,
               clip_norm: Optional[float] = None) -> GradScale:
    """Combines loss-scale unscaling and global-norm clipping into one multiplier.

    Args:
      norm_sq: :func:`global_norm_sq` of the gradient as computed (that is,
        still multiplied by ``loss_scale``).
      loss_scale: The loss scale the gradient carries (1 without scaling).
      clip_norm: Clipping threshold on the unscaled global norm, or ``None``.

    Returns:
      The :class:`GradScale`; when not finite, ``multiplier`` is 0.
    """
    norm = math.sqrt(norm_sq) / loss_scale if norm_sq >= 0 else float("nan")
    if not math.isfinite(norm):
        return GradScale(np.float32(0.0), norm, False)
    return GradScale(np.float32(clip_scale(norm, clip_norm) / loss_scale), norm, True)


class LossScaler(NamedTuple):
    """State of the (dynamic) loss scaler; a pure value, DeepSpeed's fields.

    Attributes:
      scale: Current loss scale (multiply the loss by it before ``grad``).
      hysteresis: Overflows still tolerated before the scale drops
        (DeepSpeed's ``cur_hysteresis``).
      step: Number of :func:`update_loss_scale` calls so far (``cur_iter``).
      last_overflow_step: ``step`` of the last overflow, ``-1`` if none.
    """

    scale: float
    hysteresis: int
    step: int
    last_overflow_step: int


def _is_dynamic(enabled: bool, static_scale: float) -> bool:
    return bool(enabled) and not static_scale


def init_loss_scale(*, enabled: bool = True, static_scale: float = 0.0,
                    initial_scale_power: int = 16, window: int = 1000, hysteresis: int = 2,
                    min_scale: float = 1.0, consecutive_hysteresis: bool = False) -> LossScaler:
    """Initial loss-scaler state.

    Args:
      enabled: Loss scaling on (float16 training); off means a fixed scale of 1.
      static_scale: A fixed scale when positive; 0 selects dynamic scaling
        (DeepSpeed's ``fp16.loss_scale``).
      initial_scale_power: Dynamic scaling starts at ``2**initial_scale_power``.
      window: Good steps between scale increases (unused here).
      hysteresis: Delayed shift: overflows tolerated before a decrease.
      min_scale: Lower bound of the dynamic scale (unused here).
      consecutive_hysteresis: Refill hysteresis on every good step (unused here).

    Returns:
      The :class:`LossScaler` state.

    Raises:
      ValueError: On a non-positive hysteresis or window, or a negative static scale.
    """
    del min_scale, consecutive_hysteresis
    if hysteresis < 1 or window < 1 or static_scale < 0:
        raise ValueError(f"need hysteresis >= 1, window >= 1, static_scale >= 0; got "
                         f"{hysteresis}, {window}, {static_scale}")
    if not enabled:
        scale = 1.0
    elif static_scale:
        scale = float(static_scale)
    else:
        scale = float(2.0 ** initial_scale_power)
    return LossScaler(scale=scale, hysteresis=int(hysteresis), step=0, last_overflow_step=-1)


def update_loss_scale(state: LossScaler, overflow: bool, *, enabled: bool = True,
                      static_scale: float = 0.0, initial_scale_power: int = 16,
                      window: int = 1000, hysteresis: int = 2, min_scale: float = 1.0,
                      consecutive_hysteresis: bool = False,
                      raise_at_min_scale: bool = True) -> LossScaler:
    """Advances the loss scaler by one step (DeepSpeed ``DynamicLossScaler.update_scale``).

    Call once per optimizer step, after the overflow check, whether or not the
    step was skipped. A static or disabled scaler only counts steps.

    Args:
      state: The current state.
      overflow: Whether this step's gradient held NaN/Inf (the step is skipped).
      enabled: As for :func:`init_loss_scale`.
      static_scale: As for :func:`init_loss_scale`.
      initial_scale_power: Unused here (initial state only).
      window: Consecutive good steps after which the scale doubles.
      hysteresis: The delayed shift the counter is refilled to.
      min_scale: The scale never drops below this.
      consecutive_hysteresis: Refill the counter on every good step rather
        than only when the scale grows.
      raise_at_min_scale: Raise when an overflow hits a scale already at
        ``min_scale`` with no hysteresis left (DeepSpeed's behaviour).

    Returns:
      The next :class:`LossScaler` state.

    Raises:
      FloatingPointError: On an overflow at ``min_scale`` with
        ``raise_at_min_scale``: training cannot make progress.
    """
    del initial_scale_power
    if not _is_dynamic(enabled, static_scale):
        return state._replace(step=state.step + 1)
    scale, counter, last = state.scale, state.hysteresis, state.last_overflow_step
    if overflow:
        if hysteresis == 1 or counter == 1:
            if scale == min_scale and raise_at_min_scale:
                raise FloatingPointError(
                    f"gradient overflow at the minimum loss scale {min_scale}: "
                    "the scale cannot decrease further")
            scale = max(scale / _SCALE_FACTOR, min_scale)
        else:
            counter -= 1
        last = state.step
    else:
        if consecutive_hysteresis:
            counter = hysteresis
        stable = state.step - last - 1
        if stable > 0 and stable % window == 0:
            if not consecutive_hysteresis:
                counter = hysteresis
            scale *= _SCALE_FACTOR
    return LossScaler(scale=scale, hysteresis=counter, step=state.step + 1,
                      last_overflow_step=last)
