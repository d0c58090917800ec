"""Compiled glue: the code between unit calls runs as jitted segments.

The user's loss is traced once per input signature (structure, shapes and
dtypes of the glue parameters, the model state and the batch; Python values in
the batch) into a jaxpr in which every unit call is a single
``zinf_unit_call`` equation. The equations between two unit calls form a
*segment*; each is compiled with :func:`jax.jit`. Running the loss walks the
segments in order and hands each unit call to the engine, which fetches the
unit's parameters and runs its own compiled program.

In a training pass each segment is one compiled program forward (returning its
residuals) and one backward (:mod:`~zinf_jax.engine.tape`), so a step
dispatches a small constant number of programs per unit instead of every
embedding add, layer norm and loss op one by one.

A unit called inside a transform of the model's code (a scan over a stack of layers, a ``jit`` or
``checkpoint``) is brought out to the loss's top level by :mod:`~zinf_jax.engine.unroll` first.

As under ``jax.jit``, Python side effects of the loss run once, at trace time,
and arrays it closes over are captured as constants.

A model written for Explicit mesh axes is traced under the user's mesh with typed inputs, and each
segment runs as a region of the model's code (:class:`~zinf_jax.plan.model_mesh.ModelMesh`, see
[Note: model regions]); a unit call records its inputs' specs in its signature.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.profiler import TraceAnnotation
from jax.sharding import PartitionSpec as P

from zinf_jax._internal import jax_private as core
from zinf_jax.engine.programs import join_inputs, split_inputs
from zinf_jax.engine.unroll import has_nested_calls, holds_calls, unroll
from zinf_jax.plan.model_mesh import ModelMesh, spec_of
from zinf_jax.plan.units import Plan

__all__ = ["UnitCall", "Recorder", "GlueProgram", "Traced", "TraceCache", "unit_call_p", "unit_out_shapes",
           "MAX_TRACES"]

MAX_TRACES = 16
"""Traced losses kept (per loss function, mode and input signature), oldest dropped first."""

unit_call_p = core.Primitive("zinf_unit_call")
"""A unit call in a traced loss: never lowered, only cut at (see :class:`GlueProgram`)."""
unit_call_p.multiple_results = True
unit_call_p.def_abstract_eval(lambda *args, call, out_avals: out_avals)


@dataclasses.dataclass(frozen=True)
class UnitCall:
    """One unit call of a traced loss: which unit and method, its static inputs, the structure of its outputs.

    ``sig`` is :func:`~zinf_jax.engine.programs.split_inputs`' signature with the specs of the array
    inputs appended (empty without Explicit axes; see :func:`~zinf_jax.engine.programs.model_call`).
    """

    uid: int
    method: str
    sig: Any
    out_tree: Any
    layer: int | None = None
    """For a unit whose parameters are a stack of layers called inside the model's scan: the layer the call uses
    once the scan is unrolled (the iteration, :func:`~zinf_jax.engine.unroll.unroll`), or ``-1`` while the call
    is still inside the scan (as recorded, and as the compiled engine keeps it: each iteration takes its layer,
    :func:`~zinf_jax.engine.unroll.evaluate`); ``None``: the unit's whole parameters."""


OutShapes = Callable[[int, str, Any, list, bool], Any]
"""``(uid, method, sig, dyn, layered) -> pytree of ShapeDtypeStruct``: what a unit call returns (``layered``: a
call inside the model's scan, with one layer of the unit's stacked parameters)."""


def unit_out_shapes(adapter: Any, store: Any, train: bool, model_mesh: ModelMesh | None = None) -> OutShapes:
    """What a unit call returns: the adapter's unit function evaluated abstractly on its full parameters.

    Args:
      adapter: the model's adapter.
      store: the parameter store (the params' layouts and compute dtype).
      train: the unit functions' mode.
      model_mesh: with Explicit axes, the parameters are typed with their gathered specs and the
        inputs with their recorded ones, so the outputs come typed (see [Note: model regions]).
    """
    mm = model_mesh or ModelMesh(store.mesh)

    def out_shapes(uid: int, method: str, sig: Any, dyn: list, layered: bool = False) -> Any:
        lays = [store.layouts[p] for p in adapter.units[uid].param_paths]
        cut = 1 if layered else 0  # one layer of the stack: its leading axis dropped
        full = [mm.typed(jax.ShapeDtypeStruct(l.shape[cut:], store.dtype_of(l.path)), P(*l.gathered[cut:]))
                for l in lays]
        specs = sig[2] if len(sig) > 2 and sig[2] else [P()] * len(dyn)
        sds = [mm.typed(x, spec) for x, spec in zip(dyn, specs)]
        fn = adapter.unit_fn(uid, method, train)
        return jax.eval_shape(lambda f, d: fn(f, join_inputs(sig, d)), full, sds)

    return out_shapes


class Recorder:
    """The hook of a tracing pass: records each unit call and stands for it with one equation.

    Args:
      out_shapes: the output shapes of a unit call (an abstract evaluation of its program).
      typed: the model has Explicit axes: each call's signature records its inputs' specs, and its
        outputs keep the types the abstract evaluation gave them (see [Note: model regions]).
      stacked: whether a unit's parameters look like a stack of layers: a call of such a unit made inside a
        transform of the model's code (another trace than the loss's own, :attr:`outer`) is evaluated with one
        layer's parameters and recorded with ``layer=-1``.
    """

    def __init__(self, out_shapes: OutShapes, typed: bool = False, stacked: Callable[[int], bool] = lambda uid: False):
        self._out_shapes = out_shapes
        self._typed = typed
        self._stacked = stacked
        self.calls: list[UnitCall] = []
        self.outer: Any = None
        """The loss's own trace (set when its tracing starts): a call made in another is inside a transform."""

    def __call__(self, uid: int, method: str, inputs: Any) -> Any:
        dyn, sig = split_inputs(f"unit {uid}.{method}", inputs)
        sig = (*sig, tuple(spec_of(x) for x in dyn) if self._typed else ())
        layered = self.outer is not None and core.current_trace() is not self.outer and self._stacked(uid)
        leaves, tree = jax.tree.flatten(self._out_shapes(uid, method, sig, dyn, layered))
        if self._typed:
            avals = tuple(jax.typeof(s) for s in leaves)
        else:
            avals = tuple(core.ShapedArray(s.shape, s.dtype, weak_type=getattr(s, "weak_type", False)) for s in leaves)
        k = len(self.calls)
        self.calls.append(UnitCall(uid, method, sig, tree, -1 if layered else None))
        return jax.tree.unflatten(tree, unit_call_p.bind(*dyn, call=k, out_avals=avals))


@dataclasses.dataclass
class _Step:
    ins: list[Any]        # atoms read (Vars or Literals)
    outs: list[Any]       # Vars written
    drop: list[Any]       # Vars read for the last time here
    eqns: list[Any] | None  # the segment's equations; None for a unit call
    call: int = -1          # index into the recorded calls
    fn: Callable | None = None  # the jitted segment
    body: Callable | None = None  # the segment's function (``fn`` is its jit; :mod:`~zinf_jax.engine.tape` differentiates it)
    effects: Any = frozenset()
    vjp: Any = None  # the segment's vjp programs (:class:`~zinf_jax.engine.tape.SegmentVjp`), built at first use
    jaxpr: Any = None  # the segment as a jaxpr
    nested: bool = False  # it holds unit calls inside its equations (a trace not unrolled: see TraceCache.trace)


class GlueProgram:
    """A traced loss cut at its unit calls: jitted segments between engine calls.

    Args:
      closed: the traced loss (``jax.make_jaxpr`` output) with unit calls as
        ``zinf_unit_call`` equations.
      calls: the unit calls recorded while tracing, in order.
      model_mesh: each segment runs as a region of the model's code with its inputs' traced specs
        (see [Note: model regions]); ``None``: as traced.
    """

    def __init__(self, closed: core.ClosedJaxpr, calls: Sequence[UnitCall], model_mesh: ModelMesh | None = None):
        self.calls = tuple(calls)
        self._model_mesh = model_mesh
        jaxpr = closed.jaxpr
        self._invars = list(jaxpr.invars)
        self._outvars = list(jaxpr.outvars)
        self._consts = dict(zip(jaxpr.constvars, closed.consts))
        groups: list[list[Any]] = [[]]
        for eqn in jaxpr.eqns:
            if eqn.primitive is unit_call_p:
                groups.append(eqn)
                groups.append([])
            else:
                groups[-1].append(eqn)
        self.steps = [s for s in (self._step(g) for g in groups) if s is not None]
        self._set_drops()

    @property
    def segments(self) -> int:
        """Compiled glue segments run per pass."""
        return sum(s.eqns is not None for s in self.steps)

    def _step(self, group: Any) -> _Step | None:
        if not isinstance(group, list):  # a unit call
            return _Step(list(group.invars), list(group.outvars), [], None, group.params["call"])
        if not group:
            return None
        defined = {v for e in group for v in e.outvars}
        ins: dict[Any, None] = {}
        for e in group:
            for v in e.invars:
                if isinstance(v, core.Var) and v not in defined:
                    ins[v] = None
        return _Step(list(ins), [v for e in group for v in e.outvars if not isinstance(v, core.DropVar)], [], group)

    def _set_drops(self) -> None:
        """Compiles each segment with the outputs later steps read, and marks where each value is last read."""
        last: dict[Any, int] = {}
        for i, s in enumerate(self.steps):
            for v in s.ins:
                if isinstance(v, core.Var):
                    last[v] = i
        keep = {v for v in self._outvars if isinstance(v, core.Var)}
        for i, s in enumerate(self.steps):
            if s.eqns is not None:
                s.outs = [v for v in s.outs if v in keep or last.get(v, -1) > i]
                s.effects = core.join_effects(*(e.effects for e in s.eqns))
                info = core.DebugInfo("zinf_jax glue", f"segment {i}", tuple(f"in{j}" for j in range(len(s.ins))),
                                      tuple(f"out{j}" for j in range(len(s.outs))))
                sub = core.Jaxpr([], s.ins, s.outs, s.eqns, s.effects, debug_info=info)
                s.jaxpr, s.nested = sub, holds_calls(s.eqns, unit_call_p)
                fn = _as_fun(core.ClosedJaxpr(sub, []))
                if self._model_mesh is not None:
                    fn = self._model_mesh.region(fn, tuple(spec_of(v.aval) for v in s.ins))
                s.body, s.fn = fn, jax.jit(fn)
        for v, i in last.items():
            if v not in keep:
                self.steps[i].drop.append(v)
        for s in self.steps:  # outputs nothing reads (a unit's unused outputs): dropped at once
            s.drop += [v for v in s.outs if isinstance(v, core.Var) and v not in keep and v not in last]
        self.steps = [s for s in self.steps if s.eqns is None or s.outs or s.effects]

    @property
    def outvars(self) -> list[Any]:
        """The loss's flat output variables."""
        return list(self._outvars)

    @property
    def invars(self) -> list[Any]:
        """The loss's flat input variables (glue parameters, model state, batch)."""
        return list(self._invars)

    def __call__(self, args: Sequence[Any], call_unit: Callable[[int, list[Any]], list[Any]],
                 runs: Sequence[Any] = (), call_run: Callable[[Any, list[list[Any]]], list[list[Any]]] | None = None,
                 call_segment: Callable[[int, list[Any]], Sequence[Any]] | None = None) -> list[Any]:
        """The loss's flat outputs; ``call_unit(k, dyn)`` runs recorded call ``k`` and returns its flat outputs.

        ``runs`` (:class:`~zinf_jax.engine.runs.Run` objects over :attr:`steps`) are run by ``call_run(run, ins)``
        instead, ``ins`` holding each call's inputs (``None`` where the previous call's output is
        carried); it returns each call's outputs (``None`` where nothing after the run reads one).
        ``call_segment(i, ins)`` runs glue step ``i`` instead of its jitted function (the tape's
        forward, which keeps the segment's residuals).
        """
        env = dict(self._consts)
        env.update(zip(self._invars, args))
        starts = {r.start: r for r in runs}

        def read(v: Any) -> Any:
            return v.val if isinstance(v, core.Literal) else env[v]

        def bind(s: _Step, outs: Sequence[Any]) -> None:
            for v, x in zip(s.outs, outs):
                if x is not None and not isinstance(v, core.DropVar):
                    env[v] = x

        i = 0
        while i < len(self.steps):
            run = starts.get(i)
            if run is not None:
                steps = self.steps[run.start:run.stop]
                ins = [[None if n and run.carry[p] is not None else read(v) for p, v in enumerate(s.ins)]
                       for n, s in enumerate(steps)]
                for s, outs in zip(steps, call_run(run, ins)):
                    bind(s, outs)
                for s in steps:
                    for v in s.drop:
                        env.pop(v, None)
                i = run.stop
                continue
            s = self.steps[i]
            ins = [read(v) for v in s.ins]
            if s.eqns is not None:
                with TraceAnnotation("zinf/glue"):
                    outs = s.fn(*ins) if call_segment is None else call_segment(i, ins)
            else:
                outs = call_unit(s.call, ins)
            del ins
            bind(s, outs)
            for v in s.drop:
                env.pop(v, None)
            i += 1
        return [read(v) for v in self._outvars]


def _as_fun(closed: core.ClosedJaxpr) -> Callable[..., list[Any]]:
    def run(*args: Any) -> list[Any]:
        return core.jaxpr_as_fun(closed)(*args)

    return run



@dataclasses.dataclass(frozen=True)
class Traced:
    """A loss traced for one input signature: its compiled glue, output structure and unit call order."""

    program: GlueProgram
    out_tree: Any
    plan: Plan
    args: list = dataclasses.field(default_factory=list)  # the flat inputs of this pass (glue, state, batch)

    def unflatten(self, leaves: list) -> Any:
        return jax.tree.unflatten(self.out_tree, leaves)


def _placed_spec(x: Any) -> P:
    """The spec of a batch leaf as placed on the mesh (``P()`` for host values)."""
    spec = getattr(getattr(x, "sharding", None), "spec", None)
    return P() if spec is None else P(*spec)


def _avals(leaves: Sequence[Any]) -> tuple:
    return tuple((jnp.shape(x), jax.typeof(x).dtype, getattr(jax.typeof(x), "weak_type", False)) for x in leaves)


class TraceCache:
    """Traced losses by signature (loss function, mode, structure and shapes of glue, model state and batch).

    Args:
      units: the model's units (for the plans).
    """

    def __init__(self, units: tuple):
        self.units = units
        self._traces: dict[tuple, Traced] = {}

    def values(self) -> list[Traced]:
        return list(self._traces.values())

    def trace(self, adapter: Any, loss_fn: Callable, glue: list, state: Any, batch: Any, train: bool,
              out_shapes: OutShapes, model_mesh: ModelMesh | None = None,
              glue_specs: Sequence[P] = (), layers: Callable[[int], int | None] = lambda uid: None,
              unroll_nested: bool = True) -> Traced:
        """``loss_fn`` run by ``adapter`` on these inputs, traced now or taken from the cache, with this pass's inputs.

        With a ``model_mesh`` that has Explicit axes the loss is traced under the user's mesh, the glue
        parameters typed ``glue_specs`` (their gathered specs), the model state replicated and the
        batch as it is placed (see [Note: model regions]).

        ``layers(uid)``: a unit's layer count where its parameters look like a stack of layers (a call of it
        inside the model's scan then takes one layer); ``unroll_nested``: bring unit calls made inside the
        model's transforms out to the top level (:func:`~zinf_jax.engine.unroll.unroll`), or leave them where
        they are, in segments the caller runs with :func:`~zinf_jax.engine.unroll.evaluate`.
        """
        sdyn, ssig = split_inputs("model state", state)
        bdyn, bsig = split_inputs("batch", batch)
        key = (loss_fn, train, ssig, bsig, _avals(glue), _avals(sdyn), _avals(bdyn))
        hit = self._traces.get(key)
        if hit is None:
            if len(self._traces) >= MAX_TRACES:  # a new loss_fn object per call would grow it without bound
                self._traces.pop(next(iter(self._traces)))
            typed = model_mesh is not None and bool(model_mesh.explicit)
            rec = Recorder(out_shapes, typed, lambda uid: layers(uid) is not None)
            tree = []

            def flat(g, s, b):
                rec.outer = core.current_trace()
                out = adapter.run(loss_fn, list(g), join_inputs(ssig, s), join_inputs(bsig, b), rec, train)
                leaves, t = jax.tree.flatten(out)
                tree.append(t)
                return leaves

            args: tuple = (glue, sdyn, bdyn)
            if typed:
                args = ([model_mesh.typed(x, p) for x, p in zip(glue, glue_specs)],
                        [model_mesh.typed(x, P()) for x in sdyn],
                        [model_mesh.typed(x, _placed_spec(x)) for x in bdyn])
            with model_mesh.tracing() if model_mesh is not None else contextlib.nullcontext():
                closed = jax.make_jaxpr(flat)(*args)
                calls = rec.calls
                if unroll_nested and has_nested_calls(closed, unit_call_p):  # See zinf_jax.engine.unroll
                    closed, calls = unroll(closed, calls, unit_call_p, jax.tree.leaves(args), layers,
                                           lambda uid: self.units[uid].path)
            plan = Plan(calls=tuple((c.uid, c.method) for c in calls), units=self.units)
            hit = self._traces[key] = Traced(GlueProgram(closed, calls, model_mesh), tree[0], plan)
        return dataclasses.replace(hit, args=[*glue, *sdyn, *bdyn])
