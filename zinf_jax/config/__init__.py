"""What the user asked for: the frozen, validated settings of an engine.

* :mod:`~zinf_jax.config.zero`: :class:`ZeroConfig` and its sections (:class:`Offload`,
  :class:`AioConfig`, :class:`LossScaleConfig`, :class:`OptimizerConfig`); one docstring per field.
* :mod:`~zinf_jax.config.fields`: how a field is checked and a config built from dicts.
* :mod:`~zinf_jax.config.deepspeed`: DeepSpeed JSON (ZeRO stage 3) read into a :class:`ZeroConfig`.
* :mod:`~zinf_jax.config.files`: the DeepSpeed JSON file reader both importers use.

Nothing here imports JAX: a config is plain data, checked on construction.
"""
from zinf_jax.config.zero import (ALIGN_BYTES, COMPUTE_DTYPES, DEVICES, INERT, NVME_CHUNK_BYTES, NVME_UPDATE, AioConfig,
                                  LossScaleConfig, Offload, OptimizerConfig, ZeroConfig)
from zinf_jax.config.fields import OPTIMIZERS
from zinf_jax.errors import ConfigError

__all__ = ["ConfigError", "Offload", "AioConfig", "LossScaleConfig", "OptimizerConfig", "ZeroConfig", "INERT",
           "DEVICES", "COMPUTE_DTYPES", "ALIGN_BYTES", "OPTIMIZERS", "NVME_CHUNK_BYTES", "NVME_UPDATE"]
