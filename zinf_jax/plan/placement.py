"""Where each kind of state lives: the one placement decision, read by the engine and the estimator.

:func:`place` turns a :class:`~zinf_jax.config.ZeroConfig` (and the compute dtype) into a
:class:`Placement`: which tier holds the compute-dtype params, the optimizer state and the
gradients, under which subdirectory of an offload path, how an nvme tier applies a step
(:class:`UpdateMode`: slots on disk, durability) and whether trained params are read from the
optimizer's fp32 master. The engine opens exactly these tiers
(:func:`zinf_jax.engine.build.build`); the estimator counts exactly these bytes
(:mod:`zinf_jax.estimate`); the main job clears exactly these subdirectories
(:mod:`zinf_jax.app.rundir`). Change a decision here and all three follow.

[Note: shared fp32 master]
With fp32 compute and both tiers on nvme, a trained parameter's compute-dtype copy would equal its fp32
master bit for bit. It is not stored twice: the param tier holds only the frozen parameters, and the
forward reads a trained one from the optimizer tier's master (:class:`~zinf_jax.engine.store.ParamStore`
``master_paths``). The optimizer's new master is therefore also the new parameter: no parameter write
follows the optimizer step, the param tier's commit publishes nothing for it, and the estimator counts
its disk bytes once. With both tiers in host RAM under the compiled engine the same holds in any compute
dtype: the compiled step copies the masters out once a step, cast to the compute dtype on the way (the
cast the optimizer's parameter write would make), a scanned run's layers as one stack ([Note: masters in
rows] in :mod:`zinf_jax.optim.state_io`). On nvme a bfloat16 copy halves the bytes each step reads, so
there it is kept. Enforced where it is cited by name.

[Note: scratch gradients]
With the optimizer on nvme, a unit's gradient shards leave host RAM as the backward produces
them, into a third nvme tier (``grads/``) in :attr:`UpdateMode.SCRATCH`: rewritten in place,
never fsynced, emptied when opened; shards under
:data:`~zinf_jax.optim.grads_out.IN_RAM_BELOW` bytes stay in RAM. Nothing in it outlives a step.

Pure data; nothing here imports JAX.
"""
from __future__ import annotations

import dataclasses
import enum

from zinf_jax.config.zero import ZeroConfig

__all__ = ["UpdateMode", "TierPlacement", "Placement", "place", "TIER_SUBDIRS"]


class UpdateMode(str, enum.Enum):
    """How an nvme tier applies a step (``ZeroConfig.nvme_update`` names the first two)."""

    DOUBLE_SLOT = "double_slot"
    """Two slots per key on disk: a step writes the one the manifest does not name, then swaps the
    manifest atomically. After a crash at any moment the previous step is on disk, intact."""
    IN_PLACE = "in_place"
    """One slot per key, rewritten in place; the manifest says "in progress" from the first write of a
    step to its commit. A crash in between leaves a half-updated tier (see [Note: half-updated tier]
    in :mod:`zinf_jax.tiers.nvme`), refused when opened and rebuilt from a checkpoint."""
    SCRATCH = "scratch"
    """One slot, in place, never synced, nothing published, emptied when opened: this step's
    gradients (see [Note: scratch gradients])."""

    @property
    def slots(self) -> int:
        """Copies of each key's data on disk."""
        return 2 if self is UpdateMode.DOUBLE_SLOT else 1

    @property
    def durable(self) -> bool:
        """Whether its writes are fsynced and its commits published in a manifest."""
        return self is not UpdateMode.SCRATCH


TIER_SUBDIRS = ("params", "optimizer", "grads")
"""The subdirectories an engine's nvme tiers use under an offload path (params, optimizer, gradients)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TierPlacement:
    """One tier the engine opens.

    Attributes:
      device: ``"none"`` (device memory), ``"cpu"`` (host RAM) or ``"nvme"``.
      path: the offload path (nvme), else None.
      subdir: its subdirectory under ``path`` (one of :data:`TIER_SUBDIRS`).
      host_memory: how a cpu tier holds its shards: ``"pinned_host"`` jax.Arrays or ``"numpy"`` buffers.
      update: how an nvme tier applies a step.
      direct_io: bypass the page cache (nvme).
      chunk_bytes: an nvme tier's chunk file size (``aio.block_size`` resolved: the tier writes it, the
        estimator counts it).
    """

    device: str
    path: str | None
    subdir: str
    host_memory: str
    update: UpdateMode
    direct_io: bool
    chunk_bytes: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Placement:
    """The tiers of one engine and the decisions that follow from them.

    Attributes:
      params: the compute-dtype parameter shards between uses.
      optimizer: the fp32 master, and the optimizer's states (Adam's m and v).
      grads: the scratch gradient tier ([Note: scratch gradients]), or None: gradients in host RAM.
      shared_master: trained params are read from the optimizer's master ([Note: shared fp32 master]).
      engine: ``"compiled"`` (one program per step) or ``"streamed"`` (units fetched between programs).
      activations: where the streamed engine keeps saved activations: ``"device"``, ``"cpu"`` (pinned host
        memory) or ``"nvme"`` (files under :attr:`activations_path`).
      activations_path: the offload path activations are written under (``"nvme"``: the params', else
        the optimizer's), or None.
    """

    params: TierPlacement
    optimizer: TierPlacement
    grads: TierPlacement | None
    shared_master: bool
    engine: str
    activations: str = "device"
    activations_path: str | None = None

    @property
    def grads_out(self) -> bool:
        """Gradients leave host RAM as they are produced (to :attr:`grads`)."""
        return self.grads is not None


def place(config: ZeroConfig, compute_dtype: str, *, param_device: str | None = None,
          optimizer_device: str | None = None) -> Placement:
    """The placement of an engine built with ``config`` computing in ``compute_dtype``.

    Args:
      config: the engine's settings (``offload_param``, ``offload_optimizer``, ``nvme_update``).
      compute_dtype: the resolved compute dtype (``config.resolved_compute_dtype(platform)``).
      param_device, optimizer_device: other tiers than ``config``'s (the estimator's configurations;
        an nvme tier then has no path).
    """
    po, oo, update = config.offload_param, config.offload_optimizer, UpdateMode(config.nvme_update)
    pd, od = param_device or po.device, optimizer_device or oo.device
    params = TierPlacement(device=pd, path=po.path if pd == po.device else None, subdir="params",
                           host_memory="pinned_host", update=update, direct_io=po.direct_io,
                           chunk_bytes=config.aio.chunk_bytes)
    on_device = config.optimizer_update == "device"  # a cpu tier's states: [Note: states moved in the program]
    optimizer = TierPlacement(device=od, path=oo.path if od == oo.device else None, subdir="optimizer",
                              host_memory="pinned_host" if on_device else "numpy", update=update,
                              direct_io=oo.direct_io,
                              chunk_bytes=config.aio.chunk_bytes)
    grads = None if od != "nvme" or config.optimizer_update == "device" else dataclasses.replace(optimizer, subdir="grads",
                                                                 update=UpdateMode.SCRATCH)
    act = config.offload_activations
    activations = "nvme" if act == "nvme" else "cpu" if act in (True, "cpu") else "device"
    nvme_path = params.path if pd == "nvme" else optimizer.path if od == "nvme" else None
    engine = config.resolved_engine(pd)
    return Placement(params=params, optimizer=optimizer, grads=grads,
                     shared_master=(compute_dtype == "float32" and pd == od == "nvme"
                                    or pd == od == "cpu" and engine == "compiled"),
                     engine=engine, activations=activations,
                     activations_path=nvme_path if activations == "nvme" else None)
