"""Configuration: where each kind of state lives, and how it is moved.

Frozen dataclasses, validated on construction: a wrong value or type raises :class:`ConfigError`
naming the field and the values it accepts. Sizes count *elements*, as in DeepSpeed, unless the
name ends in ``_bytes``. :meth:`ZeroConfig.from_deepspeed` reads DeepSpeed JSON configs.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable, Mapping

__all__ = ["ConfigError", "Offload", "AioConfig", "LossScaleConfig", "OptimizerConfig", "ZeroConfig", "INERT"]

DEVICES = ("none", "cpu", "nvme")
ALIGN_BYTES = 4096  # smallest chunk file: one direct-I/O block
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
OPTIMIZERS = ("adam", "adamw")


class ConfigError(ValueError):
    """A config value is missing, of the wrong type or out of range (``field`` at fault, if any)."""

    def __init__(self, message: str, *, field: str | None = None, detail: str | None = None):
        super().__init__(message)
        self.field, self.detail = field, (message if detail is None else detail)


class _Invalid(Exception):
    """Raised by a converter; its text names the accepted values."""


def _as_int(value: Any, minimum: int | None = None) -> int:
    """Returns ``value`` as an int; floats with an integral value (``1e9``) are accepted."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        raise _Invalid("an integer" + ("" if minimum is None else f" >= {minimum}"))
    return value


def _as_float(value: Any, test: Callable[[float], bool], accepted: str) -> float:
    """Returns ``value`` (an int or float, not a bool) as a finite float if ``test`` accepts it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not test(value):
        raise _Invalid(accepted)
    return float(value)


def _as_other(value: Any, test: Callable[[Any], bool], accepted: str) -> Any:
    """Returns ``value`` (a path-like as a str) if ``test`` accepts it."""
    value = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not test(value):
        raise _Invalid(accepted)
    return value


# (test, accepted values) pairs for _as_float and _as_other.
_NONNEG = (lambda v: v >= 0, "a number >= 0")
_POSITIVE = (lambda v: v > 0, "a number > 0")
_UNIT = (lambda v: 0 <= v < 1, "a number in [0, 1)")
_BOOL = (lambda v: isinstance(v, bool), "true or false")
_PATH = (lambda v: isinstance(v, str) and v != "", "a non-empty directory path (str or os.PathLike)")


def _as_names(value: Any) -> tuple[str, ...]:
    """Returns a non-empty list or tuple of non-empty strs (mesh axis names) as a tuple."""
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, str) and v for v in value):
        raise _Invalid("a non-empty tuple of mesh axis names (non-empty str)")
    return tuple(value)


def _choices(choices: tuple[str, ...]) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: isinstance(v, str) and v in choices), "one of " + ", ".join(map(repr, choices))


def _field(default: Any, convert: Callable[..., Any], *args: Any, optional: bool = False,
           ds: str | tuple[str, ...] = (), nested: type | None = None) -> Any:
    """A field checked by ``convert(value, *args)``, read from DeepSpeed key ``ds`` (or its aliases)."""
    return dataclasses.field(default=default, metadata={"check": (convert, args, optional), "ds": ds, "nested": nested})


def _nested(default: Any, cls: type, optional: bool = False) -> Any:
    """A field holding a ``cls`` instance (given as a dict of its fields to :meth:`ZeroConfig.from_dict`)."""
    return _field(default, _as_other, lambda v: isinstance(v, cls), f"a zinf_jax.{cls.__name__}", optional=optional,
                  nested=cls)


def _validate(obj: Any) -> None:
    """Checks every field of the frozen ``obj``, stores normalized values, else raises ConfigError."""
    for f in dataclasses.fields(obj):
        convert, args, optional = f.metadata["check"]
        value = getattr(obj, f.name)
        if optional and value is None:
            continue
        try:
            object.__setattr__(obj, f.name, convert(value, *args))
        except _Invalid as e:
            detail = f"expected {e}{' or None' if optional else ''}, got {value!r}"
            raise ConfigError(f"{type(obj).__name__}.{f.name}: {detail}", field=f.name, detail=detail) from None


@dataclasses.dataclass(frozen=True)
class Offload:
    """Where one kind of state lives, and the staging buffers that move it.

    ``device`` is the only positional field: ``Offload("nvme", path="/local_nvme")``.
    Mirrors DeepSpeed's ``offload_param`` / ``offload_optimizer`` sections.
    """

    device: str = _field("none", _as_other, *_choices(DEVICES), ds="device")
    """Tier of the state: ``"none"`` (accelerator memory), ``"cpu"`` (host RAM), ``"nvme"`` (files under ``path``)."""
    _: dataclasses.KW_ONLY
    path: str | None = _field(None, _as_other, *_PATH, optional=True, ds="nvme_path")
    """Directory of the NVMe tier (DeepSpeed ``nvme_path``); required when ``device="nvme"``, unused otherwise."""
    buffer_count: int = _field(5, _as_int, 1, ds="buffer_count")
    """Optimizer tier: sub-group buffer sets the streamed step reads into ahead and writes back from (bounds
    its host RAM: ``buffer_count`` x sub-group x 4 B x (master, states, gradient)). Param tier: no effect
    (reported)."""
    direct_io: bool = _field(False, _as_other, *_BOOL)
    """Bypass the page cache for NVMe reads and writes (measures and uses the disk, not RAM)."""

    def __post_init__(self) -> None:
        _validate(self)
        if self.device == "nvme" and self.path is None:
            detail = "required when device='nvme' (DeepSpeed: nvme_path): a directory on a local NVMe drive"
            raise ConfigError(f"Offload.path: {detail}", field="path", detail=detail)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AioConfig:
    """Asynchronous I/O settings of the NVMe tier (DeepSpeed's ``aio`` section)."""

    block_size: int | None = _field(None, _as_int, ALIGN_BYTES, optional=True, ds="block_size")
    """Bytes per chunk file of the NVMe tier: a shard larger than this is cut into chunk files written,
    synced and read as one request each, concurrently; ``None``: 16 MiB (DeepSpeed's default, 1 MiB, makes
    16x more files and measured slower here)."""
    intra_op_parallelism: int | None = _field(None, _as_int, 1, optional=True,
                                              ds=("intra_op_parallelism", "thread_count"))
    """Threads reading and (as many) writing chunk files of the NVMe tier at once (DeepSpeed's old name:
    ``thread_count``); ``None``: 4."""

    __post_init__ = _validate


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossScaleConfig:
    """Loss scaling for float16 compute, with DeepSpeed's fp16 rules.

    An overflowing step is skipped; once ``hysteresis`` overflows are absorbed the dynamic
    scale halves (not below ``min_scale``); after ``window`` clean steps it doubles.
    """

    enabled: bool | None = _field(None, _as_other, *_BOOL, optional=True)
    """Scale the loss (and unscale the gradients) at all; ``None``: on exactly when the compute dtype is float16."""
    static_scale: float = _field(0.0, _as_float, *_NONNEG, ds="loss_scale")
    """A fixed scale; ``0`` selects dynamic scaling."""
    initial_scale_power: int = _field(16, _as_int, 0, ds="initial_scale_power")
    """The dynamic scale starts at ``2**initial_scale_power``."""
    window: int = _field(1000, _as_int, 1, ds="loss_scale_window")
    """Clean steps after which the dynamic scale doubles."""
    hysteresis: int = _field(2, _as_int, 1, ds="hysteresis")
    """Overflows tolerated before the scale is halved."""
    min_scale: float = _field(1.0, _as_float, *_POSITIVE, ds="min_loss_scale")
    """The dynamic scale never drops below this."""
    consecutive_hysteresis: bool = _field(False, _as_other, *_BOOL, ds="consecutive_hysteresis")
    """Refill the hysteresis budget after every clean step (not only after a window)."""

    __post_init__ = _validate


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Adam hyper-parameters, as read from a DeepSpeed ``optimizer`` section."""

    name: str = _field("adamw", _as_other, *_choices(OPTIMIZERS))
    """``"adamw"``: decoupled weight decay; ``"adam"``: weight decay added to the gradient (L2)."""
    lr: float = _field(1e-3, _as_float, *_NONNEG, ds="lr")
    """Learning rate."""
    b1: float = _field(0.9, _as_float, *_UNIT)
    """Decay rate of the first moment."""
    b2: float = _field(0.999, _as_float, *_UNIT)
    """Decay rate of the second moment."""
    eps: float = _field(1e-8, _as_float, *_NONNEG, ds="eps")
    """Added to the denominator for numerical stability."""
    weight_decay: float = _field(0.0, _as_float, *_NONNEG, ds="weight_decay")
    """Weight decay coefficient."""

    __post_init__ = _validate


INERT = ("offload_param.buffer_count",)
"""Settings accepted (and validated) that have no effect: a value other than the default is reported by
:meth:`ZeroConfig.inert_settings` and warned at ``initialize``. (DeepSpeed keys with no counterpart at all,
e.g. ``pin_memory``, ``max_in_cpu``, ``aio.queue_depth``, are listed as unused by ``from_deepspeed``.)"""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """ZeRO stage 3 / ZeRO-Infinity: every parameter sharded, state staged in tiers."""

    offload_param: Offload = _nested(Offload("none"), Offload)
    """Tier of the compute-dtype parameter shards between uses."""
    offload_optimizer: Offload = _nested(Offload("cpu"), Offload)
    """Tier of the fp32 master params and optimizer states; ``"none"``: in device memory (sharded like the
    params; the update still streams through host buffers on the CPU)."""
    prefetch_depth: int = _field(2, _as_int, 0)
    """Units fetched ahead of the one computing (``0``: no prefetch)."""
    max_live_bytes: int | None = _field(None, _as_int, 1, optional=True)
    """Device bytes of gathered parameters alive at once; ``None``: unbounded."""
    persistence_threshold: int = _field(100_000, _as_int, 0, ds="stage3_param_persistence_threshold")
    """Parameters with at most this many elements stay gathered on device."""
    compute_dtype: str | None = _field(None, _as_other, *_choices(COMPUTE_DTYPES), optional=True)
    """``"float32"``, ``"bfloat16"`` or ``"float16"``; ``None``: float32 on CPU, bfloat16 on GPU/TPU."""
    sub_group_size: int = _field(1_000_000_000, _as_int, 1, ds="sub_group_size")
    """Elements per optimizer sub-group, the unit the streamed optimizer step reads, updates and writes."""
    offload_activations: bool = _field(False, _as_other, *_BOOL)
    """Keep the activation checkpoints at unit boundaries (or, without checkpointing, the saved
    activations) in pinned host memory."""
    activation_checkpointing: bool = _field(True, _as_other, *_BOOL)
    """Keep only each unit's inputs and recompute its forward in the backward (least device memory).
    ``False``: keep every activation the backward needs, as plain ``jax.grad`` and DeepSpeed without
    activation checkpointing do (no recompute, no backward fetch: faster, more device memory); the
    gathered parameters are still never kept."""
    max_in_flight_bytes: int = _field(1 << 30, _as_int, 1)
    """Bytes of tier reads and writes in flight at once (back-pressure bound)."""
    nvme_update: str = _field("in_place", _as_other, *_choices(("in_place", "double_slot")))
    """How nvme tiers apply a step: ``"in_place"`` (one copy on disk; a step interrupted by a crash
    leaves the tier half-updated, refused on reopening and rebuilt from the newest checkpoint) or
    ``"double_slot"`` (every step durable on disk, at twice the disk)."""
    aio: AioConfig = _nested(AioConfig(), AioConfig)
    """Asynchronous I/O settings of the NVMe tier."""
    gradient_clipping: float = _field(0.0, _as_float, *_NONNEG)
    """Clip gradients to this global norm, whatever the optimizer (``0``: no clipping); an optimizer
    that clips at another norm is an error."""
    gradient_accumulation_steps: int = _field(1, _as_int, 1)
    """Micro-batches per optimizer step: ``train_step`` splits the batch's leading axis into this many
    equal parts and sums their gradients (each scaled by 1/k) before one optimizer step."""
    loss_scale: LossScaleConfig = _nested(LossScaleConfig(), LossScaleConfig)
    """Loss scaling (used with float16 compute)."""
    optimizer: OptimizerConfig | None = _nested(None, OptimizerConfig, optional=True)
    """Optimizer read from a DeepSpeed config; ``None``: the one given to ``initialize``."""
    seed: int = _field(0, _as_int)
    """Seed of the parameter initialisation."""
    zero_axes: tuple[str, ...] | None = _field(None, _as_names, optional=True)
    """Mesh axes parameters are sharded over (shard count: the product of their sizes), replicated over
    the others; ``None``: every axis not named ``data`` or ``tensor`` (``fsdp`` with ``make_mesh``)."""

    __post_init__ = _validate

    def resolved_compute_dtype(self, platform: str) -> str:
        """Returns ``compute_dtype``, or if None ``"float32"`` on CPU and ``"bfloat16"`` elsewhere.

        Args:
          platform: ``jax.devices()[0].platform``: ``"cpu"``, ``"gpu"``, ``"tpu"``...
        """
        return self.compute_dtype or ("float32" if platform.lower() == "cpu" else "bfloat16")

    def inert_settings(self) -> list[str]:
        """``"field=value"`` for every setting in :data:`INERT` that differs from its default (it has no effect)."""
        out = []
        for dotted in INERT:
            obj, name = self, dotted
            if "." in dotted:
                section, name = dotted.split(".")
                obj = getattr(self, section)
            default = next(f.default for f in dataclasses.fields(obj) if f.name == name)
            if getattr(obj, name) != default:
                out.append(f"{dotted}={getattr(obj, name)!r}")
        return out

    def to_dict(self) -> dict[str, Any]:
        """Returns the config as nested plain dicts of JSON values (see :meth:`from_dict`)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ZeroConfig:
        """Builds a config from :meth:`to_dict` output; missing keys take their defaults.

        Raises:
          ConfigError: on an unknown key (named with its dotted path) or a bad value.
        """
        return _from_dict(cls, d, "")

    @classmethod
    def from_deepspeed(cls, path_or_dict: str | os.PathLike[str] | Mapping[str, Any]) -> ZeroConfig:
        """Reads a DeepSpeed JSON config (ZeRO stage 3 / ZeRO-Infinity keys).

        ``stage3_max_live_parameters`` (elements) becomes ``max_live_bytes`` (x bytes of
        the compute dtype). A section left out means what it means in DeepSpeed (no
        ``offload_optimizer``: optimizer state on device); ``"auto"``/``null``: the zinf
        default. ``"Adam"`` is AdamW unless ``params.adam_w_mode`` is false, as in
        DeepSpeed. Keys not used, and ``"auto"`` ones, are listed in one ``UserWarning``.

        Args:
          path_or_dict: a path to the JSON file, or the parsed dict (not modified).

        Raises:
          ConfigError: file missing or not JSON, ZeRO stage other than 3, or a bad
            value (the message names its dotted key and the accepted values).
        """
        from zinf_jax.deepspeed import parse_deepspeed

        return parse_deepspeed(path_or_dict)


def _from_dict(cls: type, d: Any, prefix: str) -> Any:
    """Builds ``cls`` from dict ``d``, recursing into its nested config fields."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or cls.__name__}: expected a dict, got {d!r}")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [str(k) for k in d if k not in names]
    if unknown:
        raise ConfigError(f"unknown config key(s) {', '.join(prefix + k for k in unknown)}; "
                          f"accepted keys{' of ' + prefix.rstrip('.') if prefix else ''}: {', '.join(names)}")
    nested = {f.name: f.metadata["nested"] for f in dataclasses.fields(cls) if f.metadata["nested"]}
    kwargs = {k: _from_dict(nested[k], v, f"{prefix}{k}.") if k in nested and v is not None else v
              for k, v in d.items()}
    try:
        return cls(**kwargs)
    except ConfigError as e:
        if not prefix or e.field is None or e.field.startswith(prefix):
            raise
        key = prefix + e.field  # name the key as the file spells it: offload_param.device
        raise ConfigError(f"{key}: {e.detail}", field=key, detail=e.detail) from None
