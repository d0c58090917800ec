"""Pinned host memory: what the compiled step keeps in ``pinned_host`` on a GPU, against the runtime's pool.

XLA's GPU runtime hands out pinned host memory from a pool it sizes when its client starts, 64 GB unless
``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` says otherwise (read once, at the start). A step whose host-resident
arrays need more fails at its first allocation past the pool, after the model was built. So the engine plans
them (:func:`plan_pinned`) and checks the pool (:func:`pool_decision`) before it builds anything; the
estimator reports the same items as the pinned part of its host bytes.

Counted, per process:

* ``params``: a ``cpu`` param tier's arrays in ``pinned_host`` as the step reads them (the compute dtype), twice
  for the trained ones (the next step's copy of the masters is made while the last one is alive);
* ``gradients``: each trained parameter's float32 gradient, moved out of the step to ``pinned_host`` for an
  optimizer on the host;
* ``optimizer_state``: with ``optimizer_update="device"`` and the state on a host tier, the states the step's
  program takes in ``pinned_host`` and the new ones it puts there, both alive at its end (see [Note: states
  moved in the program]).

Everything else the engine keeps on the host (the host optimizer's numpy state, nvme staging, the gradient
sink's own arrays) is pageable memory.

Pure data; nothing here imports JAX.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Mapping

from zinf_jax._internal.fmt import human_bytes

__all__ = ["POOL_VARIABLE", "DEFAULT_POOL_GB", "PinnedPlan", "plan_pinned", "pool_decision", "PoolDecision"]

POOL_VARIABLE = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
"""The environment variable XLA's GPU runtime sizes its pinned host pool from (gigabytes, read at start)."""
DEFAULT_POOL_GB = 64.0
"""The pool's size when the variable is not set."""
_MARGIN = 1.25
"""The pool the engine asks for, over its plan: XLA's own pinned buffers (transfers, its allocator's rounding)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PinnedPlan:
    """Pinned host bytes of one process.

    Attributes:
      items: ``"params"``, ``"gradients"`` and ``"optimizer_state"`` to bytes (see the module docstring).
    """

    items: Mapping[str, int]

    @property
    def total(self) -> int:
        return int(sum(self.items.values()))

    @property
    def pool_gb(self) -> int:
        """The pool to ask the runtime for (whole gigabytes, with a margin for XLA's own pinned buffers)."""
        return max(1, math.ceil(self.total * _MARGIN / 1e9))

    def describe(self) -> str:
        return ", ".join(f"{k} {human_bytes(v)}" for k, v in self.items.items() if v) or "none"


def plan_pinned(*, params_bytes: int, trained_params_bytes: int, gradient_bytes: int, param_tier: str,
                grads_to_host: bool, compiled: bool, moved_state_bytes: int = 0) -> PinnedPlan:
    """The pinned bytes of one process.

    Args:
      params_bytes: this process's unit parameter shards in the compute dtype (all of them).
      trained_params_bytes: the trained ones' part of ``params_bytes``.
      gradient_bytes: this process's trained parameter shards in float32.
      param_tier: ``"none"``, ``"cpu"`` or ``"nvme"``.
      grads_to_host: the optimizer is on the host.
      compiled: the compiled engine runs the step (the streamed one keeps its host buffers in numpy).
      moved_state_bytes: the optimizer state the step's program moves in and out (0: none; its update is
        elsewhere, or the state is in device memory).
    """
    if not compiled:
        return PinnedPlan(items={})
    items = {"params": params_bytes + trained_params_bytes if param_tier == "cpu" else 0,
             "gradients": gradient_bytes if grads_to_host else 0,
             "optimizer_state": 2 * moved_state_bytes}
    return PinnedPlan(items=items)


@dataclasses.dataclass(frozen=True)
class PoolDecision:
    """What to do about the pool: ``set`` the variable to ``gigabytes`` (the client has not started), nothing
    (``ok``), or ``refuse`` with ``message``."""

    action: str
    gigabytes: int = 0
    message: str = ""


def pool_decision(plan: PinnedPlan, *, platform: str, client_started: bool,
                  environ: Mapping[str, str] | None = None) -> PoolDecision:
    """Whether ``plan`` fits the GPU runtime's pinned pool, and what to set where the runtime has not started.

    Args:
      plan: the engine's pinned bytes.
      platform: the devices' platform (only ``gpu``/``cuda``/``rocm`` have the pool).
      client_started: the GPU client already exists (its pool is sized).
      environ: the environment (default ``os.environ``).
    """
    if platform not in ("gpu", "cuda", "rocm") or plan.total == 0:
        return PoolDecision("ok")
    env = os.environ if environ is None else environ
    given = env.get(POOL_VARIABLE)
    try:
        pool = float(given) if given else DEFAULT_POOL_GB
    except ValueError:
        return PoolDecision("refuse", message=f"{POOL_VARIABLE}={given!r} is not a number of gigabytes")
    if plan.total * _MARGIN <= pool * 1e9:
        return PoolDecision("ok")
    if not client_started and not given:
        return PoolDecision("set", gigabytes=plan.pool_gb)
    why = f"{POOL_VARIABLE}={given}" if given else f"its default of {DEFAULT_POOL_GB:.0f} GB ({POOL_VARIABLE} unset)"
    return PoolDecision("refuse", message=(
        f"the step keeps {human_bytes(plan.total)} in pinned host memory on each process ({plan.describe()}), "
        f"over the GPU runtime's pinned pool of {pool:g} GB ({why}, with a {(_MARGIN - 1) * 100:.0f}% margin for "
        f"XLA's own pinned buffers). Set {POOL_VARIABLE}={plan.pool_gb} before JAX starts (before the first jax "
        "call of the process), or keep fewer parameters in host memory (more processes, offload_param='nvme')"))
