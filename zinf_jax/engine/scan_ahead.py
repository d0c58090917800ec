"""A scanned run of host-resident layers that moves the next layer in while one computes.

[Note: moves ahead]
With the parameters in ``pinned_host`` (``offload_param="cpu"``), each call of a scanned run ([Note:
scanned runs] in :mod:`zinf_jax.engine.compiled`) needs its layer's shards in device memory. Moved in
the iteration that uses them, the move is a dependency of that iteration's compute and nothing overlaps
it. Here iteration ``k`` moves layer ``k + 1`` (the backward: ``k - 1``) and hands it to the next
iteration in the loop's carry, so the copy runs while layer ``k`` computes, as the streamed engine's
prefetcher fetches one unit ahead. The forward's last iteration moves its own layer again, which is
where the backward starts; the backward's last moves the first layer again (one spare move a step).
XLA's latency-hiding scheduler then starts each copy early (the options the engine sets for a GPU:
``GPU_COMPILER_OPTIONS`` in :mod:`zinf_jax.engine.compiled`).

Differentiated by JAX, such a loop would save every iteration's carried device copy for the backward
(a stack of all layers in device memory: the offload undone), so the run is one custom VJP:

* forward: the loop above, saving each call's carried inputs (what activation checkpointing saves);
* backward: the reverse loop, moving layer ``k - 1`` in while layer ``k`` is recomputed from its saved
  inputs and differentiated; each trained parameter's cotangent is cast to float32 and reduce-scattered
  in device memory and moved out as the last operation, into its tap's memory ([Note: gradient taps] in
  :mod:`zinf_jax.engine.staging`), stacked layer by layer.

Used for runs whose units recompute in the backward (``activation_checkpointing=True``, the default) and
for forward-only programs; with ``activation_checkpointing=False`` the run keeps JAX's own differentiation
(the activations are saved, the parameters read again in the backward).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from zinf_jax.engine.runs import Run
from zinf_jax.engine.staging import gather_in, move_in, scatter_out
from zinf_jax.plan.partition import ParamLayout

__all__ = ["scan_ahead"]


def _inexact(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _layer(stack: jax.Array, k: Any) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(stack, k, keepdims=False)


def scan_ahead(unit: Callable[[list, list], list], layouts: Sequence[ParamLayout], mesh: Mesh, dtype: Any,
               stacked: Sequence[Any], run: Run, ins: list[list[Any]], grad: bool) -> tuple[list, list]:
    """The calls of ``run`` as one loop that moves each layer in one iteration ahead (see [Note: moves ahead]).

    Args:
      unit: ``unit(gathered_params, dyn)``: one call's flat outputs.
      layouts: the unit's parameter layouts (one per stack).
      mesh: the mesh.
      dtype: the compute dtype the parameters are gathered in.
      stacked: per parameter position, the host stack ``(n, *stored)``, or a trained one's
        ``(tap_stack, host_stack)`` pair (its gradient goes to the tap).
      run: the run.
      ins: each call's inputs (``None`` where carried).
      grad: the loop is differentiated (else a forward-only loop).

    Returns:
      The carried values after the last call (per carried input position), and per output in
      ``run.outputs`` its values of every call, stacked.
    """
    n = len(ins)
    first = ins[0]
    carried = [p for p, o in enumerate(run.carry) if o is not None]
    per_call = [p for p, o in enumerate(run.carry) if o is None and not run.invariant[p]]
    fixed = [p for p, o in enumerate(run.carry) if o is None and run.invariant[p] and isinstance(first[p], jax.Array)]
    template = [None if p in carried or p in per_call or p in fixed else v for p, v in enumerate(first)]
    taps = [x[0] if isinstance(x, tuple) else None for x in stacked]
    stores = [x[1] if isinstance(x, tuple) else x for x in stacked]
    tap_out = [None if t is None else NamedSharding(  # where each gradient goes: its tap's memory
        mesh, lay.spec, memory_kind="pinned_host" if jax.typeof(t).memory_space.name == "Host" else "device")
        for t, lay in zip(taps, layouts)]

    def moved(hosts: list, k: Any) -> list[jax.Array]:
        return [move_in(lay, _layer(s, k), mesh) for lay, s in zip(layouts, hosts)]

    def call(params: list, c: list, x: list, f: list) -> tuple[list, list]:
        dyn = list(template)
        for ps, vs in ((carried, c), (per_call, x), (fixed, f)):
            for p, v in zip(ps, vs):
                dyn[p] = v
        outs = unit(params, dyn)
        return [outs[run.carry[p]] for p in carried], [outs[o] for o in run.outputs]

    def forward(hosts: list, c0: list, f: list, xs: list, save: bool) -> tuple[list, list, list, list]:
        def body(carry, kx):
            c, dev = carry
            k, x = kx
            ahead = moved(hosts, jnp.minimum(k + 1, n - 1))  # See [Note: moves ahead]
            c_next, y = call([gather_in(lay, d, mesh, dtype) for lay, d in zip(layouts, dev)], c, x, f)
            return (c_next, ahead), (y, c if save else [])

        (final, last), (ys, cins) = jax.lax.scan(body, (c0, moved(hosts, 0)), (jnp.arange(n), xs))
        return final, ys, cins, last  # last: the last layer, moved in again by the last iteration

    c0 = [first[p] for p in carried]
    f0 = [first[p] for p in fixed]
    xs0 = [jnp.stack([ins[k][p] for k in range(n)]) for p in per_call]
    if not grad:
        final, ys, _, _ = forward(stores, c0, f0, xs0, save=False)
        return final, ys

    dc = [i for i, v in enumerate(c0) if _inexact(v)]  # the differentiable carried, fixed, per-call inputs
    df = [i for i, v in enumerate(f0) if _inexact(v)]
    dx = [i for i, v in enumerate(xs0) if _inexact(v)]

    @jax.custom_vjp
    def loop(taps: list, hosts: list, c0: list, f: list, xs: list) -> tuple[list, list]:
        del taps  # differentiated, never read: [Note: gradient taps]
        final, ys, _, _ = forward(hosts, c0, f, xs, save=False)
        return final, ys

    def loop_fwd(taps, hosts, c0, f, xs):
        del taps
        final, ys, cins, last = forward(hosts, c0, f, xs, save=True)
        return (final, ys), (hosts, cins, f, xs, last)  # last: one layer, where the backward starts

    def loop_bwd(res, cts):
        hosts, cins, f, xs, last = res
        ct_final, ct_ys = cts
        dy = [j for j, v in enumerate(ct_ys) if _inexact(v)]  # the differentiable outputs
        trained = [j for j, t in enumerate(taps) if t is not None]

        def body(carry, kx):
            ct_c, dev, acc = carry
            k, c, x, ct_y = kx
            ahead = moved(hosts, jnp.maximum(k - 1, 0))  # See [Note: moves ahead]
            gathered = [gather_in(lay, d, mesh, dtype) for lay, d in zip(layouts, dev)]

            def diff(tp, cv, fv, xv):
                params, c_all, f_all, x_all = list(gathered), list(c), list(f), list(x)
                for idx, vals, dst in ((trained, tp, params), (dc, cv, c_all), (df, fv, f_all), (dx, xv, x_all)):
                    for i, v in zip(idx, vals):
                        dst[i] = v
                c_next, y = call(params, c_all, x_all, f_all)
                return [c_next[i] for i in dc], [y[j] for j in dy]

            _, pull = jax.vjp(diff, [gathered[j] for j in trained], [c[i] for i in dc], [f[i] for i in df],
                              [x[i] for i in dx])
            g_p, g_c, g_f, g_x = pull((ct_c, ct_y))
            out = []
            for j, g in zip(trained, g_p):
                g = scatter_out(layouts[j], g, mesh)  # float32, reduce-scattered, in device memory
                out.append(g if tap_out[j].memory_kind == "device" else jax.device_put(g, tap_out[j]))
            return (g_c, ahead, [a + g for a, g in zip(acc, g_f)]), (out, g_x)

        ct_c0 = [ct_final[i] for i in dc]
        acc0 = [jnp.zeros_like(f[i]) for i in df]
        (g_c, _, g_f), (g_taps, g_xs) = jax.lax.scan(
            body, (ct_c0, last, acc0), (jnp.arange(n), cins, xs, [ct_ys[j] for j in dy]), reverse=True)
        out_taps: list[Any] = [None] * len(taps)
        for j, g in zip(trained, g_taps):
            out_taps[j] = g
        return (out_taps, None, _place(dc, g_c, len(c0)), _place(df, g_f, len(f)), _place(dx, g_xs, len(xs)))

    loop.defvjp(loop_fwd, loop_bwd)
    return loop(taps, stores, c0, f0, xs0)


def _place(idx: Sequence[int], vals: Sequence[Any], n: int) -> list[Any]:
    """``vals`` at positions ``idx`` of a list of ``n``, ``None`` (a zero cotangent) elsewhere."""
    out: list[Any] = [None] * n
    for i, v in zip(idx, vals):
        out[i] = v
    return out
