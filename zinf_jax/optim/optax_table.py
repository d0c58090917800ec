"""How each kind of optax transform runs in each placement, from the proofs the engine itself runs.

The table in ``docs/guides/optimizers.md`` is generated from :func:`rows` when the docs are built: each
transform of :data:`CATALOGUE` is proved (:func:`~zinf_jax.optim.optax_split.prove`) on a small tree
of a matrix, a vector and a scale, exactly as the engine proves it on a model, and the row says what
the proof decided. A transform the engine refuses shows the refusal's reason.
"""
from __future__ import annotations

from typing import Any, Callable

__all__ = ["CATALOGUE", "rows", "table_md"]

_SHAPES = {"dense/kernel": (64, 32), "dense/bias": (32,), "norm/scale": (32,)}


def _catalogue() -> dict[str, Callable[[], Any]]:
    import jax
    import optax
    from optax import contrib

    matrices = lambda t: jax.tree.map(lambda x: x.ndim > 1, t)  # noqa: E731
    return {
        "sgd, momentum, nesterov": lambda: optax.sgd(0.1, momentum=0.9),
        "adam, adamw, nadam, radam, adamax, adan, lion, adagrad, rmsprop": lambda: optax.adamw(1e-3),
        "inject_hyperparams(adamw)": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3),
        "contrib.schedule_free_adamw": lambda: contrib.schedule_free_adamw(1e-3),
        "chain(clip_by_global_norm, ...)": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
        "chain(..., contrib.reduce_on_plateau)": lambda: optax.chain(optax.adam(1e-3),
                                                                   contrib.reduce_on_plateau()),
        "lars (trust ratio on matrices)": lambda: optax.lars(0.1, trust_ratio_mask=matrices),
        "lamb, novograd": lambda: optax.lamb(1e-3),
        "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=8),
        "contrib.muon": lambda: contrib.muon(1e-3),
        "contrib.prodigy": lambda: contrib.prodigy(),
        "contrib.dadapt_adamw": lambda: contrib.dadapt_adamw(),
        "contrib.mechanize(adam)": lambda: contrib.mechanize(optax.adam(1e-3)),
        "polyak_sgd, contrib.momo": lambda: optax.polyak_sgd(),
        "noisy_sgd": lambda: optax.noisy_sgd(1e-2, key=jax.random.key(0)),
        "chain(scale_by_adam, clip_by_global_norm, ...)": lambda: optax.chain(
            optax.scale_by_adam(), optax.clip_by_global_norm(1.0), optax.scale(-1e-3)),
        "lbfgs": lambda: optax.lbfgs(),
    }


CATALOGUE = _catalogue
"""The transforms the table shows, by label (a function: optax is imported only when asked)."""


def _row(label: str, make: Callable[[], Any]) -> tuple[str, str, str, str]:
    from zinf_jax.errors import ConfigError
    from zinf_jax.optim.optax_rule import OptaxRule
    from zinf_jax.plan.partition import ParamLayout

    layouts = {p: ParamLayout(path=p, shape=s, dtype="float32", kind="persistent", dim=None, num_shards=1,
                              axes=(), gathered=()) for p, s in _SHAPES.items()}
    try:
        rule = OptaxRule(make(), layouts, {p: 4 for p in layouts})
    except ConfigError as e:
        return label, f"refused: {e.detail}", "refused", "refused"
    value = "; reads the loss (`value=`)" if rule.reads_value else ""
    if rule.calls_loss:
        return (label, f"whole tree: {rule.tree}; calls the loss (`value_fn`) in its line search",
                "refused: only the step's program has the loss to call", "one update over the tree, the loss "
                "and its gradient at each trial point computed by the step (params and state in device memory)")
    if rule.tree is not None:
        return (label, f"whole tree: {rule.tree}{value}", "the whole tree in one update (all of its state in host "
                "RAM at once)", "one update over the tree")
    whole = sorted(p for p in layouts if rule.whole(p))
    if not whole:
        return label, f"chunk by chunk (element-wise){value}", "chunk by chunk; small shards in packs", \
            "per parameter"
    which = "matrices" if whole == ["dense/kernel"] else "every parameter"
    why = rule.why[whole[0]]
    return (label, f"whole tensor on {which}: {why}{value}", "whole tensor by tensor" +
            ("; vectors chunk by chunk" if which == "matrices" else ""), "per parameter")


def rows() -> list[tuple[str, str, str, str]]:
    """``(transform, what the proof decided, host update (offload_optimizer cpu or nvme), in the step's program
    (state in device memory, or optimizer_update="device"))`` per :data:`CATALOGUE` entry."""
    return [_row(label, make) for label, make in CATALOGUE().items()]


def table_md() -> str:
    """:func:`rows` as a Markdown table."""
    out = ["| transform | proven split | host update (cpu, nvme) | in the step's program |", "| --- | --- | --- | --- |"]
    for row in rows():
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
    return "\n".join(out) + "\n"
