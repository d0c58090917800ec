"""Update rules: what the streamed optimizer does to one sub-group.

The driver (:mod:`zinf_jax.optim.driver`) moves sub-groups of the optimizer
state between the tier and RAM and computes the global gradient norm; a *rule*
says which per-element state a parameter has besides its float32 master copy
and how one sub-group is updated. Two rules exist:

* :class:`AdamRule`: Adam / AdamW from an :class:`~zinf_jax.optim.AdamSpec`,
  the fused in-place kernel (the fast path);
* :class:`~zinf_jax.optim.optax_rule.OptaxRule`: any optax ``GradientTransformation``, run on the
  host CPU backend per sub-group where it is element-wise and per whole parameter elsewhere
  ([Note: whole-tensor updates] in :mod:`~zinf_jax.optim.work`), or over the whole tree in one update
  where one parameter's update reads another's ([Note: split proofs]).

Every per-element state is stored as float32 chunks of the master's chunking,
key ``f"{name}/{path}"`` in the optimizer tier.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Hashable, Mapping, Protocol, Sequence

import numpy as np

from zinf_jax.errors import ConfigError
from zinf_jax.optim.adam import AdamSpec, adam_coefficients, apply_adam
from zinf_jax.optim.kernel import AdamCoefficients
from zinf_jax.optim.subgroups import Span, sub_groups

Shard = tuple[str, tuple[int, ...], Sequence[np.ndarray], np.ndarray]
"""``(path, shape, arrays, grad)``: one whole shard for ``UpdateRule.update_each``."""

__all__ = ["UpdateRule", "AdamRule", "make_rule", "rule_for", "WholeSets", "whole_sets"]


class UpdateRule(Protocol):
    """What the driver needs from an update rule."""

    clip_norm: float | None  # global-norm clipping the driver folds into the gradient multiplier

    def state_names(self, path: str) -> tuple[str, ...]:
        """Names of the per-element states of ``path`` besides ``"master"``."""

    def init_states(self, path: str, master: np.ndarray) -> list[np.ndarray] | None:
        """Initial states of one chunk (``None``: all zeros)."""

    def lr_at(self, count: int) -> float | None:
        """Learning rate of the step after ``count`` applied steps (``None`` if the rule has no single one)."""

    def begin_step(self, value: float | None) -> None:
        """A step begins; ``value``: its loss (``None``: not known), for rules whose update reads it."""

    def update(self, path: str, shape: tuple[int, ...], arrays: Sequence[np.ndarray], grad: np.ndarray, *,
               valid: int, step: int, lr: float | None, mult: np.float32) -> None:
        """Updates ``arrays`` (master then states, full padded chunks) in place from ``grad`` (``valid`` elements)."""

    def pack_key(self, path: str, shape: tuple[int, ...]) -> Hashable:
        """Parameters with equal keys may be updated together as one array (:meth:`update_many`)."""

    def update_many(self, spans: Sequence[Span], arrays: Sequence[np.ndarray], grad: np.ndarray, *,
                    step: int, lr: float | None, mult: np.float32) -> None:
        """Updates the whole shards of several parameters packed into ``arrays`` (and ``grad``) in place.

        ``spans``: ``(path, shape, start, stop)`` of each shard in the packed arrays, in order and side by
        side (each starts where the one before stops); ``stop - start`` elements each, no padding.
        """

    def update_each(self, shards: Sequence[Shard], *, step: int, lr: float | None, mult: np.float32) -> None:
        """Updates several whole shards in place, each in its own arrays (a pack updated in the tier's arrays:
        [Note: updates in place] in :mod:`~zinf_jax.optim.driver`).

        ``shards``: ``(path, shape, arrays, grad)`` each, ``arrays`` the master then the states (at least
        ``len(grad)`` elements each; the first ``len(grad)`` are the shard).
        """

    def end_step(self, applied: bool) -> None:
        """The step is over (``applied`` False: skipped, nothing may change)."""

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready scalar state (step counters of optax transforms)."""

    def load_state_dict(self, state: Mapping[str, Any], *, checkpoint: bool = False) -> None:
        """Inverse of :meth:`state_dict` (``checkpoint``: read from a checkpoint by a rule built now, not put back
        after a failed step)."""


class AdamRule:
    """Adam(W) with the fused in-place kernel: states ``m`` and ``v``, initially zero."""

    def __init__(self, spec: AdamSpec):
        self.spec = spec
        self._decays: dict[str, float] = {}  # path -> its weight decay (the mask asked once)
        self.clip_norm = spec.clip_norm

    def state_names(self, path: str) -> tuple[str, ...]:
        return ("m", "v")

    def init_states(self, path: str, master: np.ndarray) -> list[np.ndarray] | None:
        return None

    def lr_at(self, count: int) -> float | None:
        return float(self.spec.lr_at(count))

    def update(self, path: str, shape: tuple[int, ...], arrays: Sequence[np.ndarray], grad: np.ndarray, *,
               valid: int, step: int, lr: float | None, mult: np.float32) -> None:
        # a padded tail stays zero: never touched
        self.update_many([(path, shape, 0, valid)], arrays, grad, step=step, lr=lr, mult=mult)

    def begin_step(self, value: float | None) -> None:
        pass

    def pack_key(self, path: str, shape: tuple[int, ...]) -> Hashable:
        return self.spec.decay_for(path, shape)

    def update_many(self, spans: Sequence[Span], arrays: Sequence[np.ndarray], grad: np.ndarray, *,
                    step: int, lr: float | None, mult: np.float32) -> None:
        """One kernel call per run of adjacent shards with the same weight decay (element-wise: the same numbers)."""
        decays = [self._decay(path, shape) for path, shape, _, _ in spans]
        i = 0
        while i < len(spans):  # spans lie side by side: a run of equal decay is one slice
            j = i
            while j + 1 < len(spans) and decays[j + 1] == decays[i]:
                j += 1
            start, stop = spans[i][2], spans[j][3]
            p, m, v = (a[start:stop] for a in arrays)
            apply_adam(p, m, v, grad[start:stop], self._coefficients(decays[i], step, lr, mult))
            i = j + 1

    def update_each(self, shards: Sequence[Shard], *, step: int, lr: float | None, mult: np.float32) -> None:
        """One kernel call per shard, the step's scalars computed once per weight decay."""
        coeffs: dict[float, AdamCoefficients] = {}
        for path, shape, (p, m, v), g in shards:
            decay = self._decay(path, shape)
            if decay not in coeffs:
                coeffs[decay] = self._coefficients(decay, step, lr, mult)
            n = g.shape[0]
            apply_adam(p[:n], m[:n], v[:n], g, coeffs[decay])

    def _decay(self, path: str, shape: tuple[int, ...]) -> float:
        hit = self._decays.get(path)
        if hit is None:
            hit = self._decays[path] = self.spec.decay_for(path, shape)
        return hit

    def _coefficients(self, decay: float, step: int, lr: float | None, mult: np.float32) -> AdamCoefficients:
        """The step's scalars for shards of weight decay ``decay``."""
        sp = self.spec
        return adam_coefficients(step=step, lr=lr, b1=sp.b1, b2=sp.b2, eps=sp.eps, eps_root=sp.eps_root,
                                 weight_decay=decay, grad_scale=mult)

    def end_step(self, applied: bool) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any], *, checkpoint: bool = False) -> None:
        pass


def make_rule(optimizer: Any, layouts: Mapping[str, Any], chunks: Mapping[str, int]) -> UpdateRule:
    """The rule for ``optimizer``: an :class:`AdamSpec` or an optax ``GradientTransformation``.

    Raises:
      ConfigError: neither, or an optax transform the driver cannot run (with the reason and the fix).
    """
    if isinstance(optimizer, AdamSpec):
        return AdamRule(optimizer)
    import optax

    if isinstance(optimizer, (optax.GradientTransformation, optax.MultiSteps)):
        from zinf_jax.optim.optax_rule import OptaxRule

        return OptaxRule(optimizer, layouts, chunks)
    raise ConfigError(f"optimizer: takes zinf_jax.adamw(...)/adam(...), an optax GradientTransformation or an "
                      f"optax.MultiSteps, got {type(optimizer).__name__}", field="optimizer")


def rule_for(optimizer: Any, layouts: Mapping[str, Any], sub_group_size: int) -> UpdateRule:
    """:func:`make_rule` for ``layouts`` cut into the sub-groups the driver cuts them into (``sub_group_size``)."""
    return make_rule(optimizer, layouts,
                     {p: sub_groups(math.prod(lay.shard_shape), sub_group_size)[0] for p, lay in layouts.items()})


@dataclasses.dataclass(frozen=True)
class WholeSets:
    """What the parameters a rule updates whole tensor by tensor add to the streamed step's host buffers
    ([Note: whole-tensor updates] in :mod:`~zinf_jax.optim.work`).

    Attributes:
      elements: elements of one buffer set (the largest such parameter's local shards, padded to whole
        sub-groups; every parameter's together for a tree-coupled rule; 0: none).
      arrays: float32 arrays of a set (master, the most states of any parameter, the gradient).
      gather_bytes: a multi-process job's temporaries while one such parameter is gathered (every process's
        shards as received, and the whole tensor's arrays; 0 with one process).
      paths: the parameters updated whole (each one unit of the step's work, never cut nor packed).
    """

    elements: int = 0
    arrays: int = 0
    gather_bytes: int = 0
    paths: frozenset = frozenset()

    @property
    def set_bytes(self) -> int:
        """Bytes of one buffer set this large."""
        return 4 * self.elements * self.arrays


def whole_sets(rule: Any, layouts: Mapping[str, Any], shards: Mapping[str, int], sub_group_size: int,
               processes: int = 1) -> WholeSets:
    """The buffer geometry :class:`~zinf_jax.optim.driver.StreamedOptimizer` allocates for ``rule``'s
    whole-tensor parameters among ``layouts`` (``shards``: how many of each this process stores)."""
    whole = [p for p in layouts if getattr(rule, "whole", lambda p: False)(p)]
    if not whole:
        return WholeSets()
    arrays = 2 + max(len(rule.state_names(p)) for p in layouts)  # master, states, gradient
    padded = {p: math.prod(sub_groups(math.prod(layouts[p].shard_shape), sub_group_size)) for p in whole}
    gathers = [4 * arrays * padded[p] * (layouts[p].num_shards + processes * shards[p]) for p in whole]
    elements = [shards[p] * padded[p] for p in whole]
    together = getattr(rule, "tree", None) is not None  # one unit of every parameter: [Note: split proofs]
    return WholeSets(elements=sum(elements) if together else max(elements), arrays=arrays,
                     gather_bytes=(sum(gathers) if together else max(gathers)) if processes > 1 else 0,
                     paths=frozenset(whole))
