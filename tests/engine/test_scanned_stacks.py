"""Stacks of layers with a leading layer axis, applied by a scan in the model's own code (``nnx.vmap`` +
``nnx.scan``, ``nnx.split_rngs`` + ``jax.lax.scan`` under ``nnx.remat``, Linen ``nn.scan`` over ``nn.remat``):
built, trained and compared with plain jit + optax on the unwrapped model, in both engines (the compiled one
with params and optimizer on the cpu tier, the streamed one on nvme).

The module holding the scan is the unit (``STACK_POLICY``): its stacked leaves are sharded at rest like any
parameter and gathered for the stack's call. (Per-layer units inside the scan are issue 45's open part.)
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zinf_jax as zinf
from helpers.scan_models import STACK_POLICY, LaxScanLM, LinenScanLM, VmapScanMLP
from test_idioms import (ENGINES, EPS, LR, STEPS, WD, assert_params, flat_linen, flat_nnx, linen_reference,
                         nnx_reference, nvme, tokens, xent)


SLOW_STREAMED = pytest.mark.parametrize("engine", [pytest.param("streamed", marks=pytest.mark.slow), "compiled"])
"""Both engines; the streamed one (nvme tiers) in the slow suite (~40 s each on the 2-core box)."""


def _features(step, batch=8):
    x = np.asarray(jax.random.normal(jax.random.key(4000 + step), (batch, 8)), np.float32)
    y = np.asarray(jax.random.randint(jax.random.key(5000 + step), (batch,), 0, 10), np.int32)
    return x, y


def _optimizer():
    return zinf.adamw(LR, eps=EPS, weight_decay=WD, mask=None)


@ENGINES
def test_nnx_vmap_built_stack_with_batchnorm_and_dropout_applied_by_nnx_scan(tmp_path, engine):
    ctor = lambda: VmapScanMLP(nnx.Rngs(0, dropout=1))  # noqa: E731
    loss_fn = lambda m, b: xent(m(b[0]), b[1])  # noqa: E731
    batches = [_features(s) for s in range(STEPS)]
    ref_losses, ref_model = nnx_reference(ctor, loss_fn, batches)
    eng = zinf.initialize(ctor, config=nvme(tmp_path, threshold=16, engine=engine), optimizer=_optimizer(),
                          loss_fn=loss_fn, unit_policy=STACK_POLICY)
    assert eng.mode == engine and "stack" in {u.path for u in eng.adapter.units}
    kernel = eng.layouts["stack/layers/lin/kernel"]
    assert kernel.shape == (4, 32, 32) and kernel.num_shards == 8  # sharded at rest
    losses = [eng.train_step(b)["loss"] for b in batches]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_params(eng.param_arrays(), flat_nnx(nnx.state(ref_model, nnx.Param)))
    got, want = flat_nnx(eng.model_state()), flat_nnx(nnx.state(ref_model, nnx.Not(nnx.Param)))
    assert "stack/layers/bn/mean" in want and want["stack/layers/drop/rngs/count"].shape == (4,)
    for path, v in want.items():  # the stacked batch statistics and per-layer dropout streams
        np.testing.assert_allclose(got[path], v, rtol=1e-5, atol=1e-6, err_msg=path)
    eng.close()


@SLOW_STREAMED
def test_nnx_split_rngs_built_stack_applied_by_lax_scan_under_remat(tmp_path, engine):
    ctor = lambda: LaxScanLM(nnx.Rngs(0))  # noqa: E731
    loss_fn = lambda m, t: xent(m(t[:, :-1]), t[:, 1:])  # noqa: E731
    batches = [tokens(s) for s in range(STEPS)]
    ref_losses, ref_model = nnx_reference(ctor, loss_fn, batches)
    eng = zinf.initialize(ctor, config=nvme(tmp_path, threshold=16, engine=engine), optimizer=_optimizer(),
                          loss_fn=loss_fn, unit_policy=STACK_POLICY)
    assert eng.layouts["stack/layers/up/kernel"].shape == (4, 32, 128)
    losses = [eng.train_step(b)["loss"] for b in batches]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_params(eng.param_arrays(), flat_nnx(nnx.state(ref_model, nnx.Param)))
    eng.close()


@SLOW_STREAMED
def test_linen_nn_scan_decoder_with_remat_and_dropout(tmp_path, engine):
    module, tok0 = LinenScanLM(), jnp.zeros((8, 8), jnp.int32)

    def loss_fn(model, batch):
        toks, key = batch
        return xent(model(toks[:, :-1], rngs={"dropout": key}), toks[:, 1:])

    batches = [(tokens(s), jax.random.key(s)) for s in range(STEPS)]
    ref_losses, ref_params, _ = linen_reference(module, (tok0,), {"train": False}, loss_fn, batches)
    eng = zinf.initialize(module, init_args=(tok0,), init_kwargs={"train": False},
                          config=nvme(tmp_path, threshold=16, engine=engine), optimizer=_optimizer(),
                          loss_fn=loss_fn, unit_policy=STACK_POLICY)
    assert "stack" in {u.path for u in eng.adapter.units}
    assert eng.layouts["stack/layers/Dense_0/kernel"].shape == (4, 32, 96)
    losses = [eng.train_step(b)["loss"] for b in batches]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_params(eng.param_arrays(), flat_linen(ref_params))
    eng.close()


def test_a_unit_called_inside_the_models_scan_is_one_error_naming_the_fix():
    from helpers.scan_models import TopLevelScanMLP

    ctor = lambda: TopLevelScanMLP(nnx.Rngs(0, dropout=1))  # noqa: E731
    eng = zinf.initialize(ctor, config=zinf.ZeroConfig(persistence_threshold=16), loss_fn=lambda m, b: xent(m(b[0]), b[1]),
                          unit_policy=zinf.UnitPolicy(patterns=("stack/layers",)))
    with pytest.raises(zinf.EngineError, match=r"inside a transform.*UnitPolicy\(patterns=\('stack',\)\)"):
        eng.train_step(_features(0))
    eng.close()
