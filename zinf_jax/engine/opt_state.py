"""The optimizer's state and hyperparameters as a user of optax reads and sets them.

A plain optax loop holds ``opt_state`` and reads it (``optax.contrib.schedule_free_eval_params(opt_state,
params)``, ``opt_state.hyperparams['learning_rate'] = x``). The engine keeps that state in pieces: per
parameter, its element-wise leaves sharded and chunked in the optimizer tier, its scalars and
other-shaped leaves beside it (:mod:`~zinf_jax.optim.optax_rule`). :func:`optimizer_state` puts the
pieces back together, one parameter at a time from its tier (``path=``) or as the whole tree, in the
structure ``tx.init`` gives for the model's own parameters (``nnx.State`` or a Linen dict), so it goes
where an optax state goes. Hyperparameters of ``optax.inject_hyperparams`` are read and set by name
(:meth:`~zinf_jax.optim.optax_rule.OptaxRule.set_hyperparams`); they take effect at the next step in every
placement and are saved with the optimizer's counters.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from zinf_jax.errors import ConfigError
from zinf_jax.optim.optax_rule import OptaxRule
from zinf_jax.plan.partition import from_stored

__all__ = ["optimizer_state", "rule_of"]


def rule_of(components: Any, what: str) -> OptaxRule:
    """The engine's optax rule.

    Raises:
      ConfigError: the engine runs zinf's own Adam (no optax state, no injected hyperparameters).
    """
    rule = components.optimizer.rule
    if not isinstance(rule, OptaxRule):
        raise ConfigError(f"engine.{what}: the engine runs zinf's own Adam (zinf_jax.adamw/adam: the fused kernel), "
                          "which keeps no optax state. Fix: pass an optax transform as optimizer= (e.g. "
                          "optax.inject_hyperparams(optax.adamw)(learning_rate=...) to change it between steps)",
                          field="optimizer")
    return rule


def _value(components: Any, path: str, state: str) -> np.ndarray:
    """One optimizer state of ``path`` (``"s0"``...) whole, float32, in the parameter's own shape.

    Raises:
      RuntimeError: this process holds only some of its shards (a multi-process job).
    """
    lay = components.layouts[path]
    local = components.store.local_indices(path)
    if len(local) != lay.num_shards:
        raise RuntimeError("optimizer_state(): this process holds only some shards; use checkpoints to read all")
    shards = [components.optimizer.read_state(path, i, state) for i in local]
    full = shards[0] if lay.dim is None else np.concatenate(shards, axis=lay.dim)
    return np.asarray(from_stored(lay, full))


def _path_state(components: Any, rule: OptaxRule, path: str) -> Any:
    """One parameter's state (a one-leaf tree's, at its path), its tier states read whole."""
    names = [s for s in components.optimizer.state_names(path) if s != "master"]
    return rule.state_of(path, [_value(components, path, s) for s in names])


def optimizer_state(components: Any, path: str | None = None) -> Any:
    """The optax state of one parameter (``path``: the state of a one-leaf tree at that path) or of every one (the
    state ``tx.init`` gives for the model's parameters, in their structure). See the module doc.

    Raises:
      ConfigError: the engine runs zinf's own Adam, or ``path`` is not a trained parameter.
      RuntimeError: this process holds only some shards (a multi-process job).
    """
    rule = rule_of(components, "optimizer_state()")
    if path is not None:
        if path not in components.trainable:
            raise ConfigError(f"engine.optimizer_state: {path!r} is not a trained parameter (trained: e.g. "
                              f"{sorted(components.trainable)[:3]})", field="path")
        return _path_state(components, rule, path)
    paths = [p for p in components.layouts if p in components.trainable]
    ours = rule.tree_state({p: _path_state(components, rule, p) for p in paths})
    return _in_model_structure(components, rule, paths, ours)


def _in_model_structure(components: Any, rule: OptaxRule, paths: list[str], ours: Any) -> Any:
    """``ours`` (the state for the tree of nested path dicts) as ``tx.init`` lays it out for the model's own
    parameter structure: each leaf found by its key path, a parameter's part of it translated."""
    shapes = {p: jax.ShapeDtypeStruct(tuple(components.layouts[p].shape), np.float32) for p in paths}
    model = components.adapter.structure(shapes)
    theirs = jax.eval_shape(rule.tx.init, model)
    mine = {jax.tree_util.keystr(k): x for k, x in jax.tree_util.tree_flatten_with_path(ours)[0]}
    user_keys = {}  # the model structure's key path of each parameter -> our nested-dict key path
    for k, x in jax.tree_util.tree_flatten_with_path(model)[0]:
        path = next(p for p in paths if shapes[p] is x)
        user_keys[jax.tree_util.keystr(k)] = jax.tree_util.keystr(tuple(jax.tree_util.DictKey(s)
                                                                        for s in path.split("/")))
    leaves = []
    pairs, treedef = jax.tree_util.tree_flatten_with_path(theirs)
    for k, _ in pairs:
        kp = jax.tree_util.keystr(k)
        for their, our in sorted(user_keys.items(), key=lambda t: -len(t[0])):
            if kp.endswith(their):
                kp = kp[:len(kp) - len(their)] + our
                break
        leaves.append(mine[kp])
    return jax.tree.unflatten(treedef, leaves)

