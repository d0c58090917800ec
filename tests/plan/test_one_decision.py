"""One decision per setting: the nvme chunk size and update mode are read from one place by the config, the
tier and the estimator (issue 47)."""
import zinf_jax as zinf
from zinf_jax.config import NVME_CHUNK_BYTES, AioConfig
from zinf_jax.estimate import estimate_from_sizes
from zinf_jax.plan.placement import UpdateMode, place
from zinf_jax.tiers import open_tier
from zinf_jax.tiers.nvme import NvmeTier


def _nvme(tmp_path, **kw):
    off = zinf.Offload("nvme", path=str(tmp_path))
    return zinf.ZeroConfig(offload_param=off, offload_optimizer=off, compute_dtype="float32", **kw)


def test_update_mode_default_is_the_configs_in_the_tier_and_the_placement(tmp_path):
    config = _nvme(tmp_path)
    (tmp_path / "t").mkdir()
    tier = NvmeTier(tmp_path / "t", process_index=0)
    opened = open_tier("nvme", path=tmp_path, subdir="o")
    try:
        assert tier.update is opened.update is UpdateMode(config.nvme_update) is place(config, "float32").params.update
    finally:
        tier.close()
        opened.close()


def test_chunk_size_is_aio_block_size_for_the_tier_and_the_estimator(tmp_path):
    assert AioConfig().chunk_bytes == NVME_CHUNK_BYTES and AioConfig(block_size=1 << 20).chunk_bytes == 1 << 20
    odd = (3 << 20) + 4096  # chunks that do not divide the shards: the last one is padded on disk
    config = _nvme(tmp_path, aio=AioConfig(block_size=odd))
    assert place(config, "float32").optimizer.chunk_bytes == odd
    sizes = dict(params=None, layers=2, hidden=1024, vocab=256, seq=16, batch=2, n_devices=1, platform="cpu",
                 configurations=[("nvme", "nvme")])
    default, chunked = (estimate_from_sizes(**sizes, config=c)[0] for c in (_nvme(tmp_path), config))
    assert chunked.nvme_bytes > default.nvme_bytes  # 16 MiB divides every shard of this model; 3 MiB + 4 KiB not
