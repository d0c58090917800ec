"""Parameters read outside their unit's call (tied heads, table lookups, ``w.T``) train like plain JAX.

Each read becomes a call of the unit that returns the parameter, gathered: the glue gets its value and its
gradient goes to the unit's shards, summed with the unit's own (the tied table gets both uses').
"""
from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import zinf_jax as zinf
from helpers.engine_utils import build, flat, nnx_adapter, optax_run, optax_steps, streamed_grads
from helpers.llm_models import LookupLM, TiedHeadLM, lm_loss
from helpers.tp_models import TPLM, tp_loss

TOKENS = [np.random.default_rng(i).integers(0, 64, (8, 17)).astype(np.int32) for i in range(6)]
THRESHOLD = 64
EPS = 1e-4  # as in test_idioms.py: an element whose gradient is pure cancellation (~1e-8 here, against a median
# 3e-3) takes an Adam step set by rounding noise with eps 1e-8; the gradients are compared directly below


@pytest.mark.parametrize("model", [TiedHeadLM, LookupLM])
def test_reads_outside_the_unit_train_like_optax_on_nvme(model, tmp_path):
    off = zinf.Offload("nvme", path=str(tmp_path))
    eng = zinf.initialize(lambda: model(nnx.Rngs(0)), loss_fn=lm_loss, optimizer=zinf.adamw(3e-3, eps=EPS),
                          config=zinf.ZeroConfig(offload_param=off, offload_optimizer=off,
                                                 persistence_threshold=THRESHOLD))
    assert "embed" in [u.path for u in eng.adapter.units] and eng.layouts["embed/embedding"].dim is not None
    losses = [eng.train_step(t)["loss"] for t in TOKENS]
    ref_losses, ref = optax_run(model(nnx.Rngs(0)), optax.adamw(3e-3, eps=EPS), TOKENS, loss_fn=lm_loss)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    got = eng.param_arrays()
    for k, v in ref.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-5, err_msg=k)
    eng.close()


def test_the_tied_tables_gradient_sums_both_uses():
    sm = build(nnx_adapter(lambda: LookupLM(nnx.Rngs(0)), THRESHOLD), "cpu", threshold=THRESHOLD)
    glue = sm.store.fetch(sm.adapter.glue_paths)
    batch = jax.device_put(TOKENS[0])
    loss, _, g_glue = sm.forward_backward(lm_loss, batch, glue, has_aux=False)
    got = streamed_grads(sm, g_glue)
    reads = [method for _, method in sm.plan.calls if method.startswith("__read__")]
    assert reads == ["__read__:embedding"]  # two reads of the table in the pass: one fetch
    m = LookupLM(nnx.Rngs(0))
    gdef, params, rest = nnx.split(m, nnx.Param, ...)
    ref_loss, ref = jax.jit(jax.value_and_grad(lambda p: lm_loss(nnx.merge(gdef, p, rest), TOKENS[0])))(params)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    ref = flat(ref)
    assert sorted(got) == sorted(ref)
    for k, v in ref.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-7, err_msg=k)
    sm.prefetcher.close()


@pytest.mark.parametrize("names,zero_axes,shards", [(("data", "model"), ("model",), 4), (("x", "y"), None, 8)])
def test_explicit_axis_meshes_as_jax_make_mesh_gives_them(names, zero_axes, shards):
    """``jax.make_mesh`` defaults to Explicit axes; the engine runs on an Auto view of the same devices."""
    mesh = jax.make_mesh((2, 4), names)
    assert all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    with jax.set_mesh(mesh):  # as a user's script sets it; the engine's programs run on its Auto view
        eng = zinf.initialize(lambda: TiedHeadLM(nnx.Rngs(0)), loss_fn=lm_loss, optimizer=zinf.adamw(3e-3, eps=EPS),
                              mesh=mesh, config=zinf.ZeroConfig(offload_param=zinf.Offload("cpu"), zero_axes=zero_axes,
                                                                persistence_threshold=THRESHOLD))
        assert eng.layouts["embed/embedding"].num_shards == shards
        losses = [eng.train_step(t)["loss"] for t in TOKENS[:2]]
        losses += [m["loss"] for m in eng.train_steps(TOKENS[2:4])]
        assert np.isfinite(eng.eval_step(TOKENS[0]))
    # the reference: plain jit + optax on the same (Explicit) mesh, everything replicated
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    with jax.set_mesh(mesh):
        ref, ref_params = optax_run(TiedHeadLM(nnx.Rngs(0)), optax.adamw(3e-3, eps=EPS), TOKENS[:4], loss_fn=lm_loss,
                                    place=lambda x: jax.device_put(x, rep))
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    got = eng.param_arrays()
    for k, v in ref_params.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-5, err_msg=k)
    eng.close()


def test_persistent_params_keep_a_table_gathered_whatever_its_size(tmp_path):
    """``persistent_params`` (DeepSpeed's ds_persist): the table is not a unit and is never sharded; reads are plain."""
    off = zinf.Offload("nvme", path=str(tmp_path))
    config = zinf.ZeroConfig(offload_param=off, offload_optimizer=off, persistence_threshold=THRESHOLD,
                             persistent_params=("embed/embedding",))
    eng = zinf.initialize(lambda: LookupLM(nnx.Rngs(0)), loss_fn=lm_loss, optimizer=zinf.adamw(3e-3, eps=EPS),
                          config=config)
    assert "embed" not in [u.path for u in eng.adapter.units] and "embed/embedding" in eng.adapter.glue_paths
    assert eng.layouts["embed/embedding"].kind == "persistent" and eng.layouts["embed/embedding"].size > THRESHOLD
    assert eng.layouts["blocks/0/up/kernel"].kind == "sharded"  # the others as before
    losses = [eng.train_step(t)["loss"] for t in TOKENS[:4]]
    ref_losses, ref = optax_run(LookupLM(nnx.Rngs(0)), optax.adamw(3e-3, eps=EPS), TOKENS[:4], loss_fn=lm_loss)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    got = eng.param_arrays()
    for k, v in ref.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-5, err_msg=k)
    eng.close()
    with pytest.raises(zinf.UnitPolicyError, match=r"inside the unit 'blocks/0'.*'blocks/0/\.\*'"):
        zinf.initialize(lambda: LookupLM(nnx.Rngs(0)), loss_fn=lm_loss,
                        config=zinf.ZeroConfig(persistence_threshold=THRESHOLD,
                                               persistent_params=("blocks/0/up/kernel",)))
    with pytest.raises(zinf.ConfigError, match="persistent_params"):
        zinf.ZeroConfig(persistent_params=("embed/(",))


def _linen_reference(module, loss_fn, params, tx, batches, place=lambda t: t):
    """Plain ``jit(value_and_grad)`` + ``tx`` of a Linen module: the losses and the final params."""
    return optax_steps(lambda p: (lambda x: module.apply({"params": p}, x)), params, tx, batches, loss_fn, place)


@pytest.mark.parametrize("read", ["attr", "variables", "attend"])
def test_linen_lm_sharing_its_embedding_with_the_head_trains_like_optax(read, tmp_path):
    from flax import traverse_util

    from helpers.llm_models import LinenTiedLM, linen_loss

    module, tok0 = LinenTiedLM(read=read), TOKENS[0][:, :-1]
    off = zinf.Offload("nvme", path=str(tmp_path))
    eng = zinf.initialize(module, init_args=(tok0,), loss_fn=linen_loss, optimizer=zinf.adamw(3e-3, eps=EPS),
                          config=zinf.ZeroConfig(offload_param=off, offload_optimizer=off,
                                                 persistence_threshold=THRESHOLD))
    assert "embed" in [u.path for u in eng.adapter.units] and eng.layouts["embed/embedding"].dim is not None
    losses = [eng.train_step(t)["loss"] for t in TOKENS[:5]]
    ref, params = _linen_reference(module, linen_loss, jax.jit(module.init)(jax.random.key(0), tok0)["params"],
                                   optax.adamw(3e-3, eps=EPS), TOKENS[:5])
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    got = eng.param_arrays()
    for k, v in traverse_util.flatten_dict(params, sep="/").items():
        np.testing.assert_allclose(got[k], np.asarray(v), rtol=1e-5, atol=1e-5, err_msg=k)
    eng.close()


def test_linen_tied_tables_gradient_sums_both_uses():
    from flax import traverse_util

    from helpers.engine_utils import linen_adapter
    from helpers.llm_models import LinenTiedLM, linen_loss

    module, tok0 = LinenTiedLM(read="attr"), TOKENS[0][:, :-1]
    sm = build(linen_adapter(module, tok0, THRESHOLD), "cpu", threshold=THRESHOLD)
    glue = sm.store.fetch(sm.adapter.glue_paths)
    loss, _, g_glue = sm.forward_backward(linen_loss, jax.device_put(TOKENS[0]), glue, has_aux=False)
    got = streamed_grads(sm, g_glue)
    params = jax.jit(module.init)(jax.random.key(0), tok0)["params"]
    ref_loss, ref = jax.jit(jax.value_and_grad(
        lambda p: linen_loss(lambda x: module.apply({"params": p}, x), TOKENS[0])))(params)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    for k, v in traverse_util.flatten_dict(ref, sep="/").items():
        np.testing.assert_allclose(got[k], np.asarray(v), rtol=1e-5, atol=1e-7, err_msg=k)
    sm.prefetcher.close()


def _tp_reference(mesh, steps):
    """Plain ``jit(value_and_grad)`` + optax.adamw of the TP model on the same Explicit mesh, its parameters
    sharded by Flax's eager sharding and the batch split over ``fsdp``, as the model's own code runs it."""
    tx = optax.adamw(3e-3, eps=EPS)
    with jax.set_mesh(mesh):
        return optax_run(TPLM(nnx.Rngs(0)), tx, TOKENS[:steps], loss_fn=tp_loss,
                         place=lambda x: x if isinstance(x, jax.Array) else jax.device_put(x, P("fsdp")))


@pytest.fixture(scope="module")
def tp_reference():
    return _tp_reference(jax.make_mesh((4, 2), ("fsdp", "tp")), 5)


@pytest.mark.parametrize("engine,tier", [("compiled", "cpu"), ("streamed", "nvme")])
def test_tensor_parallel_model_on_an_explicit_fsdp_tp_mesh_trains_like_plain_jit(tp_reference, engine, tier,
                                                                                 tmp_path):
    """A model that splits its own kernels and activations over ``tp`` (Explicit axes, as ``jax.make_mesh``
    gives them): ZeRO shards over ``fsdp``, each gathered parameter keeps the model's ``tp`` split, the
    batch is replicated over ``tp``; both engines equal plain jit on the mesh."""
    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"))
    off = zinf.Offload(tier, path=str(tmp_path) if tier == "nvme" else None)
    given = {"mesh": mesh} if engine == "compiled" else {}  # streamed: the mesh set with jax.set_mesh is taken
    with jax.set_mesh(mesh):
        eng = zinf.initialize(lambda: TPLM(nnx.Rngs(0)), loss_fn=tp_loss, optimizer=zinf.adamw(3e-3, eps=EPS),
                              config=zinf.ZeroConfig(offload_param=off, offload_optimizer=off,
                                                     persistence_threshold=16, engine=engine), **given)
        assert dict(eng.mesh.shape) == {"fsdp": 4, "tp": 2}
        assert eng.mode == engine and eng.components.model_mesh.explicit == ("fsdp", "tp")
        up, table = eng.layouts["blocks/0/up/kernel"], eng.layouts["embed/embedding"]
        assert (up.spec, up.gathered_spec) == (P("fsdp"), P(None, "tp"))  # ZeRO on fsdp, the model's tp kept
        assert (table.spec, table.gathered_spec) == (P(None, "fsdp"), P("tp", None))
        assert eng.shard_batch(TOKENS[0]).sharding.spec == P("fsdp", None)  # replicated over tp
        losses = [eng.train_step(t)["loss"] for t in TOKENS[:3]]
        losses += [m["loss"] for m in eng.train_steps(TOKENS[3:5])]
    ref_losses, ref = tp_reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    got = eng.param_arrays()
    for k, v in ref.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-5, err_msg=k)
    eng.close()


class _ShardsItsLookup(nnx.Module):
    """Shards its own lookup (out_sharding in the glue) but declares no parameter shardings."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(64, 32, rngs=rngs)
        self.blocks = nnx.List([nnx.Linear(32, 32, rngs=rngs) for _ in range(2)])

    def __call__(self, tokens):
        x = self.embed.embedding[...].at[(tokens,)].get(out_sharding=P("fsdp", None, None))
        for b in self.blocks:
            x = x + b(x)
        return x @ self.embed.embedding[...].T


@pytest.mark.parametrize("mesh_kind", ["explicit_without_specs", "auto_mesh"])
def test_code_that_needs_explicit_axes_without_them_gets_one_error_naming_the_fix(mesh_kind):
    if mesh_kind == "auto_mesh":  # the model declares its shardings, but the mesh has Auto axes
        auto = (jax.sharding.AxisType.Auto,) * 2
        mesh, ctor, loss = jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=auto), lambda: TPLM(nnx.Rngs(0)), tp_loss
    else:
        mesh, ctor, loss = jax.make_mesh((4, 2), ("fsdp", "tp")), lambda: _ShardsItsLookup(nnx.Rngs(0)), lm_loss
    config = zinf.ZeroConfig(persistence_threshold=THRESHOLD)
    if mesh_kind == "auto_mesh":  # its constructor already names shardings (an initialiser's out_sharding=)
        with pytest.raises(zinf.EngineError, match=r"shards its own arrays.*Explicit.*out_sharding metadata"):
            zinf.initialize(ctor, loss_fn=loss, mesh=mesh, config=config)
        return
    eng = zinf.initialize(ctor, loss_fn=loss, mesh=mesh, config=config)
    with pytest.raises(zinf.EngineError, match=r"shards its own arrays.*Explicit.*out_sharding metadata"):
        eng.train_step(TOKENS[0])
    assert eng.step == 0
    eng.close()


@pytest.mark.parametrize("engine,tier", [("compiled", "cpu"), pytest.param("streamed", "nvme", marks=pytest.mark.slow)])
def test_linen_logical_rules_and_activation_constraints_on_a_fsdp_tensor_mesh(engine, tier, tmp_path):
    """MaxText's idiom: logically partitioned kernels, ``nn.with_logical_constraint`` on activations, a (fsdp,
    tensor) mesh with Auto axes set around the training loop with the rules: ZeRO on fsdp, the tensor split of
    each kernel kept when gathered, the activations' constraints applied; equal to plain jit on the mesh."""
    import flax.linen as nn
    from flax import traverse_util

    from helpers.tp_models import LOGICAL_RULES, LinenTPLM, linen_tp_loss

    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=auto)
    module, tok0, tx = LinenTPLM(), TOKENS[0][:, :-1], optax.adamw(3e-3, eps=EPS)
    with jax.set_mesh(mesh), nn.logical_axis_rules(LOGICAL_RULES):
        variables = jax.jit(module.init)(jax.random.key(0), tok0)  # eager: an XLA program per op
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(variables), mesh, LOGICAL_RULES)
        params = jax.device_put(nn.unbox(variables["params"]), shardings["params"])
        ref, params = _linen_reference(module, linen_tp_loss, params, tx, TOKENS[:4],
                                       place=lambda t: jax.device_put(t, P("fsdp")))
        off = zinf.Offload(tier, path=str(tmp_path) if tier == "nvme" else None)
        eng = zinf.initialize(module, init_args=(tok0,), loss_fn=linen_tp_loss, optimizer=tx, mesh=mesh,
                              config=zinf.ZeroConfig(offload_param=off, offload_optimizer=off, engine=engine,
                                                     persistence_threshold=THRESHOLD))
        up = eng.layouts["block_0/Dense_0/kernel"]  # ("embed", "mlp") -> ("fsdp", "tensor")
        assert (up.spec, up.gathered_spec) == (P("fsdp"), P(None, "tensor"))
        assert eng.shard_batch(TOKENS[0]).sharding.spec == P("fsdp", None)  # replicated over tensor
        losses = [eng.train_step(t)["loss"] for t in TOKENS[:4]]
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    got = eng.param_arrays()
    for k, v in traverse_util.flatten_dict(jax.device_get(params), sep="/").items():
        np.testing.assert_allclose(got[k], np.asarray(v), rtol=1e-5, atol=1e-5, err_msg=k)
    eng.close()
