"""What the engine decided, in words: the build summary a user reads before the first step.

:func:`describe` answers what a newcomer asks after ``initialize``: which engine runs, what the units
are, which parameters are sharded and which stay whole (and why: ``persistence_threshold``), where each
tier is and what it holds, how the optimizer runs. :func:`advice` lists the choices that are probably
not what the user wanted (nothing sharded; one unit holding most of the model). The engine logs both
once at build (logger ``zinf_jax``: the summary at INFO, the advice at WARNING) and returns the summary
from ``Engine.describe()``; :func:`format_step` is the CLI's progress line for a user's own loop.
"""
from __future__ import annotations

import math
from typing import Any

from zinf_jax._internal.fmt import human_bytes
from zinf_jax.plan.partition import zero_axes_of

__all__ = ["describe", "advice", "format_step"]

_UNITS_SHOWN = 4
"""Units named one by one in the summary (the rest are counted)."""

_MOST = 0.5
"""A unit holding more than this share of the model's bytes is reported (it is gathered whole on each device)..."""
_WORTH = 256 << 20
"""... when it holds at least this many bytes (a smaller unit gathers whole on any accelerator)."""


def _bytes_of(layout: Any) -> int:
    import numpy as np

    return math.prod(layout.shape) * np.dtype(layout.dtype).itemsize


def _optimizer(components: Any) -> str:
    rule = components.optimizer.rule
    where = "in the step's program" if getattr(components.passes, "fused", None) is not None else "on the host"
    name = getattr(rule, "name", None)
    if name is None:
        return f"zinf's Adam (fused CPU kernel, chunk by chunk), {where}"
    if getattr(rule, "tree", None) is not None:
        return f"optax {name}: the whole tree in one update ({rule.tree}), {where}"
    whole = [p for p in components.trainable if rule.whole(p)]
    out = f"optax {name}: chunk by chunk"
    if whole:
        out += f", {len(whole)} of {len(components.trainable)} parameters whole tensor by tensor ({rule.why[whole[0]]})"
    return f"{out}, {where}"


def _where(tier: Any, device: str, path: str | None, *, masters: bool = False) -> str:
    """Where a tier is and the bytes it holds; ``masters``: the parameters' tier, whose trained float32 values may
    be the optimizer's masters (no copy of their own)."""
    held = getattr(tier, "stored_bytes", None)
    n = held() if held is not None else None
    size = "" if n is None else (", the optimizer's float32 masters (no copy of their own)" if masters and n == 0
                                 else f", {human_bytes(n)}")
    if device == "none":
        return f"on the devices{size}"
    return ("host RAM" if device == "cpu" else f"nvme at {path}") + size


def _units(units: list[Any]) -> str:
    shown = ", ".join(f"{u.path!r} {human_bytes(u.nbytes)}" for u in units[:_UNITS_SHOWN])
    more = f", and {len(units) - _UNITS_SHOWN} more" if len(units) > _UNITS_SHOWN else ""
    return f"{len(units)} ({shown}{more})" if units else "none"


def describe(components: Any) -> str:
    """The build summary of an engine's parts (:class:`~zinf_jax.engine.build.Components`), as lines of text.

    Which engine runs, the model's size, what is sharded and what stays whole (and why), the units
    (gathered whole for their call, released after), the tiers and the bytes they hold, how the
    optimizer runs, and a ``note:`` line per :func:`advice`.
    """
    c, cfg = components, components.config
    lays = c.layouts
    total = sum(_bytes_of(l) for l in lays.values())
    sharded = [p for p, l in lays.items() if l.kind != "persistent"]
    whole = [p for p in lays if p not in sharded]
    units = list(c.adapter.units)
    pl = c.placement
    how = "one XLA program per step" if pl.engine == "compiled" else "a program per unit, shards fetched between them"
    over = "x".join(zero_axes_of(c.mesh, cfg.zero_axes))
    lines = [
        f"zinf_jax engine: {pl.engine} ({how}), compute dtype {c.compute_dtype}, mesh {dict(c.mesh.shape)}",
        f"model: {len(lays)} parameters, {human_bytes(total)}; {len(c.trainable)} trained",
        f"sharded over {over}: {len(sharded)} parameters ({human_bytes(sum(_bytes_of(lays[p]) for p in sharded))}); "
        f"whole on every device: {len(whole)} ({human_bytes(sum(_bytes_of(lays[p]) for p in whole))}), "
        f"those under persistence_threshold ({cfg.persistence_threshold:,} elements) or in persistent_params",
        f"units, each gathered for its call and released after: {_units(units)}; "
        f"outside every unit (kept gathered): {len(c.adapter.glue_paths)} parameters",
        f"params: {_where(c.param_tier, pl.params.device, pl.params.path, masters=bool(c.trainable))}; "
        f"optimizer state: {_where(c.opt_tier, pl.optimizer.device, pl.optimizer.path)}; "
        f"gradients: {'nvme scratch' if pl.grads is not None else 'host RAM'}",
        f"optimizer: {_optimizer(c)}",
    ]
    return "\n".join(lines + [f"note: {a}" for a in advice(components)])


def advice(components: Any) -> list[str]:
    """Choices in ``components`` that are probably not what the user wanted, each with its fix."""
    c = components
    lays = c.layouts
    out = []
    devices = math.prod(dict(c.mesh.shape).values())
    if devices > 1 and all(l.kind == "persistent" for l in lays.values()):
        out.append(f"nothing is sharded: every parameter has fewer than persistence_threshold "
                   f"({c.config.persistence_threshold:,}) elements, so each device holds the whole model and its "
                   "gradients; lower ZeroConfig(persistence_threshold=...) to shard them")
    root = [p for p in c.adapter.glue_paths if lays[p].kind != "persistent"]
    if root:  # [Note: the root's parameters] in zinf_jax.plan.units
        owners = sorted({p.rsplit("/", 1)[0] for p in root if "/" in p})
        fix = (f"UnitPolicy(patterns={tuple(owners)!r}) makes their modules units" if owners else
               "a submodule that is a unit would hold them")
        out.append(f"{len(root)} parameters above persistence_threshold are outside every unit ({', '.join(root[:4])}"
                   f"{', ...' if len(root) > 4 else ''}): sharded, and gathered on every device for the whole step "
                   f"({human_bytes(sum(_bytes_of(lays[p]) for p in root))}); {fix}")
    total = sum(_bytes_of(l) for l in lays.values())
    units = list(c.adapter.units)
    if total and len(units) > 1:
        big = max(units, key=lambda u: u.nbytes)
        if big.nbytes > _MOST * total and big.nbytes >= _WORTH:
            out.append(f"unit {big.path!r} holds {big.nbytes / total:.0%} of the model's bytes: it is gathered whole "
                       "on each device for its call; UnitPolicy(patterns=...) can cut it finer")
    return out


def format_step(metrics: dict[str, Any], total: int | None = None) -> str:
    """One line for a step's metrics (what :meth:`~zinf_jax.Engine.train_step` returns): the CLI's progress line,
    for a user's own loop.

    Args:
      metrics: a step's metrics.
      total: the step the run goes to, shown as ``step 12/100``.

    Returns:
      ``step, loss, tokens/s, the step's time and the share of it spent waiting for parameter reads, the device's
      peak bytes and the bytes each tier holds``, e.g. ``step 3/10 loss 5.1023 812 tok/s 142 ms (fetch wait 12%)
      dev 3.2MiB params 1.1MiB optimizer 4.3MiB``.
    """
    m = metrics
    step = f"{m.get('step', '?')}" + (f"/{total}" if total else "")
    seconds = m.get("step_time_s", 0.0)
    wait = (m.get("time_split") or {}).get("fetch_wait_s")
    share = f" (fetch wait {wait / seconds:.0%})" if wait is not None and seconds > 0 else ""
    return (f"step {step} loss {m['loss']:.4f} {m.get('tokens_per_s', 0):.0f} tok/s {seconds * 1e3:.0f} ms{share} "
            f"dev {human_bytes(m.get('peak_device_bytes', 0), '')} "
            f"params {human_bytes(m.get('bytes_param_tier', 0), '')} "
            f"optimizer {human_bytes(m.get('bytes_optimizer_tier', 0), '')}")
