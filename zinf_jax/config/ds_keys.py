"""Every DeepSpeed config key zinf_jax knows: one table, read by the importer and by the docs.

:data:`KEYS` maps each DeepSpeed key (dotted, as DeepSpeed spells it today) to what it becomes here:

* ``effect="set"``: it sets the zinf setting ``field`` (a dotted :class:`~zinf_jax.config.ZeroConfig`
  field, or one of the run's own settings: ``batch``, ``schedule``);
* ``effect="none"``: no counterpart here and no effect on the numbers (bucket sizes, ``pin_memory``,
  logging...): reported on one line;
* ``effect="unsupported"``: it changes training in a way this run does not follow (a scheduler of
  another type, bf16 master weights, quantized gradients...): reported on another line, unless its
  value is ``neutral`` (DeepSpeed's default, which changes nothing).

``aliases`` are the other spellings DeepSpeed accepts (its deprecated keys and the unprefixed
``stage3_`` names its pydantic models take by field name); ``auto`` says how the Hugging Face
integration fills the value ``"auto"`` (see :mod:`zinf_jax.config.deepspeed`). A key whose parent is
listed with ``whole=True`` is a section reported once, by its name. :func:`doc_rows` is the same table as
the docs' DeepSpeed key reference shows it. Standard library only.
"""
from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["DsKey", "KEYS", "lookup", "EFFECTS", "doc_rows"]

EFFECTS = ("set", "none", "unsupported")

_NO: Any = object()


@dataclasses.dataclass(frozen=True)
class DsKey:
    """One DeepSpeed key and its zinf counterpart."""

    key: str
    """Dotted DeepSpeed key, as DeepSpeed spells it today."""
    effect: str
    """``"set"``, ``"none"`` or ``"unsupported"`` (see the module doc)."""
    field: str | None
    """The zinf setting it sets (dotted ``ZeroConfig`` field, or ``batch``/``schedule``); ``None``: none."""
    about: str
    """What it means here, in a few words."""
    aliases: tuple[str, ...] = ()
    """Other spellings DeepSpeed accepts (relative to the same section)."""
    auto: str | None = None
    """How ``"auto"`` is filled (the Hugging Face rule), if it can be."""
    neutral: Any = _NO
    """For ``"unsupported"``: a value that changes nothing (then reported as no effect)."""
    whole: bool = False
    """A section reported by its name alone (its keys are not listed one by one)."""

    def is_neutral(self, value: Any) -> bool:
        return self.neutral is not _NO and value == self.neutral


def _k(key: str, effect: str, field: str | None, about: str, **kw: Any) -> DsKey:
    return DsKey(key, effect, field, about, **kw)


_Z = "zero_optimization."
_P = _Z + "offload_param."
_O = _Z + "offload_optimizer."

KEYS: tuple[DsKey, ...] = (
    # --- zero_optimization: what zinf reads ---
    _k(_Z + "stage", "set", None, "must be 3 (ZeRO-3 / ZeRO-Infinity); other stages are refused"),
    _k(_P + "device", "set", "offload_param.device", "tier of the parameters: none (device memory), cpu, nvme"),
    _k(_P + "nvme_path", "set", "offload_param.path", "directory of the parameters' nvme tier"),
    _k(_P + "buffer_count", "set", "offload_param.buffer_count", "accepted; no effect on the param tier (warned)"),
    _k(_O + "device", "set", "offload_optimizer.device", "tier of the fp32 master and optimizer states"),
    _k(_O + "nvme_path", "set", "offload_optimizer.path", "directory of the optimizer's nvme tier"),
    _k(_O + "buffer_count", "set", "offload_optimizer.buffer_count",
       "sub-group buffer sets of the streamed optimizer (DeepSpeed's default 4 where the file gives none)"),
    _k(_Z + "cpu_offload", "set", "offload_optimizer.device",
       "deprecated spelling of offload_optimizer.device=cpu (true)"),
    _k(_Z + "cpu_offload_param", "set", "offload_param.device",
       "deprecated spelling of offload_param.device=cpu (true)", aliases=("cpu_offload_params",)),
    _k(_Z + "stage3_param_persistence_threshold", "set", "persistence_threshold",
       "parameters with at most this many elements are kept whole", aliases=("param_persistence_threshold",),
       auto="10 x hidden size"),
    _k(_Z + "stage3_max_live_parameters", "set", "max_live_bytes",
       "elements x bytes of the compute dtype: device bytes of gathered parameters", aliases=("max_live_parameters",)),
    _k(_Z + "sub_group_size", "set", "sub_group_size", "elements per optimizer sub-group"),
    # --- zero_optimization: no counterpart, no effect on the numbers ---
    _k(_Z + "stage3_prefetch_bucket_size", "none", None, "prefetch_depth counts units, not elements",
       aliases=("prefetch_bucket_size",), auto="0.9 x hidden size^2"),
    _k(_Z + "reduce_bucket_size", "none", None, "gradients are reduce-scattered per unit", auto="hidden size^2"),
    _k(_Z + "stage3_max_reuse_distance", "none", None, "a unit called again next keeps its gathered shards",
       aliases=("max_reuse_distance",)),
    _k(_Z + "stage3_gather_16bit_weights_on_model_save", "none", None,
       "checkpoints are sharded; engine.save_safetensors writes whole weights",
       aliases=("gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save")),
    _k(_Z + "stage3_model_persistence_threshold", "none", None, "no cap on the total of persistent parameters",
       aliases=("model_persistence_threshold",)),
    _k(_Z + "stage3_module_granularity_threshold", "none", None, "units are chosen by class or path",
       aliases=("module_granularity_threshold",)),
    _k(_Z + "stage3_use_all_reduce_for_fetch_params", "none", None, "gathers are all-gathers",
       aliases=("use_all_reduce_for_fetch_params",)),
    _k(_Z + "stage3_allgather_sequential", "none", None, "gathers are per unit", aliases=("allgather_sequential",)),
    _k(_Z + "cpu_offload_use_pin_memory", "none", None, "deprecated; host tiers are pinned host memory"),
    *(_k(_Z + n, "none", None, "communication layout handled by XLA") for n in (
        "contiguous_gradients", "overlap_comm", "reduce_scatter", "allgather_partitions", "allgather_bucket_size",
        "round_robin_gradients", "use_multi_rank_bucket_allreduce", "ignore_unused_parameters", "legacy_stage1",
        "load_from_fp32_weights", "elastic_checkpoint", "memory_efficient_linear", "log_trace_cache_warnings",
        "mics_shard_size", "mics_hierarchical_params_gather", "zero_hpz_partition_size", "pipeline_loading_checkpoint",
        "override_module_apply", "offload_states")),
    *(_k(_P + n, "none", None, "host staging is sized by the tier itself") for n in (
        "pin_memory", "buffer_size", "max_in_cpu")),
    *(_k(_O + n, "none", None, "the streamed optimizer always pipelines its reads and writes") for n in (
        "pin_memory", "pipeline", "pipeline_read", "pipeline_write", "fast_init", "cpuadam_cores_perc",
        "super_offload")),
    # --- zero_optimization: changes training ---
    _k(_O + "ratio", "unsupported", None, "ZeRO-Offload++: a share of the params stepped on device", neutral=1.0),
    _k(_Z + "zero_quantized_weights", "unsupported", None, "quantized weight gathers", neutral=False),
    _k(_Z + "zero_quantized_nontrainable_weights", "unsupported", None, "quantized frozen weights", neutral=False),
    _k(_Z + "zero_quantized_gradients", "unsupported", None, "quantized gradient reduction", neutral=False),
    _k(_Z + "zenflow", "unsupported", None, "ZenFlow: stale updates of unimportant gradients", whole=True),
    # --- aio (top level in DeepSpeed) ---
    _k("aio.block_size", "set", "aio.block_size", "bytes per nvme chunk file"),
    _k("aio.intra_op_parallelism", "set", "aio.intra_op_parallelism", "nvme reader and writer threads",
       aliases=("thread_count",)),
    *(_k("aio." + n, "none", None, "tensorstore schedules its own requests") for n in (
        "queue_depth", "single_submit", "overlap_events", "use_gds")),
    # --- precision ---
    _k("bf16.enabled", "set", "compute_dtype", "bfloat16 compute", auto="the run's compute dtype"),
    _k("bf16.bf16_optimizer_states", "set", "moments_dtype", "Adam moments stored in bfloat16"),
    _k("bf16.bf16_master_weights_and_grads", "unsupported", None, "bf16 master weights (zinf keeps fp32)",
       neutral=False),
    _k("bf16.immediate_grad_update", "none", None, "gradients are reduced as each unit finishes"),
    _k("bf16.check_grad_overflow", "none", None, "non-finite gradients always skip the step"),
    _k("fp16.enabled", "set", "compute_dtype", "float16 compute with loss scaling", auto="the run's compute dtype"),
    _k("fp16.loss_scale", "set", "loss_scale.static_scale", "0: dynamic"),
    _k("fp16.initial_scale_power", "set", "loss_scale.initial_scale_power", "dynamic scale starts at 2^this"),
    _k("fp16.loss_scale_window", "set", "loss_scale.window", "clean steps before the scale doubles"),
    _k("fp16.hysteresis", "set", "loss_scale.hysteresis", "overflows before the scale halves"),
    _k("fp16.min_loss_scale", "set", "loss_scale.min_scale", "floor of the dynamic scale"),
    _k("fp16.consecutive_hysteresis", "set", "loss_scale.consecutive_hysteresis", "refill hysteresis each clean step"),
    _k("fp16.auto_cast", "unsupported", None, "casting the model's inputs to fp16", neutral=False),
    _k("fp16.fp16_master_weights_and_grads", "unsupported", None, "fp16 master weights (zinf keeps fp32)",
       neutral=False),
    _k("amp", "unsupported", None, "NVIDIA apex AMP", whole=True),
    _k("torch_autocast", "unsupported", None, "torch autocast regions", whole=True),
    _k("communication_data_type", "unsupported", None, "gradients reduced in another dtype", neutral=None),
    # --- optimizer, scheduler, training loop ---
    _k("optimizer.type", "set", "optimizer.name", "Adam or AdamW (Adam is AdamW unless adam_w_mode is false)"),
    _k("optimizer.params.lr", "set", "optimizer.lr", "learning rate (the schedule's peak)", auto="learning rate"),
    _k("optimizer.params.betas", "set", "optimizer.b1", "Adam's (b1, b2)", auto="Adam betas"),
    _k("optimizer.params.eps", "set", "optimizer.eps", "Adam's epsilon", auto="Adam epsilon"),
    _k("optimizer.params.weight_decay", "set", "optimizer.weight_decay", "weight decay", auto="weight decay"),
    _k("optimizer.params.adam_w_mode", "set", "optimizer.name", "false: L2 weight decay (Adam)"),
    _k("optimizer.params.torch_adam", "none", None, "zinf's CPU Adam computes the same update"),
    _k("optimizer.params.amsgrad", "unsupported", None, "AMSGrad", neutral=False),
    _k("optimizer.params.bias_correction", "unsupported", None, "Adam without bias correction", neutral=True),
    _k("scheduler.type", "set", "schedule", "WarmupLR, WarmupDecayLR, WarmupCosineLR (others are refused)"),
    _k("scheduler.params.warmup_min_lr", "set", "schedule", "rate at the start of the warmup", auto="0"),
    _k("scheduler.params.warmup_max_lr", "set", "schedule", "rate at the end of the warmup", auto="learning rate"),
    _k("scheduler.params.warmup_num_steps", "set", "schedule", "warmup length", auto="warmup steps"),
    _k("scheduler.params.warmup_type", "set", "schedule", "log (DeepSpeed's default) or linear"),
    _k("scheduler.params.total_num_steps", "set", "schedule", "where the decay ends", auto="training steps"),
    _k("scheduler.params.warmup_min_ratio", "set", "schedule", "WarmupCosineLR: start ratio of lr"),
    _k("scheduler.params.cos_min_ratio", "set", "schedule", "WarmupCosineLR: end ratio of lr"),
    _k("scheduler.params.last_batch_iteration", "set", "schedule", "must be -1 (resume restores the step)",
       neutral=-1),
    _k("gradient_clipping", "set", "gradient_clipping", "clip to this global norm (0: none)", auto="gradient clipping"),
    _k("gradient_accumulation_steps", "set", "gradient_accumulation_steps", "micro-batches per optimizer step",
       auto="gradient accumulation steps"),
    _k("train_batch_size", "set", "batch", "sequences per optimizer step, whole job", auto="batch"),
    _k("train_micro_batch_size_per_gpu", "set", "batch", "sequences per device per micro-batch",
       auto="batch per device"),
    _k("activation_checkpointing.cpu_checkpointing", "set", "offload_activations", "saved activations in host memory"),
    *(_k("activation_checkpointing." + n, "none", None, "units are checkpointed at their boundaries") for n in (
        "partition_activations", "contiguous_memory_optimization", "number_checkpoints",
        "synchronize_checkpoint_boundary", "profile")),
    # --- whole sections and top-level knobs with no effect on the numbers ---
    *(_k(n, "none", None, "logging, launching or saving", whole=True) for n in (
        "steps_per_print", "wall_clock_breakdown", "dump_state", "memory_breakdown", "tensorboard", "wandb",
        "csv_monitor", "comet", "flops_profiler", "comms_logger", "monitor_config", "autotuning", "checkpoint",
        "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "prescale_gradients",
        "gradient_predivide_factor", "sparse_gradients", "disable_allgather", "elasticity", "pipeline",
        "data_types", "timers", "nebula", "use_data_before_expert_parallelism", "graph_harvesting",
        "seq_parallel_communication_data_type", "compile", "zero_optimization.offload_optimizer.nvme_path_ratio")),
    *(_k(n, "unsupported", None, "changes the data or the model", whole=True) for n in (
        "data_efficiency", "curriculum_learning", "compression_training", "sparse_attention", "eigenvalue",
        "progressive_layer_drop", "quantize_training", "hybrid_engine")),
)
"""The table (see the module doc)."""

_BY_KEY: dict[str, DsKey] = {}
for _entry in KEYS:
    _BY_KEY[_entry.key] = _entry
    _parent = _entry.key.rpartition(".")[0]
    for _alias in _entry.aliases:
        _BY_KEY.setdefault(f"{_parent}.{_alias}" if _parent else _alias, _entry)


def lookup(dotted: str) -> DsKey | None:
    """The table entry of a dotted key (by any of its spellings; a key inside a ``whole`` section: the section)."""
    if dotted in _BY_KEY:
        return _BY_KEY[dotted]
    parts = dotted.split(".")
    for n in range(len(parts) - 1, 0, -1):
        entry = _BY_KEY.get(".".join(parts[:n]))
        if entry is not None and entry.whole:
            return entry
    return None


_NOT_SET = {"none": "(no counterpart: no effect on the numbers)", "unsupported": "(changes training: not supported)"}


def doc_rows() -> list[tuple[str, str, str]]:
    """:data:`KEYS` as ``(DeepSpeed key, zinf_jax setting, note)`` rows, in table order (the docs' key reference).

    The note says what the key means here, its other spellings, and how ``"auto"`` is filled.
    """
    rows = []
    for k in KEYS:
        setting = k.field or _NOT_SET.get(k.effect, "(checked)")
        note = k.about + (" (the whole section)" if k.whole else "")
        parent = k.key.rpartition(".")[0]
        if k.aliases:
            note += "; also spelled " + ", ".join(f"{parent}.{a}" if parent else a for a in k.aliases)
        if k.auto:
            note += f'; "auto" becomes: {k.auto}'
        rows.append((k.key, setting, note))
    return rows
