"""Units (gather/release granularity) and the static prefetch plan.

A *unit* is a submodule whose parameters are fetched, gathered and released
together. :class:`UnitPolicy` picks them; the default takes each repeated block
(an item of an ``nnx.List`` or a Linen child named ``Block_0, Block_1, ...``),
each embedding, and every other top-level child larger than the persistence
threshold (the head). Parameters outside every unit belong to the root: small ones
stay on every device, large ones are sharded like a unit's and gathered for the
whole step (see [Note: the root's parameters]).

The order of unit calls, found by one abstract trace, is a :class:`Plan`: plain
data that drives prefetching and can be printed.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Iterable, Mapping, Sequence

from zinf_jax.errors import UnitPolicyError

__all__ = ["UnitPolicy", "Unit", "Plan", "UnitPolicyError", "select_units", "path_str", "persistent_paths", "layer_count"]


def path_str(path: Iterable[Any]) -> str:
    """``("blocks", 0, "mlp")`` -> ``"blocks/0/mlp"``."""
    return "/".join(str(p) for p in path)


@dataclasses.dataclass(frozen=True, kw_only=True)
class UnitPolicy:
    """Which submodules are units.

    Attributes:
      classes: module classes whose instances are units.
      patterns: regular expressions matched (``re.fullmatch``) against the
        ``/``-joined module path, e.g. ``r"blocks/\\d+"`` or ``r"head"``.
      default: also apply the default rules (repeated blocks, embeddings, large
        top-level children).
    """

    classes: tuple[type, ...] = ()
    patterns: tuple[str, ...] = ()
    default: bool = True

    def matches(self, path: tuple[Any, ...], module: Any) -> bool:
        """Whether the user rules select this module."""
        if self.classes and isinstance(module, self.classes):
            return True
        s = path_str(path)
        return any(re.fullmatch(p, s) for p in self.patterns)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Unit:
    """One unit.

    Attributes:
      uid: index in discovery order.
      path: ``/``-joined module path (``"blocks/3"``).
      param_paths: full paths of its parameters, in the order the unit's
        program takes them.
      nbytes: bytes of its parameters in their own dtypes.
    """

    uid: int
    path: str
    param_paths: tuple[str, ...]
    nbytes: int


def layer_count(shapes: Sequence[Sequence[int]]) -> int | None:
    """The number of layers of a unit whose parameters look like a stack of layers (every one at least 2-D,
    all with the same leading size, 2 or more), or ``None``. Called inside the model's scan, such a unit
    is taken to use one layer per iteration (the scan's length must then be that size)."""
    heads = {s[0] for s in shapes}
    if not shapes or len(heads) != 1 or any(len(s) < 2 for s in shapes):
        return None
    n = heads.pop()
    return n if n >= 2 else None


_REPEATED = re.compile(r"^(.*)_(\d+)$")


def _repeated(path: tuple[Any, ...], siblings: Sequence[Any]) -> bool:
    last = path[-1] if path else None
    if isinstance(last, int):
        return True
    m = _REPEATED.match(str(last))
    if not m:
        return False
    prefix = m.group(1)
    return sum(1 for s in siblings if (_REPEATED.match(str(s)) or [None, None])[1] == prefix) >= 2


def persistent_paths(paths: Iterable[str], patterns: Sequence[str]) -> frozenset[str]:
    """The paths ``ZeroConfig.persistent_params`` selects (``re.fullmatch`` of any pattern)."""
    return frozenset(p for p in paths if any(re.fullmatch(pat, p) for pat in patterns))


def select_units(
    modules: Mapping[tuple[Any, ...], Any],
    param_sizes: Mapping[tuple[Any, ...], int],
    policy: UnitPolicy,
    threshold: int,
    *,
    is_embedding: Any = lambda m: False,
    exclude: set[tuple[Any, ...]] = frozenset(),
    persistent: Sequence[str] = (),
) -> list[tuple[Any, ...]]:
    """Chooses unit paths, outermost first, never one inside another.

    Args:
      modules: module path to module object (the root at ``()``).
      param_sizes: parameter path to its number of elements.
      policy: the user's policy.
      threshold: persistence threshold in elements.
      is_embedding: predicate for embedding modules.
      exclude: module paths that must not be units (found unable to run alone).
      persistent: patterns of parameters kept gathered on every device (``ZeroConfig.persistent_params``):
        a module all of whose parameters match is never a unit, and they may be of any size.

    Returns:
      Unit module paths in depth-first order.

    Raises:
      UnitPolicyError: a unit holds some persistent parameters and some that are not.
    """
    kept = persistent_paths([path_str(p) for p in param_sizes], persistent)

    def all_kept(path: tuple[Any, ...]) -> bool:
        mine = [p for p in param_sizes if p[: len(path)] == path]
        return bool(mine) and all(path_str(p) in kept for p in mine)

    def size_under(path: tuple[Any, ...]) -> int:
        n = len(path)
        return sum(s for p, s in param_sizes.items() if p[:n] == path)

    children: dict[tuple[Any, ...], list[Any]] = {}
    for p in modules:
        if p:
            children.setdefault(p[:-1], []).append(p[-1])
    def inside(path: tuple[Any, ...]) -> bool:
        return any(path[: len(c)] == c for c in chosen)

    chosen: list[tuple[Any, ...]] = []
    ordered = sorted(modules, key=lambda p: (len(p), [str(x) for x in p]))
    for path in ordered:  # user rules, repeated blocks, embeddings: outermost first
        if not path or inside(path) or size_under(path) == 0 or path in exclude or all_kept(path):
            continue
        m = modules[path]
        pick = policy.matches(path, m) or (
            policy.default and (_repeated(path, children.get(path[:-1], [])) or is_embedding(m))
        )
        if pick:
            chosen.append(path)
    if policy.default:  # then large top-level children that hold no unit (the head)
        for path in ordered:
            if (len(path) == 1 and path not in exclude and not inside(path) and not all_kept(path)
                    and not any(c[:1] == path for c in chosen)):
                if size_under(path) > threshold:
                    chosen.append(path)
    for c in chosen:
        mixed = [path_str(p) for p in param_sizes if p[: len(c)] == c and path_str(p) in kept]
        if mixed:
            raise UnitPolicyError(
                f"persistent_params selects {mixed[:3]} inside the unit {path_str(c)!r}, which also holds parameters "
                "that are not persistent; a unit is gathered and released whole: select all of its parameters "
                f"(e.g. {path_str(c) + '/.*'!r}), or make the persistent ones a module outside it")
    order = {p: i for i, p in enumerate(modules)}
    return sorted(chosen, key=lambda p: order.get(p, 0))


# [Note: the root's parameters]
# A parameter that no unit holds belongs to the root, as in FSDP2 (whose root module owns every parameter no
# child's fully_shard owns): a frozen table on the model itself (a DiT's pos_embed), a stem beside the unit
# blocks inside their parent (a Whisper encoder's convolutions), a cell run by a lifted scan. Under
# persistence_threshold it stays whole on every device, as always. A larger one is partitioned like a unit's
# parameter (its tier holds shards; its gradient leaves the step reduce-scattered into them) and is gathered
# for the whole step: the engines pass the root's parameters to the loss as they are stored and XLA gathers a
# sharded one where the model uses it. The device holds it whole for the step, so the estimator counts it
# whole, and the build summary names such parameters with the unit policy that would make them a unit.


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static order of unit calls in one forward pass.

    Attributes:
      calls: ``(uid, method)`` per unit call, in forward order.
      units: the units, by uid.
    """

    calls: tuple[tuple[int, str], ...]
    units: tuple[Unit, ...]

    def schedule(self, backward: bool) -> tuple[tuple[int, str], ...]:
        """Fetch order: the forward calls, then (training) the same in reverse."""
        return self.calls + (tuple(reversed(self.calls)) if backward else ())

    def __str__(self) -> str:
        lines = [f"plan: {len(self.calls)} unit calls over {len(self.units)} units"]
        for i, (uid, method) in enumerate(self.calls):
            u = self.units[uid]
            lines.append(f"  {i:3d}  {u.path}.{method}  ({len(u.param_paths)} params, {u.nbytes:,} B)")
        return "\n".join(lines)


def nbytes_of(shapes: Iterable[tuple[tuple[int, ...], Any]]) -> int:
    """Total bytes of (shape, dtype) pairs."""
    import numpy as np

    return sum(math.prod(s) * np.dtype(d).itemsize for s, d in shapes)
