"""accelerate YAML configs read as DeepSpeed configs.

``accelerate config`` writes a YAML file whose ``deepspeed_config`` section either points at a
DeepSpeed JSON (``deepspeed_config_file``) or holds a few keys inline, which accelerate turns into a
DeepSpeed config itself. This module does the same turning, so one importer
(:mod:`zinf_jax.config.deepspeed`) reads both: :data:`INLINE` maps each inline key to the DeepSpeed
key it becomes; the YAML's top-level ``mixed_precision`` becomes ``fp16``/``bf16``; launcher keys
(machines, processes, ``zero3_init_flag``...) have no effect here and are reported as such.
PyYAML comes with Flax and orbax (and is a declared dependency).
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping

from zinf_jax.config.files import read_deepspeed_json
from zinf_jax.errors import ConfigError

__all__ = ["INLINE", "read_accelerate"]

INLINE: dict[str, str | None] = {
    "zero_stage": "zero_optimization.stage",
    "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
    "offload_param_device": "zero_optimization.offload_param.device",
    "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
    "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "zero3_init_flag": None,  # zinf always builds the model sharded, unit by unit
    "deepspeed_multinode_launcher": None, "deepspeed_hostfile": None, "deepspeed_exclusion_filter": None,
    "deepspeed_inclusion_filter": None, "deepspeed_moe_layer_cls_names": None,
}
"""Inline ``deepspeed_config`` key -> the DeepSpeed key it becomes (``None``: no effect on the numbers)."""

def _load_yaml(path: str) -> Mapping[str, Any]:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"accelerate config file not found: {path}") from None
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read accelerate config {path} (invalid YAML?): {e}") from None
    if not isinstance(data, Mapping):
        raise ConfigError(f"accelerate config {path}: expected a mapping at the top, got {data!r:.40}")
    return data


def _precision(out: dict[str, Any], precision: Any, path: str) -> None:
    """Applies accelerate's ``mixed_precision`` as accelerate does: fills ``"auto"``, adds a missing section."""
    if precision in (None, "no"):
        precision = "no"
    elif precision not in ("fp16", "bf16"):
        raise ConfigError(f"accelerate config {path}: mixed_precision: accepted values: no, fp16, bf16; "
                          f"got {precision!r}")
    for key in ("fp16", "bf16"):
        sec = out.get(key)
        if sec is None and precision == key:
            out[key] = {"enabled": True}
        elif isinstance(sec, Mapping) and sec.get("enabled") == "auto":
            out[key] = {**sec, "enabled": precision == key}
        elif isinstance(sec, Mapping) and sec.get("enabled") is True and precision not in ("no", key):
            raise ConfigError(f"accelerate config {path}: mixed_precision {precision} but the DeepSpeed config "
                              f"enables {key} (accelerate refuses this too)")


def read_accelerate(path: str) -> tuple[dict[str, Any], str, list[str], list[str]]:
    """The DeepSpeed dict an accelerate YAML describes, its name, notes, and its keys with no effect here.

    Raises:
      ConfigError: the file is unreadable, has no ``deepspeed_config`` section, or names a
        ``deepspeed_config_file`` that cannot be read.
    """
    data = _load_yaml(path)
    ds = data.get("deepspeed_config")
    if not isinstance(ds, Mapping):
        raise ConfigError(f"accelerate config {path}: no deepspeed_config section (distributed_type "
                          f"{data.get('distributed_type', 'not set')}); zinf_jax reads the DeepSpeed part of "
                          "accelerate configs (accelerate config -> DeepSpeed)")
    notes, quiet = [], []
    top_quiet = sorted(k for k in data if k not in ("deepspeed_config", "mixed_precision"))
    precision = data.get("mixed_precision")
    if "deepspeed_config_file" in ds:
        file = os.fspath(ds["deepspeed_config_file"])
        if not os.path.isabs(file) and not os.path.exists(file):
            beside = os.path.join(os.path.dirname(os.path.abspath(path)), file)
            file = beside if os.path.exists(beside) else file
        out = read_deepspeed_json(file)
        others = sorted(k for k in ds if k != "deepspeed_config_file")
        if others:  # accelerate refuses inline keys beside a file too
            raise ConfigError(f"accelerate config {path}: deepspeed_config.{others[0]}: give it in "
                              f"{file} (accelerate refuses inline keys beside deepspeed_config_file)")
        notes.append(f"read {file}: the deepspeed_config_file of accelerate config {path}")
        out.setdefault("gradient_accumulation_steps", 1)  # accelerate's default beside a file
        name = f"{file} (via {path})"
    else:
        out: dict[str, Any] = {}
        for k, v in ds.items():
            if k not in INLINE:
                raise ConfigError(f"accelerate config {path}: deepspeed_config.{k}: not an accelerate DeepSpeed key; "
                                  f"accepted: {', '.join(sorted([*INLINE, 'deepspeed_config_file']))}")
            target = INLINE[k]
            if target is None:
                quiet.append(f"deepspeed_config.{k}")
                continue
            *parents, last = target.split(".")
            node = out
            for p in parents:
                node = node.setdefault(p, {})
            node[last] = v
        for tier in ("offload_optimizer", "offload_param"):  # accelerate writes "none" paths as the string
            sec = out.get("zero_optimization", {}).get(tier)
            if sec and sec.get("nvme_path") in ("none", None) and sec.get("device") != "nvme":
                sec.pop("nvme_path", None)
        out.setdefault("gradient_accumulation_steps", "auto")  # inline: accelerate fills it from the run
        out.setdefault("train_batch_size", "auto")
        out.setdefault("train_micro_batch_size_per_gpu", "auto")
        notes.append(f"accelerate config {path}: deepspeed_config keys read as DeepSpeed keys: "
                     + ", ".join(f"{k} -> {INLINE[k]}" for k in ds if INLINE.get(k)))
        name = path
    _precision(out, precision, path)
    if precision not in (None, "no"):
        notes.append(f"accelerate config {path}: mixed_precision {precision} read as {precision}.enabled")
    json.dumps(out)  # plain data only
    return out, name, notes, [*quiet, *top_quiet]
