"""The user's own mesh: any axis names, ZeRO over chosen axes (``ZeroConfig.zero_axes``), batch split."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh, PartitionSpec as P

import zinf_jax as zinf
from helpers.engine_utils import flat, optax_run
from zinf_jax.config import ConfigError
from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss
from zinf_jax.plan.partition import (batch_spec, local_shard_devices, owns_shard, plan_partition, shard_index_of,
                                     zero_axes_of)

CFG = GPTConfig(vocab=256, d_model=32, n_heads=4, n_layers=2, seq=16)
LR, WD, STEPS = 3e-3, 0.1, 3
DATA = corpus()


def ctor():
    return GPT(CFG, rngs=nnx.Rngs(0))


def batches(n):
    return [batch_at(DATA, s, 8, CFG.seq) for s in range(n)]


def mesh_of(shape, names, auto=True):
    devices = np.asarray(jax.devices(), dtype=object).reshape(shape)
    return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names)) if auto else Mesh(devices, names)


@pytest.fixture(scope="module")
def reference():
    """Losses and parameters of plain jit + optax.adamw on the unwrapped model."""
    return optax_run(ctor(), optax.adamw(LR, weight_decay=WD, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
                     batches(STEPS))


def train(mesh, **config):
    cfg = zinf.ZeroConfig(offload_param=zinf.Offload("cpu"), offload_optimizer=zinf.Offload("cpu"),
                          persistence_threshold=600, **config)
    eng = zinf.initialize(ctor, config=cfg, mesh=mesh, optimizer=zinf.adamw(LR, weight_decay=WD), loss_fn=lm_loss)
    try:
        losses = [eng.train_step(b)["loss"] for b in batches(STEPS)]
        return eng, losses, flat(eng.params())
    finally:
        eng.close()


def assert_matches(reference, losses, params):
    ref_losses, ref_params = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert set(params) == set(ref_params)
    for path, r in ref_params.items():
        np.testing.assert_allclose(params[path], r, rtol=1e-5, atol=1e-6, err_msg=path)


@pytest.mark.parametrize("shape, names, zero_axes, shards, entry", [
    ((2, 4), ("data", "fsdp"), ("fsdp",), 4, "fsdp"),              # ZeRO over fsdp, replicas over data
    pytest.param((2, 4), ("replica", "shard"), None, 8, ("replica", "shard"), marks=pytest.mark.slow),  # default: all
    pytest.param((2, 4), ("replica", "shard"), ("shard",), 4, "shard", marks=pytest.mark.slow),
    pytest.param((2, 2, 2), ("a", "b", "c"), ("c", "a"), 4, ("c", "a"), marks=pytest.mark.slow),  # not in mesh order
])
def test_own_mesh_trains_like_optax(reference, shape, names, zero_axes, shards, entry):
    mesh = mesh_of(shape, names, auto=names != ("replica", "shard"))
    eng, losses, params = train(mesh, zero_axes=zero_axes)
    assert_matches(reference, losses, params)
    sharded = [lay for lay in eng.layouts.values() if lay.dim is not None]
    assert sharded and all(lay.num_shards == shards and lay.spec[lay.dim] == entry for lay in sharded)
    path = sharded[0].path
    assert eng.store.local_indices(path) == list(range(shards))  # one copy per shard index in the param tier
    assert sum(owns_shard(mesh, eng.layouts[path], i, zero_axes) for i in range(shards)) == shards


def test_shard_indices_and_replicas():
    mesh = mesh_of((2, 4), ("data", "fsdp"))
    devs = local_shard_devices(mesh, ("fsdp",))
    assert sorted(devs) == [0, 1, 2, 3] and all(len(d) == 2 for d in devs.values())  # one per data coordinate
    for (i, j), d in np.ndenumerate(mesh.devices):
        assert shard_index_of(mesh, d, ("fsdp",)) == j
        assert shard_index_of(mesh, d, ("data", "fsdp")) == 4 * i + j
        assert shard_index_of(mesh, d, ("fsdp", "data")) == 2 * j + i
    assert zero_axes_of(mesh) == ("fsdp",)  # data replicates by default, as with make_mesh
    assert zero_axes_of(mesh_of((2, 4), ("x", "y"))) == ("x", "y")
    assert zero_axes_of(zinf.make_mesh(data=2, tensor=2)) == ("fsdp",)


def test_batch_split_over_all_but_tensor():
    assert batch_spec(mesh_of((2, 4), ("replica", "shard")), 2) == P(("replica", "shard"), None)
    assert batch_spec(zinf.make_mesh(data=2, tensor=2)) == P(("data", "fsdp"))
    assert batch_spec(zinf.make_mesh(tensor=2)) == P("fsdp")


def test_partition_hint_uses_zero_axes():
    mesh = mesh_of((2, 4), ("replica", "shard"))
    shape = {"w": jax.ShapeDtypeStruct((8, 24), jnp.float32)}
    plan = lambda hint: plan_partition(shape, mesh, 0, {"w": hint}, ("shard",))["w"].dim  # noqa: E731
    assert plan(None) == 1                          # largest dimension dividing by 4
    assert plan(("shard", None)) == 0               # the dimension mapped to the zero axis
    assert plan((("replica", "shard"), None)) == 0  # ... also within a tuple of axes
    assert plan(("replica", None)) == 1             # not a zero axis: no preference


def test_unknown_axis_names_the_axes():
    mesh = mesh_of((2, 4), ("data", "fsdp"))
    with pytest.raises(ConfigError, match=r"'nope'.*\('data', 'fsdp'\)"):
        zinf.initialize(ctor, config=zinf.ZeroConfig(zero_axes=("nope",)), mesh=mesh, loss_fn=lm_loss)
    with pytest.raises(ConfigError, match="named twice"):
        zero_axes_of(mesh, ("fsdp", "fsdp"))


@pytest.mark.parametrize("bad", ["fsdp", (), ("",), ("fsdp", 1), 3])
def test_zero_axes_type_is_checked(bad):
    with pytest.raises(ConfigError, match="ZeroConfig.zero_axes"):
        zinf.ZeroConfig(zero_axes=bad)


def test_zero_axes_round_trip():
    cfg = zinf.ZeroConfig(zero_axes=["data", "fsdp"])
    assert cfg.zero_axes == ("data", "fsdp")
    assert zinf.ZeroConfig.from_dict(cfg.to_dict()) == cfg
    assert zinf.ZeroConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert zinf.ZeroConfig.from_dict(zinf.ZeroConfig().to_dict()).zero_axes is None
