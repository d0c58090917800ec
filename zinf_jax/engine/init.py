"""Initialisation unit by unit: the model is never materialised whole.

For each unit, the model constructor runs inside ``jax.jit`` returning only that
unit's parameters, already in stored form and sharded over the mesh; XLA drops
the rest of the model from the program. The arrays go straight to the param
tier (and to ``on_param``, e.g. the optimizer's fp32 master) and are released
before the next unit, so host and device memory hold about one unit at a time.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

from zinf_jax.engine.store import ParamStore
from zinf_jax.sharding import to_stored

__all__ = ["init_unit_by_unit", "param_groups"]


def param_groups(adapter: Any) -> list[tuple[str, ...]]:
    """Parameter paths grouped by unit, then the persistent ones outside units."""
    groups = [tuple(u.param_paths) for u in adapter.units]
    if adapter.glue_paths:
        groups.append(tuple(adapter.glue_paths))
    return groups


def init_unit_by_unit(
    adapter: Any,
    store: ParamStore,
    *,
    on_param: Callable[[str, jax.Array], None] | None = None,
    metadata: dict | None = None,
) -> None:
    """Creates every parameter group by group and writes it to ``store``.

    Args:
      adapter: the model adapter.
      store: the parameter store to fill (committed at the end).
      on_param: called with ``(path, stored_fp32_array)`` for each parameter.
      metadata: committed with the store.
    """
    for group in param_groups(adapter):
        arrays: Sequence[jax.Array] = adapter.init_params(
            group, lambda p, v: to_stored(store.layouts[p], v), [store.sharding(p) for p in group]
        )
        futures = []
        for path, arr in zip(group, arrays):
            futures += store.put_array(path, arr)
            if on_param is not None:
                on_param(path, arr)
        for f in futures:
            f.result()
        del arrays
    store.commit(metadata)
