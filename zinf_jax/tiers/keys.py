"""The declared keys of a tier: each key's shard layout and the shard indices this process stores.

Every tier (:mod:`zinf_jax.tiers.memory`, :mod:`zinf_jax.tiers.nvme`) holds one
:class:`KeyRegistry` and answers :meth:`~zinf_jax.tiers.base.Tier.declare`,
:meth:`~zinf_jax.tiers.base.Tier.keys`, :meth:`~zinf_jax.tiers.base.Tier.spec` and
:meth:`~zinf_jax.tiers.base.Tier.local_indices` from it. A key may be declared again
with the same spec (its local indices are replaced); a different spec is a
:class:`~zinf_jax.tiers.base.TierError`, worded by the tier (the NVMe tier's names its
directory, which may hold another model's state).
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

from zinf_jax.tiers.base import ShardSpec, TierError

__all__ = ["KeyRegistry", "Conflict"]

Conflict = Callable[[str, ShardSpec, ShardSpec], str]
"""Words the error for a key re-declared with another spec: ``(key, declared spec, new spec) -> message``."""


class KeyRegistry:
    """Declared keys: their :class:`ShardSpec` and the shard indices stored by this process.

    Args:
      kind: the owning tier's kind (``"device"``, ``"cpu"``, ``"nvme"``), the first word of every message.
      specs: keys known before any declaration (a committed manifest's), with their specs.
      local: their local shard indices (the same keys as ``specs``).
      conflict: the message for a key re-declared with a different spec (default:
        ``"<kind> tier: key 'k' already declared as <old>, not <new>"``).
    """

    def __init__(
        self,
        kind: str,
        *,
        specs: Mapping[str, ShardSpec] | None = None,
        local: Mapping[str, Sequence[int]] | None = None,
        conflict: Conflict | None = None,
    ):
        self.kind = kind
        self._specs: dict[str, ShardSpec] = dict(specs or {})
        self._local: dict[str, list[int]] = {k: list(v) for k, v in (local or {}).items()}
        if set(self._specs) != set(self._local):
            raise ValueError("KeyRegistry: specs and local must name the same keys")
        self._conflict: Conflict = conflict or self._already_declared
        self._held: dict[str, frozenset[int]] = {}  # local indices as sets, made on first use

    def _already_declared(self, key: str, old: ShardSpec, new: ShardSpec) -> str:
        return f"{self.kind} tier: key {key!r} already declared as {old}, not {new}"

    def declare(self, key: str, spec: ShardSpec, local_indices: Sequence[int] | None = None) -> None:
        """Registers ``key`` (again) with its layout.

        Args:
          key: the name, ``/``-separated.
          spec: shard shape, dtype and count.
          local_indices: the shard indices this process stores (default: all), kept sorted.

        Raises:
          TierError: ``key`` is declared with a different spec.
        """
        old = self._specs.get(key)
        if old is not None and old != spec:
            raise TierError(self._conflict(key, old, spec))
        self._specs[key] = spec
        self._local[key] = sorted(range(spec.num_shards) if local_indices is None else local_indices)
        self._held.pop(key, None)

    def keys(self) -> list[str]:
        """Declared keys, in declaration order."""
        return list(self._specs)

    def spec(self, key: str) -> ShardSpec:
        """The declared layout of ``key``.

        Raises:
          TierError: ``key`` was never declared.
        """
        try:
            return self._specs[key]
        except KeyError:
            raise TierError(f"{self.kind} tier: unknown key {key!r}; declare it first") from None

    def holds(self, key: str, index: int) -> bool:
        """Whether shard ``index`` of ``key`` is stored by this process (no copy: every transfer asks).

        Raises:
          TierError: ``key`` was never declared.
        """
        held = self._held.get(key)
        if held is None:
            self.spec(key)
            held = self._held[key] = frozenset(self._local[key])
        return index in held

    def local_indices(self, key: str) -> list[int]:
        """Shard indices of ``key`` stored by this process (a copy).

        Raises:
          TierError: ``key`` was never declared.
        """
        self.spec(key)
        return list(self._local[key])
