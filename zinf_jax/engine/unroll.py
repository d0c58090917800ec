"""Unit calls inside the model's own transforms, brought out to the top of the traced loss.

A glue program (:mod:`zinf_jax.engine.glue`) cuts the traced loss at its unit calls, so every call
must be an equation of the loss itself. A model that applies a unit inside a transform of its own
code — a stack of layers scanned by ``nnx.scan`` or ``jax.lax.scan``, a call under ``jax.checkpoint``
or an inner ``jax.jit`` — leaves the call inside that equation's inner jaxpr. :func:`unroll` traces
the loss again through an interpreter that runs such equations step by step: a scan's iterations one
after another (its ``xs`` sliced, its ``ys`` stacked, the carry passed on), a ``jit``, ``checkpoint``
or ``custom_jvp``/``custom_vjp`` primal inline. The calls then sit at the top level, in the order the
model makes them, each knowing the iteration of the innermost scan it was made in: for a unit whose
parameters are a stack of layers (one slice per iteration) that is the layer it uses.

The computation is the same; only its structure changes (the engine's own checkpoints replace the
model's remat around a unit, as they do around every unit call). Any other transform around a unit
call (``vmap``, ``while_loop``, ``cond``) is an error naming it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from zinf_jax._internal import jax_private as core
from zinf_jax.errors import EngineError

__all__ = ["has_nested_calls", "holds_calls", "unroll", "evaluate"]


def _holds_call(jaxpr: Any, call_p: Any) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive is call_p or any(_holds_call(sub, call_p) for sub in core.jaxprs_in_params(eqn.params)):
            return True
    return False


def holds_calls(eqns: Sequence[Any], call_p: Any) -> bool:
    """Whether some of ``eqns`` hold a unit call inside their inner jaxprs (a glue segment that
    :func:`evaluate` must run)."""
    return any(_holds_call(sub, call_p) for eqn in eqns for sub in core.jaxprs_in_params(eqn.params))


def has_nested_calls(closed: Any, call_p: Any) -> bool:
    """Whether a unit call (an equation of ``call_p``) sits inside another equation of the traced loss."""
    return any(_holds_call(sub, call_p) for eqn in closed.jaxpr.eqns for sub in core.jaxprs_in_params(eqn.params))


_INLINED = ("jit", "pjit", "closed_call", "core_call", "checkpoint", "remat", "remat2", "custom_jvp_call",
            "custom_vjp_call", "custom_vjp_call_jaxpr", "custom_lin")
"""Primitives whose one inner jaxpr runs inline (a ``custom_*`` call's primal, without its rule)."""


Ctx = Any
"""What an interpretation passes down to the equations inside a scan: :func:`unroll`'s iteration, or
:func:`evaluate`'s layer parameters by unit."""


def _interpret(jaxpr: Any, consts: Sequence[Any], ins: Sequence[Any], ctx: Ctx, call_p: Any,
               on_call: Callable[[Any, list, Ctx], list], on_scan: Callable[[Any, list, Ctx], list]) -> list[Any]:
    """Evaluates ``jaxpr`` in the current trace: equations without unit calls are bound again as they are, a unit
    call is ``on_call(eqn, inputs, ctx)``, a scan holding one ``on_scan(eqn, inputs, ctx)``, and a ``jit``,
    ``checkpoint`` or ``custom_*`` call holding one runs inline.

    Raises:
      EngineError: a unit call inside any other transform.
    """
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, core.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, ins))
    for eqn in jaxpr.eqns:
        vals = [read(v) for v in eqn.invars]
        subs = list(core.jaxprs_in_params(eqn.params))
        if eqn.primitive is call_p:
            outs = on_call(eqn, vals, ctx)
        elif not any(_holds_call(s, call_p) for s in subs):
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(*vals, **core.bind_params(eqn))
            outs = outs if eqn.primitive.multiple_results else [outs]
        elif eqn.primitive is core.scan_p:
            outs = on_scan(eqn, vals, ctx)
        elif eqn.primitive.name in _INLINED:
            inner = eqn.params.get("call_jaxpr") or eqn.params.get("jaxpr") or eqn.params.get("fun_jaxpr")
            if inner is None:
                raise EngineError(f"zinf_jax: a unit is called inside {eqn.primitive.name}, whose inner program "
                                  "the engine cannot find; call the unit outside it")
            body, body_consts = (inner.jaxpr, inner.consts) if hasattr(inner, "consts") else (inner, [])
            outs = _interpret(body, body_consts, vals, ctx, call_p, on_call, on_scan)[:len(eqn.outvars)]
        else:
            raise EngineError(_inside(eqn.primitive.name))
        for v, x in zip(eqn.outvars, outs):
            if not isinstance(v, core.DropVar):
                env[v] = x
    return [read(v) for v in jaxpr.outvars]


def unroll(closed: Any, calls: Sequence[Any], call_p: Any, args: Sequence[Any], unit_layers: Callable[[int], Any],
           names: Callable[[int], str]) -> tuple[Any, list[Any]]:
    """The loss traced again with every unit call at its top level.

    Args:
      closed: the traced loss (``jax.make_jaxpr`` output).
      calls: the recorded unit calls (``UnitCall``), indexed by the ``call`` parameter of ``call_p``.
      call_p: the unit call primitive.
      args: the loss's flat example inputs (arrays or ``ShapeDtypeStruct``).
      unit_layers: a unit's layer count (see :func:`~zinf_jax.plan.units.layer_count`).
      names: a unit's path, for errors.

    Returns:
      ``(closed, calls)``: the new jaxpr and its calls in order; a call made inside a scan has its
      ``layer`` set to that scan's iteration.

    Raises:
      EngineError: a unit call inside a transform other than a scan or an inlined call, or a stack of
        layers called outside a scan of its length.
    """
    out_calls: list[Any] = []

    def on_call(eqn: Any, vals: list, at: tuple[int, int] | None) -> list:
        c = calls[eqn.params["call"]]
        if c.layer == -1:  # a stack of layers: the innermost scan's iteration is the layer
            n = unit_layers(c.uid)
            if at is None or at[1] != n:
                raise EngineError(_outside_scan(names(c.uid), n, None if at is None else at[1]))
            c = dataclasses.replace(c, layer=at[0])
        out_calls.append(c)
        return call_p.bind(*vals, call=len(out_calls) - 1, out_avals=eqn.params["out_avals"])

    def on_scan(eqn: Any, vals: list, at: Any) -> list:  # the iterations one by one, ``(iteration, length)`` down
        p = eqn.params
        nc, nk, n, body = p["num_consts"], p["num_carry"], p["length"], p["jaxpr"]
        consts, carry, xs = vals[:nc], vals[nc:nc + nk], vals[nc + nk:]
        ys: dict[int, list[Any]] = {}
        for i in (range(n - 1, -1, -1) if p["reverse"] else range(n)):
            out = _interpret(body.jaxpr, body.consts, [*consts, *carry, *(x[i] for x in xs)], (i, n), call_p,
                             on_call, on_scan)
            carry, ys[i] = out[:nk], out[nk:]
        avals = [v.aval for v in body.jaxpr.outvars[nk:]]
        return [*carry, *(jnp.stack([ys[i][j] for i in range(n)]) if n else jnp.zeros((0, *a.shape), a.dtype)
                          for j, a in enumerate(avals))]

    flat = jax.make_jaxpr(lambda *a: _interpret(closed.jaxpr, closed.consts, a, None, call_p, on_call, on_scan))(*args)
    return flat, out_calls


def _layered_calls(jaxpr: Any, call_p: Any, calls: Sequence[Any]) -> list[int]:
    """The units of the stacked calls (``layer == -1``) in ``jaxpr`` outside any scan nested in it."""
    out: list[int] = []
    for eqn in jaxpr.eqns:
        if eqn.primitive is call_p:
            c = calls[eqn.params["call"]]
            if c.layer == -1 and c.uid not in out:
                out.append(c.uid)
        elif eqn.primitive is not core.scan_p:
            for sub in core.jaxprs_in_params(eqn.params):
                out += [u for u in _layered_calls(sub, call_p, calls) if u not in out]
    return out


LayerLoop = Callable[[list, Callable, list, list, list, int], tuple[list, list]]
"""``run_layers(uids, body, carry, consts, xs, length) -> (final carry, ys)``: a scan over stacks of layers run by
the caller, ``body(gathered, carry, consts, x) -> (carry, y)`` taking per unit the layer's parameters as the
caller hands them (gathered: the call then uses them as they are)."""


def evaluate(jaxpr: Any, consts: Sequence[Any], ins: Sequence[Any], call_p: Any, calls: Sequence[Any],
             call_unit: Callable[[int, list, Any], list], stacked: Callable[[int], list],
             unit_layers: Callable[[int], Any], names: Callable[[int], str],
             run_layers: LayerLoop | None = None) -> list[Any]:
    """Runs a glue segment whose equations hold unit calls, inside the caller's trace (the compiled engine's
    step): the scans among them stay scans.

    A scan whose body calls a stack of layers (a recorded call with ``layer == -1``) runs over the stack's
    layers: with ``run_layers``, as the caller's loop over them (its body this scan's, each layered call
    given its layer's parameters: ``call_unit(k, inputs, ("gathered", params))``); else bound again with the
    stack's parameters, ``stacked(uid)``, as further scanned inputs, each iteration's call taking its layer
    (``call_unit(k, inputs, layer_params)``). A call of a unit's whole parameters is
    ``call_unit(k, inputs, None)``; a reversed scan, or one whose body also calls a unit's whole parameters,
    is always bound again.

    Raises:
      EngineError: a unit call inside another transform, or a stack called outside a scan of its length.
    """
    def on_call(eqn: Any, vals: list, layer_params: dict) -> list:
        k = eqn.params["call"]
        c = calls[k]
        if c.layer == -1 and c.uid not in layer_params:
            raise EngineError(_outside_scan(names(c.uid), unit_layers(c.uid), None))
        return call_unit(k, vals, layer_params.get(c.uid) if c.layer == -1 else None)

    def on_scan(eqn: Any, vals: list, layer_params: dict) -> list:
        p = eqn.params
        nc, nk, body = p["num_consts"], p["num_carry"], p["jaxpr"]
        uids = _layered_calls(body.jaxpr, call_p, calls)
        for uid in uids:
            if unit_layers(uid) != p["length"]:
                raise EngineError(_outside_scan(names(uid), unit_layers(uid), p["length"]))
        consts, carry, xs = vals[:nc], vals[nc:nc + nk], vals[nc + nk:]
        if run_layers is not None and uids and not p["reverse"] and not _whole_calls(body.jaxpr, call_p, calls):
            def layer_body(gathered: list, c: list, f: list, x: list) -> tuple[list, list]:
                inner = {**layer_params, **{u: ("gathered", g) for u, g in zip(uids, gathered)}}
                out = _interpret(body.jaxpr, body.consts, [*f, *c, *x], inner, call_p, on_call, on_scan)
                return out[:nk], out[nk:]
            final, ys = run_layers(uids, layer_body, list(carry), list(consts), list(xs), p["length"])
            return [*final, *ys]

        def step(c: list, x: tuple) -> tuple[list, list]:
            xs_i, params_i = x
            out = _interpret(body.jaxpr, body.consts, [*consts, *c, *xs_i],
                             {**layer_params, **dict(zip(uids, params_i))}, call_p, on_call, on_scan)
            return out[:nk], out[nk:]

        final, ys = jax.lax.scan(step, list(carry), (list(xs), [stacked(u) for u in uids]), length=p["length"],
                                 reverse=p["reverse"], unroll=p["unroll"])
        return [*final, *ys]

    return _interpret(jaxpr, consts, ins, {}, call_p, on_call, on_scan)


def _whole_calls(jaxpr: Any, call_p: Any, calls: Sequence[Any]) -> bool:
    """Whether ``jaxpr`` (a scan's body) calls some unit with its whole parameters (not one layer of a stack)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive is call_p and calls[eqn.params["call"]].layer != -1:
            return True
        if any(_whole_calls(sub, call_p, calls) for sub in core.jaxprs_in_params(eqn.params)):
            return True
    return False


def _inside(name: str) -> str:
    return (f"zinf_jax: a unit is called inside {name} in the model's code; the engine runs a unit call inside a "
            f"scan (nnx.scan, jax.lax.scan, nn.scan), jit or checkpoint, not inside {name}. Call the unit outside "
            "it, or make the module around it the unit (UnitPolicy(patterns=(...,)))")


def _outside_scan(name: str, n: int, length: int | None) -> str:
    where = f"a scan of length {length}" if length is not None else "a transform that is not a scan"
    return (f"zinf_jax: unit {name!r} holds {n} layers (every parameter's leading axis is {n}) and is called inside "
            f"{where} in the model's code; a stack of layers is applied one layer per iteration of a scan over it "
            f"({n} iterations). Call it so, or make the module around the call the unit (UnitPolicy(patterns=(...,)))")
