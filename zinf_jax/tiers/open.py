"""Choosing a tier from an offload setting."""
from __future__ import annotations

import os
from typing import Callable

import jax

from zinf_jax.config.zero import NVME_UPDATE
from zinf_jax.plan.placement import UpdateMode
from zinf_jax.tiers.base import Tier
from zinf_jax.tiers.memory import CpuTier, DeviceTier
from zinf_jax.tiers.nvme import NvmeTier

__all__ = ["open_tier"]


def open_tier(
    device: str,
    *,
    path: str | os.PathLike | None = None,
    subdir: str = "",
    host_memory: str = "pinned_host",
    placement: Callable[[int], jax.Device] | None = None,
    max_in_flight_bytes: int = 1 << 30,
    direct_io: bool = False,
    update: str | UpdateMode = NVME_UPDATE,
    chunk_bytes: int | None = None,
    threads: int | None = None,
    rebuild: bool = False,
) -> Tier:
    """Opens the tier an offload setting names.

    Args:
      device: ``"none"`` (device memory), ``"cpu"`` (host RAM) or ``"nvme"``.
      path: directory for ``"nvme"``.
      subdir: subdirectory of ``path`` (created) so that params and optimizer
        state can share one offload path.
      host_memory: ``"pinned_host"`` or ``"numpy"`` for the cpu tier.
      placement: shard index to the device that owns it (memory tiers).
      max_in_flight_bytes: back-pressure bound.
      direct_io: bypass the page cache (nvme).
      update: an :class:`~zinf_jax.plan.placement.UpdateMode` or its value, ``"double_slot"``,
        ``"in_place"`` or ``"scratch"`` (nvme only, checked there; see :class:`NvmeTier`; default
        ``ZeroConfig.nvme_update``'s).
      chunk_bytes: nvme chunk file size (``None``: the tier's default).
      threads: nvme threads reading and writing chunk files (``None``: the tier's default).
      rebuild: every key is written anew (a restore): a half-updated nvme directory is cleared, not refused.

    Raises:
      ValueError: unknown device, missing path, or an unknown nvme ``update``.
      TierError: the nvme path is unusable or locked.
    """
    if device == "none":
        return DeviceTier(placement=placement, max_in_flight_bytes=max_in_flight_bytes)
    if device == "cpu":
        return CpuTier(memory=host_memory, placement=placement, max_in_flight_bytes=max_in_flight_bytes)
    if device == "nvme":
        if path is None:
            raise ValueError("offload device 'nvme' needs a path (Offload('nvme', path=...) / nvme_path)")
        root = os.fspath(path)
        if subdir:
            from zinf_jax.tiers.nvme_layout import check_dir
            from pathlib import Path

            check_dir(Path(root))
            root = os.path.join(root, subdir)
            os.makedirs(root, exist_ok=True)
        io = {k: v for k, v in (("chunk_bytes", chunk_bytes), ("read_threads", threads), ("write_threads", threads))
              if v is not None}
        return NvmeTier(root, max_in_flight_bytes=max_in_flight_bytes, direct_io=direct_io, update=update,
                        rebuild=rebuild, **io)
    raise ValueError(f"offload device must be 'none', 'cpu' or 'nvme', got {device!r}")
