"""The shard-wise Adam(W) update against optax, the reference.

Every comparison is with optax run on the same parameters and gradients:
``optax.chain(optax.clip_by_global_norm(c), optax.adamw(schedule, ...))`` for
AdamW with clipping, a weight-decay mask and a warmup-cosine schedule, and
``optax.adam`` for plain Adam. Parameters are split into two shards each and
updated shard by shard, as the streamed driver does.
"""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from zinf_jax.optim import kernel
from zinf_jax.optim import (
    AdamSpec,
    adam,
    adam_update_shard,
    adam_update_shard_jax,
    adamw,
    bias_correction,
    default_decay_mask,
    global_norm_sq,
    grad_scale,
)

SHAPES = {
    "dense": {"kernel": (8, 16), "bias": (16,)},
    "norm": {"scale": (16,)},
    "embed": {"embedding": (32, 8)},
    "head": {"kernel": (16, 5)},
}
STEPS = 20
RTOL = 1e-6
# The function zinf_jax.optim.adam shadows the submodule of the same name.
adam_mod = importlib.import_module("zinf_jax.optim.adam")


def _path(keypath) -> str:
    return "/".join(str(k.key) for k in keypath)


def _init_params(seed: int = 0):
    rng = np.random.default_rng(seed)

    def leaf(shape):  # magnitudes in [0.5, 1.5]: no near-zero entries, so rtol is meaningful
        mag = rng.uniform(0.5, 1.5, size=shape).astype(np.float32)
        return np.where(rng.random(shape) < 0.5, -mag, mag).astype(np.float32)

    return jax.tree.map(leaf, SHAPES, is_leaf=lambda x: isinstance(x, tuple))


def _grads(step: int, params, seed: int = 1):
    rng = np.random.default_rng(seed * 1000 + step)
    scale = 0.01 if step % 2 else 1.0  # alternate: below and above the clipping norm
    return jax.tree.map(lambda p: (rng.standard_normal(p.shape) * scale).astype(np.float32), params)


def _optax_run(tx, params, steps):
    params = jax.tree.map(jnp.asarray, params)
    state = tx.init(params)

    @jax.jit
    def step_fn(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    for t in range(steps):
        params, state = step_fn(params, state, jax.tree.map(jnp.asarray, _grads(t, params)))
    return jax.tree.map(np.asarray, params)


def _zinf_run(spec: AdamSpec, params, steps, update=adam_update_shard, n_shards=2):
    params = jax.tree.map(np.copy, params)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    moments = [(np.zeros_like(p), np.zeros_like(p)) for _, p in leaves]
    for count in range(steps):
        grads = jax.tree.leaves(_grads(count, params))
        scale = grad_scale(global_norm_sq(grads), clip_norm=spec.clip_norm)
        assert scale.finite
        lr = spec.lr_at(count)
        for (path, p), (m, v), g in zip(leaves, moments, grads):
            wd = spec.decay_for(_path(path), p.shape)
            shards = [np.array_split(a.reshape(-1), n_shards) for a in (p, m, v, g)]
            for ps, ms, vs, gs in zip(*shards):  # views: updated in place
                update(ps, ms, vs, gs, step=count + 1, lr=lr, b1=spec.b1, b2=spec.b2,
                       eps=spec.eps, eps_root=spec.eps_root, weight_decay=wd,
                       grad_scale=scale.multiplier)
    return jax.tree_util.tree_unflatten(treedef, [p for _, p in leaves])


def _jax_functional_update(p, m, v, g, **kw):
    """Adapts the functional JAX update to the in-place loop above."""
    new = adam_update_shard_jax(jnp.asarray(p), jnp.asarray(m), jnp.asarray(v), g, **kw)
    for dst, src in zip((p, m, v), new):
        dst[...] = np.asarray(src)


def _assert_trees_close(actual, expected, rtol=RTOL):
    for (path, a), e in zip(jax.tree_util.tree_flatten_with_path(actual)[0], jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=0, err_msg=_path(path))


def _adamw_case():
    sched = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=1e-2, warmup_steps=5, decay_steps=STEPS, end_value=1e-3)
    spec = adamw(sched, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, clip_norm=1.0)
    params = _init_params()
    mask = jax.tree_util.tree_map_with_path(lambda k, p: default_decay_mask(_path(k), p.shape), params)
    ref_tx = optax.chain(optax.clip_by_global_norm(1.0),
                         optax.adamw(sched, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=mask))
    return spec, params, ref_tx


def test_adamw_clip_mask_schedule_matches_optax():
    spec, params, ref_tx = _adamw_case()
    expected = _optax_run(ref_tx, params, STEPS)
    _assert_trees_close(_zinf_run(spec, params, STEPS), expected)


def test_plain_adam_matches_optax():
    params = _init_params(3)
    expected = _optax_run(optax.adam(1e-3, b1=0.8, b2=0.99, eps=1e-6, eps_root=1e-12), params, STEPS)
    spec = adam(1e-3, b1=0.8, b2=0.99, eps=1e-6, eps_root=1e-12)
    _assert_trees_close(_zinf_run(spec, params, STEPS), expected)


def test_jax_functional_update_matches_optax():
    spec, params, ref_tx = _adamw_case()
    expected = _optax_run(ref_tx, params, STEPS)
    _assert_trees_close(_zinf_run(spec, params, STEPS, update=_jax_functional_update), expected)


def test_inplace_fallback_without_numba_matches_optax(monkeypatch):
    monkeypatch.setattr(kernel, "NUMBA_AVAILABLE", False)
    monkeypatch.setattr(adam_mod, "_JAX_BLOCK", 37)  # several blocks and a ragged tail
    spec, params, ref_tx = _adamw_case()
    expected = _optax_run(ref_tx, params, STEPS)
    _assert_trees_close(_zinf_run(spec, params, STEPS), expected)


@pytest.mark.skipif(not kernel.NUMBA_AVAILABLE, reason="numba unavailable")
def test_kernel_agrees_with_xla_fallback_on_one_large_step():
    rng = np.random.default_rng(7)
    n = 100_003
    p, g = (rng.standard_normal(n).astype(np.float32) for _ in range(2))
    m = (rng.standard_normal(n) * 1e-2).astype(np.float32)
    v = (rng.random(n) * 1e-3).astype(np.float32)
    kw = dict(step=3, lr=3e-4, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01, grad_scale=0.5)
    ref = adam_update_shard_jax(jnp.asarray(p), jnp.asarray(m), jnp.asarray(v), g, **kw)
    adam_update_shard(p, m, v, g, **kw)
    for got, want in zip((p, m, v), ref):
        np.testing.assert_allclose(got, np.asarray(want), rtol=RTOL, atol=1e-12)


def test_bias_correction_is_optax_float32():
    for decay in (0.9, 0.95, 0.999, 0.9999):
        steps = jnp.arange(1, 3000, 7, dtype=jnp.int32)  # spans cached blocks
        ref = np.asarray(jax.jit(jax.vmap(lambda c: optax.tree.bias_correction(jnp.ones(()), decay, c)))(steps))
        got = np.array([bias_correction(decay, int(t)) for t in steps], np.float32)
        np.testing.assert_array_equal(1.0 / got, ref)


def test_schedule_is_evaluated_before_the_increment():
    sched = optax.linear_schedule(1.0, 0.0, 10)
    spec = adamw(sched)
    assert spec.lr_at(0) == np.float32(1.0)
    assert spec.lr_at(5) == np.float32(0.5)
    assert adam(0.25).lr_at(123) == np.float32(0.25)


def test_default_mask_and_decay_for():
    assert default_decay_mask("dense/kernel", (4, 4))
    assert not default_decay_mask("dense/bias", (4,))
    assert not default_decay_mask("scalar", ())
    spec = adamw(1e-3, weight_decay=0.1)
    assert spec.decay_for("a/kernel", (2, 3)) == pytest.approx(0.1)
    assert spec.decay_for("a/bias", (3,)) == 0.0
    assert adamw(1e-3, weight_decay=0.1, mask=None).decay_for("a/bias", (3,)) == pytest.approx(0.1)
    assert adam(1e-3).decay_for("a/kernel", (2, 3)) == 0.0


@pytest.mark.parametrize("kwargs", [dict(b1=1.0), dict(b2=-0.1), dict(eps=-1.0),
                                    dict(clip_norm=0.0), dict(learning_rate=-1.0)])
def test_spec_rejects_bad_hyperparameters(kwargs):
    base = dict(learning_rate=1e-3)
    with pytest.raises(ValueError):
        AdamSpec(**{**base, **kwargs})


def test_update_rejects_bad_buffers():
    ok = np.zeros(8, np.float32)
    kw = dict(step=1, lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0)
    with pytest.raises(TypeError):
        adam_update_shard(np.zeros(8), ok.copy(), ok.copy(), ok, **kw)
    with pytest.raises(ValueError):
        adam_update_shard(np.zeros((4, 4), np.float32)[:, ::2], ok.copy(), ok.copy(), ok, **kw)
    with pytest.raises(ValueError):
        adam_update_shard(ok.copy(), ok.copy(), ok.copy(), np.zeros(9, np.float32), **kw)
    with pytest.raises(ValueError):
        adam_update_shard(ok.copy(), ok.copy(), ok.copy(), ok, **{**kw, "step": 0})
    frozen = ok.copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError):
        adam_update_shard(frozen, ok.copy(), ok.copy(), ok, **kw)
    adam_update_shard(ok.copy(), ok.copy(), ok.copy(), frozen, **kw)  # a read-only grad is fine


@pytest.mark.skipif(not kernel.NUMBA_AVAILABLE, reason="numba not installed")
@pytest.mark.parametrize("n", [1, 7, 1000, kernel.SERIAL_BELOW - 1, kernel.SERIAL_BELOW + 13, 300_001])
def test_serial_and_parallel_kernels_agree_bitwise(n):
    # small shards take the serial kernel: it must be the same arithmetic as the parallel one
    rng = np.random.default_rng(n)
    coeffs = kernel.AdamCoefficients(*(np.float32(x) for x in (0.7, 0.9, 0.1, 0.999, 1e-3, 0.3, 0.01, 1e-8, 0.0,
                                                                 0.1, -1e-3)))
    a = [rng.standard_normal(n).astype(np.float32) for _ in range(4)]
    a[2] = np.abs(a[2])
    b = [x.copy() for x in a]
    kernel._adam_nb(*a, *coeffs)
    kernel._adam_serial_nb(*b, *coeffs)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("n", [1, 1000, kernel.SERIAL_BELOW, kernel.NORM_SERIAL_BELOW - 1, kernel.NORM_SERIAL_BELOW + 13])
def test_sum_squares_is_the_float64_sum_either_side_of_the_serial_threshold(n):
    # below NORM_SERIAL_BELOW the serial kernel sums, above it the parallel one: both the float64 sum
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    ref = float(np.sum(x.astype(np.float64) ** 2))
    assert kernel.sum_squares(x) == pytest.approx(ref, rel=1e-12)
    x[n // 2] = np.inf
    assert not np.isfinite(kernel.sum_squares(x))


@pytest.mark.skipif(not kernel.NUMBA_AVAILABLE, reason="numba not installed")
@pytest.mark.parametrize("n", [1000, kernel.SERIAL_BELOW + 13])
def test_kernel_divides_and_takes_square_roots_correctly_rounded(n):
    # with g = 0, b1 = b2 = 1, eps = eps_root = wd = 0 and lr = 1 the step is p = 0 - (m / bc1) / sqrt(v / bc2):
    # bitwise numpy's float32 arithmetic unless the kernel approximates a division (numba's fastmath "arcp"
    # turned m / bc1 into m * (1 / bc1): on an AVX-512 machine the cpu optimizer then left optax and the
    # in-program XLA update by an ulp, and two runs that must be equal were not)
    rng = np.random.default_rng(n)
    m = rng.standard_normal(n).astype(np.float32)
    v = (rng.random(n) + 0.1).astype(np.float32)
    p, g = np.zeros(n, np.float32), np.zeros(n, np.float32)
    bc1, bc2 = np.float32(0.271), np.float32(0.0199)
    coeffs = kernel.AdamCoefficients(*(np.float32(x) for x in (1, 1, 0, 1, 0, bc1, bc2, 0, 0, 0, -1)))
    kernel.fused_adam_(p, m.copy(), v.copy(), g, coeffs)
    np.testing.assert_array_equal(p, -((m / bc1) / np.sqrt(v / bc2)))
