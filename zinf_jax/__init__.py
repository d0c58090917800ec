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

This module only re-exports the public API.
"""
from zinf_jax.api import Engine, initialize, restore
from zinf_jax.checkpoint import CheckpointError
from zinf_jax.config import AioConfig, ConfigError, LossScaleConfig, Offload, OptimizerConfig, ZeroConfig
from zinf_jax.engine.store import ParamMismatchError
from zinf_jax.engine.streamed import EngineError
from zinf_jax.optim import adam, adamw
from zinf_jax.sharding import format_table, make_mesh, plan_partition
from zinf_jax.tiers import TierError
from zinf_jax.units import Plan, UnitPolicy, UnitPolicyError

__version__ = "0.1.0"

__all__ = [
    "Engine", "initialize", "restore",
    "ZeroConfig", "Offload", "AioConfig", "LossScaleConfig", "OptimizerConfig",
    "adam", "adamw",
    "make_mesh", "plan_partition", "format_table",
    "UnitPolicy", "Plan",
    "ConfigError", "TierError", "UnitPolicyError", "ParamMismatchError", "EngineError", "CheckpointError",
]
