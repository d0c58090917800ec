"""One place that turns what the user passes as ``model`` into an adapter."""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import flax.linen as nn
from jax.sharding import Mesh

from zinf_jax.engine.linen_adapter import LinenAdapter
from zinf_jax.engine.nnx_adapter import NnxAdapter
from zinf_jax.plan.units import UnitPolicy

__all__ = ["make_adapter"]


def make_adapter(model: Callable[[], Any] | nn.Module, *, policy: UnitPolicy | None, threshold: int, seed: int,
                 init_args: tuple = (), init_kwargs: Mapping[str, Any] | None = None,
                 logical_axis_rules: Any = None, persistent: Sequence[str] = (),
                 mesh: Mesh | None = None) -> NnxAdapter | LinenAdapter:
    """The adapter for an NNX constructor or a Linen module (``persistent``: ``ZeroConfig.persistent_params``;
    ``mesh``: the user's, see :class:`~zinf_jax.engine.nnx_adapter.NnxAdapter`).

    Raises:
      TypeError: ``model`` is neither.
    """
    policy = policy or UnitPolicy()
    if isinstance(model, nn.Module):
        return LinenAdapter(model, tuple(init_args), dict(init_kwargs or {}), policy, threshold, seed,
                            logical_axis_rules, persistent=persistent)
    if callable(model):
        return NnxAdapter(model, policy, threshold, persistent=persistent, mesh=mesh)
    raise TypeError(f"model must be an NNX constructor (a callable) or a Linen module, got {type(model).__name__}")


def trainable_paths(adapter: Any, trainable: Any) -> frozenset[str]:
    """The paths ``trainable`` selects (all parameters when ``None``); selecting none is an error."""
    if trainable is None:
        return frozenset(adapter.abstract_params)
    paths = frozenset(adapter.select(trainable))
    if not paths:
        raise ValueError(f"trainable={trainable!r} selects no parameter of the model; parameters are e.g. "
                         f"{sorted(adapter.abstract_params)[:4]}")
    return paths
