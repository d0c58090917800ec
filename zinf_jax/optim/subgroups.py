"""Sub-groups of the streamed optimizer and the buffers that carry them.

A shard of ``numel`` elements is cut into the fewest near-equal chunks of at
most ``sub_group_size`` elements (:func:`sub_groups`); a :class:`Group` names
one chunk of one shard; a :class:`Pack` holds several small whole shards that
are read, updated and written as one unit of work (:func:`pack_groups`). A
:class:`BufferSet` holds one unit's float32 arrays (master and the rule's
states) plus the I/O futures still using them; a :class:`Pipe` is the
in-flight state of one optimizer step.

[Note: packs]
A step costs a fixed amount per sub-group (its reads and writes issued, its futures waited on, one
kernel call, one ``write_param``), ~0.1-0.2 ms on this machine: a model of many small shards (a
d_model 128 GPT on 8 devices: 52 sub-groups of ~6K elements; 32 tiny layers: 512 of 32) paid that
for almost no arithmetic. Whole shards of at most :data:`PACK_BELOW` elements are gathered into
packs of up to :data:`PACK_ELEMENTS` (:func:`pack_groups`): a pack's
members are read into one buffer set side by side, updated by one call of the rule
(``update_many``: one Adam kernel call per run of equal weight decay), and their parameters handed
to ``write_params`` in one call (the device tier moves them with one ``device_put``). The tier keys
and the stored data are those of the members (nothing about storage changes: checkpoints, restore,
inspect and other process counts see the same keys); the update is element-wise, so the numbers are
the same bitwise.
"""
from __future__ import annotations

import collections
import dataclasses
from concurrent.futures import Future

from typing import Any, Callable, Hashable, Sequence

import numpy as np

from zinf_jax.tiers.direct import aligned_empty

__all__ = ["Group", "Pack", "Whole", "Tree", "Span", "PACK_BELOW", "PACK_ELEMENTS", "pack_groups", "pool_geometry", "sub_groups",
           "work_name", "BufferSet", "Pipe"]

PACK_BELOW = 1 << 16
"""Shards of at most this many elements (in one sub-group) are updated in packs (See [Note: packs])."""

PACK_ELEMENTS = 1 << 20
"""Most elements of one pack (4 MB per float32 state)."""

Span = tuple[str, tuple[int, ...], int, int]
"""``(path, shape, start, stop)``: one parameter's shard in a pack (see ``UpdateRule.update_many``)."""


@dataclasses.dataclass(frozen=True)
class Group:
    path: str
    shard: int
    chunk: int  # chunk index within the shard
    start: int  # offset of the chunk in the flat shard
    valid: int  # elements of real data (< chunk size only for a padded last chunk)
    n_chunks: int
    index: int  # tier index: shard * n_chunks + chunk


@dataclasses.dataclass(frozen=True)
class Pack:
    """Whole small shards (one sub-group each) updated as one: ``members[k]`` at ``offsets[k]`` of the buffers."""

    members: tuple[Group, ...]
    offsets: tuple[int, ...]
    size: int  # elements of all members


@dataclasses.dataclass(frozen=True)
class Whole:
    """Every sub-group of one parameter, updated together by a whole-tensor rule.

    ``members`` in order of shard then chunk; member ``k`` at ``k * chunk`` of the buffers, so shard ``s``
    (the ``s``-th local one) is at ``s * per_shard`` with ``per_shard = n_chunks * chunk`` (zero-padded).
    """

    path: str
    members: tuple[Group, ...]
    chunk: int
    per_shard: int

    @property
    def size(self) -> int:
        """Elements of each of its buffers (every shard, padded)."""
        return len(self.members) * self.chunk


@dataclasses.dataclass(frozen=True)
class Tree:
    """Every parameter of a rule that updates the whole tree at once: ``wholes[k]`` at ``offsets[k]`` of the buffers
    (see [Note: whole-tensor updates])."""

    wholes: tuple[Whole, ...]
    offsets: tuple[int, ...]

    @property
    def size(self) -> int:
        """Elements of each of its buffers (every parameter's local shards, padded)."""
        return sum(w.size for w in self.wholes)

    @property
    def members(self) -> tuple[Group, ...]:
        return tuple(g for w in self.wholes for g in w.members)


def pack_groups(groups: Sequence[Group], below: int, most: int, same: Callable[[Group], Hashable],
                order: Callable[[Group], Hashable]) -> list[Group | Pack]:
    """``groups`` with their whole small shards gathered into packs, each where its first member was.

    A shard of one sub-group of at most ``below`` elements joins the open pack of its kind (``same``: the
    states it has) until the pack would exceed ``most`` elements; inside a pack members are sorted by
    ``order`` (the rule's :meth:`pack_key`: equal keys side by side update as one array). A pack of one
    shard stays that shard's group. Every member comes no later than before: nothing waits longer to be
    written.
    """
    out: list[Group | list[Group]] = []
    open_: dict[Hashable, tuple[list[Group], int]] = {}  # kind -> (its open pack, elements in it)
    for g in groups:
        if g.n_chunks != 1 or g.valid > below:
            out.append(g)
            continue
        kind = same(g)
        members, size = open_.get(kind, (None, 0))
        if members is None or size + g.valid > most:
            members, size = [], 0
            out.append(members)
        members.append(g)
        open_[kind] = (members, size + g.valid)
    packed: list[Group | Pack] = []
    for w in out:
        if isinstance(w, Group) or len(w) == 1:
            packed.append(w if isinstance(w, Group) else w[0])
            continue
        members = sorted(w, key=order)
        offsets = [0]
        for g in members[:-1]:
            offsets.append(offsets[-1] + g.valid)
        packed.append(Pack(tuple(members), tuple(offsets), offsets[-1] + members[-1].valid))
    return packed


def pool_geometry(shards: Sequence[tuple[int, int]], sub_group_size: int, below: int,
                  most: int) -> tuple[int, int, bool]:
    """``(units of work, elements of one buffer set, any pack)`` of a step over ``(elements, count)`` shards.

    What :class:`~zinf_jax.optim.driver.StreamedOptimizer` allocates for them (the estimator's view of
    :func:`pack_groups`; one kind of state for all).
    """
    groups, largest = [], 1
    for numel, count in shards:
        chunk, n = sub_groups(numel, sub_group_size)
        largest = max(largest, chunk)
        cuts = [Group("", 0, c, c * chunk, min(chunk, numel - c * chunk), n, 0) for c in range(n)]
        groups += cuts * count
    work = pack_groups(groups, below, most, same=lambda g: 0, order=lambda g: 0)
    packs = [w.size for w in work if isinstance(w, Pack)]
    return len(work), max([largest, *packs]), bool(packs)


def work_name(w: Group | Pack | Whole | Tree) -> str:
    """What the profiler regions name: the sub-group's parameter, or a pack's first and its size."""
    if isinstance(w, Tree):
        return f"tree of {len(w.wholes)}"
    return f"{w.members[0].path} +{len(w.members) - 1}" if isinstance(w, Pack) else w.path


def sub_groups(numel: int, sub_group_size: int) -> tuple[int, int]:
    """``(chunk, n)``: the fewest sub-groups of at most ``sub_group_size`` elements, cut near-equal.

    The last one is padded by fewer than ``n`` elements. Padding is stored and
    moved every step: cuts of ``min(numel, sub_group_size)`` padded a shard just
    over the size almost twofold.
    """
    numel = max(int(numel), 1)
    n = -(-numel // max(int(sub_group_size), 1))
    return -(-numel // n), n


class BufferSet:
    """float32 buffers for one sub-group (master and the rule's states) and the futures still using them."""

    def __init__(self, size: int, count: int):
        self.arrays = tuple(aligned_empty(4 * size).view(np.float32) for _ in range(count))
        self.pending: list[Future] = []
        self.written: Group | None = None  # the sub-group whose writes ``pending`` holds
        self._stage: dict[int, np.ndarray] = {}  # array index -> its narrow staging buffer (bf16 states)
        self._staged: list[int] = []  # the arrays whose read landed in their staging buffer

    def staged(self, k: int, size: int, dtype: Any, start: int = 0) -> np.ndarray:
        """The staging buffer array ``k`` is read into (a narrower stored dtype), widened by :meth:`unstage`
        (``size`` elements from ``start``)."""
        buf = self._stage.get(k)
        if buf is None:  # the same dtype every time (the optimizer's state_dtype)
            buf = self._stage[k] = aligned_empty(np.dtype(dtype).itemsize * self.arrays[k].shape[0]).view(dtype)
        if k not in self._staged:
            self._staged.append(k)
        return buf[start:start + size]

    def staging(self) -> tuple[np.ndarray, ...]:
        """The staging buffers made so far."""
        return tuple(self._stage.values())

    def unstage(self, size: int) -> None:
        """Widens the staged reads (after they completed) into their float32 arrays."""
        for k in self._staged:
            np.copyto(self.arrays[k][:size], self._stage[k][:size])
        self._staged = []


@dataclasses.dataclass
class Pipe:
    """In-flight state of one step: sets being read ahead, the current one, sets being written."""

    reads: collections.deque = dataclasses.field(default_factory=collections.deque)
    writing: collections.deque = dataclasses.field(default_factory=collections.deque)
    current: BufferSet | None = None
    nxt: int = 0  # next sub-group to read
    t_write: float = 0.0  # seconds blocked on writes
