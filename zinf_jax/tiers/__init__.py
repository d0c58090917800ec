"""Storage tiers for shards: device memory, host RAM, NVMe (re-exports only)."""
from zinf_jax.tiers.base import ByteBudget, ShardSpec, Tier, TierDataError, TierError, done_future, np_dtype
from zinf_jax.tiers.direct import aligned_empty
from zinf_jax.tiers.memory import CpuTier, DeviceTier
from zinf_jax.tiers.nvme import NvmeTier, read_manifest
from zinf_jax.tiers.open import open_tier

__all__ = [
    "ByteBudget", "ShardSpec", "Tier", "TierError", "TierDataError", "done_future", "np_dtype", "aligned_empty",
    "CpuTier", "DeviceTier", "NvmeTier", "read_manifest", "open_tier",
]
