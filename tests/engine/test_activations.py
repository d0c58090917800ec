"""Saved activations on disk (``offload_activations="nvme"``): the same numbers as in device memory, no file
left behind, neither device nor host memory counted for them, and clear errors."""
import logging
import os

import jax
import numpy as np
import pytest
from flax import nnx

import zinf_jax as zinf
from zinf_jax.engine.activations import OnDisk, parking_for
from zinf_jax.engine.adapters import leaf_paths
from zinf_jax.estimate import estimate_from_model
from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss
from zinf_jax.plan.partition import make_mesh
from zinf_jax.plan.units import path_str

CFG = GPTConfig(vocab=256, d_model=32, n_heads=4, n_layers=2, seq=16)
DATA = corpus()


def ctor():
    return GPT(CFG, rngs=nnx.Rngs(0))


def batches(n):
    return [batch_at(DATA, s, 8, CFG.seq) for s in range(n)]


def engine(path, offload, checkpointing=True):
    config = zinf.ZeroConfig(offload_param=zinf.Offload("nvme", path=str(path)), persistence_threshold=600,
                             offload_activations=offload, activation_checkpointing=checkpointing)
    return zinf.initialize(ctor, config=config, optimizer=zinf.adamw(3e-3), loss_fn=lm_loss)


def flat(state):
    return {path_str(p): np.asarray(v) for p, v in zip(leaf_paths(state), jax.tree.leaves(state))}


@pytest.mark.parametrize("checkpointing", [True, False])
def test_activations_on_disk_train_bitwise_like_on_device(tmp_path, checkpointing):
    """Losses and parameters after 2 steps are bitwise those of activations kept in device memory; every
    file is deleted once read back, and the directory at close; device memory holds no saved activation."""
    runs = {}
    for offload in (False, "nvme"):
        (tmp_path / str(offload)).mkdir()
        eng = engine(tmp_path / str(offload), offload, checkpointing)
        spill = tmp_path / str(offload) / "activations" / "process_0"
        losses, peaks = [], []
        for b in batches(2):
            m = eng.train_step(b)
            losses.append(m["loss"])
            peaks.append(m["peak_device_bytes"])
            assert not spill.exists() or os.listdir(spill) == []
        runs[offload] = losses, flat(eng.params()), max(peaks)
        eng.close()
        assert not spill.exists()
    (dev_loss, dev_par, dev_peak), (disk_loss, disk_par, disk_peak) = runs[False], runs["nvme"]
    assert disk_loss == dev_loss
    assert all(disk_par[p].tobytes() == dev_par[p].tobytes() for p in dev_par)
    assert disk_peak < dev_peak


def test_on_disk_round_trip_keeps_shardings_and_writes_a_replicated_array_once(tmp_path):
    mesh = make_mesh()
    sharded = jax.device_put(np.arange(64.0, dtype=np.float32).reshape(8, 8),
                             jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp")))
    replicated = jax.device_put(np.arange(6, dtype=np.int32), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    loose = jax.numpy.arange(3)  # uncommitted: stays where it is
    disk = OnDisk(str(tmp_path / "spill"))
    parked = disk.park((sharded, [replicated, loose]))
    assert parked[1][1] is loose
    assert len(parked[0].files) == len(mesh.devices.flat) and len(parked[1][0].files) == 1
    disk.prefetch(parked)
    back = disk.unpark(parked)
    assert back[0].sharding == sharded.sharding and back[1][0].sharding == replicated.sharding
    np.testing.assert_array_equal(back[0], sharded)
    np.testing.assert_array_equal(back[1][0], replicated)
    assert os.listdir(tmp_path / "spill") == []
    again = disk.park(sharded)
    disk.discard(again)  # a pass stopped between its forward and backward
    assert os.listdir(tmp_path / "spill") == []
    disk.close()
    assert not (tmp_path / "spill").exists()


def test_files_a_killed_run_left_are_removed_with_a_warning(tmp_path, caplog):
    stale = tmp_path / "activations" / "process_0"
    stale.mkdir(parents=True)
    (stale / "17.bin").write_bytes(b"x" * 10)
    with caplog.at_level(logging.WARNING, logger="zinf_jax.engine.activations"):
        disk = parking_for("nvme", str(tmp_path))  # what the engine opens (its path checked above)
    assert "previous run" in caplog.text and not (stale / "17.bin").exists() and stale.is_dir()
    disk.close()


def test_nvme_activations_need_an_nvme_tier_and_deepspeed_cpu_checkpointing_maps():
    with pytest.raises(zinf.ConfigError, match="offload_activations.*Offload\\('nvme', path=...\\)"):
        zinf.ZeroConfig(offload_activations="nvme")
    with pytest.raises(zinf.ConfigError, match="offload_activations"):
        zinf.ZeroConfig(offload_activations="disk")
    ds = {"zero_optimization": {"stage": 3}, "activation_checkpointing": {"cpu_checkpointing": True}}
    assert zinf.ZeroConfig.from_deepspeed(ds).offload_activations is True
    assert zinf.ZeroConfig(offload_activations="nvme", offload_optimizer=zinf.Offload("nvme", path="/x")
                           ).resolved_engine() == "streamed"


def test_estimate_counts_activations_on_disk_in_neither_memory(tmp_path):
    def estimate(offload):
        config = zinf.ZeroConfig(offload_param=zinf.Offload("nvme", path=str(tmp_path)), persistence_threshold=600,
                                 offload_activations=offload)
        (est,) = estimate_from_model(ctor, config=config, loss_fn=lm_loss, example_batch=batches(1)[0],
                                     configurations=[("nvme", "cpu")])
        return est

    on_device, on_disk = estimate(False), estimate("nvme")
    assert on_device.breakdown.get("device.activations", 0) > 0 and "device.activations" not in on_disk.breakdown
    assert on_disk.device_bytes_local < on_device.device_bytes_local
    assert on_disk.host_bytes == on_device.host_bytes
