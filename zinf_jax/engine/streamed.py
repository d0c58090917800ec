"""The streamed forward and backward: hooks around every unit call.

Each unit call of the wrapped model becomes a ``jax.custom_vjp`` call. Outside
``jit``, JAX runs its forward rule in call order and its backward rule in
reverse call order on concrete arrays, so the rules may do I/O:

* forward: take the unit's shards from the prefetcher, run the compiled unit
  program (all-gather inside), keep the unit's inputs as the activation
  checkpoint (optionally in host memory), release the parameters;
* backward: take the shards again, recompute + vjp in the compiled backward
  program, hand the reduce-scattered float32 parameter gradients to the
  :class:`~zinf_jax.engine.grads.GradSink`, return the input cotangent.

Glue code between units (residual adds, small persistent layers, the loss) runs
eagerly as the user wrote it; its gradients come from the same ``jax.vjp``.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from zinf_jax.engine.grads import GradSink
from zinf_jax.engine.prefetch import Prefetcher
from zinf_jax.engine.programs import UnitPrograms, split_diff
from zinf_jax.engine.store import ParamStore
from zinf_jax.units import Plan

__all__ = ["StreamedModel", "EngineError"]


class EngineError(RuntimeError):
    """The streamed engine was used in a way it cannot support."""


_JIT_MSG = (
    "zinf_jax: the streamed engine fetches parameters between unit calls and cannot run under "
    "jax.jit, vmap, grad or scan. Call engine.train_step / engine.eval_step eagerly (the units "
    "are compiled inside), and keep loss_fn free of an outer jax.jit."
)


def _one_program_at_a_time(mesh: Any) -> bool:
    """Whether each unit program must finish before the next one is dispatched.

    XLA:CPU runs every device's part of a program as a task on one shared pool
    with as many threads as devices, and an in-process collective blocks its
    thread until all devices arrive. With several collective programs in flight
    (async dispatch of unit after unit), their tasks can occupy every thread
    while each program waits for a device whose task cannot start: a deadlock
    that XLA aborts after 40 s ("Termination timeout for `all gather`"). It
    shows up on an oversubscribed host; waiting for each unit program avoids it.
    """
    devices = list(mesh.devices.flat)
    return len(devices) > 1 and devices[0].platform == "cpu"


def _nbytes_on_devices(tree: Any) -> int:
    total = 0
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and x.sharding.memory_kind in (None, "device"):
            total += sum(s.data.nbytes for s in x.addressable_shards)
    return total


def _split_static(args: tuple) -> tuple[list[Any], tuple[Any, tuple[tuple[int, Any], ...]]]:
    """Array leaves of a unit's positional arguments, and the rest as a static (hashable) part.

    Python ``bool``/``int``/``str`` arguments (``block(x, True)``, a Linen
    ``train`` flag) select program variants like keyword arguments do; tracing
    them would break Python control flow inside the unit.
    """
    leaves, treedef = jax.tree.flatten(args)
    fixed = tuple((i, v) for i, v in enumerate(leaves) if isinstance(v, (bool, int, str)))
    dyn = [v for v in leaves if not isinstance(v, (bool, int, str))]
    return dyn, (treedef, fixed)


class StreamedModel:
    """Runs a wrapped model's loss with streamed units.

    Args:
      adapter: the NNX or Linen adapter (units, unit functions, wrapped model).
      store: the parameter store (param tier).
      prefetch_depth: units kept in flight ahead of use.
      max_live_bytes: bound on parameter bytes held on device (``None``: none).
      offload_activations: keep unit-boundary checkpoints in pinned host memory.
      track_live_arrays: also record ``jax.live_arrays()`` bytes at every unit
        call (slow; for tests and benchmarks).
    """

    def __init__(
        self,
        adapter: Any,
        store: ParamStore,
        *,
        prefetch_depth: int = 2,
        max_live_bytes: int | None = None,
        offload_activations: bool = False,
        track_live_arrays: bool = False,
    ):
        self.adapter = adapter
        self.store = store
        self.mesh = store.mesh
        self.programs = UnitPrograms(store.mesh, store.compute_dtype)
        self.sink = GradSink(store.layouts, store.mesh)
        self.units = adapter.units
        self._layouts = [[store.layouts[p] for p in u.param_paths] for u in self.units]
        self._unit_bytes = [store.nbytes(u.param_paths) for u in self.units]
        self._gathered = [
            sum(l.size * jnp.dtype(store.dtype_of(l.path)).itemsize for l in lays) * len(self.mesh.devices.flat)
            for lays in self._layouts
        ]
        self.prefetcher = Prefetcher(
            lambda uid: store.fetch(self.units[uid].param_paths),
            lambda uid: self._unit_bytes[uid],
            prefetch_depth,
            max_live_bytes,
        )
        self.offload_activations = offload_activations
        self.track_live_arrays = track_live_arrays
        self.unit_rests, self.glue_rest = adapter.init_state(NamedSharding(self.mesh, P()))
        adapter.dispatch.call = self.call_unit
        self.plan: Plan | None = None
        self._mode = "idle"
        self._saved: list[tuple[int, str, Any, Any]] = []
        self._vjp_fns: dict[tuple, Callable] = {}
        self.peak_device_bytes = 0
        self.peak_live_array_bytes = 0
        self._warned = False
        self._anchor = jnp.zeros((), jnp.float32)
        self._train = True  # which mode the unit programs run in (False only inside forward(train=False))
        self._sync_units = _one_program_at_a_time(self.mesh)

    # --- public passes --------------------------------------------------------
    def make_plan(self, loss_fn: Callable, batch: Any, glue: Sequence[jax.Array]) -> Plan:
        """Finds the unit call order with one abstract trace of the loss."""
        self._mode, self._plan_calls = "plan", []
        try:
            jax.eval_shape(lambda g: self.adapter.run(loss_fn, g, self.glue_rest, batch)[0], list(glue))
        finally:
            self._mode = "idle"
        self.plan = Plan(calls=tuple(self._plan_calls), units=tuple(self.units))
        return self.plan

    def forward_backward(
        self, loss_fn: Callable, batch: Any, glue: Sequence[jax.Array], *, has_aux: bool, loss_scale: float = 1.0
    ) -> tuple[jax.Array, Any, list[jax.Array]]:
        """Loss, aux and glue-parameter gradients; unit gradients go to :attr:`sink`.

        The backward pass is seeded with ``loss_scale`` (float16 loss scaling).
        """
        self._begin(loss_fn, batch, glue, backward=True)
        try:
            def f(g, anchor):
                self._anchor = anchor
                out, new_rest = self.adapter.run(loss_fn, g, self.glue_rest, batch)
                loss, aux = out if has_aux else (out, None)
                return loss, (aux, new_rest)

            loss, vjp, (aux, new_rest) = jax.vjp(f, list(glue), jnp.zeros((), jnp.float32), has_aux=True)
            g_glue, _ = vjp(jnp.full_like(loss, loss_scale))
        finally:
            self._end(backward=True)
        self.glue_rest = new_rest
        return loss, aux, g_glue

    def forward(self, loss_fn: Callable, batch: Any, glue: Sequence[jax.Array], *, has_aux: bool,
                train: bool = False) -> tuple[Any, Any]:
        """Loss (and aux) of a forward pass only, streamed.

        With ``train=False`` (evaluation) NNX modules run as after ``model.eval()``
        (dropout off, running averages used) and no state changes: RNG counters
        and other non-parameter state are left as they were, so evaluating
        between training steps does not alter training.
        """
        self._begin(loss_fn, batch, glue, backward=False)
        self._train = train
        try:
            out, new_rest = self.adapter.run(loss_fn, list(glue), self.glue_rest, batch, train)
        finally:
            self._end(backward=False)
        if train:
            self.glue_rest = new_rest
        return out if has_aux else (out, None)

    def _begin(self, loss_fn: Callable, batch: Any, glue: Sequence[jax.Array], backward: bool) -> None:
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((batch, list(glue)))):
            raise EngineError(_JIT_MSG)
        if self.plan is None:
            self.make_plan(loss_fn, batch, glue)
        self.sink.clear()
        self._saved.clear()
        self.prefetcher.start(self.plan.schedule(backward))
        self._mode = "train" if backward else "eval"
        self._train = True

    def _end(self, backward: bool) -> None:
        self._mode = "idle"
        self._train = True
        self._anchor = jnp.zeros((), jnp.float32)
        self.prefetcher.finish()
        self._saved.clear()
        if self.prefetcher.deviated:
            seen = self.prefetcher.seen
            fwd = tuple(seen[: len(seen) // 2] if backward else seen)
            if not self._warned:
                warnings.warn("zinf_jax: unit call order differed from the plan; re-planning from the order seen")
                self._warned = True
            self.plan = Plan(calls=fwd, units=tuple(self.units))

    # --- the hook -------------------------------------------------------------
    def call_unit(self, uid: int, method: str, args: tuple, kwargs: dict) -> Any:
        """Entry point of every wrapped unit call."""
        args, static = _split_static(args)
        try:
            kwkey = (tuple(sorted(kwargs.items())), static)
            hash(kwkey)
        except TypeError:
            raise EngineError(f"unit {self.units[uid].path}.{method}: keyword arguments must be hashable (static)") from None
        if self._mode == "plan":
            self._plan_calls.append((uid, method))
            full = [jax.ShapeDtypeStruct(l.shape, self.store.dtype_of(l.path)) for l in self._layouts[uid]]
            sds = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), args)
            fn = self._unit_fn(uid, method, kwargs, kwkey)
            out = jax.eval_shape(lambda f, r, a: fn(f, r, a)[0], full, self.unit_rests[uid], sds)
            return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out)
        if self._mode == "idle":
            raise EngineError("a unit of the wrapped model was called outside engine.train_step/eval_step")
        fn = self._vjp_fns.get((uid, method, kwkey))
        if fn is None:
            fn = self._vjp_fns[(uid, method, kwkey)] = self._make_vjp(uid, method, kwargs, kwkey)
        return fn(args, self._anchor)

    def _make_vjp(self, uid: int, method: str, kwargs: dict, kwkey: tuple) -> Callable:
        # ``anchor`` is a float scalar tied to the outer vjp: without it a unit whose
        # inputs are all integers (an embedding lookup) would get no backward call.
        @jax.custom_vjp
        def unit(args, anchor):
            return self._forward(uid, method, kwargs, kwkey, args, save=False)

        def unit_fwd(args, anchor):
            return self._forward(uid, method, kwargs, kwkey, args, save=True), None

        def unit_bwd(_, g):
            return self._backward(uid, method, kwargs, kwkey, g), np.zeros((), np.float32)

        unit.defvjp(unit_fwd, unit_bwd)
        return unit

    def _unit_fn(self, uid: int, method: str, kwargs: dict, kwkey: tuple) -> Callable:
        """The adapter's unit function in the current mode, with the static positional arguments put back."""
        fn = self.adapter.unit_fn(uid, method, kwargs, self._train)
        treedef, fixed = kwkey[1]

        def with_static(full, rest, dyn):
            leaves = list(dyn)
            for pos, value in fixed:
                leaves.insert(pos, value)
            return fn(full, rest, jax.tree.unflatten(treedef, leaves))

        return with_static

    def _key(self, uid: int, method: str, kwkey: tuple) -> tuple:
        sig = tuple((l.kind, l.shape, l.dtype, l.dim, l.num_shards) for l in self._layouts[uid])
        return (self.adapter.program_key(uid, method, kwkey, self._train), sig)

    def _forward(self, uid: int, method: str, kwargs: dict, kwkey: tuple, args: Any, save: bool) -> Any:
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
            raise EngineError(_JIT_MSG)
        stored = self.prefetcher.take((uid, method))
        fn = self._unit_fn(uid, method, kwargs, kwkey)
        prog = self.programs.forward(self._key(uid, method, kwkey), self._layouts[uid], fn)
        rest = self.unit_rests[uid]
        self._account(uid)
        out, new_rest = prog(stored, rest, args)
        if self._train:  # an evaluation pass leaves RNG counters and other state alone
            self.unit_rests[uid] = new_rest
        if self._sync_units:
            jax.block_until_ready(out)
        if save:
            self._saved.append((uid, method, self._park(args), rest))
        del stored
        self.prefetcher.release()
        return out

    def _backward(self, uid: int, method: str, kwargs: dict, kwkey: tuple, g: Any) -> Any:
        suid, smethod, parked, rest = self._saved.pop()
        if (suid, smethod) != (uid, method):
            raise EngineError(f"backward order mismatch: expected {self.units[suid].path}.{smethod}, got {self.units[uid].path}.{method}")
        args = self._unpark(parked)
        stored = self.prefetcher.take((uid, method))
        fn = self._unit_fn(uid, method, kwargs, kwkey)
        prog = self.programs.backward(self._key(uid, method, kwkey), self._layouts[uid], fn)
        self._account(uid)
        gp, gd = prog(stored, rest, args, g)
        if self._sync_units:
            jax.block_until_ready((gp, gd))
        del stored
        self.prefetcher.release()
        for path, gpath in zip(self.units[uid].param_paths, gp):
            if gpath is not None:
                self.sink.add(path, gpath)
        leaves, tree = jax.tree.flatten(args)
        out = [np.zeros(np.shape(x), jax.dtypes.float0) for x in leaves]
        for i, d in zip(split_diff(leaves), gd):
            out[i] = d
        return jax.tree.unflatten(tree, out)

    # --- activation checkpoints and accounting -------------------------------
    def _park(self, args: Any) -> Any:
        # Uncommitted arrays (e.g. ``jnp.arange`` made by glue code) stay where they are:
        # a round trip through the host would commit them to one device, and the
        # backward program would then refuse them next to mesh-sharded parameters.
        if not self.offload_activations:
            return args
        return jax.tree.map(
            lambda x: jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))
            if isinstance(x, jax.Array) and x.committed else x,
            args,
        )

    def _unpark(self, args: Any) -> Any:
        if not self.offload_activations:
            return args
        return jax.tree.map(
            lambda x: jax.device_put(x, x.sharding.with_memory_kind("device"))
            if isinstance(x, jax.Array) and x.sharding.memory_kind == "pinned_host" else x,
            args,
        )

    def held_device_bytes(self) -> int:
        """Bytes the engine holds on device now: params in flight + checkpoints + unit state."""
        return (
            self.prefetcher.held_bytes()
            + _nbytes_on_devices([s[2] for s in self._saved])
            + _nbytes_on_devices(self.unit_rests)
        )

    def _account(self, uid: int) -> None:
        now = self.held_device_bytes() + self._gathered[uid]
        self.peak_device_bytes = max(self.peak_device_bytes, now)
        if self.track_live_arrays:
            live = sum(sum(s.data.nbytes for s in a.addressable_shards) for a in jax.live_arrays()
                       if a.sharding.memory_kind in (None, "device"))
            self.peak_live_array_bytes = max(self.peak_live_array_bytes, live)

    def reset_peaks(self) -> None:
        """Starts a new peak measurement."""
        self.peak_device_bytes = 0
        self.peak_live_array_bytes = 0
