"""Host memory as a budget: every host buffer the engine owns, planned from ``ZeroConfig.host_memory_limit``.

:func:`plan_host` turns what the model and mesh make each buffer hold (:class:`HostSizes`) and the settings
asked for into a :class:`HostPlan`: the bytes of each item at the settings it picks, the smallest total any
settings reach, and whether the limit is met. The engine plans from it before it opens a tier
(:func:`zinf_jax.engine.host_budget.plan_for`) and runs the settings it picked; the estimator reports the
same plan (:attr:`zinf_jax.estimate.MemoryEstimate.host_plan`). Change an item here and both follow.

What is counted (bytes of one process):

* ``runtime``: the process's own resident memory before the engine (JAX, XLA, Python, the model's code),
  measured at start by the engine, assumed by the estimator.
* ``param_staging``: host copies of nvme parameter reads before they are put on the devices, for the unit
  computing and ``prefetch_depth`` ahead.
* ``device_params`` (on a CPU mesh the devices' memory is host RAM): the gathered unit on every local
  device and the stored shards of the units in the prefetch window.
* ``device_grads`` (a CPU mesh): the gathered unit's gradient on every local device, which its backward
  holds before reducing it to shards (measured: d2048 blocks, 8 devices, held most of it at the step's peak).
* ``optimizer_buffers``: the streamed optimizer's buffer sets (``buffer_count`` of them, each the largest
  sub-group's master, moments and gradient), and a shard being assembled from its sub-groups.
* ``optimizer_writes``: tensorstore's copies of the optimizer's writes to an nvme tier (one per buffer set).
* ``grad_sink``: gradient shards kept in RAM (all of them with the optimizer in RAM; with it on nvme only
  the shards under the scratch tier's threshold, and one unit's in flight).
* ``resident_tiers``: a ``cpu`` param tier and a ``cpu`` optimizer state (not planned: they are the model).
* ``trim_slack``: free-but-resident memory the allocator may keep before it is handed back
  (:class:`~zinf_jax._internal.native_memory.Trimmer`).
* ``margin`` (with a limit only): memory the kernel charges the process beyond what it allocates, kept free
  of the plan (:func:`margin`; see [Note: the host margin]).

Not counted: the step's working set (activations and XLA temporaries; on a CPU mesh they are host RAM
too): what is left of the limit is theirs, and :attr:`HostPlan.headroom` says how much that is.
tensorstore's chunk cache is off (``cache_pool`` 0) in every tier, so it holds nothing.

Pure data; nothing here imports JAX.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

from zinf_jax._internal.fmt import human_bytes
from zinf_jax._internal.native_memory import TRIM_SLACK

__all__ = ["HostSizes", "HostPlan", "plan_host", "margin", "MIN_TRIM_SLACK", "TRIM_SLACK", "MIN_MARGIN"]

MIN_TRIM_SLACK = 64 << 20
"""The least trim slack a plan gives: below it the allocator hands pages back after nearly every unit."""


MIN_MARGIN = 256 << 20
"""The least :func:`margin` of a limit."""

# [Note: the host margin]
# A memory cgroup charges a process more than its own allocations: the page cache of the tier files it reads
# and writes (clean pages are reclaimed at the cap, but pages under writeback are not, and the kernel reclaims
# them only as fast as the disk takes them), kernel buffers, and the allocator's fragmentation. The plan keeps
# a margin of the limit free of every item for them: a sixteenth of the limit, at least 256 MiB. Measured
# (scripts/host_budget_run.py, 4 GiB cgroup cap, nvme tiers, 8 CPU devices): the bundled GPT d1024 x 32 and
# x 128 trained under the cap with plans of 1.8-1.9 GiB; d2048 x 32 (seq 64), planned at 3.98 GiB with its
# step's working set and no margin, was killed by the kernel at the cap with a peak RSS of 3.9 GiB uncapped.


def margin(limit: int) -> int:
    """Bytes of ``limit`` a plan leaves free of every item ([Note: the host margin])."""
    return max(MIN_MARGIN, limit // 16)


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostSizes:
    """What the model, its placement and the mesh make each host buffer hold, per process.

    Attributes:
      unit_held: each unit's stored shards on this process (bytes in the compute dtype).
      unit_gathered: each unit gathered on every local device (bytes).
      params_on_nvme: parameters are read from an nvme tier (their reads are staged in host RAM).
      device_is_host: the devices' memory is host RAM (a CPU mesh).
      buffer_set: bytes of one optimizer buffer set.
      sets: units of optimizer work (the most buffer sets ever useful).
      assembly: bytes of a shard being assembled from its sub-groups (0: none is cut).
      optimizer_on_nvme: the optimizer's writes go to an nvme tier.
      grad_ram: gradient shards kept in RAM (bytes).
      grad_unit: the largest unit's gradient shards (in flight to the scratch tier), or 0.
      resident_tiers: bytes of tiers held in RAM (cpu param tier, cpu optimizer state).
    """

    unit_held: tuple[int, ...]
    unit_gathered: tuple[int, ...]
    params_on_nvme: bool
    device_is_host: bool
    buffer_set: int
    sets: int
    assembly: int
    optimizer_on_nvme: bool
    grad_ram: int
    grad_unit: int
    resident_tiers: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostPlan:
    """The host buffers of one process at the settings the plan picked.

    Attributes:
      limit: the budget (``host_memory_limit``), or None.
      prefetch_depth: units fetched ahead (at most the one asked for).
      buffer_count: optimizer buffer sets (at most the one asked for).
      trim_slack: bytes the allocator may keep free before it trims.
      max_live_bytes: stored bytes of the units fetched at once (the prefetch window; with a limit the
        prefetcher's bound, ``ZeroConfig.max_live_bytes`` at most), or None: unbounded.
      items: bytes of each item (see the module docstring) at these settings.
      minimum: the smallest limit that fits: the total at the least settings (``prefetch_depth`` 0, one
        buffer set, the least slack) and that limit's :func:`margin`.
      lowering: what would lower :attr:`minimum`, largest item first (settings and their effect).
    """

    limit: int | None
    prefetch_depth: int
    buffer_count: int
    trim_slack: int
    max_live_bytes: int | None
    items: Mapping[str, int]
    minimum: int
    lowering: tuple[str, ...]

    @property
    def total(self) -> int:
        """Bytes of every item at the picked settings."""
        return sum(self.items.values())

    @property
    def fits(self) -> bool:
        """Whether the plan fits the limit (always, without one)."""
        return self.limit is None or self.total <= self.limit

    @property
    def headroom(self) -> int | None:
        """Bytes of the limit left for the step's working set (activations, XLA temporaries), or None."""
        return None if self.limit is None else self.limit - self.total

    def describe(self) -> str:
        """One line per item, the settings and the verdict."""
        lines = [f"  {k:<18} {human_bytes(v):>10}" for k, v in self.items.items() if v]
        head = (f"host plan: {human_bytes(self.total)} at prefetch_depth={self.prefetch_depth}, "
                f"buffer_count={self.buffer_count}, trim slack {human_bytes(self.trim_slack)}; "
                f"smallest limit that fits {human_bytes(self.minimum)}")
        if self.limit is not None:
            head += (f"; limit {human_bytes(self.limit)}: " + (f"fits, {human_bytes(self.headroom)} left for the "
                                                               "step's activations" if self.fits else "does not fit"))
        return "\n".join([head, *lines])


def _items(s: HostSizes, runtime: int, depth: int, count: int, slack: int, kept: int = 0) -> dict[str, int]:
    held, gathered = max(s.unit_held, default=0), max(s.unit_gathered, default=0)
    window = (1 + depth) * held
    buffers = min(count, max(s.sets, 1)) * s.buffer_set + s.assembly
    return {"runtime": runtime,
            "param_staging": window if s.params_on_nvme else 0,
            "device_params": gathered + window if s.device_is_host else 0,
            "device_grads": gathered if s.device_is_host else 0,
            "optimizer_buffers": buffers,
            "optimizer_writes": buffers if s.optimizer_on_nvme else 0,
            "grad_sink": s.grad_ram + s.grad_unit,
            "resident_tiers": s.resident_tiers,
            "trim_slack": slack,
            **({"margin": kept} if kept else {})}


def _lowering(s: HostSizes, items: Mapping[str, int]) -> tuple[str, ...]:
    why = {"optimizer_buffers": "a smaller sub_group_size (one buffer set holds the largest sub-group's master, "
                                "moments and gradient)",
           "optimizer_writes": "a smaller sub_group_size (tensorstore copies each buffer set it writes)",
           "device_params": "more devices or processes (a gathered unit is whole on every local device) or "
                            "smaller units (unit_policy)",
           "device_grads": "smaller units (unit_policy): a unit's backward holds its whole gradient on every "
                           "local device before reducing it",
           "param_staging": "smaller units (unit_policy), or more processes (each reads its own shards)",
           "resident_tiers": "offload_param / offload_optimizer on 'nvme' (cpu tiers hold their state in RAM)",
           "grad_sink": ("more processes (each holds its own shards' gradients)" if s.optimizer_on_nvme else
                         "offload_optimizer on 'nvme' (gradients then leave RAM as they are produced)"),
           "runtime": "fewer local devices per process, or less imported before initialize (measured at start)"}
    ranked = sorted((k for k in why if items.get(k)), key=lambda k: -items[k])
    return tuple(f"{k} {human_bytes(items[k])}: {why[k]}" for k in ranked)


def plan_host(sizes: HostSizes, *, runtime: int, prefetch_depth: int, buffer_count: int,
              limit: int | None = None, max_live_bytes: int | None = None) -> HostPlan:
    """Plans the host buffers: the settings asked for, lowered only as far as the limit needs.

    Without a limit the settings are kept (and the trim slack is :data:`TRIM_SLACK`). With one, the trim
    slack is lowered first (to :data:`MIN_TRIM_SLACK`), then ``prefetch_depth`` (to 0), then ``buffer_count``
    (to 1), each only until the plan fits; what the limit leaves over goes to the slack (half of it, up to
    :data:`TRIM_SLACK`; the other half is the step's).

    Args:
      sizes: what each buffer holds (:class:`HostSizes`).
      runtime: the process's own resident bytes before the engine.
      prefetch_depth, buffer_count: the settings asked for (``ZeroConfig.prefetch_depth``,
        ``offload_optimizer.buffer_count``): the most the plan uses.
      limit: ``ZeroConfig.host_memory_limit``, or None.
      max_live_bytes: ``ZeroConfig.max_live_bytes`` (with a limit, the planned window is bounded by it too).
    """
    kept = 0 if limit is None else margin(limit)
    least = _items(sizes, runtime, 0, 1, MIN_TRIM_SLACK)
    base = sum(least.values())
    minimum = base if limit is None else max(base + MIN_MARGIN, -(-base * 16 // 15))  # the least L: base+margin(L) <= L
    depth, count, slack = prefetch_depth, buffer_count, TRIM_SLACK
    if limit is not None:
        slack = MIN_TRIM_SLACK
        while depth > 0 and sum(_items(sizes, runtime, depth, count, slack, kept).values()) > limit:
            depth -= 1
        while count > 1 and sum(_items(sizes, runtime, depth, count, slack, kept).values()) > limit:
            count -= 1
        left = limit - sum(_items(sizes, runtime, depth, count, 0, kept).values())
        slack = min(TRIM_SLACK, max(MIN_TRIM_SLACK, left // 2))
    items = _items(sizes, runtime, depth, count, slack, kept)
    live = None if limit is None else (1 + depth) * max(sizes.unit_held, default=0)
    if live is not None and max_live_bytes is not None:
        live = min(live, max(max_live_bytes, max(sizes.unit_held, default=0)))
    return HostPlan(limit=limit, prefetch_depth=depth, buffer_count=count, trim_slack=slack, max_live_bytes=live,
                    items=items,
                    minimum=minimum, lowering=_lowering(sizes, least))
