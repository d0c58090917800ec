"""Reading DeepSpeed JSON configs (and accelerate YAML ones) into :class:`~zinf_jax.config.ZeroConfig`.

The keys, their spellings and their effect come from one table (:data:`zinf_jax.config.ds_keys.KEYS`);
each section is read key by key, so every key of the file is either used or reported (no counterpart /
changes training / unknown), and a bad value names its dotted key. ``zero_optimization.stage`` must be 3.

``"auto"`` is filled the way the Hugging Face integration fills it, from :class:`RunValues` (the
caller's arguments, or ``zinf-jax train``'s flags): clipping, learning rate, weight decay, batch,
accumulation, warmup and total steps from the run; ``stage3_param_persistence_threshold`` from the model
width (10 h; the bucket sizes h^2 and 0.9 h^2 have no counterpart here); the dtype from the run's compute
dtype; Adam's betas and epsilon from the run or the Trainer's defaults. Where nothing fills a key that
changes the numbers, a :class:`ConfigError` names it and what to give. Every spelling DeepSpeed accepts
is read: ``cpu_offload``/``cpu_offload_param(s)``, the unprefixed ``stage3_`` names, the old fp16 save
key; an ``aio`` section nested in ``zero_optimization`` (as the HF docs write it) is read, with a note.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Mapping

from zinf_jax.config.ds_keys import KEYS, doc_rows, lookup
from zinf_jax.config.files import read_deepspeed_json
from zinf_jax.config.fields import BOOL, NONNEG, OPTIMIZERS, Invalid, as_float, as_int, as_other
from zinf_jax.config.resolution import Resolution, RunValues, _show
from zinf_jax.config.schedule import SCHEDULES, LRSchedule
from zinf_jax.errors import ConfigError

__all__ = ["parse_deepspeed", "resolve_deepspeed", "load_file", "RunValues", "KEY_TABLE"]

KEY_TABLE: list[tuple[str, str, str]] = doc_rows()
"""The keys this importer reads, as ``(DeepSpeed key, zinf_jax setting, note)`` rows: the docs' DeepSpeed key
reference is generated from it (the same :data:`~zinf_jax.config.ds_keys.KEYS` the importer reads)."""


_ABSENT: Any = object()
_DS_OPTIMIZER = (lambda v: isinstance(v, str) and v.lower() in OPTIMIZERS, "'Adam' or 'AdamW' (any case)")
_BETAS = (lambda v: isinstance(v, (list, tuple)) and len(v) == 2
          and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in v),
          "a list [b1, b2] of two numbers in [0, 1)")
_STR = (lambda v: isinstance(v, str) and v != "", "a name")
_HF_ADAM = {"betas": ((0.9, 0.999), "adam_beta1/adam_beta2"), "eps": (1e-8, "adam_epsilon")}


class _Reader:
    """What one resolution shares: the run's values, where each setting came from, the sections read."""

    def __init__(self, run: RunValues, file: str):
        self.run, self.file = run, file
        self.sections: list[_Section] = []
        self.origin: dict[str, str] = {}  # zinf setting (table field) -> source
        self.key_origin: dict[str, str] = {}  # canonical DeepSpeed key -> source

    def fill(self, key: str) -> tuple[Any, str]:
        """The value of the ``"auto"`` key ``key`` (canonical spelling) and where it came from.

        Raises:
          ConfigError: nothing in the run fills it (the message names the key and what to give).
        """
        run, h = self.run, self.run.hidden_size
        per_h = {"zero_optimization.stage3_param_persistence_threshold": (lambda: 10 * h, "10 x hidden size"),
                 "zero_optimization.stage3_prefetch_bucket_size": (lambda: int(0.9 * h * h), "0.9 x hidden size^2"),
                 "zero_optimization.reduce_bucket_size": (lambda: h * h, "hidden size^2")}
        if key in per_h:
            rule, what = per_h[key]
            if h is None:
                raise ConfigError(f'{key}: "auto" is filled from the model width (the Hugging Face rule: {what}); '
                                  f"give {run.how('hidden_size')} or put a number in the file")
            return rule(), f'"auto" <- {what} ({run.said("hidden_size")})'
        if key == "scheduler.params.warmup_min_lr":
            return 0.0, '"auto" <- 0 (the Hugging Face rule)'
        if key in ("fp16.enabled", "bf16.enabled"):
            if run.compute_dtype is None:
                raise ConfigError(f'{key}: "auto" is filled from the run\'s compute dtype; give '
                                  f'{run.how("compute_dtype")} ("float32", "bfloat16" or "float16") or put true/false')
            want = "float16" if key == "fp16.enabled" else "bfloat16"
            return run.compute_dtype == want, f'"auto" <- {run.said("compute_dtype")}'
        name = {"gradient_clipping": "clip", "optimizer.params.lr": "lr", "scheduler.params.warmup_max_lr": "lr",
                "optimizer.params.weight_decay": "weight_decay", "optimizer.params.betas": "betas",
                "optimizer.params.eps": "eps", "gradient_accumulation_steps": "gradient_accumulation_steps",
                "train_batch_size": "batch", "train_micro_batch_size_per_gpu": "micro_batch",
                "scheduler.params.total_num_steps": "total_steps",
                "scheduler.params.warmup_num_steps": "warmup_steps"}.get(key)
        if name is None:
            raise ConfigError(f'{key}: "auto" has no rule to fill it (the Hugging Face integration fills only '
                              "batch, accumulation, clipping, optimizer, scheduler, precision and the hidden-size "
                              "keys); put a value in the file")
        value = getattr(run, name)
        if value is not None:
            return (list(value) if name == "betas" else value), f'"auto" <- {run.said(name)}'
        if name in _HF_ADAM:
            default, hf = _HF_ADAM[name]
            return (list(default) if name == "betas" else default), \
                f'"auto" <- default {_show(default)} (the Hugging Face Trainer\'s {hf}; give {run.how(name)})'
        if name in ("batch", "micro_batch"):
            return None, '"auto", not filled: the batch is what train_step is given'
        raise ConfigError(f'{key}: "auto" is filled from the run\'s {name.replace("_", " ")}; give '
                          f"{run.how(name)} or put a number in the file")


class _Section:
    """One JSON object of a DeepSpeed config, read key by key; remembers the keys it used."""

    def __init__(self, data: Mapping[str, Any], prefix: str, reader: _Reader, shown: str | None = None):
        self.data, self.prefix, self.reader = data, prefix, reader
        self.shown = prefix if shown is None else shown  # how the file spells this section (a misplaced aio)
        self.used: set[str] = set()
        reader.sections.append(self)

    def names(self, name: str) -> tuple[str, ...]:
        entry = lookup(self.prefix + name)
        return (name, *(entry.aliases if entry and entry.key == self.prefix + name else ()))

    def get(self, name: str, convert: Callable[..., Any] | None = None, *args: Any, default: Any = _ABSENT) -> Any:
        """The value of ``name`` (or of one of its other spellings) through ``convert``.

        ``"auto"`` is filled from the run (see :meth:`_Reader.fill`); ``default`` if absent or null.
        """
        present = [n for n in self.names(name) if n in self.data]
        if not present:
            return default
        if len({json.dumps(self.data[n], sort_keys=True, default=str) for n in present}) > 1:
            raise ConfigError(f"{', '.join(self.shown + n for n in present)}: spellings of one setting with "
                              "different values; keep one")
        self.used.update(present)
        spelled = present[0]
        key, value = self.shown + spelled, self.data[spelled]
        source = f"config file {key}" + ("" if spelled == name else f" (DeepSpeed's other spelling of {name})")
        if isinstance(value, str) and value == "auto":
            value, source = self.reader.fill(self.prefix + name)
        entry = lookup(self.prefix + name)
        if entry is not None and entry.field:
            self.reader.origin.setdefault(entry.field, source)
        self.reader.key_origin[self.prefix + name] = source
        if value is None:
            return default
        if convert is None:
            return value
        try:
            return convert(value, *args)
        except Invalid as e:
            raise ConfigError(f"{key}: expected {e}, got {value!r}") from None

    def section(self, name: str, data: Any = _ABSENT, *, spelled: str | None = None) -> _Section:
        """The sub-object ``name`` (empty when absent or null), spelled ``spelled`` in the file (default: ``name``)."""
        spelled = spelled or name
        value = self.get(spelled, default={}) if data is _ABSENT else data
        if not isinstance(value, Mapping):
            raise ConfigError(f"{self.shown}{spelled}: expected a JSON object, got {value!r}")
        return _Section(value, f"{self.prefix}{name}.", self.reader, f"{self.shown}{spelled}.")

    def build(self, cls: type, zinf_prefix: str, defaults: dict[str, Any] | None = None, **fixed: Any) -> Any:
        """Builds ``cls`` from ``fixed``, the keys of this section that the table maps to its fields, and
        ``defaults`` for those the section leaves out (DeepSpeed's defaults where they differ from zinf's)."""
        names = {f.name for f in dataclasses.fields(cls)}
        attrs = {e.field[len(zinf_prefix):]: e.key[len(self.prefix):] for e in KEYS
                 if e.field and e.field.startswith(zinf_prefix) and e.key.rpartition(".")[0] + "." == self.prefix}
        attrs = {a: k for a, k in attrs.items() if a in names and a not in fixed}
        kwargs = {**(defaults or {}), **fixed}
        for attr, key in attrs.items():
            if (value := self.get(key)) is not _ABSENT:
                kwargs[attr] = value
        try:
            return cls(**kwargs)
        except ConfigError as e:
            if e.field not in attrs:
                raise
            spelled = next((n for n in self.names(attrs[e.field]) if n in self.data), attrs[e.field])
            raise ConfigError(f"{self.shown}{spelled}: {e.detail}", field=e.field, detail=e.detail) from None


def _sections(config_cls: type) -> dict[str, type]:
    """The config class of each nested section of ``config_cls`` (``offload_param`` -> ``Offload``...)."""
    return {f.name: f.metadata["nested"] for f in dataclasses.fields(config_cls) if f.metadata["nested"]}


def load_file(path: Any) -> tuple[dict[str, Any], str, list[str], list[str]]:
    """A DeepSpeed JSON file, or an accelerate YAML one (``.yaml``/``.yml``) turned into DeepSpeed keys.

    Returns:
      The DeepSpeed dict, the name to show, notes (how accelerate keys were read), and keys of the
      file with no effect on the numbers (accelerate's launcher settings).
    """
    source = os.fspath(path)
    if source.lower().endswith((".yaml", ".yml")):
        from zinf_jax.config.accelerate import read_accelerate

        return read_accelerate(source)
    return read_deepspeed_json(source), source, [], []


def parse_deepspeed(path_or_dict: Any, config_cls: type, run: RunValues | None = None) -> Any:
    """Implements :meth:`zinf_jax.ZeroConfig.from_deepspeed`: the config alone (see there)."""
    return resolve_deepspeed(path_or_dict, config_cls, run).config


def resolve_deepspeed(path_or_dict: Any, config_cls: type, run: RunValues | None = None) -> Resolution:
    """Reads a DeepSpeed config (a path to JSON or accelerate YAML, or the parsed dict) with ``"auto"`` filled.

    Args:
      path_or_dict: the file, or the parsed DeepSpeed dict (not modified).
      config_cls: the class to build (``ZeroConfig``); its nested sections' classes come from its fields,
        so this module needs nothing of :mod:`zinf_jax.config.zero` (which imports it).
      run: the run's values that fill ``"auto"``.

    Returns:
      The :class:`Resolution`: the config, each setting's source, the keys not used.

    Raises:
      ConfigError: the file is missing or unreadable, the stage is not 3, a value is bad, or an
        ``"auto"`` cannot be filled (each names its dotted key).
    """
    if isinstance(path_or_dict, Mapping):
        data, file, notes, quiet = dict(path_or_dict), "(dict)", [], []
    else:
        data, file, notes, quiet = load_file(path_or_dict)
    reader = _Reader(run or RunValues(), file)
    res = _read(data, config_cls, reader)
    res.notes[:0] = notes
    res.no_effect[:0] = quiet
    return res


def _read(data: Mapping[str, Any], config_cls: type, reader: _Reader) -> Resolution:
    section_cls = _sections(config_cls)
    Offload, AioConfig = section_cls["offload_param"], section_cls["aio"]
    LossScaleConfig, OptimizerConfig = section_cls["loss_scale"], section_cls["optimizer"]
    notes: list[str] = []
    top = _Section(data, "", reader)
    zero = top.section("zero_optimization")
    if (stage := zero.get("stage", as_int, default=None)) != 3:
        got = "no stage" if stage is None else stage
        raise ConfigError("zero_optimization.stage: zinf_jax implements ZeRO stage 3 / ZeRO-Infinity only "
                          f'(accepted value: 3), got {got}; set "zero_optimization": {{"stage": 3}}')
    # precision
    bf16 = top.section("bf16", spelled="bfloat16" if "bfloat16" in data and "bf16" not in data else "bf16")
    fp16 = top.section("fp16")
    use_bf16 = bf16.get("enabled", as_other, *BOOL, default=False)
    use_fp16 = fp16.get("enabled", as_other, *BOOL, default=False)
    if use_bf16 and use_fp16:
        raise ConfigError(f"{bf16.shown}enabled, fp16.enabled: accepted values: at most one of them true, got both")
    dtype = "bfloat16" if use_bf16 else "float16" if use_fp16 else "float32"
    said = [reader.key_origin[k] for k in ("bf16.enabled", "fp16.enabled") if k in reader.key_origin]
    reader.origin["compute_dtype"] = (reader.key_origin["bf16.enabled"] if use_bf16 else
                                      reader.key_origin["fp16.enabled"] if use_fp16 else
                                      " and ".join(said) if said else "default (DeepSpeed: fp32 without fp16/bf16)")
    bf16_states = bf16.get("bf16_optimizer_states", as_other, *BOOL, default=False)
    # tiers
    param = _offload(zero, "offload_param", "cpu_offload_param", Offload, {}, notes)
    optim = _offload(zero, "offload_optimizer", "cpu_offload", Offload, {"buffer_count": 4}, notes)  # DeepSpeed's
    # default buffer_count, where the file gives none
    aio = _aio(top, zero, AioConfig, notes)
    # optimizer and schedule
    optimizer, schedule = _optimizer(top, OptimizerConfig, reader)
    max_live = zero.get("stage3_max_live_parameters", as_int, 1, default=None)
    cpu_checkpointing = top.section("activation_checkpointing").get("cpu_checkpointing", as_other, *BOOL,
                                                                    default=False)
    clip = top.get("gradient_clipping", as_float, *NONNEG, default=0.0)
    accum = top.get("gradient_accumulation_steps", as_int, 1, default=1)
    batch = top.get("train_batch_size", as_int, 1, default=None)
    micro = top.get("train_micro_batch_size_per_gpu", as_int, 1, default=None)
    config = zero.build(
        config_cls, "", offload_param=param, offload_optimizer=optim, aio=aio,
        max_live_bytes=None if max_live is None else max_live * (2 if dtype in ("bfloat16", "float16") else 4),
        compute_dtype=dtype, loss_scale=fp16.build(LossScaleConfig, "loss_scale.", enabled=use_fp16 or None),
        optimizer=optimizer, gradient_clipping=clip, gradient_accumulation_steps=accum,
        moments_dtype="bfloat16" if bf16_states else "float32", offload_activations=cpu_checkpointing)
    res = Resolution(config=config, file=reader.file, schedule=schedule, batch=batch, micro_batch=micro, notes=notes,
                     batch_keys=[k for k in ("train_batch_size", "train_micro_batch_size_per_gpu") if k in data])
    _unused(reader, res)
    _rows(res, reader.origin, reader.key_origin)
    return res


def _offload(zero: _Section, name: str, old: str, Offload: type, defaults: dict[str, Any], notes: list[str]) -> Any:
    """``offload_param``/``offload_optimizer``, or DeepSpeed's deprecated boolean spelling of it (``defaults``:
    DeepSpeed's values of keys the file leaves out)."""
    flag = zero.get(old, as_other, *BOOL, default=None)
    if flag is not None and name in zero.data:
        raise ConfigError(f"zero_optimization.{old}, zero_optimization.{name}: the deprecated and the new spelling "
                          f"of one setting (DeepSpeed refuses both too); keep {name}")
    if flag is not None:
        spelled = next(n for n in zero.names(old) if n in zero.data)
        notes.append(f"zero_optimization.{spelled}: {str(flag).lower()} read as {name}.device="
                     f"{'cpu' if flag else 'none'} (DeepSpeed's deprecated spelling)")
        return Offload("cpu" if flag else "none", **defaults)
    return zero.section(name).build(Offload, name + ".", defaults)


def _aio(top: _Section, zero: _Section, AioConfig: type, notes: list[str]) -> Any:
    """The top-level ``aio`` section, or one nested in ``zero_optimization`` (read with a note)."""
    nested = zero.data.get("aio")
    if nested is None:
        return top.section("aio").build(AioConfig, "aio.")
    zero.used.add("aio")
    if "aio" in top.data and top.data["aio"] != nested:
        raise ConfigError("aio, zero_optimization.aio: two aio sections that differ; keep the top-level one "
                          "(DeepSpeed reads aio only at the top level)")
    notes.append("zero_optimization.aio: read as the top-level aio section (DeepSpeed itself reads aio only at "
                 "the top level and would ignore this one; move it there)")
    if "aio" in top.data:
        top.used.add("aio")
    aio = top.section("aio", nested)
    aio.shown = "zero_optimization.aio."
    return aio.build(AioConfig, "aio.")


def _optimizer(top: _Section, OptimizerConfig: type, reader: _Reader) -> tuple[Any, LRSchedule | None]:
    optimizer = None
    if (opt := top.section("optimizer")).data:
        if (kind := opt.get("type", as_other, *_DS_OPTIMIZER, default=None)) is None:
            raise ConfigError("optimizer.type: missing; accepted values: 'Adam', 'AdamW'")
        params = opt.section("params")
        adam_w = params.get("adam_w_mode", as_other, *BOOL, default=True)  # DeepSpeed: "Adam" is AdamW by default
        b1, b2 = params.get("betas", as_other, *_BETAS, default=(OptimizerConfig.b1, OptimizerConfig.b2))
        name = "adamw" if kind.lower() == "adamw" or adam_w else "adam"
        optimizer = params.build(OptimizerConfig, "optimizer.", name=name, b1=b1, b2=b2)
    schedule = _schedule(top, None if optimizer is None else optimizer.lr, reader)
    if optimizer is not None and schedule is not None:
        optimizer = dataclasses.replace(optimizer, schedule=schedule)
    return optimizer, schedule


def _schedule(top: _Section, lr: float | None, reader: _Reader) -> LRSchedule | None:
    """The ``scheduler`` section as an :class:`LRSchedule` (``None``: none, or a type reported as unsupported)."""
    if not (sched := top.section("scheduler")).data:
        return None
    kind = sched.get("type", as_other, *_STR, default=None)
    if kind not in SCHEDULES:
        sched.used.clear()
        top.used.discard("scheduler")  # reported whole, as changing training
        return None
    p = sched.section("params")
    if p.get("last_batch_iteration", as_int, default=-1) != -1:
        raise ConfigError("scheduler.params.last_batch_iteration: accepted value: -1 (a resumed run restores its "
                          "step from the checkpoint)")
    kw: dict[str, Any] = {"kind": kind}
    for name, conv, args in (("warmup_min_lr", as_float, NONNEG), ("warmup_max_lr", as_float, NONNEG),
                             ("warmup_num_steps", as_int, (1,)), ("warmup_type", as_other, _STR),
                             ("total_num_steps", as_int, (1,)), ("warmup_min_ratio", as_float, NONNEG),
                             ("cos_min_ratio", as_float, NONNEG)):
        if kind == "WarmupCosineLR" and name in ("warmup_min_lr", "warmup_max_lr"):
            continue
        if kind != "WarmupCosineLR" and name in ("warmup_min_ratio", "cos_min_ratio"):
            continue
        if (value := p.get(name, conv, *args)) is not _ABSENT:
            kw[name] = value
    if kind == "WarmupCosineLR" or (kind == "WarmupLR" and "warmup_max_lr" not in kw):
        lr = lr if lr is not None else reader.run.lr  # no optimizer section: the caller's optimizer's lr
        if lr is None:  # DeepSpeed takes the optimizer's lr
            raise ConfigError(f"scheduler: {kind} takes its peak rate from the optimizer's lr, and the file has no "
                              "optimizer section; add one (optimizer.params.lr), give scheduler.params.warmup_max_lr, or give "
                              f"{reader.run.how('lr')}"
                              if kind == "WarmupLR" else
                              f"scheduler: {kind} scales the optimizer's lr, and the file has no optimizer section; "
                              f"add one with optimizer.params.lr or give {reader.run.how('lr')}")
        kw["warmup_max_lr"] = lr
    try:
        return LRSchedule(**kw)
    except ConfigError as e:
        raise ConfigError(f"scheduler.params.{e.field}: {e.detail}", field=e.field, detail=e.detail) from None


def _unused(reader: _Reader, res: Resolution) -> None:
    """Sorts every key the sections did not use into the resolution's three lists."""
    seen: set[str] = set()
    for s in reader.sections:
        for k, v in s.data.items():
            if k in s.used:
                continue
            dotted, canonical = s.shown + k, s.prefix + k
            entry = lookup(canonical)
            name = entry.key if entry is not None and entry.whole else dotted
            if name in seen:
                continue
            seen.add(name)
            if entry is None:
                res.unknown.append(name)
            elif entry.effect == "unsupported" and not entry.is_neutral(v):
                shown = "" if entry.whole or isinstance(v, Mapping) else f"={json.dumps(v)}"
                res.unsupported.append(f"{name}{shown} ({entry.about})")
            else:
                res.no_effect.append(name)
    sched = reader.sections[0].data.get("scheduler")
    if isinstance(sched, Mapping) and sched and "scheduler" not in reader.sections[0].used:
        res.unsupported.append(f"scheduler {sched.get('type')!r} (zinf_jax follows {', '.join(SCHEDULES)}; "
                               "this run's learning rate does not follow it)")
        res.unsupported[:] = [u for u in res.unsupported if not u.startswith("scheduler.")]
        res.no_effect[:] = [u for u in res.no_effect if not u.startswith("scheduler.")]
        res.unknown[:] = [u for u in res.unknown if not u.startswith("scheduler.") and u != "scheduler"]
    for lst in (res.no_effect, res.unsupported, res.unknown):
        lst.sort()


def _rows(res: Resolution, origin: dict[str, str], key_origin: dict[str, str]) -> None:
    """The settings that matter, each with its source (a key absent from the file: DeepSpeed's default)."""
    c = res.config
    dflt = "default (not in the file: DeepSpeed's default)"

    def src(field: str) -> str:
        return origin.get(field, dflt)

    for name in ("offload_param", "offload_optimizer"):
        off = getattr(c, name)
        tier = off.device + (f" at {off.path}" if off.device == "nvme" else "")
        res.set(f"{name.replace('offload_', '')} tier", tier, src(f"{name}.device"))
    res.set("compute dtype", c.compute_dtype, src("compute_dtype"))
    res.set("moments dtype", c.moments_dtype, src("moments_dtype"))
    o = c.optimizer
    if o is not None:
        res.set("optimizer", o.name, src("optimizer.name"))
        res.set("adam betas", (o.b1, o.b2), src("optimizer.b1"))
        res.set("adam eps", o.eps, src("optimizer.eps"))
        res.set("learning rate", o.lr, src("optimizer.lr"))
        res.set("weight decay", o.weight_decay, src("optimizer.weight_decay"))
    else:
        res.set("optimizer", "none in the file: the caller's", "default (no optimizer section)")
    if res.schedule is not None:
        res.set("lr schedule", res.schedule.describe(), "config file scheduler" + "".join(
            f"; {k.rpartition('.')[2]} {v}" for k, v in key_origin.items()
            if k.startswith("scheduler.params.") and v.startswith('"auto"')))
    else:
        res.set("lr schedule", "constant" if o is not None else "the caller's", "default (no scheduler section)")
    res.set("gradient clipping", c.gradient_clipping, src("gradient_clipping"))
    res.set("gradient accumulation", c.gradient_accumulation_steps, src("gradient_accumulation_steps"))
    if "batch" in origin:
        parts = [f"{res.batch} per step" if res.batch else "", f"{res.micro_batch} per device" if res.micro_batch
                 else ""]
        res.set("batch", ", ".join(p for p in parts if p) or "what train_step is given",
                "; ".join(v if v.startswith("config file") else f"{k} {v}"  # "auto": name the key it fills
                          for k, v in key_origin.items() if k.startswith("train_")))
    res.set("persistence threshold", c.persistence_threshold, src("persistence_threshold"))
    res.set("max live bytes", c.max_live_bytes if c.max_live_bytes is not None else "unbounded", src("max_live_bytes"))
    res.set("sub group size", c.sub_group_size, src("sub_group_size"))
    ls = c.loss_scale
    res.set("loss scaling", ("static " + _show(ls.static_scale) if ls.static_scale else
                             f"dynamic from 2^{ls.initial_scale_power}") if ls.enabled else "off", src("compute_dtype"))
    if "nvme" in (c.offload_param.device, c.offload_optimizer.device):
        a = c.aio
        res.set("nvme io", f"block {a.block_size or 'default'}, threads {a.intra_op_parallelism or 'default'}",
                src("aio.block_size") if "aio.block_size" in origin else src("aio.intra_op_parallelism"))
    res.set("offload activations", c.offload_activations, src("offload_activations"))
