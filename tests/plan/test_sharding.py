"""ZeRO-3 partition rule on the 8-device CPU mesh."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from zinf_jax.plan.partition import (
    assemble, format_table, from_stored, make_mesh, plan_partition, split_local, to_stored,
)

SHAPES = {
    "divisible": (16, 40),      # both divide by 8: the larger (40) is chosen
    "second_dim": (3, 64),      # only dim 1 divides
    "non_divisible": (3, 5, 7),  # none divides: padded + flattened
    "scalar": (),
    "tiny": (4,),
    "huge": (1031, 257),        # large and prime-ish: never replicated
}


def _abstract(dtype=jnp.float32):
    return {k: jax.ShapeDtypeStruct(s, dtype) for k, s in SHAPES.items()}


def test_make_mesh_default_and_axes(n_devices):
    m = make_mesh()
    assert m.axis_names == ("fsdp",) and m.shape["fsdp"] == n_devices
    m2 = make_mesh(data=2, tensor=2)
    assert m2.axis_names == ("data", "fsdp", "tensor") and m2.shape["fsdp"] == 2
    assert all(t == jax.sharding.AxisType.Auto for t in m2.axis_types)
    with pytest.raises(ValueError, match="does not match"):
        make_mesh(3)


def test_expected_specs(n_devices):
    lay = plan_partition(_abstract(), make_mesh(), persistence_threshold=16)
    assert lay["divisible"].spec == P(None, "fsdp") and lay["divisible"].kind == "sharded"
    assert lay["second_dim"].spec == P(None, "fsdp")
    assert lay["non_divisible"].kind == "flat" and lay["non_divisible"].spec == P("fsdp")
    assert lay["non_divisible"].stored_shape == (112,) and lay["non_divisible"].shard_shape == (14,)
    assert lay["scalar"].kind == "persistent" and lay["scalar"].spec == P()
    assert lay["tiny"].kind == "persistent"
    huge = lay["huge"]
    assert huge.kind == "flat" and huge.bytes_per_device() * n_devices >= 1031 * 257 * 4
    assert huge.bytes_per_device() < 1031 * 257 * 4 / (n_devices - 1)
    table = format_table(lay.values())
    assert "non_divisible" in table and "flat" in table and "bytes/device" in table


def test_threshold_zero_shards_everything():
    lay = plan_partition(_abstract(), make_mesh(), persistence_threshold=0)
    assert all(l.kind != "persistent" for l in lay.values())
    assert lay["scalar"].kind == "flat" and lay["scalar"].stored_shape == (8,)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16, np.int32])
def test_shard_gather_roundtrip_bitwise(dtype):
    mesh = make_mesh()
    rng = np.random.default_rng(0)
    values = {k: (rng.standard_normal(s) * 100).astype(dtype) for k, s in SHAPES.items()}
    lay = plan_partition({k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in values.items()}, mesh, 16)
    for k, v in values.items():
        l = lay[k]
        stored = jax.device_put(to_stored(l, v), NamedSharding(mesh, l.spec))
        assert stored.shape == l.stored_shape
        shards = split_local(l, mesh, stored)
        assert all(s.shape == l.shard_shape for s in shards.values())
        assert len(shards) == (1 if l.kind == "persistent" else 8)
        # back through host buffers, as a tier hands them over
        rebuilt = assemble(l, mesh, {i: np.asarray(s) for i, s in shards.items()})
        assert rebuilt.sharding.is_equivalent_to(NamedSharding(mesh, l.spec), len(l.stored_shape))
        gathered = np.asarray(from_stored(l, jax.device_get(rebuilt)))
        assert gathered.dtype == v.dtype and gathered.shape == v.shape
        assert gathered.tobytes() == v.tobytes()


def test_data_axis_replicates_params():
    mesh = make_mesh(data=2)
    l = plan_partition({"w": jax.ShapeDtypeStruct((8, 12), jnp.float32)}, mesh, 0)["w"]
    assert l.num_shards == 4 and l.spec == P(None, "fsdp")  # 12 is the largest dim dividing by 4
    v = np.arange(96, dtype=np.float32).reshape(8, 12)
    arr = jax.device_put(v, NamedSharding(mesh, l.spec))
    shards = split_local(l, mesh, arr)
    assert sorted(shards) == [0, 1, 2, 3]
    np.testing.assert_array_equal(np.asarray(assemble(l, mesh, shards)), v)
