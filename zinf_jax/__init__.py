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

Where things live, in data-flow order (each package's ``__init__`` maps its modules)::

  errors.py    every public exception, under ZinfError
  config/      what the user asked for: ZeroConfig & co, DeepSpeed import
  plan/        what goes where, as data: units, partition (mesh, shards), placement (tiers)
  tiers/       where the bytes live: device, cpu, nvme (tensorstore zarr3, manifests, checksums)
  optim/       update math (fused Adam kernel, optax rules), the streamed driver over a tier
  engine/      hooks and executors: adapters, init, store, prefetch, glue, streamed, build, stepping
  checkpoint/  format (on-disk names), state, save, restore, integrity, policies, retention
  distributed/ multi-process jobs in your own loop: join with a peer watch, agreed stop on a signal
  api.py       initialize / restore / Engine;  estimate.py: memory per tier before building
               (estimate_step.py: one step replayed, its device/host peaks and disk bytes)
  _internal/   the one jax._src fence, durable files, futures, multi-host, formatting
  app/         the zinf-jax command and its main job (the library never imports it)
"""
import importlib
from typing import Any

_EXPORTS = {
    "zinf_jax.api": ("Engine", "initialize", "restore"),
    "zinf_jax.engine.hostcheck": ("HostComputeReport", "check_host_compute", "host_compute_report"),
    "zinf_jax.engine.summary": ("format_step",),
    "zinf_jax.engine.weights": ("TensorMap", "from_safetensors", "TIED_EMBEDDINGS"),
    "zinf_jax.config": ("AioConfig", "LossScaleConfig", "Offload", "OptimizerConfig", "ZeroConfig"),
    "zinf_jax.config.resolution": ("RunValues",),
    "zinf_jax.errors": ("ZinfError", "ConfigError", "CheckpointError", "ParamMismatchError", "EngineError",
                        "TierError", "TierDataError", "UnitPolicyError", "DistributedError"),
    "zinf_jax.optim": ("adam", "adamw"),
    "zinf_jax.plan.partition": ("ParamLayout", "format_table", "make_mesh", "plan_partition"),
    "zinf_jax.plan.units": ("Plan", "UnitPolicy"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
_SUBMODULES = ("distributed", "estimate", "models")  # public namespaces: zinf.distributed.initialize(...)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")  # the import binds it here too
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'zinf_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE, *_SUBMODULES])


def _version() -> str:
    """The installed distribution's version (pyproject.toml is its one source)."""
    from importlib import metadata

    try:
        return metadata.version("zinf-jax")
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


__version__ = _version()

__all__ = [
    "distributed", "estimate", "models",
    "Engine", "initialize", "restore", "from_safetensors", "TensorMap", "TIED_EMBEDDINGS",
    "ZeroConfig", "Offload", "AioConfig", "LossScaleConfig", "OptimizerConfig", "RunValues",
    "adam", "adamw",
    "make_mesh", "plan_partition", "format_table", "ParamLayout",
    "UnitPolicy", "Plan",
    "check_host_compute", "host_compute_report", "HostComputeReport", "format_step",
    "ZinfError", "ConfigError", "TierError", "TierDataError", "UnitPolicyError", "ParamMismatchError", "EngineError",
    "CheckpointError", "DistributedError",
]
