"""The main job's settings: the flags, or a config file with the flags given explicitly on top.

:func:`resolve` returns the flags as the run uses them (a DeepSpeed or accelerate file may set the
batch), the :class:`~zinf_jax.config.ZeroConfig`, and for a DeepSpeed/accelerate file the
:class:`~zinf_jax.config.resolution.Resolution` that ``zinf-jax train`` prints: every setting with
its source. Rules:

* the file's ``"auto"`` values are filled from the flags (given or default), as the Hugging Face
  integration fills them from the Trainer's arguments (``--lr``, ``--clip``, ``--weight-decay``,
  ``--batch``, ``--gradient-accumulation-steps``, ``--warmup``, ``--steps``, ``--compute-dtype``, and
  ``--d-model`` for the hidden-size rules);
* a flag given explicitly overrides the file (tiers, ``--nvme-dir``, clip, thresholds, dtypes,
  accumulation, batch, lr, weight decay, warmup); one that cannot apply is an error naming why;
* flags a DeepSpeed file has no key for (``--seed``, ``--engine``, ``--nvme-update``, ``--optimizer-update``)
  always apply; a zinf config has these keys, so there only the flags given explicitly replace them.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from zinf_jax.config import Offload, OptimizerConfig, ZeroConfig
from zinf_jax.config.resolution import Resolution

__all__ = ["resolve", "given_by_default", "flags_config"]

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def given_by_default(args: Any) -> frozenset[str]:
    """The fields of ``args`` that differ from their defaults (the flags "given" when none are named)."""
    return frozenset(f.name for f in dataclasses.fields(args) if getattr(args, f.name) != f.default)


def flags_config(args: Any) -> ZeroConfig:
    """The ZeroConfig the flags alone describe (no config file)."""
    nvme = args.nvme_dir or os.path.join(args.run_dir, "nvme")
    off = lambda d: Offload(d, path=nvme if d == "nvme" else None)  # noqa: E731
    return ZeroConfig(offload_param=off(args.param_device), offload_optimizer=off(args.optimizer_device),
                      gradient_clipping=args.clip, seed=args.seed, persistence_threshold=args.persistence_threshold,
                      nvme_update=args.nvme_update, optimizer_update=args.optimizer_update, engine=args.engine,
                      moments_dtype=args.moments_dtype,
                      compute_dtype=args.compute_dtype, gradient_accumulation_steps=args.gradient_accumulation_steps)


def resolve(args: Any, given: frozenset[str] | None = None) -> tuple[Any, ZeroConfig, Resolution | None]:
    """The flags as the run uses them, the config, and (for a DeepSpeed/accelerate file) the resolution.

    Args:
      args: the :class:`~zinf_jax.app.train.TrainArgs`.
      given: the flags given explicitly (``TrainArgs`` field names); ``None``: those differing from the default.

    Raises:
      ConfigError: the file is bad, or an ``"auto"`` cannot be filled.
      ValueError: a flag that cannot apply with the file (``--flag VALUE: why``).
    """
    given = given_by_default(args) if given is None else frozenset(given)
    if args.config and args.deepspeed_config:
        raise ValueError("--config and --deepspeed-config: give one of them, not both")
    if not (args.config or args.deepspeed_config):
        return args, flags_config(args), None
    if args.config:
        import json

        with open(args.config) as f:
            try:
                config = ZeroConfig.from_dict(json.load(f))
            except json.JSONDecodeError as e:
                raise ValueError(f"--config {args.config}: not valid JSON ({e})") from None
        return _Flags(args, given, config, None).apply()
    import jax

    n = jax.device_count()
    platform = jax.devices()[0].platform
    dtype = args.compute_dtype or ("float32" if platform == "cpu" else "bfloat16")
    names = {"hidden_size": "d_model", "total_steps": "steps", "warmup_steps": "warmup"}
    values = dict(hidden_size=args.d_model, lr=args.lr, clip=args.clip, weight_decay=args.weight_decay,
                  compute_dtype=dtype, batch=args.batch, gradient_accumulation_steps=args.gradient_accumulation_steps,
                  total_steps=args.steps, warmup_steps=args.warmup)
    micro, rest = divmod(args.batch, n * args.gradient_accumulation_steps)
    values["micro_batch"] = None if rest else micro
    origin = {k: _said(names.get(k, k), v, given) for k, v in values.items() if k != "micro_batch"}
    origin["compute_dtype"] = _said("compute_dtype", args.compute_dtype, given) if args.compute_dtype else \
        f"--compute-dtype not given: {dtype} on {platform}"
    origin["micro_batch"] = f"--batch {args.batch} / {n} devices / {args.gradient_accumulation_steps} accumulation"
    res = ZeroConfig.resolve_deepspeed(args.deepspeed_config, **values, origin=tuple(origin.items()),
                                       hint=(*((k, _flag(names.get(k, k))) for k in values),
                                             ("betas", "a value in the file (no flag sets it)"),
                                             ("eps", "a value in the file (no flag sets it)")))
    return _Flags(args, given, res.config, res, n_devices=n).apply()


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _said(field: str, value: Any, given: frozenset[str]) -> str:
    return f"{_flag(field)} {value}" + ("" if field in given else " (the flag's default)")


class _Flags:
    """Applies the flags to a config read from a file, noting each change in the resolution."""

    def __init__(self, args: Any, given: frozenset[str], config: ZeroConfig, res: Resolution | None,
                 n_devices: int = 1):
        self.args, self.given, self.config, self.res, self.n = args, given, config, res, n_devices
        self.file = args.deepspeed_config or args.config

    def note(self, row: str, value: Any, field: str, why: str = "") -> None:
        if self.res is not None:
            self.res.set(row, value, f"{_flag(field)} (flag{why})")

    def replace(self, **kw: Any) -> None:
        self.config = dataclasses.replace(self.config, **kw)

    def apply(self) -> tuple[Any, ZeroConfig, Resolution | None]:
        a, g = self.args, self.given
        self._tiers()
        for field, row in (("clip", "gradient clipping"), ("persistence_threshold", "persistence threshold"),
                           ("moments_dtype", "moments dtype"),
                           ("gradient_accumulation_steps", "gradient accumulation")):
            if field in g:
                self.replace(**{"gradient_clipping" if field == "clip" else field: getattr(a, field)})
                self.note(row, getattr(a, field), field)
        if "compute_dtype" in g:
            self._dtype(a.compute_dtype)
        for field, row in (("seed", "seed"), ("engine", "engine"), ("nvme_update", "nvme update"),
                           ("optimizer_update", "optimizer update")):
            if field in g or self.res is not None:  # a zinf config has these keys; a DeepSpeed file has none
                self.replace(**{field: getattr(a, field)})
                self.note(row, getattr(a, field), field, "" if field in g else "; the file has no such key: the "
                          "flag's default")
        if "nvme_update" in g and "nvme" not in (self.config.offload_param.device,
                                                 self.config.offload_optimizer.device):
            raise ValueError(f"--nvme-update {a.nvme_update}: no tier is on nvme ({self._where()}); give "
                             "--param-device nvme or --optimizer-device nvme, or drop --nvme-update")
        self._optimizer()
        args = self._batch()
        if self.res is not None:
            self.res.config = self.config
        return args, self.config, self.res

    def _where(self) -> str:
        c = self.config
        return f"params on {c.offload_param.device}, optimizer on {c.offload_optimizer.device}"

    def _tiers(self) -> None:
        a, g, c = self.args, self.given, self.config
        paths = [o.path for o in (c.offload_param, c.offload_optimizer) if o.device == "nvme"]
        default_path = a.nvme_dir if "nvme_dir" in g else (paths[0] if paths else os.path.join(a.run_dir, "nvme"))
        for field, name in (("param_device", "offload_param"), ("optimizer_device", "offload_optimizer")):
            if field not in g:
                continue
            old, dev = getattr(c, name), getattr(a, field)
            path = (old.path if old.device == "nvme" and "nvme_dir" not in g else default_path) if dev == "nvme" else None
            self.replace(**{name: dataclasses.replace(old, device=dev, path=path)})
            self.note(f"{name.replace('offload_', '')} tier", dev + (f" at {path}" if path else ""), field)
        if "nvme_dir" in g:
            on = [n for n in ("offload_param", "offload_optimizer") if getattr(self.config, n).device == "nvme"]
            if not on:
                raise ValueError(f"--nvme-dir {a.nvme_dir}: no tier is on nvme ({self._where()}, from {self.file} "
                                 "and the flags); give --param-device nvme or --optimizer-device nvme with it, or "
                                 "drop --nvme-dir")
            for n in on:
                self.replace(**{n: dataclasses.replace(getattr(self.config, n), path=a.nvme_dir)})
                self.note(f"{n.replace('offload_', '')} tier", f"nvme at {a.nvme_dir}", "nvme_dir")
        self._paths_exist()

    def _paths_exist(self) -> None:
        """An nvme path the file gives (absolute: the job creates only its own folders) must exist."""
        own = {self.args.nvme_dir, os.path.join(self.args.run_dir, "nvme")}
        for name in ("offload_param", "offload_optimizer"):
            off = getattr(self.config, name)
            if off.device != "nvme" or off.path in own or not os.path.isabs(off.path) or os.path.isdir(off.path):
                continue
            key = f"zero_optimization.{name}.nvme_path" if self.res is not None else f"{name}.path"
            if str(self.file).endswith((".yaml", ".yml")):
                key += f" (or the accelerate file's deepspeed_config.{name}_nvme_path)"
            raise ValueError(f"{self.file}: {key} {off.path!r} does not exist; create it, set {key} to a directory "
                             "on a local disk, or give --nvme-dir DIR (which overrides the file's path)")

    def _dtype(self, dtype: str) -> None:
        c = self.config
        live = c.max_live_bytes
        if live is not None:  # the file counts elements: keep the count, in the new dtype's bytes
            live = live // _BYTES[c.compute_dtype or "float32"] * _BYTES[dtype]
        self.replace(compute_dtype=dtype, max_live_bytes=live,
                     loss_scale=dataclasses.replace(c.loss_scale, enabled=None))  # on exactly with float16
        self.note("compute dtype", dtype, "compute_dtype")
        self.note("loss scaling", "dynamic" if dtype == "float16" else "off", "compute_dtype")

    def _optimizer(self) -> None:
        a, g, c = self.args, self.given, self.config
        o = c.optimizer
        schedule = o.schedule if o is not None else (self.res.schedule if self.res is not None else None)
        if o is None and schedule is None:  # the flags' AdamW: warmup, then cosine decay
            if self.res is not None:
                self.res.set("optimizer", "adamw (the CLI's)", "no optimizer section in the file")
                for row, field in (("learning rate", "lr"), ("weight decay", "weight_decay")):
                    self.res.set(row, getattr(a, field), _said(field, getattr(a, field), g))
                self.res.set("lr schedule", f"linear warmup over {a.warmup} steps, cosine decay to 0.1 x lr at step "
                             f"{max(a.steps, a.warmup + 1)}", f"the CLI's (--warmup {a.warmup}, --steps {a.steps})")
            return
        if o is None:  # a scheduler without an optimizer section: the CLI's AdamW follows it
            o = OptimizerConfig(name="adamw", lr=a.lr, weight_decay=a.weight_decay)
            if self.res is not None:
                self.res.set("optimizer", "adamw (the CLI's, following the file's scheduler)",
                             "no optimizer section in the file")
                self.res.set("learning rate", a.lr, _said("lr", a.lr, g))
                self.res.set("weight decay", a.weight_decay, _said("weight_decay", a.weight_decay, g))
        if "lr" in g:
            o = dataclasses.replace(o, lr=a.lr)
            if schedule is not None:
                schedule = dataclasses.replace(schedule, warmup_max_lr=a.lr)
            self.note("learning rate", a.lr, "lr")
        if "weight_decay" in g:
            o = dataclasses.replace(o, weight_decay=a.weight_decay)
            self.note("weight decay", a.weight_decay, "weight_decay")
        if "warmup" in g:
            if schedule is None:
                raise ValueError(f"--warmup {a.warmup}: {self.file} has an optimizer section and no scheduler, so "
                                 "its learning rate is constant (as in DeepSpeed); add a scheduler section (WarmupLR, "
                                 "WarmupDecayLR, WarmupCosineLR) or drop --warmup")
            schedule = dataclasses.replace(schedule, warmup_num_steps=a.warmup)
        if schedule is not None and ("lr" in g or "warmup" in g):
            self.note("lr schedule", schedule.describe(), "lr" if "warmup" not in g else "warmup")
        self.replace(optimizer=dataclasses.replace(o, schedule=schedule))
        if self.res is not None:
            self.res.schedule = schedule

    def _batch(self) -> Any:
        a, g, res = self.args, self.given, self.res
        if res is None or "batch" in g:
            if res is not None and res.batch_keys:
                self.note("batch", f"{a.batch} per step", "batch")
            return a
        k = self.config.gradient_accumulation_steps
        batch = res.batch or (res.micro_batch * self.n * k if res.micro_batch else None)
        if res.batch and res.micro_batch and res.batch != res.micro_batch * self.n * k:
            raise ValueError(f"{self.file}: train_batch_size {res.batch} is not train_micro_batch_size_per_gpu "
                             f"{res.micro_batch} x {self.n} devices x {k} accumulation steps (DeepSpeed refuses "
                             "this too); fix one of them, or give --batch")
        if batch is None or batch == a.batch:
            return a
        return dataclasses.replace(a, batch=batch)
