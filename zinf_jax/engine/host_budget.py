"""The engine's host plan: :class:`~zinf_jax.plan.host_memory.HostSizes` of a partitioned model, planned
against ``ZeroConfig.host_memory_limit`` before any tier is opened.

:func:`sizes_of` reads what each host buffer holds from the layouts, units and placement (as the estimator
reads them from its digest); :func:`plan_for` measures the process's resident memory, plans, and raises a
:class:`~zinf_jax.errors.ConfigError` when the plan cannot fit, naming the smallest limit that fits and what
would lower it. :func:`planned_config` is the config the engine then runs: the prefetch depth and buffer
count the plan picked.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Collection, Mapping, Sequence

import jax.numpy as jnp

from zinf_jax._internal import native_memory
from zinf_jax._internal.fmt import human_bytes
from zinf_jax.config import ZeroConfig
from zinf_jax.errors import ConfigError
from zinf_jax.optim.grads_out import ram_bytes, stays_in_ram
from zinf_jax.optim.rules import WholeSets
from zinf_jax.optim.subgroups import PACK_BELOW, PACK_ELEMENTS, pool_geometry, sub_groups
from zinf_jax.plan.pinned import POOL_VARIABLE, PinnedPlan, plan_pinned, pool_decision
from zinf_jax.plan.host_memory import HostPlan, HostSizes, plan_host
from zinf_jax.plan.partition import ParamLayout
from zinf_jax.plan.placement import Placement

__all__ = ["sizes_of", "plan_for", "planned_config", "buffer_set_bytes", "buffer_sets", "updates_in_place", "pinned_of",
           "check_pinned_pool"]


def updates_in_place(config: ZeroConfig, where: Placement) -> bool:
    """The streamed optimizer updates its state in the cpu tier's own arrays, with buffer sets only for the
    whole-tensor parameters (see [Note: updates in place] in :mod:`zinf_jax.optim.driver`)."""
    return where.optimizer.device == "cpu" and config.moments_dtype == "float32" and not where.grads_out


def buffer_sets(config: ZeroConfig, where: Placement, units: int, whole: WholeSets) -> int:
    """How many units of the optimizer's work go through buffer sets, of ``units`` (the whole-tensor
    parameters' among them): all of them, or only those where the state is updated in place."""
    return max(len(whole.paths) if updates_in_place(config, where) else units, 1)


def buffer_set_bytes(config: ZeroConfig, where: Placement, packs: bool, elements: int) -> int:
    """Bytes of one optimizer buffer set of ``elements``: the float32 master and moments, the gradient read
    back (from the scratch tier, or packed), and bfloat16 moments' narrow staging; none where the state is
    updated in place (:func:`updates_in_place`)."""
    if updates_in_place(config, where):
        return 0
    return (12 + 4 * (where.grads_out or packs) + (4 if config.moment_bytes == 2 else 0)) * elements


def sizes_of(layouts: Mapping[str, ParamLayout], units: Sequence[Collection[str]], trained: Collection[str],
             *, n_local: int, n_idx: int, config: ZeroConfig, where: Placement, compute_dtype: str,
             platform: str, whole: WholeSets = WholeSets()) -> HostSizes:
    """What each host buffer of an engine holds (bytes of this process).

    Args:
      layouts: every parameter's layout, by path.
      units: each unit's parameter paths.
      trained: the trained paths.
      n_local: this process's devices; n_idx: the shard indices it stores.
      config, where, compute_dtype: the engine's settings, placement and compute dtype.
      platform: the devices' platform (``"cpu"``: device memory is host RAM).
      whole: the optimizer's whole-tensor parameters' buffers (:func:`~zinf_jax.optim.rules.whole_sets`): a
        buffer set as large as the largest of them, and a multi-process job's gather temporaries.
    """
    def dtype(p: str) -> str:
        return compute_dtype if jnp.issubdtype(jnp.dtype(layouts[p].dtype), jnp.floating) else layouts[p].dtype

    shards = {p: 1 if lay.dim is None else n_idx for p, lay in layouts.items()}
    numel = {p: math.prod(lay.shard_shape) for p, lay in layouts.items()}
    held = tuple(sum(layouts[p].bytes_per_device(dtype(p)) * n_local for p in u) for u in units)
    gathered = tuple(sum(layouts[p].gathered_bytes_per_device(dtype(p)) * n_local for p in u) for u in units)
    grads_out = where.grads_out
    groups, size, packs = pool_geometry([(numel[p], shards[p]) for p in trained if p not in whole.paths],
                                        config.sub_group_size, PACK_BELOW, PACK_ELEMENTS)
    groups += len(whole.paths)
    cut = [numel[p] for p in trained if sub_groups(numel[p], config.sub_group_size)[1] > 1]
    grad = {p: 4 * numel[p] * shards[p] for p in trained}
    unit_grad = max((sum(grad.get(p, 0) for p in u) for u in units), default=0)
    state = config.state_bytes * sum(numel[p] * shards[p] for p in trained)
    return HostSizes(
        unit_held=held, unit_gathered=gathered, params_on_nvme=where.params.device == "nvme",
        device_is_host=platform == "cpu",
        buffer_set=max(buffer_set_bytes(config, where, packs, max(size, 1)), whole.set_bytes),
        sets=buffer_sets(config, where, groups, whole), assembly=4 * max(cut, default=0) + whole.gather_bytes,
        optimizer_on_nvme=where.optimizer.device == "nvme",
        grad_ram=(ram_bytes(sum(g for p, g in grad.items() if stays_in_ram(numel[p]))) if grads_out
                  else sum(grad.values())),
        grad_unit=unit_grad if grads_out else 0,
        resident_tiers=(sum(held) if where.params.device == "cpu" else 0)
        + (state if where.optimizer.device == "cpu" else 0))


def pinned_of(layouts: Mapping[str, ParamLayout], units: Sequence[Collection[str]], trained: Collection[str], *,
              n_idx: int, where: Placement, compute_dtype: str, fused: bool, state_bytes: int = 12) -> PinnedPlan:
    """The pinned host bytes of an engine's step on this process (:func:`zinf_jax.plan.pinned.plan_pinned`).

    Args:
      layouts, units, trained: as :func:`sizes_of`.
      n_idx: the shard indices this process stores.
      where, compute_dtype: the engine's placement and compute dtype.
      fused: the optimizer's update runs in the step's program (its gradients stay on the devices).
      state_bytes: optimizer state bytes per trained element (the master and the moments), moved through the
        program where ``fused`` with the state on a host tier.
    """
    def nbytes(p: str, dtype: str) -> int:
        lay = layouts[p]
        return math.prod(lay.shard_shape) * (1 if lay.dim is None else n_idx) * jnp.dtype(dtype).itemsize

    def dtype(p: str) -> str:
        return compute_dtype if jnp.issubdtype(jnp.dtype(layouts[p].dtype), jnp.floating) else layouts[p].dtype

    paths = {p for u in units for p in u}
    return plan_pinned(params_bytes=sum(nbytes(p, dtype(p)) for p in paths),
                       trained_params_bytes=sum(nbytes(p, dtype(p)) for p in paths if p in trained),
                       gradient_bytes=sum(nbytes(p, "float32") for p in paths if p in trained),
                       param_tier=where.params.device, grads_to_host=where.optimizer.device != "none" and not fused,
                       compiled=where.engine == "compiled",
                       moved_state_bytes=(sum(nbytes(p, "float32") for p in paths if p in trained) // 4 * state_bytes
                                          if fused and where.optimizer.device == "cpu" else 0))


def check_pinned_pool(plan: PinnedPlan, platform: str, *, client_started: bool = True) -> None:
    """Refuses a step whose pinned host memory cannot fit the GPU runtime's pinned pool, before anything is built;
    sets the pool's variable from the plan where the runtime has not started yet (see
    :func:`zinf_jax.plan.pinned.pool_decision`).

    Raises:
      ConfigError: the plan is over the pool (the message names the variable, the bytes and the fix).
    """
    import os

    decision = pool_decision(plan, platform=platform, client_started=client_started)
    if decision.action == "set":
        os.environ[POOL_VARIABLE] = str(decision.gigabytes)
    elif decision.action == "refuse":
        raise ConfigError(f"zinf_jax: {decision.message}", field="offload_param", detail=decision.message)


def plan_for(sizes: HostSizes, config: ZeroConfig, *, runtime: int | None = None) -> HostPlan:
    """Plans the host buffers against ``config.host_memory_limit``.

    Args:
      sizes: :func:`sizes_of` the engine.
      config: the settings asked for.
      runtime: the process's own resident bytes (default: measured now,
        :func:`~zinf_jax._internal.native_memory.resident_bytes`).

    Raises:
      ConfigError: the limit is below the plan's smallest total (the message names it and what would lower it).
    """
    runtime = native_memory.resident_bytes() if runtime is None else runtime
    plan = plan_host(sizes, runtime=runtime, prefetch_depth=config.prefetch_depth,
                     buffer_count=config.offload_optimizer.buffer_count, limit=config.host_memory_limit,
                     max_live_bytes=config.max_live_bytes)
    if not plan.fits:
        detail = (f"the engine's host buffers need at least {human_bytes(plan.minimum)} (host_memory_limit="
                  f"{plan.minimum} or more fits), of which {human_bytes(plan.items['runtime'])} is this process's "
                  f"own memory measured at start (JAX, XLA, Python); got {human_bytes(config.host_memory_limit)}. "
                  "What would lower it: " + "; ".join(plan.lowering) + ".\n" + plan.describe())
        raise ConfigError(f"ZeroConfig.host_memory_limit: {detail}", field="host_memory_limit", detail=detail)
    return plan


def planned_config(config: ZeroConfig, plan: HostPlan) -> ZeroConfig:
    """``config`` with the prefetch depth, live-bytes bound and optimizer buffer count the plan picked (unchanged
    without a limit)."""
    if config.host_memory_limit is None:
        return config
    return dataclasses.replace(config, prefetch_depth=plan.prefetch_depth, max_live_bytes=plan.max_live_bytes,
                               offload_optimizer=dataclasses.replace(config.offload_optimizer,
                                                                     buffer_count=plan.buffer_count))
