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


def unroll(closed: Any, calls: Sequence[Any], call_p: Any, args: Sequence[Any], unit_layers: Callable[[int], Any],
           names: Callable[[int], str]) -> tuple[Any, list[Any]]:
    """The loss traced again with every unit call at its top level.

    Args:
      closed: the traced loss (``jax.make_jaxpr`` output).
      calls: the recorded unit calls (``UnitCall``), indexed by the ``call`` parameter of ``call_p``.
      call_p: the unit call primitive.
      args: the loss's flat example inputs (arrays or ``ShapeDtypeStruct``).
      unit_layers: a unit's layer count (see :func:`~zinf_jax.engine.glue.layer_count`).
      names: a unit's path, for errors.

    Returns:
      ``(closed, calls)``: the new jaxpr and its calls in order; a call made inside a scan has its
      ``layer`` set to that scan's iteration.

    Raises:
      EngineError: a unit call inside a transform other than a scan or an inlined call.
    """
    out_calls: list[Any] = []
    scans: list[int] = []  # the lengths of the scans being run, innermost last

    def _layer(c: Any, layer: int | None, scans: list[int], unit_layers: Any) -> int:
        n = unit_layers(c.uid)
        if layer is None or not scans or scans[-1] != n:
            raise EngineError(_outside_scan(names(c.uid), n, scans[-1] if scans else None))
        return layer

    def run(jaxpr: Any, consts: Sequence[Any], ins: Sequence[Any], layer: int | None) -> list[Any]:
        env: dict[Any, Any] = {}

        def read(v: Any) -> Any:
            return v.val if isinstance(v, core.Literal) else env[v]

        env.update(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, ins))
        for eqn in jaxpr.eqns:
            vals = [read(v) for v in eqn.invars]
            subs = list(core.jaxprs_in_params(eqn.params))
            if eqn.primitive is call_p:
                c = calls[eqn.params["call"]]
                if c.layer == -1:  # a stack of layers: the scan's iteration is the layer
                    c = dataclasses.replace(c, layer=_layer(c, layer, scans, unit_layers))
                out_calls.append(c)
                outs = call_p.bind(*vals, call=len(out_calls) - 1, out_avals=eqn.params["out_avals"])
            elif not any(_holds_call(s, call_p) for s in subs):
                with eqn.ctx.manager:
                    outs = eqn.primitive.bind(*vals, **core.bind_params(eqn))
                outs = outs if eqn.primitive.multiple_results else [outs]
            elif eqn.primitive is core.scan_p:
                scans.append(eqn.params["length"])
                try:
                    outs = _scan(eqn, vals, run)
                finally:
                    scans.pop()
            elif eqn.primitive.name in _INLINED:
                inner = eqn.params.get("call_jaxpr") or eqn.params.get("jaxpr") or eqn.params.get("fun_jaxpr")
                if inner is None:
                    raise EngineError(f"zinf_jax: a unit is called inside {eqn.primitive.name}, whose inner program "
                                      "the engine cannot find; call the unit outside it")
                closed_inner = inner if hasattr(inner, "consts") else None
                body = closed_inner.jaxpr if closed_inner is not None else inner
                outs = run(body, closed_inner.consts if closed_inner is not None else [], vals, layer)
                outs = outs[:len(eqn.outvars)]
            else:
                raise EngineError(_inside(eqn.primitive.name))
            for v, x in zip(eqn.outvars, outs):
                if not isinstance(v, core.DropVar):
                    env[v] = x
        return [read(v) for v in jaxpr.outvars]

    flat = jax.make_jaxpr(lambda *a: run(closed.jaxpr, closed.consts, a, None))(*args)
    return flat, out_calls


def _scan(eqn: Any, vals: list[Any], run: Any) -> list[Any]:
    """A scan equation's outputs, its iterations run one by one (``run(body, consts, ins, iteration)``)."""
    p = eqn.params
    nc, nk, n, body = p["num_consts"], p["num_carry"], p["length"], p["jaxpr"]
    consts, carry, xs = vals[:nc], vals[nc:nc + nk], vals[nc + nk:]
    ys: dict[int, list[Any]] = {}
    for i in (range(n - 1, -1, -1) if p["reverse"] else range(n)):
        out = run(body.jaxpr, body.consts, [*consts, *carry, *(x[i] for x in xs)], i)
        carry, ys[i] = out[:nk], out[nk:]
    n_ys = len(body.jaxpr.outvars) - nk
    stacked = [jnp.stack([ys[i][j] for i in range(n)]) if n else
               jnp.zeros((0, *body.jaxpr.outvars[nk + j].aval.shape), body.jaxpr.outvars[nk + j].aval.dtype)
               for j in range(n_ys)]
    return [*carry, *stacked]


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


def evaluate(jaxpr: Any, consts: Sequence[Any], ins: Sequence[Any], call_p: Any, calls: Sequence[Any],
             call_unit: Callable[[int, list, Any], list], stacked: Callable[[int], list],
             unit_layers: Callable[[int], Any], names: Callable[[int], str]) -> list[Any]:
    """Runs a glue segment whose equations hold unit calls, inside the caller's trace (the compiled engine's
    step): the scans among them stay scans.

    A scan whose body calls a stack of layers (a recorded call with ``layer == -1``) is bound again with the
    stack's parameters, ``stacked(uid)``, as further scanned inputs, so each iteration's call takes its
    layer: ``call_unit(k, inputs, layer_params)``. A call of a unit's whole parameters is
    ``call_unit(k, inputs, None)``. ``jit``, ``checkpoint`` and ``custom_*`` calls holding unit calls run
    inline, as in :func:`unroll`.

    Raises:
      EngineError: a unit call inside another transform, or a stack called outside a scan of its length.
    """
    def run(jaxpr: Any, consts: Sequence[Any], ins: Sequence[Any], layer_params: dict) -> list[Any]:
        env: dict[Any, Any] = {}

        def read(v: Any) -> Any:
            return v.val if isinstance(v, core.Literal) else env[v]

        env.update(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, ins))
        for eqn in jaxpr.eqns:
            vals = [read(v) for v in eqn.invars]
            subs = list(core.jaxprs_in_params(eqn.params))
            if eqn.primitive is call_p:
                k = eqn.params["call"]
                c = calls[k]
                if c.layer == -1 and c.uid not in layer_params:
                    raise EngineError(_outside_scan(names(c.uid), unit_layers(c.uid), None))
                outs = call_unit(k, vals, layer_params.get(c.uid) if c.layer == -1 else None)
            elif not any(_holds_call(s, call_p) for s in subs):
                with eqn.ctx.manager:
                    outs = eqn.primitive.bind(*vals, **core.bind_params(eqn))
                outs = outs if eqn.primitive.multiple_results else [outs]
            elif eqn.primitive is core.scan_p:
                outs = rescan(eqn, vals, layer_params)
            elif eqn.primitive.name in _INLINED:
                inner = eqn.params.get("call_jaxpr") or eqn.params.get("jaxpr") or eqn.params.get("fun_jaxpr")
                closed_inner = inner if hasattr(inner, "consts") else None
                body = closed_inner.jaxpr if closed_inner is not None else inner
                outs = run(body, closed_inner.consts if closed_inner is not None else [], vals, layer_params)
                outs = outs[:len(eqn.outvars)]
            else:
                raise EngineError(_inside(eqn.primitive.name))
            for v, x in zip(eqn.outvars, outs):
                if not isinstance(v, core.DropVar):
                    env[v] = x
        return [read(v) for v in jaxpr.outvars]

    def rescan(eqn: Any, vals: list[Any], layer_params: dict) -> list[Any]:
        p = eqn.params
        nc, nk, body = p["num_consts"], p["num_carry"], p["jaxpr"]
        uids = _layered_calls(body.jaxpr, call_p, calls)
        for uid in uids:
            if unit_layers(uid) != p["length"]:
                raise EngineError(_outside_scan(names(uid), unit_layers(uid), p["length"]))
        consts, carry, xs = vals[:nc], vals[nc:nc + nk], vals[nc + nk:]

        def step(c: list, x: tuple) -> tuple[list, list]:
            xs_i, params_i = x
            out = run(body.jaxpr, body.consts, [*consts, *c, *xs_i], {**layer_params, **dict(zip(uids, params_i))})
            return out[:nk], out[nk:]

        final, ys = jax.lax.scan(step, list(carry), (list(xs), [stacked(u) for u in uids]), length=p["length"],
                                 reverse=p["reverse"], unroll=p["unroll"])
        return [*final, *ys]

    return run(jaxpr, consts, ins, {})


def _inside(name: str) -> str:
    return (f"zinf_jax: a unit is called inside {name} in the model's code; the engine runs a unit call inside a "
            f"scan (nnx.scan, jax.lax.scan, nn.scan), jit or checkpoint, not inside {name}. Call the unit outside "
            "it, or make the module around it the unit (UnitPolicy(patterns=(...,)))")


def _outside_scan(name: str, n: int, length: int | None) -> str:
    where = f"a scan of length {length}" if length is not None else "a transform that is not a scan"
    return (f"zinf_jax: unit {name!r} holds {n} layers (every parameter's leading axis is {n}) and is called inside "
            f"{where} in the model's code; a stack of layers is applied one layer per iteration of a scan over it "
            f"({n} iterations). Call it so, or make the module around the call the unit (UnitPolicy(patterns=(...,)))")
