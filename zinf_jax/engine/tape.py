"""Reverse mode over a glue program: the streamed training pass, walked by the engine.

A traced loss is a :class:`~zinf_jax.engine.glue.GlueProgram`: jitted glue segments with unit
calls between them. The training pass runs it forward once, keeping what the backward needs, and
then walks its steps in reverse:

* a glue segment runs as one compiled program that returns its outputs and its vjp (the residuals,
  as :func:`jax.vjp` inside :func:`jax.jit` gives them); its backward is a second compiled program
  of those residuals and the output cotangents. A segment with no floating input or output has no
  backward and runs as its plain jitted function;
* a unit call goes to the engine's hooks (:class:`~zinf_jax.engine.streamed.StreamedModel`): the
  forward fetches, runs and parks the unit's inputs; the backward, called in reverse call order,
  fetches again, recomputes and hands the parameter gradients to the sink.

Cotangents live in a table by jaxpr variable and are summed where a value is read twice (a
residual stream). A value nothing differentiable reads gets no cotangent: its segment's backward is
skipped, and a unit call whose outputs got none runs its backward with zeros (its parameters still
owe the step a gradient of zero, and its saved inputs their release).

This is what an outer ``jax.vjp`` over ``jax.custom_vjp`` unit rules computes, walked by the engine
itself: the JAX interpreter's per-call tracing of the rules (``linearize`` forward, the transpose of
each ``custom_vjp`` call backward) cost ~45 ms of a 300 ms step of the d=128 GPT on this machine,
on the thread that also dispatches every unit program.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from zinf_jax._internal import jax_private as core
from zinf_jax.engine.glue import GlueProgram

__all__ = ["SegmentVjp", "Tape", "inexact"]


def inexact(atom: Any) -> bool:
    """A jaxpr variable or literal of a floating (differentiable) type."""
    return jnp.issubdtype(atom.aval.dtype, jnp.inexact)


@dataclasses.dataclass
class SegmentVjp:
    """The vjp programs of one glue segment.

    Attributes:
      diff: positions of the segment's inputs that are differentiated (floating variables).
      cts: positions of its outputs that carry a cotangent (floating ones).
      avals: the abstract values of those outputs (a cotangent that did not arrive is their zeros).
      fwd: ``ins -> (outs, vjp)``, compiled.
      bwd: per pattern of present output cotangents, ``(vjp, given) -> input cotangents``, compiled.
    """

    diff: tuple[int, ...]
    cts: tuple[int, ...]
    avals: tuple[Any, ...]
    fwd: Callable | None
    bwd: dict[tuple[bool, ...], Callable] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, step: Any) -> "SegmentVjp":
        """The vjp programs of glue step ``step`` (``fwd`` is ``None`` where it has no backward)."""
        diff = tuple(i for i, v in enumerate(step.ins) if isinstance(v, core.Var) and inexact(v))
        cts = tuple(i for i, v in enumerate(step.outs) if inexact(v))
        avals = tuple(step.outs[i].aval for i in cts)
        if not diff or not cts:
            return cls(diff, cts, avals, None)
        body, n_out = step.body, len(step.outs)
        rest = tuple(i for i in range(n_out) if i not in cts)

        def fwd(ins: list) -> tuple[list, Any]:
            def f(*d: Any) -> tuple[list, list]:
                full = list(ins)
                for i, x in zip(diff, d):
                    full[i] = x
                outs = body(*full)
                return [outs[i] for i in cts], [outs[i] for i in rest]

            y, vjp, other = jax.vjp(f, *[ins[i] for i in diff], has_aux=True)
            outs: list = [None] * n_out
            for i, x in zip(cts, y):
                outs[i] = x
            for i, x in zip(rest, other):
                outs[i] = x
            return outs, vjp

        return cls(diff, cts, avals, jax.jit(fwd))

    def backward(self, vjp: Any, given: Sequence[Any]) -> tuple[Any, ...]:
        """The cotangents of the :attr:`diff` inputs, from those of the :attr:`cts` outputs (``None``: zero)."""
        present = tuple(g is not None for g in given)
        fn = self.bwd.get(present)
        if fn is None:
            avals = self.avals

            def run(vjp: Any, got: list) -> tuple[Any, ...]:
                it = iter(got)
                return vjp([next(it) if p else jnp.zeros(a.shape, a.dtype) for p, a in zip(present, avals)])

            fn = self.bwd[present] = jax.jit(run)
        return fn(vjp, [g for g in given if g is not None])


UnitForward = Callable[[int, list[Any]], list[Any]]
"""``(call k, its inputs) -> its flat outputs``: a unit call's forward, saving for its backward."""

UnitBackward = Callable[[int, list[Any]], list[Any]]
"""``(call k, cotangents of its floating outputs) -> cotangents of its inputs (None: none)``."""


class Tape:
    """One training pass over a glue program: :meth:`forward`, then :meth:`backward` once.

    Args:
      program: the traced loss.
    """

    def __init__(self, program: GlueProgram):
        self.program = program
        self._vjps: list[Any] = [None] * len(program.steps)  # per step: the vjp (residuals) of a segment run

    def _segment(self, i: int, ins: list) -> Sequence[Any]:
        s = self.program.steps[i]
        if s.vjp is None:
            s.vjp = SegmentVjp.of(s)
        if s.vjp.fwd is None:
            return s.fn(*ins)
        outs, vjp = s.vjp.fwd(ins)
        self._vjps[i] = vjp
        return outs

    def forward(self, args: Sequence[Any], unit_forward: UnitForward) -> list[Any]:
        """The loss's flat outputs, keeping each segment's residuals for :meth:`backward`."""
        return self.program(args, unit_forward, call_segment=self._segment)

    def backward(self, seeds: Sequence[Any], unit_backward: UnitBackward) -> list[Any]:
        """The cotangents of the program's inputs (``None`` where nothing reached one).

        Args:
          seeds: per program output, its cotangent (``None``: none; the loss gets the loss scale).
          unit_backward: the engine's backward of a unit call, run for every call in reverse order.
        """
        prog = self.program
        ct: dict[Any, Any] = {}

        def add(v: Any, x: Any) -> None:
            if x is None or not isinstance(v, core.Var) or isinstance(v, core.DropVar) or not inexact(v):
                return
            ct[v] = x if v not in ct else ct[v] + x

        for v, x in zip(prog.outvars, seeds):
            add(v, x)
        for i in reversed(range(len(prog.steps))):
            s = prog.steps[i]
            if s.eqns is None:
                given = [ct.pop(v, None) if inexact(v) else None for v in s.outs]
                in_cts = unit_backward(s.call, [g if g is not None or not inexact(v) else
                                                jnp.zeros(v.aval.shape, v.aval.dtype)
                                                for v, g in zip(s.outs, given)])
                for v, x in zip(s.ins, in_cts):
                    add(v, x)
                continue
            vjp, self._vjps[i] = self._vjps[i], None  # the residuals go as the walk passes them
            given = [ct.pop(s.outs[j], None) for j in s.vjp.cts] if vjp is not None else []
            if vjp is None or all(g is None for g in given):
                continue
            for j, x in zip(s.vjp.diff, s.vjp.backward(vjp, given)):
                add(s.ins[j], x)
        return [ct.get(v) for v in prog.invars]
