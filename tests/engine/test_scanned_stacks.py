"""Stacks of layers with a leading layer axis, applied by a scan in the model's own code (``nnx.vmap`` +
``nnx.scan``, ``nnx.split_rngs`` + ``jax.lax.scan`` under ``nnx.remat``, Linen ``nn.scan`` over ``nn.remat``):
built, trained and compared with plain jit + optax on the unwrapped model, in both engines (the compiled one
with params and optimizer on the cpu tier, the streamed one on nvme).

Two ways to make a stack streamable: the module holding the scan is the unit (``STACK_POLICY``, both engines):
its stacked leaves are sharded at rest like any parameter and gathered for the stack's call; or the stack
itself is the unit, called inside the model's scan (streamed engine): the scan runs layer by layer, each
layer's shards fetched and gathered alone (``LAYER_POLICY``; see [Note: layers of a stack] in
``zinf_jax.engine.streamed``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zinf_jax as zinf
from helpers.scan_models import (STACK_POLICY, LaxScanLM, LinenScanLM, ScannedDecoderLM, TopLevelScanMLP,
                                 VmapScanMLP)
from test_idioms import (ENGINES, EPS, LR, STEPS, WD, assert_params, flat_linen, flat_nnx, linen_reference,
                         nnx_reference, nvme, tokens, xent)


SLOW_STREAMED = pytest.mark.parametrize("engine", [pytest.param("streamed", marks=pytest.mark.slow), "compiled"])
"""Both engines; the streamed one (nvme tiers) in the slow suite (suite time; the stacks run as units layer by
layer in the streamed engine by default below)."""


def _features(step, batch=8):
    x = np.asarray(jax.random.normal(jax.random.key(4000 + step), (batch, 8)), np.float32)
    y = np.asarray(jax.random.randint(jax.random.key(5000 + step), (batch,), 0, 10), np.int32)
    return x, y


def _optimizer():
    return zinf.adamw(LR, eps=EPS, weight_decay=WD, mask=None)


@SLOW_STREAMED
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


@pytest.mark.slow  # the default suite runs this model with the stack as the unit (below), in the compiled engine
@ENGINES
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


LAYER_POLICY = zinf.UnitPolicy(patterns=("stack/layers",))
"""The stack of layers is the unit, called inside the model's scan: applied one layer per call."""


@pytest.mark.parametrize("model, engine", [
    ("vmap", "streamed"), ("lax", "compiled"),
    *(pytest.param(m, e, marks=pytest.mark.slow) for m, e in
      (("vmap", "compiled"), ("top", "streamed"), ("top", "compiled"), ("lax", "streamed")))])
def test_a_stack_called_inside_the_models_scan_runs_layer_by_layer_like_plain_jit(tmp_path, model, engine):
    """The stack is the unit and the model's own scan applies it (nnx.vmap-built blocks with BatchNorm and Dropout
    under nnx.scan in a submodule, or in the model's own call; split_rngs-built decoder blocks under jax.lax.scan
    over their nnx.split state, each under nnx.remat): the streamed engine (nvme) calls it once per layer with
    that layer's shards, the compiled one (cpu tiers) keeps the model's scan and gathers one layer per
    iteration (its step lowered for cuda and tpu computes nothing on host-memory values); both train as plain
    jit + optax, batch statistics and dropout streams included."""
    if model == "lax":
        ctor, batches = (lambda: LaxScanLM(nnx.Rngs(0))), [tokens(s) for s in range(STEPS)]  # noqa: E731
        loss_fn = lambda m, t: xent(m(t[:, :-1]), t[:, 1:])  # noqa: E731
    else:
        cls = VmapScanMLP if model == "vmap" else TopLevelScanMLP
        ctor, batches = (lambda: cls(nnx.Rngs(0, dropout=1))), [_features(s) for s in range(STEPS)]  # noqa: E731
        loss_fn = lambda m, b: xent(m(b[0]), b[1])  # noqa: E731
    ref_losses, ref_model = nnx_reference(ctor, loss_fn, batches)
    eng = zinf.initialize(ctor, config=nvme(tmp_path, threshold=16, engine=engine), optimizer=_optimizer(),
                          loss_fn=loss_fn, unit_policy=LAYER_POLICY)
    assert eng.mode == engine and "stack/layers" in {u.path for u in eng.adapter.units}
    losses = [eng.train_step(b)["loss"] for b in batches]
    uid = next(u.uid for u in eng.adapter.units if u.path == "stack/layers")
    calls = eng.passes._traces.values()[0].program.calls
    # streamed: one call per layer; compiled: the one call inside the model's scan, bound again per iteration
    assert [c.layer for c in calls if c.uid == uid] == ([0, 1, 2, 3] if engine == "streamed" else [-1])
    if engine == "compiled":  # params in host memory: each layer's slice is moved, never computed on there
        for platform in ("cuda", "tpu"):
            zinf.check_host_compute(eng.lower(batches[0], platforms=(platform,)))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_params(eng.param_arrays(), flat_nnx(nnx.state(ref_model, nnx.Param)))
    got, want = flat_nnx(eng.model_state()), flat_nnx(nnx.state(ref_model, nnx.Not(nnx.Param)))
    assert set(got) == set(want)
    for path, v in want.items():
        np.testing.assert_allclose(got[path], v, rtol=1e-5, atol=1e-6, err_msg=path)
    eng.close()


def _scanned_lm_peak(tmp_path, n):
    off = zinf.Offload("nvme", path=str(tmp_path / f"n{n}"))
    (tmp_path / f"n{n}").mkdir()
    eng = zinf.initialize(lambda: ScannedDecoderLM(nnx.Rngs(0), n=n, d=128), optimizer=_optimizer(),
                          config=zinf.ZeroConfig(offload_param=off, offload_optimizer=off, persistence_threshold=16,
                                                 offload_activations=True, prefetch_depth=0),
                          loss_fn=lambda m, t: xent(m(t[:, :-1]), t[:, 1:]), track_live_arrays=True,
                          unit_policy=zinf.UnitPolicy(patterns=("blocks",)))
    eng.train_step(tokens(0))
    eng.passes.reset_peaks()
    eng.train_step(tokens(1))
    uid = next(u.uid for u in eng.adapter.units if u.path == "blocks")
    stack = sum(eng.layouts[p].size * 4 for p in eng.adapter.units[uid].param_paths)
    per_device = sum(l.bytes_per_device() for l in eng.passes._layer_layouts(uid))
    peak = eng.passes.peak_live_array_bytes
    eng.close()
    return peak, stack // n, per_device


def test_a_scanned_stack_on_nvme_holds_a_layers_shards_at_a_time_and_its_peak_does_not_grow_with_depth(tmp_path):
    """A GPT-like decoder whose blocks are one stack scanned by nnx.scan, on nvme: each layer is fetched as its
    1/8 shards (the layer's layout on the 8 devices), and the peak of live device arrays is the same at 4 and at
    16 layers (within 10%): nothing of a layer stays on the devices past its call. Without prefetching the
    window is the layer in use, so the peak is one layer's shards plus the activations and the small units
    (scripts/bench_scanned_stack.py measures prefetch depth 2 as well: the layer in use and two ahead)."""
    (p4, layer4, dev4), (p16, layer16, dev16) = _scanned_lm_peak(tmp_path, 4), _scanned_lm_peak(tmp_path, 16)
    assert layer4 == layer16 and dev4 == dev16
    assert dev16 <= (1 / 8 + 0.05) * layer16  # a layer's shard per device: at most 1/8 of it (+ 5%)
    assert abs(p16 - p4) <= 0.10 * p4, (p4, p16)
    assert p16 < 1.5 * layer16, (p16, layer16)  # one layer's shards (on 8 devices: its bytes), not the stack's


def test_the_compiled_step_of_a_scanned_stack_keeps_one_layer_gathered_at_2_and_at_8_layers():
    """Params and optimizer on the cpu tier, the stack picked as a unit by the default policy: the model's own
    scan stays a loop in the step (one layer's shards moved and gathered per iteration), so the program's
    device temp bytes at 8 layers are those at 2 (within 5%) and its matmuls are compiled once."""
    cpu = zinf.Offload("cpu")
    temps, dots = [], []
    for n in (2, 8):
        eng = zinf.initialize(lambda: ScannedDecoderLM(nnx.Rngs(0), n=n, d=64), optimizer=_optimizer(),
                              config=zinf.ZeroConfig(offload_param=cpu, offload_optimizer=cpu, persistence_threshold=16),
                              loss_fn=lambda m, t: xent(m(t[:, :-1]), t[:, 1:]))
        assert "blocks" in {u.path for u in eng.adapter.units} and eng.mode == "compiled"
        compiled = eng.lower(tokens(0)).compile()
        temps.append(compiled.memory_analysis().temp_size_in_bytes)
        dots.append(compiled.as_text().count(" dot("))
        eng.close()
    assert temps[1] <= 1.05 * temps[0], temps
    assert dots[0] == dots[1] > 0, dots


def test_a_stack_split_along_its_layers_or_called_outside_a_scan_over_it_is_an_error_naming_the_fix(tmp_path):
    loss_fn = lambda m, t: xent(m(t[:, :-1]), t[:, 1:])  # noqa: E731
    cfg = zinf.ZeroConfig(offload_param=zinf.Offload("cpu"), persistence_threshold=16, engine="streamed")
    # 8 layers of d=4: the layer axis (8) is the only one of the attention kernels that divides by 8 devices
    eng = zinf.initialize(lambda: ScannedDecoderLM(nnx.Rngs(0), n=8, d=4, heads=2), config=cfg, loss_fn=loss_fn,
                          unit_policy=zinf.UnitPolicy(patterns=("blocks",)))
    with pytest.raises(zinf.EngineError, match=r"split along its layers.*persistent_params"):
        eng.train_step(tokens(0))
    eng.close()

    class Unscanned(ScannedDecoderLM):  # the stack called whole, inside jax.checkpoint: no scan over its layers
        def __call__(self, tokens):
            return self.head(self.norm(jax.checkpoint(lambda x: self.blocks(x))(self.embed(tokens))))

    eng = zinf.initialize(lambda: Unscanned(nnx.Rngs(0), n=4, d=16), loss_fn=loss_fn, config=cfg,
                          unit_policy=zinf.UnitPolicy(patterns=("blocks",)))
    with pytest.raises(zinf.EngineError, match=r"holds 4 layers.*inside a transform that is not a scan"):
        eng.train_step(tokens(0))
    eng.close()


@pytest.mark.slow  # two nvme engines and a checkpoint (~20 s)
def test_a_stack_run_layer_by_layer_saved_on_8_devices_restores_on_4_and_goes_on_equally(tmp_path):
    """The checkpoint of a stack applied layer by layer holds the stacked parameters as the model has them: saved
    after 2 steps on the 8-device mesh (nvme, streamed), restored on a 4-device mesh, the next 2 steps equal
    those of the run that went on."""
    ctor = lambda: ScannedDecoderLM(nnx.Rngs(0), n=4, d=64)  # noqa: E731
    loss_fn = lambda m, t: xent(m(t[:, :-1]), t[:, 1:])  # noqa: E731
    batches = [tokens(s) for s in range(4)]
    policy = zinf.UnitPolicy(patterns=("blocks",))
    eng = zinf.initialize(ctor, config=nvme(tmp_path / "a", threshold=16), optimizer=_optimizer(), loss_fn=loss_fn,
                          unit_policy=policy)
    for b in batches[:2]:
        eng.train_step(b)
    eng.save(tmp_path / "ckpt")
    cont = [eng.train_step(b)["loss"] for b in batches[2:]]
    cont_params = eng.param_arrays()
    eng.close()
    again = zinf.restore(tmp_path / "ckpt", ctor, config=nvme(tmp_path / "b", threshold=16), optimizer=_optimizer(),
                         loss_fn=loss_fn, unit_policy=policy, mesh=zinf.make_mesh(devices=jax.devices()[:4]))
    assert again.mesh.shape["fsdp"] == 4 and again.layouts["blocks/qkv/kernel"].shape == (4, 64, 192)
    np.testing.assert_allclose([again.train_step(b)["loss"] for b in batches[2:]], cont, rtol=1e-5)
    assert_params(again.param_arrays(), cont_params)
    again.close()
