"""Runs of alike unit calls: where a traced loss calls N units that compute the same function in a row.

A transformer's ``for blk in self.blocks: x = blk(x)`` traces to N consecutive ``zinf_unit_call``
steps of units with the same program and parameter layouts, each reading the previous one's output.
:func:`find_runs` finds such runs in a :class:`~zinf_jax.engine.glue.GlueProgram`; the compiled
engine runs each as one ``lax.scan`` over the units' stacked parameters (see [Note: scanned runs]
in :mod:`zinf_jax.engine.compiled`).

For each input position of the run's calls, a run records where the value comes from: the previous
call's output (the scan's *carry*), or a value defined before the run, the same in every call
(*invariant*: a mask, positions) or one per call (*stacked*: a unit's own non-parameter state, an
rng key). Outputs read after the run leave it stacked (one per call); the last call's carried
outputs leave it as the final carry.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable, Sequence

from zinf_jax._internal import jax_private as core

__all__ = ["Run", "find_runs"]


@dataclasses.dataclass(frozen=True)
class Run:
    """Consecutive unit calls of one program that one scan runs.

    Attributes:
      start: the index of the first call's step in ``GlueProgram.steps``.
      calls: the recorded call indices, in order (one per step from ``start``).
      carry: per input position, the output position of the previous call it reads (``None``: not
        carried; the first call reads its value from before the run).
      invariant: per input position, the value is the same in every call (for positions not carried).
      outputs: the output positions whose values are read after the run from some call other than the
        last, or from the last where they are not carried; these leave the scan stacked.
    """

    start: int
    calls: tuple[int, ...]
    carry: tuple[int | None, ...]
    invariant: tuple[bool, ...]
    outputs: tuple[int, ...]

    @property
    def stop(self) -> int:
        """The index of the first step after the run."""
        return self.start + len(self.calls)


def _same_atom(a: Any, b: Any) -> bool:
    if isinstance(a, core.Literal) and isinstance(b, core.Literal):
        return a.val is b.val or (type(a.val) is type(b.val) and a.val == b.val and a.aval == b.aval)
    return a is b


def _aval_key(atom: Any) -> tuple:
    aval = atom.aval
    return (tuple(aval.shape), aval.dtype, getattr(aval, "weak_type", False))


def find_runs(steps: Sequence[Any], calls: Sequence[Any], outvars: Sequence[Any],
              key: Callable[[Any], Hashable], min_length: int = 2) -> list[Run]:
    """The runs of alike unit calls in a glue program's steps, longest first from the left, none overlapping.

    Two calls are alike when ``key`` of their :class:`~zinf_jax.engine.glue.UnitCall` objects is equal (the
    engine's key: the unit's program and parameter layouts) and their method, static inputs and
    output structure are. A run continues while the next step is an alike call of a unit not yet in
    any run whose inputs come, position by position, the same way as the previous call's did (the
    previous output at the same position, or a value from before the run); a value of an earlier call
    of the run read by a later one (a skip connection across the run) ends it. Only runs that carry
    something are returned.

    Args:
      steps: ``GlueProgram.steps``.
      calls: the recorded unit calls.
      outvars: the program's outputs (read after every step).
      key: what makes two calls' units compute the same function of their parameters.
      min_length: the fewest calls worth a scan.
    """
    defined: dict[Any, int] = {}
    for i, s in enumerate(steps):
        for v in s.outs:
            if isinstance(v, core.Var) and not isinstance(v, core.DropVar):
                defined[v] = i
    read_after: dict[Any, int] = {}  # var -> the last step reading it (len(steps) for program outputs)
    for i, s in enumerate(steps):
        for v in s.ins:
            if isinstance(v, core.Var):
                read_after[v] = max(read_after.get(v, -1), i)
    for v in outvars:
        if isinstance(v, core.Var):
            read_after[v] = len(steps)

    def is_call(i: int) -> bool:
        return i < len(steps) and steps[i].eqns is None

    def call_key(i: int) -> tuple:
        c = calls[steps[i].call]
        return (key(c), c.method, c.sig, c.out_tree)

    used: set[int] = set()
    runs: list[Run] = []
    i = 0
    while i < len(steps):
        run = _grow(i, steps, calls, defined, is_call, call_key, used) if is_call(i) else None
        if run is None or len(run[0]) < min_length:
            i += 1
            continue
        members, carry = run
        runs.append(_finish(i, members, carry, steps, read_after))
        used.update(calls[steps[k].call].uid for k in members)
        i = members[-1] + 1
    return runs


def _grow(i: int, steps: Sequence[Any], calls: Sequence[Any], defined: dict, is_call: Callable,
          call_key: Callable, used: set) -> tuple[list[int], tuple] | None:
    """The longest run of steps from ``i`` with one input pattern, and that pattern."""
    if calls[steps[i].call].uid in used:
        return None
    members, uids, pattern, k0 = [i], {calls[steps[i].call].uid}, None, call_key(i)
    j = i + 1
    while is_call(j) and call_key(j) == k0 and calls[steps[j].call].uid not in used | uids:
        prev, cur = steps[j - 1], steps[j]
        this: list[int | None] = []
        for v in cur.ins:
            at = defined.get(v, -1) if isinstance(v, core.Var) else -1
            if at == j - 1:
                this.append(prev.outs.index(v))
            elif at >= i:  # a value of an earlier call of the run: not a scan
                this = None
                break
            else:
                this.append(None)
        if this is None:
            break
        this_t = tuple(this)
        if pattern is None:
            ok = any(o is not None for o in this_t) and all(
                o is None or _aval_key(steps[i].ins[p]) == _aval_key(steps[i].outs[o])
                for p, o in enumerate(this_t))
            if not ok:
                break
            pattern = this_t
        elif this_t != pattern:
            break
        members.append(j)
        uids.add(calls[cur.call].uid)
        j += 1
    return (members, pattern) if pattern is not None else None


def _finish(i: int, members: list[int], carry: tuple, steps: Sequence[Any], read_after: dict) -> Run:
    first = steps[i]
    invariant = tuple(o is None and all(_same_atom(steps[k].ins[p], first.ins[p]) for k in members)
                      for p, o in enumerate(carry))
    stop = members[-1] + 1
    carried_out = {o for o in carry if o is not None}
    outputs = []
    for o in range(len(first.outs)):
        for n, k in enumerate(members):
            v = steps[k].outs[o]
            if isinstance(v, core.DropVar) or not isinstance(v, core.Var) or read_after.get(v, -1) < stop:
                continue
            if n < len(members) - 1 or o not in carried_out:
                outputs.append(o)
                break
    return Run(i, tuple(steps[k].call for k in members), carry, invariant, tuple(outputs))
