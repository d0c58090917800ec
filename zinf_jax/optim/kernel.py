"""Fused CPU kernels for the streamed optimizer: Adam, sum of squares, finiteness.

Each kernel is one pass over flat float32 buffers, compiled by numba with
``parallel=True`` (``prange`` over a flat index, one chunk per thread),
``error_model="numpy"`` (no division checks, so ``sqrt`` and ``/`` vectorise)
and float32 scalar arguments (no float64 promotion inside the loop).

The Adam kernel is built with the LLVM fast-math flags ``arcp`` and
``contract`` only. Those are the rewrites XLA:CPU itself applies (reciprocal
of a loop-invariant divisor, fused multiply-add), so on one machine the kernel
reproduces ``optax.adamw`` under ``jax.jit`` bit for bit (checked by
``tests/test_adam.py``), and it runs at the memory-bandwidth roofline: with
28 bytes moved per parameter the loop is load/store bound, not arithmetic
bound, so the remaining flags (``reassoc``, ``nnan``, ``afn``) buy nothing
and would make non-finite values undefined.

The reductions use ``reassoc`` (needed to vectorise a sum) but never
``nnan``/``ninf``: a NaN or Inf in the input must reach the result, because
the non-finite-gradient skip relies on it.

When numba cannot be imported, :data:`NUMBA_AVAILABLE` is ``False``; the
reductions fall back to blocked numpy here and :mod:`zinf_jax.optim.adam`
falls back to its pure-JAX update.

numba's default ``workqueue`` threading layer is not safe for parallel kernels
launched from several Python threads at once, and a streaming driver may run
the update on a worker thread; every parallel launch therefore takes
:data:`_LAUNCH_LOCK`.
"""

from __future__ import annotations

import math
import threading
from typing import NamedTuple

import numpy as np

try:  # pragma: no cover - exercised by whichever branch the machine has
    import numba
    from numba import njit, prange

    NUMBA_AVAILABLE: bool = True
    NUMBA_IMPORT_ERROR: str | None = None
except Exception as _err:  # noqa: BLE001 - any import failure selects the fallback
    numba = None
    NUMBA_AVAILABLE = False
    NUMBA_IMPORT_ERROR = f"{type(_err).__name__}: {_err}"

__all__ = [
    "NUMBA_AVAILABLE",
    "NUMBA_IMPORT_ERROR",
    "AdamCoefficients",
    "fused_adam_",
    "shard_views",
    "sum_squares",
    "all_finite",
    "warmup",
]

_LAUNCH_LOCK = threading.Lock()
_FALLBACK_BLOCK = 1 << 20  # elements per numpy block in the reduction fallback
SERIAL_BELOW = 1 << 16
"""Shards smaller than this are updated by the serial kernel: a parallel launch (thread pool wake-up,
under a lock) costs more than the update, ~0.7 ms per sub-group on a busy 2-core host."""
NORM_SERIAL_BELOW = 1 << 20
"""Buffers smaller than this are summed by the serial kernel (:func:`sum_squares`): the sum streams 4 bytes
an element and is done before a parallel launch pays off (65,536 elements: 3 us serial, 180 us parallel
in a compiled step's norm pass on 2 cores; 1M: 47 vs 28 us idle)."""


class AdamCoefficients(NamedTuple):
    """Per-step float32 scalars of one Adam update (the kernel's argument list).

    Every field is a ``np.float32`` so that numba types them as float32 and the
    loop never promotes to float64. Built by
    :func:`zinf_jax.optim.adam.adam_coefficients`.

    Attributes:
      grad_scale: Multiplies the gradient before anything else (global-norm
        clipping times loss-scale unscaling).
      b1: First-moment decay.
      one_minus_b1: ``float32(1 - b1)`` rounded from float64, as optax does.
      b2: Second-moment decay.
      one_minus_b2: ``float32(1 - b2)``.
      bias_correction1: ``1 - b1**t`` in float32.
      bias_correction2: ``1 - b2**t`` in float32.
      eps: Added to ``sqrt(v_hat + eps_root)``.
      eps_root: Added to ``v_hat`` under the square root.
      weight_decay: Decoupled weight decay of this shard (0 when masked out).
      neg_lr: Minus the learning rate of this step.
    """

    grad_scale: np.float32
    b1: np.float32
    one_minus_b1: np.float32
    b2: np.float32
    one_minus_b2: np.float32
    bias_correction1: np.float32
    bias_correction2: np.float32
    eps: np.float32
    eps_root: np.float32
    weight_decay: np.float32
    neg_lr: np.float32


if NUMBA_AVAILABLE:

    def _adam_body(p, m, v, g, gs, b1, omb1, b2, omb2, bc1, bc2, eps, eps_root, wd, neg_lr, i):
        gi = g[i] * gs
        mi = omb1 * gi + b1 * m[i]
        vi = omb2 * (gi * gi) + b2 * v[i]
        m[i] = mi
        v[i] = vi
        u = (mi / bc1) / (math.sqrt(vi / bc2 + eps_root) + eps)
        u = u + wd * p[i]
        p[i] = p[i] + neg_lr * u

    _adam_elem = njit(inline="always", fastmath={"contract"}, error_model="numpy", cache=True)(_adam_body)

    @njit(parallel=True, nogil=True, fastmath={"contract"}, error_model="numpy", cache=True)
    def _adam_nb(p, m, v, g, gs, b1, omb1, b2, omb2, bc1, bc2, eps, eps_root, wd, neg_lr):
        for i in prange(p.shape[0]):
            _adam_elem(p, m, v, g, gs, b1, omb1, b2, omb2, bc1, bc2, eps, eps_root, wd, neg_lr, i)

    @njit(nogil=True, fastmath={"contract"}, error_model="numpy", cache=True)
    def _adam_serial_nb(p, m, v, g, gs, b1, omb1, b2, omb2, bc1, bc2, eps, eps_root, wd, neg_lr):
        for i in range(p.shape[0]):
            _adam_elem(p, m, v, g, gs, b1, omb1, b2, omb2, bc1, bc2, eps, eps_root, wd, neg_lr, i)

    def _square_body(x, i):
        xi = np.float64(x[i])
        return xi * xi

    _square_elem = njit(inline="always", fastmath={"reassoc", "contract", "nsz"}, error_model="numpy",
                        cache=True)(_square_body)

    @njit(parallel=True, nogil=True, fastmath={"reassoc", "contract", "nsz"}, error_model="numpy", cache=True)
    def _sum_squares_nb(x):
        acc = 0.0
        for i in prange(x.shape[0]):
            acc += _square_elem(x, i)
        return acc

    @njit(nogil=True, fastmath={"reassoc", "contract", "nsz"}, error_model="numpy", cache=True)
    def _sum_squares_serial_nb(x):  # the same element arithmetic, no thread-pool launch
        acc = 0.0
        for i in range(x.shape[0]):
            acc += _square_elem(x, i)
        return acc

    @njit(parallel=True, nogil=True, fastmath={"reassoc", "nsz"}, error_model="numpy", cache=True)
    def _nonfinite_probe_nb(x):
        # x * 0 is 0 for finite x and NaN for +-Inf or NaN; the sum keeps any NaN.
        acc = np.float32(0.0)
        for i in prange(x.shape[0]):
            acc += x[i] * np.float32(0.0)
        return acc


def _flat(x: np.ndarray, name: str, writable: bool = True) -> np.ndarray:
    """Returns a flat float32 view of ``x`` without copying.

    Raises:
      TypeError: If ``x`` is not a float32 numpy array.
      ValueError: If ``x`` is not C-contiguous (a view would need a copy), or
        is read-only while ``writable`` is asked for.
    """
    if not isinstance(x, np.ndarray) or x.dtype != np.float32:
        raise TypeError(f"{name} must be a float32 numpy array, got {type(x).__name__} "
                        f"of dtype {getattr(x, 'dtype', None)}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous to be updated in place")
    if writable and not x.flags.writeable:
        raise ValueError(f"{name} is read-only; it is updated in place")
    return x.reshape(-1)


def shard_views(param, m, v, grad) -> list:
    """Flat views of one shard's four buffers, checked for dtype, layout and size."""
    flats = [_flat(param, "param"), _flat(m, "m"), _flat(v, "v"), _flat(grad, "grad", writable=False)]
    if len({f.shape[0] for f in flats}) != 1:
        raise ValueError(f"shard sizes differ: {[f.shape[0] for f in flats]}")
    return flats


def fused_adam_(param: np.ndarray, m: np.ndarray, v: np.ndarray, grad: np.ndarray,
                coeffs: AdamCoefficients) -> None:
    """Applies one Adam(W) step to a shard in place, in one fused pass.

    Per element, in this order (the order of ``optax.adamw``)::

        g = grad * grad_scale
        m = (1 - b1) * g + b1 * m
        v = (1 - b2) * g * g + b2 * v
        u = (m / bc1) / (sqrt(v / bc2 + eps_root) + eps) + weight_decay * param
        param = param + (-lr) * u

    Args:
      param: float32 master weights, updated in place.
      m: float32 first moment, updated in place.
      v: float32 second moment, updated in place.
      grad: float32 gradient (read only), same size as ``param``.
      coeffs: The step's scalars; see :class:`AdamCoefficients`.

    Raises:
      RuntimeError: If numba is unavailable (use the pure-JAX path instead).
      TypeError, ValueError: On a non-float32 or non-contiguous buffer.
    """
    if not NUMBA_AVAILABLE:
        raise RuntimeError(f"numba is unavailable ({NUMBA_IMPORT_ERROR})")
    flats = shard_views(param, m, v, grad)
    if flats[0].shape[0] < SERIAL_BELOW:  # same arithmetic per element; no thread-pool launch
        _adam_serial_nb(*flats, *(np.float32(c) for c in coeffs))
        return
    with _LAUNCH_LOCK:
        _adam_nb(*flats, *(np.float32(c) for c in coeffs))


def sum_squares(x: np.ndarray) -> float:
    """Sum of squares of a float32 buffer, accumulated in float64.

    A non-finite element makes the result non-finite (Inf or NaN), so the same
    pass serves the global norm and the overflow check.

    Args:
      x: Any float32 numpy array; C-contiguous arrays are not copied.

    Returns:
      The float64 sum of ``x**2`` as a Python float.
    """
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    if NUMBA_AVAILABLE:
        if x.shape[0] < NORM_SERIAL_BELOW:  # no thread-pool launch for a small buffer
            return float(_sum_squares_serial_nb(x))
        with _LAUNCH_LOCK:
            return float(_sum_squares_nb(x))
    total = 0.0
    for start in range(0, x.shape[0], _FALLBACK_BLOCK):
        block = x[start:start + _FALLBACK_BLOCK].astype(np.float64)
        total += float(np.dot(block, block))
    return total


def all_finite(x: np.ndarray) -> bool:
    """Whether every element of a float32 buffer is finite (no NaN, no Inf).

    Args:
      x: Any float32 numpy array; C-contiguous arrays are not copied.

    Returns:
      ``True`` when no element is NaN or +-Inf.
    """
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    if NUMBA_AVAILABLE:
        with _LAUNCH_LOCK:
            return bool(np.isfinite(_nonfinite_probe_nb(x)))
    return all(bool(np.isfinite(x[s:s + _FALLBACK_BLOCK]).all())
               for s in range(0, x.shape[0], _FALLBACK_BLOCK))


def warmup() -> None:
    """Compiles (or loads from numba's cache) every kernel on tiny buffers.

    Call once before timing anything; the first real call would otherwise pay
    the compile. A no-op without numba.
    """
    if not NUMBA_AVAILABLE:
        return
    a, b, c, d = (np.zeros(8, np.float32) for _ in range(4))
    one = np.float32(1.0)
    fused_adam_(a, b, c, d, AdamCoefficients(*(one,) * len(AdamCoefficients._fields)))
    sum_squares(a)
    all_finite(a)
