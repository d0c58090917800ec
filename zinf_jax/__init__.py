"""zinf_jax: ZeRO-Infinity for JAX and Flax.

::

  constructor --eval_shape--> abstract model --plan--> units (gather/release granularity)
                                                   |
            init unit by unit, sharded (never the whole model in RAM)
                                                   v
  +---------------- tiers, per unit, per shard -------------------------------+
  | device (HBM)  <--H2D--  host (pinned_host)  <--read--  nvme (tensorstore) |
  +---------------------------------------------------------------------------+
  forward  : for unit i: prefetch i+1..i+k; gather i (all-gather) -> run -> release
  backward : reverse order; re-gather, recompute, vjp -> grads reduce-scattered -> grad sink
  optimizer: streamed CPU Adam over optimizer shards (fp32 master, m, v):
             read sub-group j+1 | update j | write j-1; new params -> param tier

This module only re-exports the public API, lazily (PEP 562): ``import zinf_jax`` loads
nothing heavy, so the CLI installs its signal handlers before JAX, Flax and orbax load.
"""
import importlib
from typing import Any

_EXPORTS = {
    "zinf_jax.api": ("Engine", "initialize", "restore"),
    "zinf_jax.checkpoint": ("CheckpointError",),
    "zinf_jax.config": ("AioConfig", "ConfigError", "LossScaleConfig", "Offload", "OptimizerConfig", "ZeroConfig"),
    "zinf_jax.engine.store": ("ParamMismatchError",),
    "zinf_jax.engine.streamed": ("EngineError",),
    "zinf_jax.optim": ("adam", "adamw"),
    "zinf_jax.sharding": ("format_table", "make_mesh", "plan_partition"),
    "zinf_jax.tiers": ("TierError", "TierDataError"),
    "zinf_jax.units": ("Plan", "UnitPolicy", "UnitPolicyError"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'zinf_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])


__version__ = "0.1.0"

__all__ = [
    "Engine", "initialize", "restore",
    "ZeroConfig", "Offload", "AioConfig", "LossScaleConfig", "OptimizerConfig",
    "adam", "adamw",
    "make_mesh", "plan_partition", "format_table",
    "UnitPolicy", "Plan",
    "ConfigError", "TierError", "TierDataError", "UnitPolicyError", "ParamMismatchError", "EngineError", "CheckpointError",
]
