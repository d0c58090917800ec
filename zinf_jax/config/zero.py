"""Configuration: where each kind of state lives, and how it is moved.

Frozen dataclasses, validated on construction: a wrong value or type raises :class:`ConfigError`
naming the field and the values it accepts. Sizes count *elements*, as in DeepSpeed, unless the
name ends in ``_bytes``. :meth:`ZeroConfig.from_deepspeed` reads DeepSpeed JSON configs.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from zinf_jax.config.deepspeed import RunValues, resolve_deepspeed
from zinf_jax.config.schedule import LRSchedule
from zinf_jax.config.fields import (OPTIMIZERS, BOOL, NONNEG, PATH, POSITIVE, UNIT, as_bytes, as_float, as_int, as_names,
                                     as_other,
                                     as_patterns,
                                     one_of, checked, build_from_dict, nested_field, validate)
from zinf_jax.errors import ConfigError

__all__ = ["ConfigError", "Offload", "AioConfig", "LossScaleConfig", "OptimizerConfig", "ZeroConfig", "INERT",
           "NVME_CHUNK_BYTES", "NVME_UPDATE"]

DEVICES = ("none", "cpu", "nvme")
ALIGN_BYTES = 4096  # smallest chunk file: one direct-I/O block
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
ENGINES = ("auto", "compiled", "streamed")
MOMENTS_DTYPES = ("float32", "bfloat16")
NVME_CHUNK_BYTES = 16 << 20
"""The NVMe tier's chunk file size when ``aio.block_size`` is None: the one default the tier
(:class:`~zinf_jax.tiers.nvme.NvmeTier`), the engine and the estimator read (:attr:`AioConfig.chunk_bytes`)."""
NVME_UPDATE = "in_place"
"""How an nvme tier applies a step unless told otherwise: the default of ``ZeroConfig.nvme_update`` and of
:class:`~zinf_jax.tiers.nvme.NvmeTier`, counted by the estimator through the placement."""
ACTIVATION_PLACES = (lambda v: isinstance(v, bool) or (isinstance(v, str) and v in ("cpu", "nvme")),
                     "false (device memory), true or 'cpu' (host memory), or 'nvme'")


@dataclasses.dataclass(frozen=True)
class Offload:
    """Where one kind of state lives, and the staging buffers that move it.

    ``device`` is the only positional field: ``Offload("nvme", path="/local_nvme")``.
    Mirrors DeepSpeed's ``offload_param`` / ``offload_optimizer`` sections.
    """

    device: str = checked("none", as_other, *one_of(DEVICES))
    """Tier of the state: ``"none"`` (accelerator memory), ``"cpu"`` (host RAM), ``"nvme"`` (files under ``path``)."""
    _: dataclasses.KW_ONLY
    path: str | None = checked(None, as_other, *PATH, optional=True)
    """Directory of the NVMe tier (DeepSpeed ``nvme_path``); required when ``device="nvme"``, unused otherwise."""
    buffer_count: int = checked(5, as_int, 1)
    """Optimizer tier: sub-group buffer sets the streamed step reads into ahead and writes back from (bounds
    its host RAM: ``buffer_count`` x sub-group x 4 B x (master, states, gradient)). With float32 state in
    host RAM (``"cpu"``) the step updates the tier's own arrays and needs sets only for the parameters a
    whole-tensor optax rule updates. Param tier: no effect (reported)."""
    direct_io: bool = checked(False, as_other, *BOOL)
    """Bypass the page cache for NVMe reads and writes (measures and uses the disk, not RAM)."""

    def __post_init__(self) -> None:
        validate(self)
        if self.device == "nvme" and self.path is None:
            detail = "required when device='nvme' (DeepSpeed: nvme_path): a directory on a local NVMe drive"
            raise ConfigError(f"Offload.path: {detail}", field="path", detail=detail)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AioConfig:
    """Asynchronous I/O settings of the NVMe tier (DeepSpeed's ``aio`` section)."""

    block_size: int | None = checked(None, as_int, ALIGN_BYTES, optional=True)
    """Bytes per chunk file of the NVMe tier: a shard larger than this is cut into chunk files written,
    synced and read as one request each, concurrently; ``None``: 16 MiB (DeepSpeed's default, 1 MiB, makes
    16x more files and measured slower here)."""
    intra_op_parallelism: int | None = checked(None, as_int, 1, optional=True)
    """Threads reading and (as many) writing chunk files of the NVMe tier at once (DeepSpeed's old name:
    ``thread_count``); ``None``: 4."""

    __post_init__ = validate

    @property
    def chunk_bytes(self) -> int:
        """``block_size``, or :data:`NVME_CHUNK_BYTES` when None: the chunk size the tier writes and the estimator
        counts."""
        return NVME_CHUNK_BYTES if self.block_size is None else self.block_size


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossScaleConfig:
    """Loss scaling for float16 compute, with DeepSpeed's fp16 rules.

    An overflowing step is skipped; once ``hysteresis`` overflows are absorbed the dynamic
    scale halves (not below ``min_scale``); after ``window`` clean steps it doubles.
    """

    enabled: bool | None = checked(None, as_other, *BOOL, optional=True)
    """Scale the loss (and unscale the gradients) at all; ``None``: on exactly when the compute dtype is float16."""
    static_scale: float = checked(0.0, as_float, *NONNEG)
    """A fixed scale; ``0`` selects dynamic scaling."""
    initial_scale_power: int = checked(16, as_int, 0)
    """The dynamic scale starts at ``2**initial_scale_power``."""
    window: int = checked(1000, as_int, 1)
    """Clean steps after which the dynamic scale doubles."""
    hysteresis: int = checked(2, as_int, 1)
    """Overflows tolerated before the scale is halved."""
    min_scale: float = checked(1.0, as_float, *POSITIVE)
    """The dynamic scale never drops below this."""
    consecutive_hysteresis: bool = checked(False, as_other, *BOOL)
    """Refill the hysteresis budget after every clean step (not only after a window)."""

    __post_init__ = validate


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Adam hyper-parameters, as read from a DeepSpeed ``optimizer`` section."""

    name: str = checked("adamw", as_other, *one_of(OPTIMIZERS))
    """``"adamw"``: decoupled weight decay; ``"adam"``: weight decay added to the gradient (L2)."""
    lr: float = checked(1e-3, as_float, *NONNEG)
    """Learning rate."""
    b1: float = checked(0.9, as_float, *UNIT)
    """Decay rate of the first moment."""
    b2: float = checked(0.999, as_float, *UNIT)
    """Decay rate of the second moment."""
    eps: float = checked(1e-8, as_float, *NONNEG)
    """Added to the denominator for numerical stability."""
    weight_decay: float = checked(0.0, as_float, *NONNEG)
    """Weight decay coefficient."""
    schedule: LRSchedule | None = nested_field(None, LRSchedule, optional=True)
    """A DeepSpeed ``scheduler`` the learning rate follows (``lr`` is then its peak); ``None``: constant ``lr``."""

    __post_init__ = validate

    def learning_rate(self) -> Any:
        """``lr``, or the schedule (an optax schedule: update count -> learning rate)."""
        return self.lr if self.schedule is None else self.schedule


INERT = ("offload_param.buffer_count",)
"""Settings accepted (and validated) that have no effect: a value other than the default is reported by
:meth:`ZeroConfig.inert_settings` and warned at ``initialize``. (DeepSpeed keys with no counterpart at all,
e.g. ``pin_memory``, ``max_in_cpu``, ``aio.queue_depth``, are listed as unused by ``from_deepspeed``.)"""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """ZeRO stage 3 / ZeRO-Infinity: every parameter sharded, state staged in tiers."""

    offload_param: Offload = nested_field(Offload("none"), Offload)
    """Tier of the compute-dtype parameter shards between uses."""
    engine: str = checked("auto", as_other, *one_of(ENGINES))
    """How a step runs. ``"compiled"``: forward and backward are one XLA program per batch signature, the
    parameters' shards staged into device memory and gathered inside it (needs ``offload_param`` ``"none"``
    or ``"cpu"``). ``"streamed"``: an eager interpreter fetches each unit's parameters from its tier between
    unit programs (any tier; the only one for ``"nvme"`` params). ``"auto"``: compiled where it can run,
    else streamed (``engine.mode`` says which)."""
    offload_optimizer: Offload = nested_field(Offload("cpu"), Offload)
    """Tier of the fp32 master params and optimizer states; ``"none"``: in device memory (sharded like the
    params; the update still streams through host buffers on the CPU)."""
    optimizer_update: str = checked("host", as_other, *one_of(("host", "device")))
    """Where the update of optimizer state kept on ``"cpu"`` or ``"nvme"`` runs. ``"host"``: the streamed CPU
    step, sub-group by sub-group. ``"device"``: each step the state moves from its tier to the devices, the
    compiled step's own program updates it (zinf's Adam or any optax transform, as with state in device
    memory), and the new state goes back to its tier (MaxText's ``optimizer_memory_host_offload``): state
    parked off the devices between steps, the update at device speed, device memory holding the whole state
    during the step. Needs what the in-program update needs (the compiled engine, params in device memory,
    no gradient accumulation or fp16 loss scaling, a shard within ``sub_group_size``): else a
    ConfigError at ``initialize`` naming what is missing. With the state in device memory
    (``offload_optimizer="none"``) the update runs in the program wherever it can, as ``"device"`` says."""
    prefetch_depth: int = checked(2, as_int, 0)
    """Units fetched ahead of the one computing (``0``: no prefetch)."""
    max_live_bytes: int | None = checked(None, as_int, 1, optional=True)
    """Device bytes of gathered parameters alive at once; ``None``: unbounded."""
    persistence_threshold: int = checked(100_000, as_int, 0)
    """Parameters with at most this many elements are never sharded: each is kept whole (DeepSpeed's persistent
    parameters). With ``offload_param="none"`` they stay on every device; on an offload tier they are stored whole
    there and put on every device each time their unit (or, outside every unit, the step) fetches them; a unit
    holding only such parameters is fetched once a training pass, and held from its forward to its backward."""
    persistent_params: tuple[str, ...] = checked((), as_patterns)
    """Regular expressions (``re.fullmatch`` on the ``/``-joined path, e.g. ``"embed/embedding"``) of parameters
    kept gathered on every device whatever their size, like DeepSpeed's per-module ``ds_persist``: never
    sharded and never part of a unit (a unit whose every parameter matches is not a unit; one that holds
    both kinds is an error naming it)."""
    compute_dtype: str | None = checked(None, as_other, *one_of(COMPUTE_DTYPES), optional=True)
    """``"float32"``, ``"bfloat16"`` or ``"float16"``; ``None``: float32 on CPU, bfloat16 on GPU/TPU."""
    moments_dtype: str = checked("float32", as_other, *one_of(MOMENTS_DTYPES))
    """Storage dtype of the optimizer's per-element states (Adam's m and v; an optax rule's moments):
    ``"bfloat16"`` halves their bytes on disk and in every step's reads and writes (12 B/param of state
    instead of 16 with the scratch gradients). The arithmetic stays float32 and the fp32 master is never
    rounded; the stored moments are rounded to nearest even (DeepSpeed: ``bf16.bf16_optimizer_states``)."""
    sub_group_size: int = checked(1_000_000_000, as_int, 1)
    """Elements per optimizer sub-group, the unit the streamed optimizer step reads, updates and writes."""
    offload_activations: bool | str = checked(False, as_other, *ACTIVATION_PLACES)
    """Where the streamed engine keeps the activations it saves for the backward (the checkpoints at unit
    boundaries, or without checkpointing everything a backward needs), which grow with depth:
    ``False``: device memory; ``True`` or ``"cpu"``: pinned host memory (DeepSpeed:
    ``activation_checkpointing.cpu_checkpointing``); ``"nvme"``: files under the NVMe tier's path (the
    params' when they are on nvme, else the optimizer's), written during the forward and read back one
    unit ahead in the backward, so neither device nor host memory grows with depth."""
    activation_checkpointing: bool = checked(True, as_other, *BOOL)
    """Keep only each unit's inputs and recompute its forward in the backward (least device memory).
    ``False``: keep every activation the backward needs, as plain ``jax.grad`` and DeepSpeed without
    activation checkpointing do (no recompute, no backward fetch: faster, more device memory); the
    gathered parameters are still never kept."""
    max_in_flight_bytes: int = checked(1 << 30, as_int, 1)
    """Bytes of tier reads and writes in flight at once (back-pressure bound); with ``optimizer_update="device"``
    and the state on a host tier, also the bytes per device of optimizer states the step's program moves into
    device memory ahead of their update (see [Note: states moved in the program])."""
    host_memory_limit: int | None = checked(None, as_bytes, 1 << 20, optional=True)
    """Host RAM this process may use, in bytes (or a str: ``"8GiB"``, ``"16GB"``); ``None``: no budget. The engine
    plans every host buffer it owns from it (:mod:`zinf_jax.plan.host_memory`: nvme read staging and prefetch
    depth, the optimizer's buffer sets, gradient shards held in RAM, the trim slack), counting the process's own
    resident memory (JAX, XLA, Python) as measured when it starts, and starts only if the plan fits: else a
    :class:`ConfigError`, before anything is written, naming the smallest limit that fits and the settings that
    would lower it. What is left of the limit is the step's working set (on a CPU mesh, the activations).
    ``zinf-jax estimate --host-memory-limit`` reports the same plan."""
    nvme_update: str = checked(NVME_UPDATE, as_other, *one_of(("in_place", "double_slot")))
    """How nvme tiers apply a step: ``"in_place"`` (one copy on disk; a step interrupted by a crash
    leaves the tier half-updated, refused on reopening and rebuilt from the newest checkpoint) or
    ``"double_slot"`` (every step durable on disk, at twice the disk)."""
    aio: AioConfig = nested_field(AioConfig(), AioConfig)
    """Asynchronous I/O settings of the NVMe tier."""
    gradient_clipping: float = checked(0.0, as_float, *NONNEG)
    """Clip gradients to this global norm, whatever the optimizer (``0``: no clipping); an optimizer
    that clips at another norm is an error."""
    gradient_accumulation_steps: int = checked(1, as_int, 1)
    """Micro-batches per optimizer step: ``train_step`` splits the batch's leading axis into this many
    equal parts and sums their gradients (each scaled by 1/k) before one optimizer step."""
    loss_scale: LossScaleConfig = nested_field(LossScaleConfig(), LossScaleConfig)
    """Loss scaling (used with float16 compute)."""
    optimizer: OptimizerConfig | None = nested_field(None, OptimizerConfig, optional=True)
    """Optimizer read from a DeepSpeed config; ``None``: the one given to ``initialize``."""
    seed: int = checked(0, as_int)
    """Seed of the parameter initialisation."""
    zero_axes: tuple[str, ...] | None = checked(None, as_names, optional=True)
    """Mesh axes parameters are sharded over (shard count: the product of their sizes), replicated over
    the others; ``None``: every axis not named ``data`` or ``tensor`` (``fsdp`` with ``make_mesh``)."""

    def __post_init__(self) -> None:
        validate(self)
        if self.offload_activations == "nvme" and "nvme" not in (self.offload_param.device,
                                                                 self.offload_optimizer.device):
            detail = ("'nvme' writes activations under an NVMe tier's path, and neither offload_param nor "
                      "offload_optimizer is on nvme: give one Offload('nvme', path=...), or use True (host memory)")
            raise ConfigError(f"ZeroConfig.offload_activations: {detail}", field="offload_activations", detail=detail)
        if self.engine == "compiled" and (why := self.why_not_compiled()):
            detail = f"the compiled engine cannot run with {why}; use engine='auto' (it picks the streamed one) or 'streamed'"
            raise ConfigError(f"ZeroConfig.engine: {detail}", field="engine", detail=detail)

    def why_not_compiled(self, param_device: str | None = None) -> str | None:
        """What keeps the compiled engine from running these settings (``None``: nothing).

        Args:
          param_device: another param tier than ``offload_param.device`` (the estimator's configurations).
        """
        if (param_device or self.offload_param.device) == "nvme":
            return "offload_param='nvme' (parameters are fetched from disk between unit programs)"
        if self.offload_activations:
            return (f"offload_activations={self.offload_activations!r} (the streamed engine parks unit inputs "
                    "in host memory or on disk)")
        return None

    def resolved_engine(self, param_device: str | None = None) -> str:
        """``"compiled"`` or ``"streamed"``: the engine these settings run (``engine="auto"`` resolved)."""
        if self.engine == "streamed" or self.why_not_compiled(param_device):
            return "streamed"
        return "compiled"


    @property
    def moment_bytes(self) -> int:
        """Bytes of one stored moment element (``moments_dtype``)."""
        return 2 if self.moments_dtype == "bfloat16" else 4

    @property
    def state_bytes(self) -> int:
        """Optimizer state bytes per trained element: the float32 master and Adam's two moments."""
        return 4 + 2 * self.moment_bytes

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
        return build_from_dict(cls, d, "")

    @classmethod
    def from_deepspeed(cls, path_or_dict: str | os.PathLike[str] | Mapping[str, Any], *, explain: bool = False,
                       **run: Any) -> ZeroConfig:
        """Reads a DeepSpeed JSON config (ZeRO stage 3 / ZeRO-Infinity keys), or an accelerate YAML one.

        ``"auto"`` values are filled as the Hugging Face integration fills them, from ``run`` (the
        fields of :class:`~zinf_jax.config.RunValues`: ``hidden_size``, ``lr``, ``clip``,
        ``weight_decay``, ``betas``, ``eps``, ``compute_dtype``, ``batch``, ``micro_batch``,
        ``gradient_accumulation_steps``, ``total_steps``, ``warmup_steps``); one that nothing fills is
        refused. ``stage3_max_live_parameters`` (elements) becomes ``max_live_bytes`` (x bytes of the
        compute dtype). A section left out means what it means in DeepSpeed (no ``offload_optimizer``:
        optimizer state on device). ``"Adam"`` is AdamW unless ``params.adam_w_mode`` is false, as in
        DeepSpeed; a ``WarmupLR``/``WarmupDecayLR``/``WarmupCosineLR`` scheduler becomes
        ``optimizer.schedule``. Keys not used are listed in one ``UserWarning``, one line per kind (no
        counterpart / changes training, not supported / unknown). See :meth:`resolve_deepspeed` for
        where each setting came from.

        Args:
          path_or_dict: a path to the JSON (or ``.yaml`` accelerate) file, or the parsed dict (not modified).
          explain: also print the resolution table (:meth:`resolve_deepspeed`) to stdout.
          **run: the run's values that fill ``"auto"`` (see above).

        Raises:
          ConfigError: file missing or not JSON/YAML, ZeRO stage other than 3, a bad value, or an
            ``"auto"`` nothing fills (the message names its dotted key and what to give).
        """
        res = cls.resolve_deepspeed(path_or_dict, **run)
        if res.batch_keys:  # the API's batch is the one train_step is given (zinf-jax train reads the file's)
            res.no_effect = sorted([*res.no_effect, *res.batch_keys])
            res.rows = [r for r in res.rows if r.name != "batch"]
        if explain:
            print(res)
        lines = res.unused_lines()
        if res.schedule is not None and res.config.optimizer is None:
            lines.insert(0, "changes training, not supported here: scheduler (no optimizer section carries it; "
                            "pass resolve_deepspeed(...).schedule to your optimizer as its learning rate)")
        if lines:
            import warnings

            warnings.warn(f"DeepSpeed config {res.file}:\n" + "\n".join(lines), UserWarning, stacklevel=2)
        return res.config

    @classmethod
    def resolve_deepspeed(cls, path_or_dict: str | os.PathLike[str] | Mapping[str, Any], **run: Any) -> Any:
        """Like :meth:`from_deepspeed`, but returns the :class:`~zinf_jax.config.Resolution` (warns nothing).

        ``str()`` of it is the table: each setting that matters with its value and source (the file,
        ``"auto"`` filled from what, or DeepSpeed's default), then the unused keys by kind; ``.config``
        is the :class:`ZeroConfig`; ``.schedule`` the learning-rate schedule the file asks for.
        """
        try:
            values = RunValues(**run)
        except TypeError as e:
            raise TypeError(f"{e}; the run's values are the fields of zinf_jax.config.RunValues") from None
        return resolve_deepspeed(path_or_dict, cls, values)
