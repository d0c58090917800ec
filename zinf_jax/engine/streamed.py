"""The streamed forward and backward: hooks around every unit call.

A training pass runs the traced loss (:mod:`zinf_jax.engine.glue`) forward and then walks it
backward (:class:`~zinf_jax.engine.tape.Tape`), both outside ``jit`` on concrete arrays, calling
the hooks of each unit call in call order and then in reverse call order, so they may do I/O:

* forward: take the unit's shards from the prefetcher, run the compiled unit
  program (all-gather inside), keep the unit's inputs as the activation
  checkpoint (optionally in host memory), release the parameters;
* backward: take the shards again, recompute + vjp in the compiled backward
  program, hand the reduce-scattered float32 parameter gradients to the
  :class:`~zinf_jax.engine.grads.GradSink`, return the input cotangent.

Glue code between units (residual adds, small persistent layers, the loss) is
traced once per input signature and runs as compiled segments between the unit
calls; in a training pass each segment's vjp is compiled too (the tape). With
``activation_checkpointing=False`` the forward keeps what each unit's backward
needs instead of its inputs, and the backward neither recomputes nor fetches.

A stack of layers called inside the model's own scan is called once per layer (the trace is unrolled by
:mod:`zinf_jax.engine.unroll`), each call fetching and gathering only its layer: see [Note: layers of a
stack].

A unit call arrives as ``hook(uid, method, inputs)`` from the adapter's wrapped
model (the hook is passed to :meth:`Adapter.run` for one pass, never installed
on the adapter for longer). Array leaves of ``inputs`` are the program's inputs
and are differentiated where inexact; everything else is static. The model's
non-parameter state travels through the inputs and outputs, so the backward
recompute sees exactly the forward's RNG state.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import math
import threading
from typing import Any, Callable, Collection, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.profiler import TraceAnnotation
from jax.sharding import NamedSharding, PartitionSpec as P

from zinf_jax._internal import native_memory
from zinf_jax.errors import EngineError
from zinf_jax.engine.activations import OnDevice
from zinf_jax.engine.glue import TraceCache, Traced, UnitCall, unit_out_shapes
from zinf_jax.engine.grads import GradSink
from zinf_jax.engine.overlap import WriteGate
from zinf_jax.engine.prefetch import Prefetcher
from zinf_jax.engine.programs import Penalty, UnitPrograms, model_call
from zinf_jax.engine.store import ParamStore
from zinf_jax.engine.tape import Tape
from zinf_jax.plan.model_mesh import ModelMesh
from zinf_jax.plan.partition import ParamLayout, assemble_many, layer_layout
from zinf_jax.plan.units import Plan, layer_count

__all__ = ["StreamedModel", "EngineError", "Phase", "ParamLoss", "JIT_MESSAGE", "live_device_bytes"]

ParamLoss = Callable[[str, jax.Array], Any]
"""``param_loss(path, value) -> scalar``: a loss term of one parameter (e.g. L2 on kernels), 0 for none."""


JIT_MESSAGE = (
    "zinf_jax: the streamed engine fetches parameters between unit calls and cannot run under "
    "jax.jit, vmap, grad or scan. Call engine.train_step / engine.eval_step eagerly (the units "
    "are compiled inside), and keep loss_fn free of an outer jax.jit."
)


class Phase(enum.Enum):
    """What a pass over the wrapped model is doing."""

    TRAIN = "train"  # forward with activation checkpoints, then backward
    EVAL = "eval"    # forward only


@dataclasses.dataclass
class _Pass:
    """State of one pass: saved activation checkpoints (and their device bytes), penalties."""

    phase: Phase
    train: bool  # unit programs in training mode (dropout on, state updated)
    loss_scale: float = 1.0
    saved: list[tuple[Any, ...]] = dataclasses.field(default_factory=list)
    saved_bytes: int = 0
    state_bytes: int = 0
    penalized: set[int] = dataclasses.field(default_factory=set)
    penalty: Any = 0.0


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
    """Bytes of ``tree``'s arrays in this process's device memory (every local copy counted)."""
    total = 0
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array):
            key = (x.sharding, x.shape, x.dtype)
            n = _DEVICE_BYTES.get(key)
            if n is None:  # worked out once per sharding, shape and dtype: ~1 ms a unit call otherwise
                n = _device_bytes(x)
                if len(_DEVICE_BYTES) < 4096:  # bounded: a model of ever-new shapes only misses
                    _DEVICE_BYTES[key] = n
            total += n
    return total


_DEVICE_BYTES: dict[tuple, int] = {}  # see _nbytes_on_devices


def _device_bytes(x: jax.Array) -> int:
    if x.sharding.memory_kind not in (None, "device"):
        return 0
    if jnp.issubdtype(x.dtype, jax.dtypes.extended):  # typed PRNG keys: ask the shards
        return sum(s.data.nbytes for s in x.addressable_shards)
    return math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize * len(x.sharding.addressable_devices)


class StreamedModel:
    """Runs a wrapped model's loss with streamed units.

    Args:
      adapter: the NNX or Linen adapter (units, unit functions, wrapped model).
      store: the parameter store (param tier).
      prefetch_depth: units kept in flight ahead of use.
      max_live_bytes: bound on parameter bytes held on device (``None``: none).
      activations: where saved activations wait for the backward (:mod:`zinf_jax.engine.activations`;
        default: device memory).
      activation_checkpointing: keep only unit inputs and recompute in the
        backward (``False``: keep what the backward needs; no recompute, no
        backward fetch).
      track_live_arrays: also record ``jax.live_arrays()`` bytes at every unit
        call, once the fetches ahead have landed (slow, and it waits for them; for tests and benchmarks).
      param_loss: a per-parameter loss term added to the training loss, applied
        unit by unit where each unit's parameters are gathered anyway.
      trainable: paths of the parameters to differentiate (``None``: all);
        the others (frozen) are gathered and used but get no gradient.
      sink: where unit gradients go (default: a host :class:`GradSink`).
      gate: holds a unit's fetch until an optimizer step in flight has written
        its parameters (see :mod:`zinf_jax.engine.overlap`).
      model_mesh: how the model's own code sees the mesh (its Explicit axes; default: none).
      trim_slack: resident bytes past their low before freed memory is handed back
        (:class:`~zinf_jax._internal.native_memory.Trimmer`; the host plan's, :mod:`zinf_jax.plan.host_memory`).
    """

    def __init__(
        self,
        adapter: Any,
        store: ParamStore,
        *,
        prefetch_depth: int = 2,
        max_live_bytes: int | None = None,
        activations: OnDevice | None = None,
        activation_checkpointing: bool = True,
        track_live_arrays: bool = False,
        param_loss: ParamLoss | None = None,
        trainable: Collection[str] | None = None,
        sink: GradSink | None = None,
        gate: WriteGate | None = None,
        model_mesh: ModelMesh | None = None,
        trim_slack: int = native_memory.TRIM_SLACK,
    ):
        self.adapter = adapter
        self.store = store
        self.mesh = store.mesh
        self.model_mesh = model_mesh or ModelMesh(store.mesh)
        self.programs = UnitPrograms(store.mesh, store.compute_dtype)
        self.sink = sink or GradSink(store.layouts, store.mesh)
        self.units = adapter.units
        self._layouts = [[store.layouts[p] for p in u.param_paths] for u in self.units]
        self._trainable = [tuple(trainable is None or p in trainable for p in u.param_paths) for u in self.units]
        self._unit_bytes = [store.nbytes(u.param_paths) for u in self.units]
        self._gathered = [
            sum(l.gathered_bytes_per_device(store.dtype_of(l.path)) for l in lays) * len(self.mesh.devices.flat)
            for lays in self._layouts
        ]
        self._layers = [layer_count([l.shape for l in lays]) for lays in self._layouts]
        self._layer_lays: dict[int, list[ParamLayout]] = {}
        self._stacks: dict[int, list] = {}  # See [Note: layers of a stack]
        self._stacks_lock = threading.Lock()
        self._trimmer = native_memory.Trimmer(trim_slack)
        self.gate = gate or WriteGate()
        whole = [all(l.dim is None for l in lays) for lays in self._layouts]
        self.prefetcher = Prefetcher(
            self._fetch,
            self._fetch_bytes,
            prefetch_depth,
            max_live_bytes,
            keep=lambda key: isinstance(key, int) and whole[key],  # whole params: held
        )
        self.activations = activations or OnDevice()
        self.activation_checkpointing = activation_checkpointing
        self.track_live_arrays = track_live_arrays
        self.param_loss = param_loss
        self._penalties: list[Penalty | None] = [self._unit_penalty(u) for u in self.units]
        self.state = adapter.init_state(NamedSharding(self.mesh, P()))
        self.plan: Plan | None = None
        self._pass: _Pass | None = None
        self._traces = TraceCache(tuple(self.units))
        self.peak_device_bytes = 0
        self.peak_live_array_bytes = 0
        self._sync_units = _one_program_at_a_time(self.mesh)

    def replace_state(self, state: Any) -> Any:
        """Sets the model's non-parameter state (RNG keys and counts, batch statistics); returns the old one.

        Only two callers: a checkpoint restore (the saved state) and a ``train_steps`` loop, which
        holds the next batch's state aside while its body sees the state of the step it yielded.
        """
        old, self.state = self.state, state
        return old

    def _fetch(self, key: int | tuple[int, int]) -> list[jax.Array]:
        """A unit's stored-form arrays (``key``: its uid), or one layer's of a stack of layers (``(uid, layer)``)."""
        if not isinstance(key, int):
            return self._fetch_layer(*key)
        paths = self.units[key].param_paths
        with TraceAnnotation("zinf/fetch", unit=self.units[key].path):
            self.gate.wait(paths)  # See [Note: write gate]
            return self.store.fetch(paths)

    def _fetch_bytes(self, key: int | tuple[int, int]) -> int:
        if isinstance(key, int):
            return self._unit_bytes[key]
        return self._unit_bytes[key[0]] // self._layers[key[0]]

    # [Note: layers of a stack]
    # A unit whose parameters are a stack of layers (each at least 2-D, one leading size) called inside the
    # model's scan is called once per layer (zinf_jax.engine.unroll): each call takes one layer's shards
    # to the devices and gathers only that layer. The tier keeps the stacked parameter as one key; the
    # first layer a pass direction takes reads the stack's shards from the tier once (host memory, as a
    # whole-unit fetch does) and every layer of that direction is sliced from them, so the tier is read
    # once per direction as for any unit. The read is dropped when the direction's last layer is taken,
    # and at the end of every pass (the optimizer writes between passes). A layer's layout is the
    # stacked one without its leading axis, which must not be the sharded one (_layer_layouts).

    def _fetch_layer(self, uid: int, layer: int) -> list[jax.Array]:
        paths = self.units[uid].param_paths
        with TraceAnnotation("zinf/fetch", unit=self._call_name((uid, layer))):
            with self._stacks_lock:
                hit = self._stacks.get(uid)
                if hit is None:
                    self.gate.wait(paths)  # See [Note: write gate]
                    hit = self._stacks[uid] = [self.store.read_shards(paths), 0]
                hit[1] += 1
                if hit[1] == self._layers[uid]:  # every layer of this direction taken
                    del self._stacks[uid]
            return assemble_many(self._layer_layouts(uid), self.mesh,
                                 [{i: x[layer] for i, x in shards.items()} for shards in hit[0]])

    def _layer_layouts(self, uid: int) -> list[ParamLayout]:
        """The layouts of one layer of unit ``uid``'s stacked parameters (see [Note: layers of a stack]).

        Raises:
          EngineError: a parameter is split along its layer axis (or flattened), so a layer is not spread
            over the devices.
        """
        got = self._layer_lays.get(uid)
        if got is None:
            got = self._layer_lays[uid] = [layer_layout(l, self._layers[uid]) for l in self._layouts[uid]]
        return got

    def _unit_penalty(self, unit: Any) -> Penalty | None:
        if self.param_loss is None:
            return None
        paths, fn = unit.param_paths, self.param_loss
        return lambda ps: sum((jnp.asarray(fn(p, x), jnp.float32) for p, x in zip(paths, ps)), jnp.float32(0))

    def glue_penalty(self, glue: Sequence[jax.Array]) -> Any:
        """The parameter loss of the parameters outside every unit (0 without ``param_loss``)."""
        if self.param_loss is None:
            return 0.0
        fn = self.param_loss
        return sum((jnp.asarray(fn(p, x.astype(jnp.float32)), jnp.float32)
                    for p, x in zip(self.adapter.glue_paths, glue)), jnp.float32(0))

    # --- public passes --------------------------------------------------------
    def _traced(self, loss_fn: Callable, batch: Any, glue: Sequence[jax.Array], train: bool) -> Traced:
        """The loss traced for these inputs' signature (cached, like ``jax.jit``'s traces)."""
        hit = self._traces.trace(self.adapter, loss_fn, list(glue), self.state, batch, train,
                                 unit_out_shapes(self.adapter, self.store, train, self.model_mesh), self.model_mesh,
                                 [self.store.layouts[p].gathered_spec for p in self.adapter.glue_paths],
                                 layers=self._layers.__getitem__)
        for c in hit.program.calls:
            if c.layer is not None:
                self._layer_layouts(c.uid)  # refuses a stack split along its layers before anything runs
                if self._penalties[c.uid] is not None:
                    raise EngineError(f"zinf_jax: param_loss with the stack of layers {self.units[c.uid].path!r} "
                                      "applied layer by layer in the model's scan is not supported; add the "
                                      "penalty in loss_fn, or make the module holding the scan the unit")
        self.plan = hit.plan
        return hit

    def forward_backward(
        self, loss_fn: Callable, batch: Any, glue: Sequence[jax.Array], *, has_aux: bool, loss_scale: float = 1.0,
        accumulate: bool = False, before_backward: Callable[[], None] | None = None,
    ) -> tuple[jax.Array, Any, list[jax.Array]]:
        """Loss, aux and glue-parameter gradients; unit gradients go to :attr:`sink`.

        The backward pass is seeded with ``loss_scale`` (float16 loss scaling,
        divided by the micro-batch count under gradient accumulation). The
        model's non-parameter state (RNG counters, batch statistics) advances.
        ``accumulate`` adds to the gradients the sink holds instead of clearing it;
        ``before_backward()`` runs between the forward and the backward pass.
        """
        if not accumulate:
            self.sink.clear()
        p, traced = self._begin(loss_fn, batch, glue, _Pass(Phase.TRAIN, train=True, loss_scale=loss_scale))
        try:
            tape = Tape(traced.program)
            calls = traced.program.calls
            outs = tape.forward([*glue, *traced.args[len(glue):]], functools.partial(self._run_call, p, calls, True))
            out, new_state, batch_state = traced.unflatten(outs)
            loss, aux = out if has_aux else (out, None)
            if jnp.shape(loss) != ():
                raise EngineError(f"loss_fn must return a scalar loss, got shape {jnp.shape(loss)}; reduce it "
                                  "(e.g. jnp.mean) — nothing was applied")
            seed = jnp.full_like(loss, loss_scale)
            if self.param_loss is not None:
                pen, pen_vjp = jax.vjp(self.glue_penalty, list(glue))
                loss = loss + pen + p.penalty
            if before_backward is not None:
                before_backward()
            at = traced.unflatten(list(range(len(outs))))[0]  # the loss's position among the flat outputs
            at = at[0] if has_aux else at
            cts = tape.backward([seed if i == at else None for i in range(len(outs))],
                                functools.partial(self._run_backward, p, calls))
            g_glue = [jnp.zeros(jnp.shape(x), jax.typeof(x).dtype) if g is None else g
                      for x, g in zip(glue, cts[:len(glue)])]
            if self.param_loss is not None:
                g_glue = [a + b for a, b in zip(g_glue, pen_vjp(seed)[0])]
            # as the parameter is stored: one copy of a persistent one (the model's own code may leave it split, by
            # tensor parallelism), a sharded one in its shards ([Note: the root's parameters] in zinf_jax.plan.units)
            g_glue = [self._as_stored(path, g) for path, g in zip(self.adapter.glue_paths, g_glue)]
        finally:
            self._end(p)
        self.state = new_state
        self.adapter.update_batch(batch, batch_state)
        return loss, aux, g_glue

    def _as_stored(self, path: str, g: jax.Array) -> jax.Array:
        lay = self.store.layouts[path]
        want = NamedSharding(self.mesh, P() if lay.kind == "persistent" else lay.spec)
        return g if g.sharding.is_equivalent_to(want, g.ndim) else jax.device_put(g, want)

    def forward(self, loss_fn: Callable, batch: Any, glue: Sequence[jax.Array], *, has_aux: bool,
                train: bool = False) -> tuple[Any, Any]:
        """Loss (and aux) of a forward pass only, streamed.

        With ``train=False`` (evaluation) NNX modules run as after ``model.eval()``
        (dropout off, running averages used) and no state changes: RNG counters
        and other non-parameter state are left as they were, so evaluating
        between training steps does not alter training.
        """
        p, traced = self._begin(loss_fn, batch, glue, _Pass(Phase.EVAL, train=train))
        try:
            call = functools.partial(self._run_call, p, traced.program.calls, False)
            out, new_state, batch_state = traced.unflatten(traced.program(traced.args, call))
        finally:
            self._end(p)
        if train:
            self.state = new_state
            self.adapter.update_batch(batch, batch_state)
        return out if has_aux else (out, None)

    def _begin(self, loss_fn: Callable, batch: Any, glue: Sequence[jax.Array], p: _Pass) -> tuple[_Pass, Traced]:
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((batch, list(glue)))):
            raise EngineError(JIT_MESSAGE)
        traced = self._traced(loss_fn, batch, glue, p.train)
        forward = tuple((_fetch_key(c.uid, c.layer), c.method) for c in traced.program.calls)
        backward = p.phase is Phase.TRAIN and self.activation_checkpointing
        self.prefetcher.start(forward + (tuple(reversed(forward)) if backward else ()))
        p.state_bytes = _nbytes_on_devices(self.state)
        self._pass = p
        return p, traced

    def _end(self, p: _Pass) -> None:
        self._pass = None
        for saved in p.saved:  # left by a pass that stopped between its forward and backward
            self.activations.discard(saved[2])
        p.saved.clear()
        self.prefetcher.finish()
        with self._stacks_lock:  # See [Note: layers of a stack]
            self._stacks.clear()

    def _run_call(self, p: _Pass, calls: Sequence[UnitCall], save: bool, k: int, dyn: list) -> list:
        """Runs the forward of traced unit call ``k`` (``save``: keeping what its backward needs); its flat outputs."""
        if self._pass is not p:
            raise EngineError("a unit of the wrapped model was called outside engine.train_step/eval_step")
        c = calls[k]
        return c.out_tree.flatten_up_to(self._forward(p, c.uid, c.method, c.sig, dyn, save=save, layer=c.layer))

    def _run_backward(self, p: _Pass, calls: Sequence[UnitCall], k: int, g: list) -> list:
        """The backward of traced unit call ``k``: ``g`` per flat output (``None`` for integer ones)."""
        c = calls[k]
        return self._backward(p, c.uid, c.method, c.sig, g, c.layer)

    def _call_name(self, key: int | tuple[int, int]) -> str:
        """A fetch key as the unit's path (with its layer for a layer of a stack)."""
        return self.units[key].path if isinstance(key, int) else f"{self.units[key[0]].path}[{key[1]}]"

    def _lays(self, uid: int, layer: int | None) -> list[ParamLayout]:
        return self._layouts[uid] if layer is None else self._layer_layouts(uid)

    def _unit_fn(self, uid: int, method: str, sig: tuple, train: bool, layer: int | None = None) -> Callable:
        """The adapter's unit function of the array inputs, with the static leaves put back (a region of the
        model's code: see :func:`~zinf_jax.engine.programs.model_call`); ``layer``: of one layer's parameters."""
        return model_call(self.adapter.unit_fn(uid, method, train), sig, self._lays(uid, layer), self.model_mesh)

    def _key(self, uid: int, method: str, sig: tuple, train: bool, layer: int | None = None) -> tuple:
        lays = tuple((l.kind, l.shape, l.dtype, l.dim, l.num_shards, l.gathered) for l in self._lays(uid, layer))
        return (self.adapter.program_key(uid, method, train), sig, lays)

    def _forward(self, p: _Pass, uid: int, method: str, sig: tuple, dyn: list, save: bool = False,
                 layer: int | None = None) -> Any:
        if any(isinstance(x, jax.core.Tracer) for x in dyn):
            raise EngineError(JIT_MESSAGE)
        penalty = None
        if save and self._penalties[uid] is not None and uid not in p.penalized:
            p.penalized.add(uid)  # counted once per step, in the unit's first call (its last backward)
            penalty = self._penalties[uid]
        fk = _fetch_key(uid, layer)
        stored = self.prefetcher.take((fk, method))
        fn = self._unit_fn(uid, method, sig, p.train, layer)
        key, lays = self._key(uid, method, sig, p.train, layer), self._lays(uid, layer)
        keep_all = save and not self.activation_checkpointing
        if keep_all:
            prog = self.programs.forward_saving(key, lays, fn, penalty, self._trainable[uid])
        else:
            prog = self.programs.forward(key, lays, fn, penalty)
        self._account(uid, layer)
        with TraceAnnotation("zinf/unit_forward", unit=self.units[uid].path):
            out = prog(stored, dyn)
        if keep_all:
            out, value, kept = out
        elif penalty is not None:
            out, value = out
        if penalty is not None:
            p.penalty = p.penalty + value
        if self._sync_units:
            jax.block_until_ready(out)
        if save:  # the unit's inputs (checkpointing), or everything its backward needs
            parked = self.activations.park(kept if keep_all else dyn)
            extra = (_out_spec(out), [(jnp.shape(x), jax.typeof(x).dtype) for x in dyn]) if keep_all else penalty
            p.saved.append((fk, method, parked, extra, _nbytes_on_devices(parked)))
            p.saved_bytes += p.saved[-1][-1]
        del stored
        self.prefetcher.release()
        self._trimmer.check()  # the pages unit calls freed go back to the system once they add up
        return out

    def _backward(self, p: _Pass, uid: int, method: str, sig: tuple, g: Any, layer: int | None = None) -> Any:
        fk = _fetch_key(uid, layer)
        suid, smethod, parked, extra, nbytes = p.saved.pop()
        p.saved_bytes -= nbytes
        if p.saved:  # the next backward's activations come back while this one computes
            self.activations.prefetch(p.saved[-1][2])
        if (suid, smethod) != (fk, method):
            raise EngineError(f"backward order mismatch: expected {self._call_name(suid)}.{smethod}, got "
                              f"{self._call_name(fk)}.{method}")
        g = [x for x in jax.tree.leaves(g) if x.dtype != jax.dtypes.float0]
        key, lays = self._key(uid, method, sig, p.train, layer), self._lays(uid, layer)
        if self.activation_checkpointing:  # recompute from the inputs, with the unit fetched again
            dyn = self.activations.unpark(parked)
            inputs = [(jnp.shape(x), jax.typeof(x).dtype) for x in dyn]
            stored = self.prefetcher.take((fk, method))
            prog = self.programs.backward(key, lays, self._unit_fn(uid, method, sig, p.train, layer), extra,
                                          self._trainable[uid])
            args = (stored, dyn)
        else:  # the forward kept everything (the shards to re-gather included): no fetch
            (out_spec, inputs), stored = extra, None
            prog = self.programs.backward_saved(key, lays, out_spec, self._trainable[uid])
            args = (self.activations.unpark(parked),)
        del parked
        self._account(uid, layer)
        with TraceAnnotation("zinf/unit_backward", unit=self.units[uid].path):
            gp, gd = prog(*args, g, np.float32(p.loss_scale))
        del args
        if self._sync_units:
            jax.block_until_ready((gp, gd))
        if stored is not None:
            del stored
            self.prefetcher.release()
        kept = [(path, lay, x) for path, lay, x in zip(self.units[uid].param_paths, lays, gp) if x is not None]
        with TraceAnnotation("zinf/grads_out", unit=self.units[uid].path):
            if layer is None:
                self.sink.add_many([k for k, _, _ in kept], [x for _, _, x in kept])
            else:
                self.sink.add_layer([k for k, _, _ in kept], [l for _, l, _ in kept], [x for _, _, x in kept],
                                    layer, self._layers[uid])
        del gp, kept
        self._trimmer.check()  # the pages unit calls freed go back to the system once they add up
        out: list[Any] = [None] * len(inputs)  # no cotangent for integer inputs
        for i, d in zip([i for i, (_, dt) in enumerate(inputs) if jnp.issubdtype(dt, jnp.inexact)], gd):
            out[i] = d
        return out

    # --- accounting -------------------------------
    def held_device_bytes(self) -> int:
        """Bytes the engine holds on device now: params in flight + checkpoints + model state."""
        p = self._pass
        held = self.prefetcher.held_bytes()
        return held + (p.saved_bytes + p.state_bytes if p is not None else _nbytes_on_devices(self.state))

    def _account(self, uid: int, layer: int | None = None) -> None:
        now = self.held_device_bytes() + self._gathered[uid] // (1 if layer is None else self._layers[uid])
        self.peak_device_bytes = max(self.peak_device_bytes, now)
        if self.track_live_arrays:  # sampled once the fetches ahead have landed, as the accounting counts them
            self.prefetcher.settle()
            self.peak_live_array_bytes = max(self.peak_live_array_bytes, live_device_bytes())

    def reset_peaks(self) -> None:
        """Starts a new peak measurement."""
        self.peak_device_bytes = 0
        self.peak_live_array_bytes = 0

    @property
    def fetch_wait_s(self) -> float:
        """Seconds spent so far waiting for parameter reads."""
        return self.prefetcher.wait_s

    def close(self) -> None:
        """Stops the prefetcher and the activations' parking."""
        self.prefetcher.close()
        self.activations.close()


def live_device_bytes() -> int:
    """Bytes of device memory the live arrays of this process hold, each buffer counted once.

    A sharded array made of single-device arrays (a fetch being assembled on a prefetch thread) and those
    arrays are all live at once but share their buffers: counted by buffer, they count once.
    """
    seen: set[tuple[int, int]] = set()
    total = 0
    for a in jax.live_arrays():
        if a.sharding.memory_kind not in (None, "device"):
            continue
        for s in a.addressable_shards:
            key = (s.device.id, s.data.unsafe_buffer_pointer())
            if key not in seen:
                seen.add(key)
                total += s.data.nbytes
    return total


def _out_spec(out: Any) -> tuple[Any, tuple[tuple[tuple[int, ...], bool], ...]]:
    """A unit output's structure and, per leaf, its shape and whether it is inexact (has a cotangent)."""
    leaves, tree = jax.tree.flatten(out)
    return tree, tuple((tuple(jnp.shape(x)), bool(jnp.issubdtype(jax.typeof(x).dtype, jnp.inexact))) for x in leaves)


def _fetch_key(uid: int, layer: int | None) -> int | tuple[int, int]:
    """What a call fetches: its unit (uid), or one layer of it (see [Note: layers of a stack])."""
    return uid if layer is None else (uid, layer)
