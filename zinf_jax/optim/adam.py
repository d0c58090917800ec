"""Adam(W) hyper-parameters and the pure update of one optimizer shard.

The streamed optimizer keeps float32 master weights and both Adam moments as
flat shards in a storage tier and updates them one shard at a time. This module
holds the arithmetic only; the driver that moves shards between tiers lives
elsewhere. The numbers are those of ``optax.adamw`` (and ``optax.adam``):

* ``t`` is the step count after the increment (``1`` on the first step),
  ``m_hat = m / (1 - b1**t)``, ``v_hat = v / (1 - b2**t)``;
* ``u = m_hat / (sqrt(v_hat + eps_root) + eps) + weight_decay * param`` (decay
  only where the mask says so), ``param = param - lr * u``;
* a learning-rate schedule is evaluated at ``t - 1``, the count before the
  increment, as ``optax.scale_by_learning_rate`` does.

Global-norm clipping and loss-scale unscaling are folded into one ``grad_scale``
multiplier applied to the gradient inside the same pass (see
:mod:`zinf_jax.optim.scaling`).

One deliberate difference from optax: the default weight-decay mask of
:func:`adamw` is :func:`default_decay_mask` (no decay on parameters with at most
one dimension: biases, norm scales), where optax decays everything by default.
Pass ``mask=None`` for optax's behaviour.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from zinf_jax.optim import kernel
from zinf_jax.optim.kernel import AdamCoefficients

__all__ = [
    "Schedule",
    "DecayMask",
    "AdamSpec",
    "adam",
    "adamw",
    "default_decay_mask",
    "bias_correction",
    "adam_coefficients",
    "adam_update_shard",
    "adam_update_shard_jax",
    "adam_math",
]

Schedule = Callable[[jax.typing.ArrayLike], jax.typing.ArrayLike]
"""An optax schedule: step count (int32) -> learning rate."""

DecayMask = Callable[[str, Tuple[int, ...]], bool]
"""``mask(path, shape) -> bool``: whether weight decay applies to a parameter."""

_JAX_BLOCK = 1 << 22  # elements per jitted call in the in-place JAX fallback


def default_decay_mask(path: str, shape: Tuple[int, ...]) -> bool:
    """Default weight-decay mask: decay matrices and higher, not vectors.

    Biases, layer-norm scales and other parameters with ``ndim <= 1`` are not
    decayed, the common practice for transformer training.

    Args:
      path: The parameter's path (unused by this rule).
      shape: The parameter's full (unsharded) shape.

    Returns:
      ``True`` when the parameter is decayed.
    """
    del path
    return len(shape) > 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdamSpec:
    """Hyper-parameters of Adam / AdamW, as an immutable value.

    Build with :func:`adam` or :func:`adamw`.
    """

    learning_rate: Union[float, Schedule]
    """A constant learning rate, or an optax schedule ``count -> lr``."""
    b1: float = 0.9
    """Decay of the first-moment moving average."""
    b2: float = 0.999
    """Decay of the second-moment moving average."""
    eps: float = 1e-8
    """Added to ``sqrt(v_hat + eps_root)`` in the denominator."""
    eps_root: float = 0.0
    """Added to ``v_hat`` under the square root."""
    weight_decay: float = 0.0
    """Decoupled weight-decay coefficient (AdamW); 0 for plain Adam."""
    mask: Optional[DecayMask] = None
    """``mask(path, shape) -> bool`` selecting decayed parameters; ``None`` decays all."""
    clip_norm: Optional[float] = None
    """Clip the gradient to this global L2 norm (``optax.clip_by_global_norm``); ``None`` disables."""

    def __post_init__(self):
        if not callable(self.learning_rate) and not float(self.learning_rate) >= 0.0:
            raise ValueError(f"learning_rate must be >= 0, got {self.learning_rate}")
        for name in ("b1", "b2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.eps < 0 or self.eps_root < 0 or self.weight_decay < 0:
            raise ValueError("eps, eps_root and weight_decay must be >= 0")
        if self.clip_norm is not None and not self.clip_norm > 0:
            raise ValueError(f"clip_norm must be > 0 or None, got {self.clip_norm}")

    def lr_at(self, count: int) -> np.float32:
        """Learning rate of the step taken after ``count`` completed steps.

        Args:
          count: Number of updates applied so far (optax's schedule count).

        Returns:
          The learning rate as float32, computed like optax (a schedule runs in
          float32 on JAX's CPU backend).
        """
        if not callable(self.learning_rate):
            return np.float32(self.learning_rate)
        with jax.default_device(_cpu_device()):
            return np.float32(np.asarray(self.learning_rate(jnp.asarray(count, jnp.int32))))

    def decay_for(self, path: str, shape: Tuple[int, ...]) -> float:
        """Weight-decay coefficient of one parameter after masking.

        Args:
          path: The parameter's path.
          shape: The parameter's full (unsharded) shape.

        Returns:
          ``weight_decay`` if the mask selects the parameter, else ``0.0``.
        """
        if self.weight_decay == 0.0 or (self.mask is not None and not self.mask(path, tuple(shape))):
            return 0.0
        return float(self.weight_decay)


def adam(learning_rate: Union[float, Schedule], b1: float = 0.9, b2: float = 0.999,
         eps: float = 1e-8, *, eps_root: float = 0.0,
         clip_norm: Optional[float] = None) -> AdamSpec:
    """Adam with ``optax.adam`` semantics (optionally with global-norm clipping).

    Args:
      learning_rate: Constant learning rate or optax schedule.
      b1: First-moment decay.
      b2: Second-moment decay.
      eps: Denominator epsilon outside the square root.
      eps_root: Denominator epsilon inside the square root.
      clip_norm: Global-norm clipping threshold, or ``None``.

    Returns:
      The :class:`AdamSpec`.
    """
    return AdamSpec(learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                    clip_norm=clip_norm)


def adamw(learning_rate: Union[float, Schedule], b1: float = 0.9, b2: float = 0.999,
          eps: float = 1e-8, weight_decay: float = 1e-4, *, eps_root: float = 0.0,
          mask: Optional[DecayMask] = default_decay_mask,
          clip_norm: Optional[float] = None) -> AdamSpec:
    """AdamW with ``optax.adamw`` semantics (optionally with global-norm clipping).

    Args:
      learning_rate: Constant learning rate or optax schedule.
      b1: First-moment decay.
      b2: Second-moment decay.
      eps: Denominator epsilon outside the square root.
      weight_decay: Decoupled weight-decay coefficient.
      eps_root: Denominator epsilon inside the square root.
      mask: ``mask(path, shape) -> bool``; default :func:`default_decay_mask`;
        ``None`` decays every parameter (optax's default).
      clip_norm: Global-norm clipping threshold, or ``None``.

    Returns:
      The :class:`AdamSpec`.
    """
    return AdamSpec(learning_rate=learning_rate, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                    weight_decay=weight_decay, mask=mask, clip_norm=clip_norm)


@functools.lru_cache(maxsize=None)
def _cpu_device() -> Optional[jax.Device]:
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:  # CPU backend excluded by JAX_PLATFORMS
        return None


_BIAS_TABLE = 1024  # steps per cached block of bias corrections


@jax.jit
def _bias_correction_xla(decay, counts):
    return 1 - decay ** counts  # the expression of optax.tree.bias_correction


@functools.lru_cache(maxsize=64)
def _bias_correction_block(decay: float, block: int) -> np.ndarray:
    counts = np.arange(block * _BIAS_TABLE, (block + 1) * _BIAS_TABLE, dtype=np.int32)
    cpu = _cpu_device()
    if cpu is None:
        return (1.0 - float(np.float32(decay)) ** counts.astype(np.float64)).astype(np.float32)
    args = jax.device_put((np.float32(decay), counts), cpu)
    return np.asarray(_bias_correction_xla(*args)).astype(np.float32)


def bias_correction(decay: float, step: int) -> np.float32:
    """``1 - decay**step`` in float32, computed exactly as optax computes it.

    optax raises a float32 constant to the int32 count with XLA's ``pow``,
    whose rounding differs from C's ``powf`` for some steps; this runs the same
    operation on JAX's CPU backend, for a block of steps at a time (cached).
    Without a CPU backend it falls back to the correctly rounded float64 value
    (at most one float32 ulp away).

    Args:
      decay: ``b1`` or ``b2``.
      step: Step count after the increment (``>= 1``).

    Returns:
      The bias correction as ``np.float32``.
    """
    block, offset = divmod(int(step), _BIAS_TABLE)
    return _bias_correction_block(float(decay), block)[offset]


def adam_coefficients(*, step: int, lr: float, b1: float, b2: float, eps: float,
                      weight_decay: float, eps_root: float = 0.0,
                      grad_scale: float = 1.0) -> AdamCoefficients:
    """Builds the float32 scalars of one step, rounded like optax rounds them.

    Args:
      step: Step count after the increment (``t``, 1 on the first step).
      lr: Learning rate of this step (see :meth:`AdamSpec.lr_at`).
      b1: First-moment decay.
      b2: Second-moment decay.
      eps: Denominator epsilon outside the square root.
      weight_decay: Decay coefficient of this shard (0 when masked out).
      eps_root: Denominator epsilon inside the square root.
      grad_scale: Multiplier applied to the gradient first.

    Returns:
      The :class:`~zinf_jax.optim.kernel.AdamCoefficients`.

    Raises:
      ValueError: If ``step < 1``.
    """
    if step < 1:
        raise ValueError(f"step counts from 1 (after the increment), got {step}")
    f = np.float32
    return AdamCoefficients(
        grad_scale=f(grad_scale), b1=f(b1), one_minus_b1=f(1.0 - b1), b2=f(b2),
        one_minus_b2=f(1.0 - b2), bias_correction1=bias_correction(b1, step),
        bias_correction2=bias_correction(b2, step), eps=f(eps), eps_root=f(eps_root),
        weight_decay=f(weight_decay), neg_lr=-f(lr))


def adam_update_shard(param: np.ndarray, m: np.ndarray, v: np.ndarray, grad: np.ndarray, *,
                      step: int, lr: float, b1: float, b2: float, eps: float,
                      weight_decay: float, eps_root: float = 0.0,
                      grad_scale: float = 1.0) -> None:
    """Updates one float32 shard (master weights and both moments) in place.

    Runs the fused numba kernel (:func:`zinf_jax.optim.kernel.fused_adam_`), or
    the pure-JAX update in bounded blocks when numba is unavailable.

    Args:
      param: float32 master weights, C-contiguous, updated in place.
      m: float32 first moment, updated in place.
      v: float32 second moment, updated in place.
      grad: float32 gradient of the same size (not modified).
      step: Step count after the increment (1 on the first step).
      lr: Learning rate of this step.
      b1: First-moment decay.
      b2: Second-moment decay.
      eps: Denominator epsilon outside the square root.
      weight_decay: Decay coefficient of this shard (0 when masked out).
      eps_root: Denominator epsilon inside the square root.
      grad_scale: Multiplies the gradient first (clipping times loss-scale
        unscaling), so neither needs a pass of its own.

    Raises:
      TypeError: If a buffer is not a float32 numpy array.
      ValueError: If a buffer is not C-contiguous, sizes differ, or ``step < 1``.
    """
    coeffs = adam_coefficients(step=step, lr=lr, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                               weight_decay=weight_decay, grad_scale=grad_scale)
    apply_adam(param, m, v, grad, coeffs)


def apply_adam(param: np.ndarray, m: np.ndarray, v: np.ndarray, grad: np.ndarray, coeffs: AdamCoefficients) -> None:
    """:func:`adam_update_shard` with the step's scalars computed already (:func:`adam_coefficients`)."""
    if kernel.NUMBA_AVAILABLE:
        kernel.fused_adam_(param, m, v, grad, coeffs)
    else:
        _jax_inplace(param, m, v, grad, coeffs)


def adam_math(p: jax.Array, m: jax.Array, v: jax.Array, g: jax.Array, c: AdamCoefficients
              ) -> Tuple[jax.Array, jax.Array, jax.Array]:
    """One Adam(W) update of float32 arrays, traceable (the fused kernel's arithmetic, in the same order).

    Returns:
      ``(param, m, v)`` after the step.
    """
    g = g * c.grad_scale
    m = c.one_minus_b1 * g + c.b1 * m
    v = c.one_minus_b2 * (g * g) + c.b2 * v
    u = (m / c.bias_correction1) / (jnp.sqrt(v / c.bias_correction2 + c.eps_root) + c.eps)
    u = u + c.weight_decay * p
    return p + c.neg_lr * u, m, v


_adam_xla = jax.jit(adam_math, donate_argnums=(0, 1, 2))


def adam_update_shard_jax(param: jax.typing.ArrayLike, m: jax.typing.ArrayLike,
                          v: jax.typing.ArrayLike, grad: jax.typing.ArrayLike, *,
                          step: int, lr: float, b1: float, b2: float, eps: float,
                          weight_decay: float, eps_root: float = 0.0,
                          grad_scale: float = 1.0) -> Tuple[jax.Array, jax.Array, jax.Array]:
    """Pure-JAX Adam(W) shard update (jitted; ``param``, ``m``, ``v`` donated).

    Same arithmetic and arguments as :func:`adam_update_shard`, but functional:
    it returns the new arrays. Donated ``jax.Array`` inputs are consumed; numpy
    inputs are copied to the device and left untouched. The scalars are traced,
    so every step reuses one compiled program per shard shape.

    Returns:
      ``(param, m, v)`` after the step, as float32 ``jax.Array``.

    Raises:
      ValueError: If ``step < 1``.
    """
    coeffs = adam_coefficients(step=step, lr=lr, b1=b1, b2=b2, eps=eps, eps_root=eps_root,
                               weight_decay=weight_decay, grad_scale=grad_scale)
    return _adam_xla(param, m, v, grad, coeffs)


def _jax_inplace(param: np.ndarray, m: np.ndarray, v: np.ndarray, grad: np.ndarray,
                 coeffs: AdamCoefficients) -> None:
    """Fallback: the JAX update over blocks of the flat shard, copied back in place."""
    pf, mf, vf, gf = kernel.shard_views(param, m, v, grad)
    with jax.default_device(_cpu_device()):
        for s in range(0, pf.shape[0], _JAX_BLOCK):
            sl = slice(s, s + _JAX_BLOCK)
            new = _adam_xla(jnp.array(pf[sl]), jnp.array(mf[sl]), jnp.array(vf[sl]),
                            jnp.asarray(gf[sl]), coeffs)
            for dst, src in zip((pf, mf, vf), new):
                np.copyto(dst[sl], np.asarray(src))
