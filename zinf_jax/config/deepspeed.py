"""Reading DeepSpeed JSON configs into :class:`~zinf_jax.config.ZeroConfig`.

Each section is read key by key (:class:`_Section` remembers the keys it used), so
the keys zinf_jax does not use, the ``"auto"`` ones and the ones it reads but that
have no effect yet are listed in one ``UserWarning``; a bad value names its dotted
key. ``zero_optimization.stage`` must be 3.
"""
from __future__ import annotations

import dataclasses
import json
import os
import warnings
from typing import Any, Callable, Mapping

from zinf_jax.config.fields import BOOL, NONNEG, OPTIMIZERS, Invalid, as_float, as_int, as_other
from zinf_jax.errors import ConfigError

__all__ = ["parse_deepspeed"]


_ABSENT: Any = object()
_DS_OPTIMIZER = (lambda v: isinstance(v, str) and v.lower() in OPTIMIZERS, "'Adam' or 'AdamW' (any case)")
_BETAS = (lambda v: isinstance(v, (list, tuple)) and len(v) == 2
          and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in v),
          "a list [b1, b2] of two numbers in [0, 1)")


class _Section:
    """One JSON object of a DeepSpeed config, read key by key; remembers the keys it used."""

    def __init__(self, data: Mapping[str, Any], prefix: str, sections: list[_Section], auto: list[str]):
        self.data, self.prefix, self.sections, self.auto = data, prefix, sections, auto
        self.used: set[str] = set()
        sections.append(self)

    def key(self, names: str | tuple[str, ...]) -> str:
        """Returns the dotted key of the first of ``names`` present (of the first one if none is)."""
        names = (names,) if isinstance(names, str) else names
        return self.prefix + next((n for n in names if n in self.data), names[0])

    def get(self, names: str | tuple[str, ...], convert: Callable[..., Any] | None = None, *args: Any,
            default: Any = _ABSENT) -> Any:
        """Returns the value of ``names`` through ``convert``; ``default`` if absent, null or ``"auto"``."""
        key = self.key(names)
        name = key[len(self.prefix):]
        if (value := self.data.get(name, _ABSENT)) is _ABSENT:
            return default
        self.used.add(name)
        if isinstance(value, str) and value == "auto":
            self.auto.append(key)
            return default
        if value is None or convert is None:
            return default if value is None else value
        try:
            return convert(value, *args)
        except Invalid as e:
            raise ConfigError(f"{key}: expected {e}, got {value!r}") from None

    def section(self, name: str) -> _Section:
        """Returns the sub-object ``name`` (empty when absent or null)."""
        value = self.get(name, default={})
        if not isinstance(value, Mapping):
            raise ConfigError(f"{self.prefix}{name}: expected a JSON object, got {value!r}")
        return _Section(value, f"{self.prefix}{name}.", self.sections, self.auto)

    def build(self, cls: type, **fixed: Any) -> Any:
        """Builds ``cls`` from ``fixed`` and the DeepSpeed keys of its fields; errors name those keys."""
        fields = {f.name: f.metadata["ds"] for f in dataclasses.fields(cls) if f.metadata["ds"]}
        kwargs = dict(fixed)
        for field, names in fields.items():
            if (value := self.get(names)) is not _ABSENT:
                kwargs[field] = value
        try:
            return cls(**kwargs)
        except ConfigError as e:
            if e.field not in fields:
                raise
            raise ConfigError(f"{self.key(fields[e.field])}: {e.detail}", field=e.field, detail=e.detail) from None


def _sections(config_cls: type) -> dict[str, type]:
    """The config class of each nested section of ``config_cls`` (``offload_param`` -> ``Offload``...)."""
    return {f.name: f.metadata["nested"] for f in dataclasses.fields(config_cls) if f.metadata["nested"]}


def parse_deepspeed(path_or_dict: Any, config_cls: type) -> Any:
    """Implements :meth:`zinf_jax.ZeroConfig.from_deepspeed` (see there).

    Args:
      path_or_dict: a path to the JSON file, or the parsed dict.
      config_cls: the class to build (``ZeroConfig``); its nested sections' classes come from its fields,
        so this module needs nothing of :mod:`zinf_jax.config.zero` (which imports it).
    """
    section_cls = _sections(config_cls)
    Offload, AioConfig = section_cls["offload_param"], section_cls["aio"]
    LossScaleConfig, OptimizerConfig = section_cls["loss_scale"], section_cls["optimizer"]
    data, source = path_or_dict, "(dict)"
    if not isinstance(data, Mapping):
        source = os.fspath(path_or_dict)
        try:
            with open(source, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"DeepSpeed config file not found: {source}") from None
        except (OSError, ValueError) as e:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise ConfigError(f"cannot read DeepSpeed config {source} (invalid JSON?): {e}") from None
        if not isinstance(data, Mapping):
            raise ConfigError(f"DeepSpeed config {source}: expected a JSON object at the top, got {data!r:.40}")
    top = _Section(data, "", sections=[], auto=[])
    zero = top.section("zero_optimization")
    if (stage := zero.get("stage", as_int, default=None)) != 3:
        got = "no stage" if stage is None else stage
        raise ConfigError("zero_optimization.stage: zinf_jax implements ZeRO stage 3 / ZeRO-Infinity only "
                          f'(accepted value: 3), got {got}; set "zero_optimization": {{"stage": 3}}')
    bf16 = top.section("bfloat16" if "bfloat16" in data and "bf16" not in data else "bf16")
    fp16 = top.section("fp16")
    use_bf16 = bf16.get("enabled", as_other, *BOOL, default=False)
    use_fp16 = fp16.get("enabled", as_other, *BOOL, default=False)
    if use_bf16 and use_fp16:
        raise ConfigError(f"{bf16.prefix}enabled, fp16.enabled: accepted values: at most one of them true, got both")
    was_auto = f"{bf16.prefix}enabled" in top.auto or "fp16.enabled" in top.auto  # then let the platform decide
    dtype = "bfloat16" if use_bf16 else "float16" if use_fp16 else None if was_auto else "float32"
    bf16_states = bf16.get("bf16_optimizer_states", as_other, *BOOL, default=False)
    optimizer = None
    if (opt := top.section("optimizer")).data:
        if (kind := opt.get("type", as_other, *_DS_OPTIMIZER, default=None)) is None:
            raise ConfigError("optimizer.type: missing; accepted values: 'Adam', 'AdamW'")
        params = opt.section("params")
        adam_w = params.get("adam_w_mode", as_other, *BOOL, default=True)  # DeepSpeed: "Adam" is AdamW by default
        b1, b2 = params.get("betas", as_other, *_BETAS, default=(OptimizerConfig.b1, OptimizerConfig.b2))
        name = "adamw" if kind.lower() == "adamw" or adam_w else "adam"
        optimizer = params.build(OptimizerConfig, name=name, b1=b1, b2=b2)
    max_live = zero.get("stage3_max_live_parameters", as_int, 1, default=None)
    cpu_checkpointing = top.section("activation_checkpointing").get("cpu_checkpointing", as_other, *BOOL,
                                                                    default=False)
    config = zero.build(
        config_cls, offload_param=zero.section("offload_param").build(Offload),
        offload_optimizer=zero.section("offload_optimizer").build(Offload, buffer_count=4),  # DeepSpeed's default
        aio=top.section("aio").build(AioConfig),
        max_live_bytes=None if max_live is None else max_live * (2 if dtype in ("bfloat16", "float16") else 4),
        compute_dtype=dtype, loss_scale=fp16.build(LossScaleConfig, enabled=use_fp16 or None),
        optimizer=optimizer, gradient_clipping=top.get("gradient_clipping", as_float, *NONNEG, default=0.0),
        gradient_accumulation_steps=top.get("gradient_accumulation_steps", as_int, 1, default=1),
        moments_dtype="bfloat16" if bf16_states else "float32", offload_activations=cpu_checkpointing)
    unused = sorted(f"{s.prefix}{k}" for s in top.sections for k in s.data if k not in s.used)
    notes = [f"{what}: {', '.join(keys)}" for what, keys in [("keys not used by zinf_jax", unused),
             ("'auto' replaced by the zinf_jax default", sorted(top.auto))] if keys]
    if notes:
        warnings.warn(f"DeepSpeed config {source}: " + "; ".join(notes), UserWarning, stacklevel=3)
    return config
