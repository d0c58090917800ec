"""Where the bytes live: shards of every key in device memory, host RAM or on NVMe (re-exports only).

* :mod:`~zinf_jax.tiers.base`: the :class:`Tier` protocol (declare, put, get, commit, close),
  :class:`ShardSpec`, the in-flight :class:`ByteBudget`.
* :mod:`~zinf_jax.tiers.keys`: the registry of declared keys both kinds of tier keep.
* :mod:`~zinf_jax.tiers.memory`: :class:`DeviceTier` and :class:`CpuTier` (``pinned_host`` or numpy).
* :mod:`~zinf_jax.tiers.nvme`: :class:`NvmeTier`: zarr3 arrays under a directory, one manifest
  per process, update modes (:class:`~zinf_jax.plan.placement.UpdateMode`) and generations;
  :mod:`~zinf_jax.tiers.nvme_layout` its on-disk layout (manifest, slots, locks);
  :mod:`~zinf_jax.tiers.direct` the ``O_DIRECT`` chunk-file I/O; :mod:`~zinf_jax.tiers.checksum`
  an XXH3-64 per chunk file.
* :mod:`~zinf_jax.tiers.open`: the tier an offload setting names.
"""
from zinf_jax.tiers.base import ByteBudget, ShardSpec, Tier, TierDataError, TierError, done_future, np_dtype
from zinf_jax.tiers.direct import aligned_empty
from zinf_jax.tiers.memory import CpuTier, DeviceTier
from zinf_jax.tiers.nvme import NvmeTier, read_manifest
from zinf_jax.tiers.open import open_tier

__all__ = [
    "ByteBudget", "ShardSpec", "Tier", "TierError", "TierDataError", "done_future", "np_dtype", "aligned_empty",
    "CpuTier", "DeviceTier", "NvmeTier", "read_manifest", "open_tier",
]
