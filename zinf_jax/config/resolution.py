"""What a config file resolved to: each setting that matters, its value and where it came from.

:class:`Resolution` is what :func:`zinf_jax.config.deepspeed.resolve_deepspeed` returns and what
``zinf-jax train`` prints: its ``str`` is a table of settings (value, source: a flag, the config file,
``"auto"`` filled from something named, or a default), then the keys of the file that change nothing
here, the ones that would change training and are not supported, unknown keys, and notes, one line each.
:class:`RunValues` are the values of the run that fill ``"auto"`` (API arguments or CLI flags).
Standard library only.
"""
from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["RunValues", "Setting", "Resolution"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunValues:
    """Values of the run that fill a DeepSpeed config's ``"auto"`` keys, as the Hugging Face integration does.

    ``None``: not given; an ``"auto"`` that needs it is refused naming the key (``betas`` and ``eps``
    fall back to the Hugging Face Trainer's defaults, 0.9/0.999 and 1e-8, and say so).
    """

    hidden_size: int | None = None
    """Model width: ``stage3_param_persistence_threshold`` = 10 h, ``stage3_prefetch_bucket_size`` = 0.9 h^2,
    ``reduce_bucket_size`` = h^2."""
    lr: float | None = None
    """``optimizer.params.lr`` and ``scheduler.params.warmup_max_lr``."""
    clip: float | None = None
    """``gradient_clipping`` (the Trainer's ``max_grad_norm``)."""
    weight_decay: float | None = None
    """``optimizer.params.weight_decay``."""
    betas: tuple[float, float] | None = None
    """``optimizer.params.betas``."""
    eps: float | None = None
    """``optimizer.params.eps``."""
    compute_dtype: str | None = None
    """``fp16.enabled`` / ``bf16.enabled``: ``"float32"``, ``"bfloat16"`` or ``"float16"``."""
    batch: int | None = None
    """``train_batch_size``: sequences per optimizer step, whole job."""
    micro_batch: int | None = None
    """``train_micro_batch_size_per_gpu``: sequences per device per micro-batch."""
    gradient_accumulation_steps: int | None = None
    """``gradient_accumulation_steps``."""
    total_steps: int | None = None
    """``scheduler.params.total_num_steps``: optimizer steps of the run."""
    warmup_steps: int | None = None
    """``scheduler.params.warmup_num_steps``."""
    origin: tuple[tuple[str, str], ...] = ()
    """``(name, how to say where it came from)`` pairs (``("lr", "--lr 0.003")``); default: ``argument lr=...``."""
    hint: tuple[tuple[str, str], ...] = ()
    """``(name, how to give it)`` pairs for the refusal (``("lr", "--lr")``); default: ``lr=...``."""

    def said(self, name: str) -> str:
        """Where the value ``name`` came from."""
        return dict(self.origin).get(name) or f"argument {name}={getattr(self, name)!r}"

    def how(self, name: str) -> str:
        """How the caller gives ``name``."""
        return dict(self.hint).get(name) or f"{name}=..."


@dataclasses.dataclass(frozen=True)
class Setting:
    """One row of the table."""

    name: str
    value: str
    source: str


@dataclasses.dataclass
class Resolution:
    """A config file resolved: the config, the run's own settings, each row's source, and the keys not used.

    Attributes:
      config: the :class:`~zinf_jax.config.ZeroConfig`.
      file: the file (or ``"(dict)"``).
      rows: the settings that matter, in order, each with its source.
      schedule: the learning-rate schedule the file asks for (:class:`~zinf_jax.config.schedule.LRSchedule`),
        also in ``config.optimizer.schedule`` when the file has an ``optimizer`` section.
      batch: sequences per optimizer step (whole job) the file gives, if any.
      micro_batch: sequences per device per micro-batch the file gives, if any.
      batch_keys: the file's batch keys (read by ``zinf-jax train``; the API's batch is what ``train_step`` gets).
      no_effect: keys with no counterpart here and no effect on the numbers.
      unsupported: keys that change training in a way this run does not follow.
      unknown: keys zinf_jax does not know as DeepSpeed keys (typos?).
      notes: how a key was read (a misplaced section, an old spelling...).
    """

    config: Any
    file: str
    rows: list[Setting] = dataclasses.field(default_factory=list)
    schedule: Any = None
    batch: int | None = None
    micro_batch: int | None = None
    batch_keys: list[str] = dataclasses.field(default_factory=list)
    no_effect: list[str] = dataclasses.field(default_factory=list)
    unsupported: list[str] = dataclasses.field(default_factory=list)
    unknown: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    def source(self, name: str) -> str:
        """The source of the row ``name``."""
        return next(r.source for r in self.rows if r.name == name)

    def value(self, name: str) -> str:
        """The value of the row ``name``, as printed."""
        return next(r.value for r in self.rows if r.name == name)

    def set(self, name: str, value: Any, source: str) -> None:
        """Sets (or adds) the row ``name``."""
        row = Setting(name, value if isinstance(value, str) else _show(value), source)
        for i, r in enumerate(self.rows):
            if r.name == name:
                self.rows[i] = row
                return
        self.rows.append(row)

    def unused_lines(self) -> list[str]:
        """The keys not used and the notes: one line per kind (none if there is nothing to say)."""
        kinds = [("no counterpart here, no effect on the numbers", self.no_effect),
                 ("changes training, not supported", self.unsupported),
                 ("not DeepSpeed keys zinf_jax knows (typos?)", self.unknown)]
        return [f"{what}: {', '.join(keys)}" for what, keys in kinds if keys] + [f"note: {n}" for n in self.notes]

    def __str__(self) -> str:
        width = max((len(r.name) for r in self.rows), default=0)
        vwidth = min(max((len(r.value) for r in self.rows), default=0), 48)
        lines = [f"settings resolved from {self.file}:"]
        lines += [f"  {r.name:<{width}}  {r.value:<{vwidth}}  <- {r.source}" for r in self.rows]
        lines += [f"  {line}" for line in self.unused_lines()]
        return "\n".join(lines)


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple):
        return "(" + ", ".join(_show(v) for v in value) + ")"
    return str(value)
