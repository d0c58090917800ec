"""Unit calls inside the compiled step: each unit's parameters moved in, gathered, used, released; gradients out.

The compiled engine (:mod:`zinf_jax.engine.compiled`) runs every unit call of a step through here, a run of
alike calls as one loop (:func:`run_staged`, [Note: scanned runs] in :mod:`zinf_jax.engine.compiled`), any
other call alone (:func:`call_staged`). Both are custom VJPs, so what a step moves, keeps and reduces is
written here and not left to JAX's differentiation of a program that reads host memory.

# [Note: moves ahead]
# With the parameters in ``pinned_host`` (``offload_param="cpu"``) a unit's shards must reach device memory
# before it runs. Moved in the iteration that uses them, the move is a dependency of that iteration's
# compute and nothing overlaps it. So in a run, iteration ``k`` moves layer ``k + 1`` (in the backward
# ``k - 1``) and hands it to the next iteration in the loop's carry: the copy runs while layer ``k``
# computes, as the streamed engine's prefetcher fetches one unit ahead. A loop whose every iteration moves
# the next layer moves one too many at its end unless something reads it. In a training step the forward
# loop's last iteration moves its own layer again, for the backward, which starts there (one layer's device
# copy kept between them); the backward's loop runs down to the second layer and the first runs after it,
# moving nothing. An evaluation's loop stops before the last layer, which runs after it. So a run of n
# layers moves 2n layers a training step (each layer for the forward and for the backward) and n an
# evaluation; a call alone moves its parameters in its forward and again in its backward. XLA's GPU
# scheduler lets only a few asynchronous moves run at once unless told otherwise: see ``compiler_options``
# in :mod:`zinf_jax.engine.compiled`.

# [Note: staged gradients]
# A parameter's gradient leaves the backward of its unit's call as soon as it is formed: the gathered
# cotangent is cast to float32, reduce-scattered to the stored sharding in device memory, and only then
# moved to host memory when the optimizer is there (``Tap``). JAX types an array's memory space, so that
# host-memory cotangent has to belong to a host-memory primal input: each trained argument comes as
# ``(tap, stored)``, the tap a float32 placeholder of the stored shape in the gradient's memory, which no
# forward reads (XLA drops it; [Note: gradient taps] in :mod:`zinf_jax.engine.staging`). A run's tap with
# host parameters comes in the two pieces its backward makes: the first layer, and the others.
# Differentiating the stored shards themselves would cast, reshard and sum gradients after they reached host
# memory (host compute on an accelerator), and JAX's transpose of a loop would carry the placeholders
# through it (bytes moved for nothing).

# [Note: no saved parameters]
# The backward reads the parameters again rather than keeping them: with activation checkpointing (the
# default) it recomputes the call from its inputs; without, the forward keeps the call's VJP residuals but
# for the gathered parameters (found by identity among the residuals' leaves), and the backward puts a
# fresh gather in their place. A call alone moves its parameters again in its backward from an index that
# an optimization barrier ties to the cotangent, so XLA cannot merge the two moves into one copy that
# lives across the step (nothing in host memory ever enters a barrier: XLA:TPU cannot compile that).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zinf_jax.engine.staging import gather_in, keep_all_but_params, move_in, scatter_out
from zinf_jax.plan.partition import ParamLayout

__all__ = ["Staging", "Tap", "run_staged", "call_staged", "pieces"]

LoopFn = Callable[[list, list, list, list], tuple[list, list]]
"""``fn(gathered_params, carry, fixed, x) -> (carry, y)``: one call of a run as a function of its gathered
parameters, the values carried from the previous call, the values the same in every call, and its own."""


@dataclasses.dataclass(frozen=True)
class Staging:
    """How a program reads its units' parameters.

    Attributes:
      mesh: the mesh.
      dtype: the compute dtype parameters are gathered in.
      host: the stored shards are in ``pinned_host`` (moved to device memory in the program).
      remat: the backward recomputes each call (else it keeps its residuals, but the parameters).
    """

    mesh: Mesh
    dtype: Any
    host: bool
    remat: bool

    def move(self, lay: ParamLayout, stored: jax.Array) -> jax.Array:
        return move_in(lay, stored, self.mesh) if self.host else stored

    def gather(self, lay: ParamLayout, dev: jax.Array) -> jax.Array:
        return gather_in(lay, dev, self.mesh, self.dtype)


@dataclasses.dataclass(frozen=True)
class Tap:
    """Where a trained parameter's gradient goes: its memory kind (see [Note: staged gradients])."""

    kind: str

    def out(self, lay: ParamLayout, g: jax.Array, mesh: Mesh) -> jax.Array:
        g = scatter_out(lay, g, mesh)  # float32, reduce-scattered, in device memory
        if self.kind == "device":
            return g
        return jax.device_put(g, NamedSharding(mesh, lay.spec, memory_kind=self.kind))


def pieces(n: int, peeled: bool) -> tuple[tuple[int, int], ...]:
    """The layer ranges a run's gradient leaves in: ``((0, 1), (1, n))`` when its backward runs the first
    layer after its loop (see [Note: moves ahead]), else ``((0, n),)``."""
    if not peeled or n < 2:
        return ((0, n),)
    return ((0, 1), (1, n))


def _inexact(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _at(stack: Any, k: Any) -> Any:
    return jax.lax.dynamic_index_in_dim(stack, k, keepdims=False)


def _place(idx: Sequence[int], vals: Sequence[Any], n: int) -> list[Any]:
    """``vals`` at positions ``idx`` of a list of ``n``, ``None`` (a zero cotangent) elsewhere."""
    out: list[Any] = [None] * n
    for i, v in zip(idx, vals):
        out[i] = v
    return out


def _put(base: Sequence[Any], idx: Sequence[int], vals: Sequence[Any]) -> list[Any]:
    out = list(base)
    for i, v in zip(idx, vals):
        out[i] = v
    return out


class _Residuals:
    """The structure of a call's VJP residuals without its parameters ([Note: no saved parameters]), learnt
    when the forward is traced and used when the backward is."""

    def __init__(self) -> None:
        self.tree: Any = None
        self.params: list[tuple[int, int]] = []  # (leaf position, parameter index)

    def strip(self, vjp_fn: Any, params: Sequence[Any]) -> list[Any]:
        leaves, self.tree = jax.tree.flatten(vjp_fn)
        self.params = [(i, j) for i, leaf in enumerate(leaves) for j, p in enumerate(params) if leaf is p]
        drop = {i for i, _ in self.params}
        return [leaf for i, leaf in enumerate(leaves) if i not in drop]

    def rebuild(self, kept: Sequence[Any], params: Sequence[Any]) -> Any:
        leaves: list[Any] = []
        it = iter(kept)
        where = dict(self.params)
        for i in range(self.tree.num_leaves):
            leaves.append(params[where[i]] if i in where else next(it))
        return jax.tree.unflatten(self.tree, leaves)


class _Call:
    """One call's forward and backward given its gathered parameters: what both entry points share."""

    def __init__(self, fn: LoopFn, st: Staging, trained: Sequence[int], dc: Sequence[int], df: Sequence[int],
                 dx: Sequence[int]):
        self.fn, self.st, self.trained = fn, st, list(trained)
        self.dc, self.df, self.dx = list(dc), list(df), list(dx)
        self.res = _Residuals()

    def _diff(self, params: list, c: list, f: list, x: list) -> Callable:
        """The call as a function of its differentiated inputs; its outputs the inexact carried values and
        outputs, and (aux) all of them."""
        def g(tp, cv, fv, xv):
            c2, y = self.fn(_put(params, self.trained, tp), _put(c, self.dc, cv), _put(f, self.df, fv),
                            _put(x, self.dx, xv))
            return ([c2[i] for i in self.dc], [v for v in y if _inexact(v)]), (c2, y)
        return g

    def _primals(self, params: list, c: list, f: list, x: list) -> tuple:
        return ([params[j] for j in self.trained], [c[i] for i in self.dc], [f[i] for i in self.df],
                [x[i] for i in self.dx])

    def forward(self, params: list, c: list, f: list, x: list, save: bool) -> tuple[list, list, Any]:
        """``(carry, y, residual)``: the residual is what the backward needs besides the parameters (the
        call's carried inputs when it recomputes, else its VJP residuals without them)."""
        if not save or self.st.remat:
            c2, y = self.fn(params, c, f, x)
            return c2, y, (list(c) if save else None)
        pol = jax.checkpoint(self._diff(params, c, f, x), policy=keep_all_but_params)
        _, vjp_fn, (c2, y) = jax.vjp(pol, *self._primals(params, c, f, x), has_aux=True)
        return c2, y, self.res.strip(vjp_fn, [params[j] for j in self.trained])

    def backward(self, params: list, residual: Any, f: list, x: list, ct_c: list,
                 ct_y: list) -> tuple[list, list, list, list]:
        """``(param cts (trained), carry cts, fixed cts, x cts)`` of one call, given its gathered parameters."""
        if self.st.remat:
            c = list(residual)
            _, pull, _ = jax.vjp(self._diff(params, c, f, x), *self._primals(params, c, f, x), has_aux=True)
        else:
            pull = self.res.rebuild(residual, [params[j] for j in self.trained])
        return pull((list(ct_c), list(ct_y)))


def run_staged(fn: LoopFn, layouts: Sequence[ParamLayout], stacks: Sequence[Any], taps: Sequence[Any],
               n: int, carry0: list, fixed: list, xs: list, st: Staging, *, grad: bool,
               tap_kinds: Sequence[str | None] = ()) -> tuple[list, list]:
    """The ``n`` calls of a run as loops over the layers of its stacked parameters (see [Note: moves ahead]).

    Args:
      fn: one call (:data:`LoopFn`).
      layouts: per parameter position, one layer's layout.
      stacks: per parameter position, the stored stack ``(n, *stored)``.
      taps: per parameter position, ``None`` (frozen) or the tap pieces its gradient goes to
        (:func:`pieces` of the run; see [Note: staged gradients]).
      n: the number of calls.
      carry0, fixed, xs: the first call's carried inputs, the inputs the same in every call, and the
        per-call inputs stacked.
      st: how parameters are read.
      grad: the loops are differentiated (else forward only).
      tap_kinds: per parameter position, the gradient's memory kind (``None`` for a frozen one).

    Returns:
      The carried values after the last call, and the per-call outputs stacked.
    """
    peel = st.host  # layers moved ahead: [Note: moves ahead]
    trained = [j for j, t in enumerate(taps) if t is not None]
    outs_tap = {j: Tap(tap_kinds[j] or "device") for j in trained}

    def moved(hosts: list, k: Any) -> list:
        return [st.move(lay, _at(s, k)) for lay, s in zip(layouts, hosts)]

    def gathered(dev: list) -> list:
        return [st.gather(lay, d) for lay, d in zip(layouts, dev)]

    def take(stack_list: list, k: Any) -> list:
        return [_at(s, k) for s in stack_list]

    def forward(hosts: list, c0: list, f: list, xs_: list, call: _Call | None) -> tuple:
        """Runs the calls: ``(final carry, ys stacked, residuals stacked, the last layer's device copy)``.

        Differentiated (``call``), one loop over all the calls whose last iteration moves its own layer again:
        the backward starts with it. Forward only, a loop over all but the last call, which runs after it
        with the layer the loop's last iteration moved: nothing is moved that no call reads.
        """
        save = call is not None
        runner = call or _Call(fn, st, [], [], [], [])

        if not peel:
            def plain(c, k):
                c2, y, r = runner.forward(gathered(moved(hosts, k)), c, f, take(xs_, k), save)
                return c2, (y, r)
            final, (ys, rs) = jax.lax.scan(plain, c0, jnp.arange(n))
            return final, ys, rs, None

        def body(carry, k):
            c, dev = carry
            ahead = moved(hosts, jnp.minimum(k + 1, n - 1))  # See [Note: moves ahead]
            c2, y, r = runner.forward(gathered(dev), c, f, take(xs_, k), save)
            return (c2, ahead), (y, r)

        dev0 = moved(hosts, 0)
        if save:
            (final, last), (ys, rs) = jax.lax.scan(body, (c0, dev0), jnp.arange(n))
            return final, ys, rs, last
        if n == 1:
            final, y_last, _ = runner.forward(gathered(dev0), c0, f, take(xs_, 0), False)
            return final, [y[None] for y in y_last], None, None
        (c, dev_last), (ys, _) = jax.lax.scan(body, (c0, dev0), jnp.arange(n - 1))
        final, y_last, _ = runner.forward(gathered(dev_last), c, f, take(xs_, n - 1), False)
        return final, [jnp.concatenate([a, b[None]]) for a, b in zip(ys, y_last)], None, None

    if not grad:
        final, ys, _, _ = forward(stacks, carry0, fixed, xs, None)
        return final, ys

    dc = [i for i, v in enumerate(carry0) if _inexact(v)]
    df = [i for i, v in enumerate(fixed) if _inexact(v)]
    dx = [i for i, v in enumerate(xs) if _inexact(v)]
    call = _Call(fn, st, trained, dc, df, dx)

    @jax.custom_vjp
    def loop(taps_: list, hosts: list, c0: list, f: list, xs_: list) -> tuple[list, list]:
        del taps_  # differentiated, never read: [Note: staged gradients]
        final, ys, _, _ = forward(hosts, c0, f, xs_, None)
        return final, ys

    def loop_fwd(taps_, hosts, c0, f, xs_):
        del taps_
        final, ys, rs, last = forward(hosts, c0, f, xs_, call)
        return (final, ys), (hosts, rs, last, f, xs_)

    def step_back(dev: list, r: Any, f: list, k: Any, xs_: list, ct_c: list, ct_ys: list) -> tuple:
        dy = [_at(s, k) for s in ct_ys if _inexact(s)]
        g_p, g_c, g_f, g_x = call.backward(gathered(dev), r, f, take(xs_, k), ct_c, dy)
        grads = [outs_tap[j].out(layouts[j], g, st.mesh) for j, g in zip(trained, g_p)]
        return grads, g_c, g_f, g_x

    def add(acc: list, g: list) -> list:
        return [a + b for a, b in zip(acc, g)]

    def at(rs: Any, k: Any) -> Any:
        return jax.tree.map(lambda s: _at(s, k), rs)

    def loop_bwd(res, cts):
        hosts, rs, last, f, xs_ = res
        ct_final, ct_ys = cts
        ct_c = [ct_final[i] for i in dc]
        acc = [jnp.zeros_like(f[i]) for i in df]
        if not peel:  # nothing to move: one loop
            def plain(carry, k):
                ct, acc_ = carry
                grads, g_c, g_f, g_x = step_back(moved(hosts, k), at(rs, k), f, k, xs_, ct, ct_ys)
                return (g_c, add(acc_, g_f)), (grads, g_x)
            (ct_c, acc), (g_stacks, g_xs) = jax.lax.scan(plain, (ct_c, acc), jnp.arange(n), reverse=True)
            by_tap = [(g,) for g in g_stacks]
        else:  # See [Note: moves ahead]: a loop from the last layer down to the second, then the first
            dev = last
            by_tap, gx = [()] * len(trained), [[] for _ in dx]
            if n > 1:
                def body(carry, k):
                    ct, d, acc_ = carry
                    nxt = moved(hosts, k - 1)
                    grads, g_c, g_f, g_x = step_back(d, at(rs, k), f, k, xs_, ct, ct_ys)
                    return (g_c, nxt, add(acc_, g_f)), (grads, g_x)
                (ct_c, dev, acc), (g_rest, gx_rest) = jax.lax.scan(body, (ct_c, dev, acc), jnp.arange(1, n),
                                                                   reverse=True)
                by_tap = [(g,) for g in g_rest]
                gx = [[g] for g in gx_rest]
            g_first, ct_c, g_f, gx_first = step_back(dev, at(rs, 0), f, 0, xs_, ct_c, ct_ys)
            acc = add(acc, g_f)
            by_tap = [(g[None],) + t for g, t in zip(g_first, by_tap)]
            g_xs = [jnp.concatenate([g[None]] + t) for g, t in zip(gx_first, gx)]
        out_taps: list[Any] = [None] * len(taps)
        for j, g in zip(trained, by_tap):  # in the structure the tap came in: pieces or one array
            out_taps[j] = tuple(g) if isinstance(taps[j], tuple) else g[0]
        return (out_taps, None, _place(dc, ct_c, len(carry0)), _place(df, acc, len(fixed)),
                _place(dx, g_xs, len(xs)))

    loop.defvjp(loop_fwd, loop_bwd)
    return loop(list(taps), list(stacks), list(carry0), list(fixed), list(xs))


def call_staged(fn: Callable[[list, list], list], layouts: Sequence[ParamLayout], stored: Sequence[Any],
                taps: Sequence[Any], dyn: list, st: Staging, *, grad: bool, tap_kinds: Sequence[str | None] = (),
                again: Sequence[Any] | None = None) -> list:
    """One unit call's outputs: its parameters moved in (from host memory), gathered and used, and in the
    backward read again ([Note: no saved parameters]) and their gradients sent to ``taps``.

    Args:
      fn: ``fn(gathered_params, dyn) -> outputs``.
      layouts, stored: per parameter, its layout and stored shards.
      taps: per parameter, ``None`` (frozen) or its tap ([Note: staged gradients]).
      dyn: the call's array inputs.
      st: how parameters are read.
      grad: differentiated (else forward only).
      tap_kinds: per parameter, its gradient's memory kind.
      again: the stored shards the backward moves in (the same buffers as ``stored``, passed to the program
        a second time so that XLA cannot merge the backward's move with the forward's into one copy kept
        across the step); default ``stored``.
    """
    def gathered(xs: Sequence[Any]) -> list:
        return [st.gather(l, st.move(l, x)) for l, x in zip(layouts, xs)]

    if not grad:
        return fn(gathered(stored), dyn)
    trained = [j for j, t in enumerate(taps) if t is not None]
    dx = [i for i, v in enumerate(dyn) if _inexact(v)]
    call = _Call(lambda ps, c, f, x: ([], fn(ps, x)), st, trained, [], [], dx)

    @jax.custom_vjp
    def one(taps_: list, stored_: list, again_: list, dyn_: list) -> list:
        del taps_, again_
        return fn(gathered(stored_), dyn_)

    def one_fwd(taps_, stored_, again_, dyn_):
        del taps_
        _, y, r = call.forward(gathered(stored_), [], [], dyn_, True)
        return y, (again_, r, dyn_)

    def one_bwd(res, ct_y):
        again_, r, dyn_ = res
        dy = [c for c in ct_y if _inexact(c)]
        g_p, _, _, g_x = call.backward(gathered(again_), r, [], dyn_, [], dy)
        out: list[Any] = [None] * len(taps)
        for j, g in zip(trained, g_p):
            out[j] = Tap(tap_kinds[j] or "device").out(layouts[j], g, st.mesh)
        return out, None, None, _place(dx, g_x, len(dyn_))

    one.defvjp(one_fwd, one_bwd)
    return one(list(taps), list(stored), list(stored if again is None else again), list(dyn))
