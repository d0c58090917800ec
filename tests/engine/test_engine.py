"""Streamed forward/backward against plain jax.value_and_grad on the unwrapped model."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec as P

from helpers.engine_utils import build, linen_adapter, nnx_adapter, streamed_grads
from helpers.small_models import TinyLM, ConvNet, TinyLMConfig, LinenMLP, lm_loss, mse_loss
from zinf_jax.engine.adapters import leaf_paths as _leaf_paths
from zinf_jax.engine.init import param_batches
from zinf_jax.engine.streamed import EngineError
from zinf_jax.plan.partition import make_mesh
from zinf_jax.plan.units import UnitPolicy, path_str

THRESHOLD = 1000  # LayerNorm scales and the position table stay on device; blocks stream
CFG = TinyLMConfig()


def gpt_ctor(n_layers=2):
    cfg = TinyLMConfig(n_layers=n_layers)
    return lambda: TinyLM(cfg, rngs=nnx.Rngs(0, dropout=1))


def tokens(mesh, seed=5, batch=8):
    t = jax.random.randint(jax.random.key(seed), (batch, CFG.seq + 1), 0, CFG.vocab)
    return jax.device_put(t, NamedSharding(mesh, P("fsdp")))


def reference_nnx(ctor, batch):
    model = ctor()
    loss, g = nnx.jit(nnx.value_and_grad(lm_loss))(model, batch)  # jitted: eager dispatch took 14 s
    st = nnx.state(g, nnx.Param) if not isinstance(g, nnx.State) else g
    return float(loss), {path_str(p): np.asarray(v) for p, v in zip(_leaf_paths(st), jax.tree.leaves(st))}


@pytest.fixture(scope="module")
def gpt_reference():
    mesh = make_mesh()
    return reference_nnx(gpt_ctor(), tokens(mesh))


_DIAGONAL = {(0, "device"), (1, "cpu"), (2, "nvme")}
"""Each prefetch depth and each tier in the default suite once; the rest of the cross product is slow (suite time)."""


@pytest.mark.parametrize("tier, depth", [
    pytest.param(t, d, marks=() if (d, t) in _DIAGONAL else pytest.mark.slow)
    for d in (0, 1, 2) for t in ("device", "cpu", "nvme")])
def test_nnx_gpt_matches_value_and_grad(tier, depth, tmp_path, gpt_reference):
    ref_loss, ref_grads = gpt_reference
    ad = nnx_adapter(gpt_ctor(), THRESHOLD)
    assert [u.path for u in ad.units] == ["blocks/0", "blocks/1", "embed"]
    sm = build(ad, tier, threshold=THRESHOLD, path=tmp_path, depth=depth)
    glue = sm.store.fetch(ad.glue_paths)
    loss, _, g_glue = sm.forward_backward(lm_loss, tokens(sm.mesh), glue, has_aux=False)
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-5)
    grads = streamed_grads(sm, g_glue)
    assert set(grads) == set(ref_grads)
    for path, r in ref_grads.items():
        np.testing.assert_allclose(grads[path], r, rtol=1e-5, atol=1e-7, err_msg=path)
    # the tied embedding really received two contributions (lookup + head)
    assert [c for c in sm.plan.calls if c[0] == 2] == [(2, "__call__"), (2, "attend")]
    sm.prefetcher.close()
    sm.store.tier.close()


def test_dropout_is_active_and_replayed(gpt_reference):
    """Dropout masks differ between steps but each backward recomputes its own forward's mask."""
    ad = nnx_adapter(gpt_ctor(), THRESHOLD)
    sm = build(ad, "device", threshold=THRESHOLD)
    glue = sm.store.fetch(ad.glue_paths)
    batch = tokens(sm.mesh)
    l1, _, _ = sm.forward_backward(lm_loss, batch, glue, has_aux=False)
    l2, _, _ = sm.forward_backward(lm_loss, batch, glue, has_aux=False)
    assert float(l1) == pytest.approx(gpt_reference[0], rel=1e-5)
    assert float(l1) != float(l2)  # second step uses the next dropout keys
    # reference: the same model called twice
    model = gpt_ctor()()
    lm_loss(model, batch)
    np.testing.assert_allclose(float(l2), float(lm_loss(model, batch)), rtol=1e-5)


def _linen_matches_value_and_grad(net, x, y, loss, tier, tmp_path, **adapter_kw):
    """Streamed loss and every grad equal value_and_grad of the unwrapped Linen model; returns the model."""
    params = jax.jit(net.init)(jax.random.key(0), x)["params"]
    ref_loss, ref_g = jax.jit(jax.value_and_grad(lambda p: loss(lambda *a: net.apply({"params": p}, *a), (x, y))))(
        params)
    ref = {"/".join(k): np.asarray(v) for k, v in traverse_util.flatten_dict(ref_g).items()}
    sm = build(linen_adapter(net, x, threshold=0, **adapter_kw), tier, threshold=0, path=tmp_path)
    batch = jax.device_put((x, y), NamedSharding(sm.mesh, P("fsdp")))
    l, _, g_glue = sm.forward_backward(loss, batch, [], has_aux=False)
    np.testing.assert_allclose(float(l), float(ref_loss), rtol=1e-5)
    grads = streamed_grads(sm, g_glue)
    for path, r in ref.items():
        np.testing.assert_allclose(grads[path], r, rtol=1e-5, atol=1e-7, err_msg=path)
    return sm


@pytest.mark.parametrize("tier", ["device", pytest.param("cpu", marks=pytest.mark.slow), "nvme"])  # (suite time)
def test_linen_convnet_matches(tier, tmp_path):
    x = jax.random.normal(jax.random.key(1), (8, 6, 6, 3))
    y = jax.random.normal(jax.random.key(2), (8, 3))
    sm = _linen_matches_value_and_grad(ConvNet(), x, y, mse_loss, tier, tmp_path)
    assert [u.path for u in sm.adapter.units] == ["Conv_0", "Conv_1", "Dense_0", "Dense_1"]
    assert "flat" in {l.kind for l in sm.store.layouts.values()}  # shapes not dividing by 8: padded, flattened
    sm.store.tier.close()


def test_linen_blocks_as_units_with_a_positional_flag(tmp_path):
    """Units with children of their own, whose names repeat at the top level (Dense_0), called as
    block(x, train): the children run inside the unit, the bool selects a program variant."""
    x = jax.random.normal(jax.random.key(1), (8, 16))
    y = jax.random.normal(jax.random.key(2), (8, 3))
    loss = lambda apply, b: jnp.mean((apply(b[0], False) - b[1]) ** 2)  # noqa: E731  (dropout off)
    sm = _linen_matches_value_and_grad(LinenMLP(), x, y, loss, "device", tmp_path,
                                       policy=UnitPolicy(patterns=(r"block_\d+",)))
    assert {"block_0", "block_1"} <= {u.path for u in sm.adapter.units}


class _Pair(nn.Module):
    """A unit with two outputs, the second of which the loss never reads."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="a")(x), nn.Dense(3, name="b")(x)


class _Branches(nn.Module):
    """Cotangents the backward walk must get right: an unused unit output, a unit whose output never
    reaches the loss, and a value read twice (a residual)."""

    @nn.compact
    def __call__(self, x):
        h, _ = _Pair()(x)
        nn.Dense(5, name="dead")(x)
        h = h + nn.Dense(8, name="mlp")(jnp.tanh(h))
        return nn.Dense(3, name="head")(h)


def test_unused_outputs_dead_units_and_residuals_get_the_gradients_of_value_and_grad(tmp_path):
    x = jax.random.normal(jax.random.key(1), (8, 6))
    y = jax.random.normal(jax.random.key(2), (8, 3))
    loss = lambda apply, b: jnp.mean((apply(b[0]) - b[1]) ** 2)  # noqa: E731
    sm = _linen_matches_value_and_grad(_Branches(), x, y, loss, "device", tmp_path,
                                       policy=UnitPolicy(patterns=(r"_Pair_0", "dead", "mlp", "head")))
    assert [u.path for u in sm.adapter.units] == ["_Pair_0", "dead", "mlp", "head"]
    grads = streamed_grads(sm, [])
    for path in ("dead/kernel", "dead/bias", "_Pair_0/b/kernel"):  # really zero, and really sent
        assert path in grads and not np.any(grads[path]), path
    assert np.any(grads["_Pair_0/a/kernel"])


def test_forward_only_matches_and_under_jit_refuses():
    ad = nnx_adapter(gpt_ctor(), THRESHOLD)
    sm = build(ad, "device", threshold=THRESHOLD)
    glue = sm.store.fetch(ad.glue_paths)
    batch = tokens(sm.mesh)
    loss, _ = sm.forward(lm_loss, batch, glue, has_aux=False, train=True)
    model = gpt_ctor()()
    np.testing.assert_allclose(float(loss), float(lm_loss(model, batch)), rtol=1e-5)
    with pytest.raises(EngineError, match="jax.jit"):
        jax.jit(lambda b: sm.forward_backward(lm_loss, b, glue, has_aux=False)[0])(batch)


def test_evaluation_runs_as_model_eval_and_leaves_training_alone():
    """eval: dropout off exactly as nnx's model.eval(); training after it sees the dropout keys it would have."""
    ad = nnx_adapter(gpt_ctor(), THRESHOLD)
    sm = build(ad, "device", threshold=THRESHOLD)
    glue = sm.store.fetch(ad.glue_paths)
    batch = tokens(sm.mesh)
    ref_model = gpt_ctor()()
    ref_train1 = float(lm_loss(ref_model, batch))
    ref_model.eval()
    ref_eval = float(lm_loss(ref_model, batch))
    ref_model.train()
    ref_train2 = float(lm_loss(ref_model, batch))
    assert len({ref_train1, ref_eval, ref_train2}) == 3  # dropout matters at this rate

    l1, _, _ = sm.forward_backward(lm_loss, batch, glue, has_aux=False)
    e1, _ = sm.forward(lm_loss, batch, glue, has_aux=False)
    e2, _ = sm.forward(lm_loss, batch, glue, has_aux=False)
    l2, _, _ = sm.forward_backward(lm_loss, batch, glue, has_aux=False)
    np.testing.assert_allclose(float(l1), ref_train1, rtol=1e-5)
    np.testing.assert_allclose([float(e1), float(e2)], [ref_eval, ref_eval], rtol=1e-5)
    np.testing.assert_allclose(float(l2), ref_train2, rtol=1e-5)


def test_large_parameters_outside_units_belong_to_the_root():
    """A policy that leaves a large parameter in no unit, and a table on the root module, give the root the
    parameters ([Note: the root's parameters]); training with them is tested in tests/engine/test_idioms.py."""
    blocks_only = UnitPolicy(default=False, patterns=(r"blocks/\d+",))
    ad = nnx_adapter(gpt_ctor(), THRESHOLD, blocks_only)
    assert [u.path for u in ad.units] == ["blocks/0", "blocks/1"] and "embed/embedding" in ad.glue_paths
    ad = nnx_adapter(gpt_ctor(), 100)  # the 16x32 position table sits on the root module
    assert "pos" in ad.glue_paths
    ad = nnx_adapter(gpt_ctor(), THRESHOLD, UnitPolicy(default=False, patterns=(r"blocks/\d+", "embed")))
    assert [u.path for u in ad.units] == ["blocks/0", "blocks/1", "embed"]


@pytest.mark.parametrize("batch_bytes", [0, 1 << 30])  # one program per unit; one for the whole model
def test_init_unit_by_unit_equals_eager_bitwise(batch_bytes):
    ad = nnx_adapter(gpt_ctor(), THRESHOLD)
    assert len(param_batches(ad, batch_bytes)) == (4 if batch_bytes == 0 else 1)  # 3 units + glue
    sm = build(ad, "cpu", threshold=THRESHOLD, init_batch_bytes=batch_bytes)
    model = gpt_ctor()()
    st = nnx.state(model, nnx.Param)
    eager = {path_str(p): np.asarray(v) for p, v in zip(_leaf_paths(st), jax.tree.leaves(st))}
    for path, lay in sm.store.layouts.items():
        (arr,) = sm.store.fetch([path])
        from zinf_jax.plan.partition import from_stored
        got = np.asarray(from_stored(lay, jax.device_get(arr)))
        assert got.tobytes() == eager[path].tobytes(), path


def test_a_batch_program_keeps_what_jax_dce_keeps():
    """A batch's equations are found by walking back from its outputs (not by DCE of the whole model's jaxpr for
    every batch: quadratic in depth); reference: jax's own DCE of the whole jaxpr, scalar equations dropped."""
    from zinf_jax._internal import jax_private

    ad = nnx_adapter(gpt_ctor(4), THRESHOLD)
    tr = ad._init_trace
    whole = tr._jaxpr
    for groups in param_batches(ad, 0):
        want = [tr._order[p] for g in groups for p in g]
        used = [i in want for i in range(len(whole.outvars))]
        ref, ref_in = jax_private.dce_jaxpr(whole, used)
        ref_eqns = [e for e in ref.eqns if not all(v in tr._scalar_vars for v in e.outvars)]
        got, got_in = tr._slice(want)
        assert got_in == ref_in
        assert [e.primitive for e in got.eqns] == [e.primitive for e in ref_eqns]
        assert [e.outvars for e in got.eqns] == [e.outvars for e in ref_eqns]
        assert [e.invars for e in got.eqns] == [e.invars for e in ref_eqns]
        assert got.outvars == ref.outvars and len(got.eqns) < len(whole.eqns) // 2


def test_init_compiles_alike_blocks_once():
    """One program per unit, and alike units (identical blocks: their RNG counters and keys enter as arguments)
    share one compilation: init compiles as much for 8 blocks as for 2, in batches of one unit or of the whole
    model (a program of many blocks took seconds to compile)."""
    import jax.monitoring

    def compiles(n_layers, batch_bytes=0):
        ad = nnx_adapter(gpt_ctor(n_layers), THRESHOLD)
        count = [0]

        def listen(event, duration, **kw):
            if event == "/jax/core/compile/backend_compile_duration":
                count[0] += 1

        jax.monitoring.register_event_duration_secs_listener(listen)
        try:
            build(ad, "cpu", threshold=THRESHOLD, init_batch_bytes=batch_bytes)
        finally:
            jax.monitoring.unregister_event_duration_listener(listen)
        return count[0]

    compiles(2)  # first: the one-time compilations (eager scalar ops of the RNG chain)
    assert compiles(8) == compiles(2) == compiles(8, 1 << 30)


def test_init_compiles_its_first_and_last_programs_in_the_background():
    """The first batch's program (a block) and the last's (the embeddings and final norm) compile in background
    threads while the RNG chain's scalars are computed on the caller's; each init program compiles once, and
    only those two compile off the caller's thread. (Values: test_init_unit_by_unit_equals_eager_bitwise.)"""
    import threading
    import jax.monitoring

    where = []

    def listen(event, duration, fun_name="", **kw):
        if event == "/jax/core/compile/backend_compile_duration" and "init_batch" in fun_name:
            where.append(threading.current_thread().name)

    ad = nnx_adapter(gpt_ctor(4), THRESHOLD)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        build(ad, "cpu", threshold=THRESHOLD, init_batch_bytes=0)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    background = [w for w in where if w.startswith("zinf-init-compile")]
    # a block's and the glue's in the background; the embedding unit's and the non-parameter state's here
    assert len(background) == 2 and len(where) == 4, where


def test_the_constructor_is_traced_once(tmp_path):
    """initialize, train, eval, model_state and a trainable filter all use one trace of the constructor (each
    trace of a deep model costs seconds, growing with depth squared)."""
    import zinf_jax as zinf

    calls = []

    def ctor():
        calls.append(1)
        return gpt_ctor()()

    config = zinf.ZeroConfig(offload_param=zinf.Offload("nvme", path=str(tmp_path)), persistence_threshold=THRESHOLD)
    engine = zinf.initialize(ctor, config=config, mesh=make_mesh(), loss_fn=lm_loss,
                             trainable=lambda path, _: "blocks" in path)
    try:
        batch = np.asarray(tokens(engine.mesh))
        engine.train_step(batch)
        engine.eval_step(batch)
        engine.model_state()
        engine.params()
    finally:
        engine.close()
    assert len(calls) == 1


def test_the_constructor_trace_never_walks_itself(monkeypatch):
    """Tracing the constructor asks no tracer where it came from: Flax compares the ``sharding`` of each
    traced RNG count when a plain Variable is updated, and JAX answers each such question by walking the
    whole trace so far (quadratic in depth: 51 s at 90 blocks). With Variables built as references there is
    no comparison. On the old trace this spy saw two walks per random draw."""
    from jax._src.interpreters import partial_eval as pe

    walks = []
    origin = pe.DynamicJaxprTracer._origin_msg

    def spy(self):
        walks.append(1)
        return origin(self)

    monkeypatch.setattr(pe.DynamicJaxprTracer, "_origin_msg", spy)
    ad = nnx_adapter(gpt_ctor(4), THRESHOLD)
    assert ad.abstract_state() is not None
    assert walks == []


def test_bfloat16_compute_float32_grads(gpt_reference):
    ref_loss, ref_grads = gpt_reference
    ad = nnx_adapter(gpt_ctor(), THRESHOLD)
    sm = build(ad, "cpu", threshold=THRESHOLD, compute_dtype="bfloat16")
    (w,) = sm.store.fetch(["blocks/0/up/kernel"])
    assert w.dtype == jnp.bfloat16  # fetched in the compute dtype
    glue = sm.store.fetch(ad.glue_paths)
    loss, _, g_glue = sm.forward_backward(lm_loss, tokens(sm.mesh), glue, has_aux=False)
    grads = streamed_grads(sm, g_glue)
    assert all(sm.sink.get(p, i).dtype == np.float32 for (p, i), _ in sm.sink.items())
    np.testing.assert_allclose(float(loss), ref_loss, rtol=2e-2)  # bf16 weights: ~3 significant digits
    g, r = grads["blocks/0/up/kernel"], ref_grads["blocks/0/up/kernel"]
    assert np.linalg.norm(g - r) < 0.1 * np.linalg.norm(r)


def test_the_grad_sink_keeps_a_shard_it_is_handed_and_sums_into_an_array_of_its_own():
    """GradSink.add_local takes the host shard without a copy (a device-to-host copy's buffer, possibly read only);
    a second gradient of the shard (a tied parameter, a micro-batch) is summed into a new array, then into that."""
    from zinf_jax.engine.grads import GradSink

    sink = GradSink({}, None)
    first = np.ones(4, np.float32)
    first.flags.writeable = False
    sink.add_local("p", 0, first)
    assert sink.get("p", 0) is first
    sink.add_local("p", 0, np.full(4, 2, np.float32))
    summed = sink.get("p", 0)
    assert summed is not first and summed.tolist() == [3.0] * 4 and first.tolist() == [1.0] * 4
    sink.add_local("p", 0, np.ones(4, np.float32))
    assert sink.get("p", 0) is summed and summed.tolist() == [4.0] * 4
    sink.clear()
    sink.add_local("p", 0, first)
    sink.add_local("p", 0, first)
    assert sink.get("p", 0).tolist() == [2.0] * 4 and first.tolist() == [1.0] * 4
