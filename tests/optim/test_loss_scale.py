"""Clipping, non-finite detection and the dynamic loss scaler.

The loss-scale sequences are written out by hand from DeepSpeed's
``DynamicLossScaler.update_scale`` rules (deepspeed/runtime/fp16/loss_scaler.py).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from zinf_jax.optim import kernel
from zinf_jax.optim import (
    clip_scale,
    global_norm_sq,
    grad_scale,
    init_loss_scale,
    is_finite,
    update_loss_scale,
)


def _run(flags, **cfg):
    state = init_loss_scale(**cfg)
    seen = []
    for overflow in flags:
        state = update_loss_scale(state, overflow, **cfg)
        seen.append((state.scale, state.hysteresis))
    return seen


def test_dynamic_scaler_follows_deepspeed_rules():
    cfg = dict(initial_scale_power=4, window=3, hysteresis=2, min_scale=1.0)
    flags = [True, True, False, False, False, False, True, False, True, True, True, True]
    expected = [
        (16.0, 1),  # iter 0: overflow, hysteresis 2 -> 1 (delayed shift), scale kept
        (8.0, 1),   # iter 1: overflow with hysteresis 1: halve
        (8.0, 1),   # iter 2: stable interval 0
        (8.0, 1),   # iter 3: 1
        (8.0, 1),   # iter 4: 2
        (16.0, 2),  # iter 5: 3 == window: double, refill hysteresis
        (16.0, 1),  # iter 6: overflow, hysteresis 2 -> 1
        (16.0, 1),  # iter 7: stable interval 0
        (8.0, 1),   # iter 8: overflow, hysteresis 1: halve
        (4.0, 1),
        (2.0, 1),
        (1.0, 1),   # iter 11: reaches min_scale
    ]
    assert _run(flags, **cfg) == expected
    state = init_loss_scale(**cfg)
    for overflow in flags:
        state = update_loss_scale(state, overflow, **cfg)
    assert state.step == len(flags) and state.last_overflow_step == 11
    with pytest.raises(FloatingPointError):
        update_loss_scale(state, True, **cfg)
    state = update_loss_scale(state, True, raise_at_min_scale=False, **cfg)
    assert (state.scale, state.hysteresis) == (1.0, 1)


def test_scale_grows_every_window_without_overflow():
    # Good iterations k = 0, 1, 2, ...: stable interval k; doubles when k % window == 0, k > 0.
    seen = _run([False] * 7, initial_scale_power=1, window=2, hysteresis=1)
    assert [s for s, _ in seen] == [2.0, 2.0, 4.0, 4.0, 8.0, 8.0, 16.0]


def test_consecutive_hysteresis_refills_on_every_good_step():
    cfg = dict(initial_scale_power=4, window=100, hysteresis=2, consecutive_hysteresis=True)
    flags = [True, False, True, True, False, True, False]
    expected = [(16.0, 1), (16.0, 2), (16.0, 1), (8.0, 1), (8.0, 2), (8.0, 1), (8.0, 2)]
    assert _run(flags, **cfg) == expected


def test_hysteresis_one_halves_on_every_overflow():
    seen = _run([True, True, False], initial_scale_power=3, hysteresis=1, min_scale=2.0)
    assert seen == [(4.0, 1), (2.0, 1), (2.0, 1)]


def test_static_and_disabled_scalers_never_change():
    assert [s for s, _ in _run([True, False, True], static_scale=128.0)] == [128.0] * 3
    assert [s for s, _ in _run([True, True], enabled=False)] == [1.0, 1.0]


def test_config_dataclass_fields_pass_through():
    @dataclasses.dataclass(frozen=True)
    class LossScaleConfig:  # the field names zinf_jax.config uses
        enabled: bool = True
        static_scale: float = 0.0
        initial_scale_power: int = 16
        window: int = 1000
        hysteresis: int = 2
        min_scale: float = 1.0
        consecutive_hysteresis: bool = False

    cfg = dataclasses.asdict(LossScaleConfig())
    state = update_loss_scale(init_loss_scale(**cfg), True, **cfg)
    assert state.scale == 2.0 ** 16 and state.hysteresis == 1


def test_clip_scale_matches_optax_clip_by_global_norm():
    rng = np.random.default_rng(0)
    tree = {"a": rng.standard_normal((7, 5)).astype(np.float32),
            "b": rng.standard_normal(13).astype(np.float32)}
    for max_norm in (0.5, 3.0, 100.0):
        ref, _ = optax.clip_by_global_norm(max_norm).update(jax.tree.map(jnp.asarray, tree), None)
        norm = float(np.sqrt(global_norm_sq(jax.tree.leaves(tree))))
        s = clip_scale(norm, max_norm)
        for k in tree:
            np.testing.assert_allclose(tree[k] * np.float32(s), np.asarray(ref[k]), rtol=1e-6)
    assert clip_scale(5.0, None) == 1.0


def test_global_norm_matches_optax_norm():
    rng = np.random.default_rng(1)
    leaves = [rng.standard_normal(s).astype(np.float32) for s in [(100, 30), (7,), (3, 3, 3)]]
    np.testing.assert_allclose(np.sqrt(global_norm_sq(leaves)), float(optax.tree.norm(leaves)), rtol=1e-6)


def test_grad_scale_unscales_and_clips():
    g = np.full(4, 3.0, np.float32)  # norm 6
    s = grad_scale(global_norm_sq([g * 1024]), loss_scale=1024.0, clip_norm=2.0)
    assert s.finite and s.norm == pytest.approx(6.0)
    np.testing.assert_allclose(g * 1024 * s.multiplier, g / 3.0, rtol=1e-6)
    s = grad_scale(global_norm_sq([g]), clip_norm=None)
    assert s.multiplier == np.float32(1.0)


@pytest.mark.parametrize("numba_on", [True, False])
def test_non_finite_detection(monkeypatch, numba_on):
    if numba_on and not kernel.NUMBA_AVAILABLE:
        pytest.skip("numba unavailable")
    monkeypatch.setattr(kernel, "NUMBA_AVAILABLE", numba_on)
    monkeypatch.setattr(kernel, "_FALLBACK_BLOCK", 1000)
    big = np.full(10_000, 3.0e38, np.float32)  # finite, but its square overflows float32
    assert is_finite(big) and is_finite([big, np.zeros(3, np.float32)])
    assert np.isfinite(global_norm_sq([big]))
    for bad in (np.nan, np.inf, -np.inf):
        x = np.zeros(10_001, np.float32)
        x[7777] = bad
        assert not is_finite([np.ones(5, np.float32), x])
        assert not np.isfinite(global_norm_sq([np.ones(5, np.float32), x]))
        s = grad_scale(global_norm_sq([x]), loss_scale=2.0 ** 16, clip_norm=1.0)
        assert not s.finite and s.multiplier == 0.0
