"""The compiled forward and backward: a step's loss and gradients as one XLA program.

Where the parameters fit in device memory (``offload_param="none"``) or host memory (``"cpu"``),
nothing needs to happen between two units that a program cannot do itself, so the eager
interpreter of :mod:`~zinf_jax.engine.streamed` (hooks around every unit call, each unit program
finished before the next is dispatched) only costs time. Here the same traced loss
(:class:`~zinf_jax.engine.glue.TraceCache`: unit calls as ``zinf_unit_call`` equations) is turned
into one jitted function of the parameters' stored shards:

* each unit call becomes staging inside the program: the unit's shards are moved to device memory
  (from ``pinned_host`` on the cpu tier), all-gathered by a sharding constraint to replicated, the
  unit runs, and the gathered values die;
* the call is wrapped in ``jax.checkpoint`` at the unit boundary, so the backward gathers again and
  recomputes, as the streamed engine's activation checkpointing does
  (``activation_checkpointing=False``: every activation but the gathered parameters is kept);
* the gradients leave the program reduce-scattered to the stored sharding, in float32, in
  ``pinned_host`` when the optimizer is on the host (its tier is cpu or nvme), where the streamed
  optimizer (:mod:`zinf_jax.optim.driver`) reads them through the same
  :class:`~zinf_jax.engine.grads.GradSink` as the streamed engine's;
* with params and optimizer both in device memory the update runs in the same program
  (:mod:`zinf_jax.optim.fused`): the gradients never leave it, the new params and states come out.

A parameter read outside its unit (a tied head, ``embedding[...]``) is a unit call of the read
method and becomes a read in the program. One program per input signature (the loss, train or
eval, the shapes, dtypes and shardings of glue, model state and batch), compiled ahead of time so
that its ``memory_analysis`` is at hand (:meth:`CompiledModel.lower`).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
import weakref
from typing import Any, Callable, Collection, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec as P

from zinf_jax.engine.arguments import ProgramArgs, Slots
from zinf_jax.engine.glue import TraceCache, Traced, unit_call_p, unit_out_shapes
from zinf_jax.engine.grads import GradSink
from zinf_jax.engine.overlap import WriteGate
from zinf_jax.engine.programs import GATHERED, model_call
from zinf_jax.engine.runs import Run, find_runs
from zinf_jax.engine.staged import Staging, call_staged, pieces, run_staged
from zinf_jax.engine.staging import keep_all_but_params, read, staged_read, tap
from zinf_jax.engine.store import ParamStore
from zinf_jax.engine.streamed import JIT_MESSAGE
from zinf_jax.engine.unroll import evaluate
from zinf_jax.errors import EngineError
from zinf_jax.optim.fused import FusedAdam
from zinf_jax.plan.model_mesh import ModelMesh
from zinf_jax.plan.partition import ParamLayout, from_stored, layer_layout, to_stored
from zinf_jax.plan.units import Plan, layer_count

log = logging.getLogger(__name__)

__all__ = ["CompiledModel", "GPU_ASYNC_LIMIT", "TransferBudget", "compiler_options"]

GPU_ASYNC_LIMIT = "xla_gpu_experimental_parallel_async_compute_limit"
"""The XLA option the compiled engine sets when it compiles a step for a GPU: how many asynchronous moves
(a layer's slice of a host stack moved in, a gradient written out to one) XLA's scheduler lets run at once.
XLA's default, 2, leaves all but two of a layer's moves waited on where they start: in the compiled program
of the bundled GPT (d256 x 4, params and optimizer on cpu, an H100 description) 33% of a forward loop's
host-to-device bytes overlapped compute and none of the backward's; at the engine's value, all of them."""


def compiler_options(platform: str, moves_per_iteration: int) -> dict[str, int]:
    """The options :class:`CompiledModel` compiles a step with on ``platform`` (``XLA_FLAGS`` settings left out).

    Args:
      platform: ``"gpu"``/``"cuda"``/``"rocm"`` (anything else: none).
      moves_per_iteration: the moves a loop iteration makes at most (a layer's parameters in, its gradients
        out); XLA's own limit (2) where that is not more.
    """
    if platform not in ("gpu", "cuda", "rocm") or moves_per_iteration <= 2:
        return {}
    if f"--{GPU_ASYNC_LIMIT}" in os.environ.get("XLA_FLAGS", ""):
        return {}
    return {GPU_ASYNC_LIMIT: int(moves_per_iteration)}


def _floating(dtype: Any) -> bool:
    return bool(jnp.issubdtype(jnp.dtype(dtype), jnp.floating))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransferBudget:
    """Bytes a step's program needs to move between host and device memory, per device per step.

    Attributes:
      h2d_bytes: host to device (parameters in host memory, each call's).
      d2h_bytes: device to host (float32 gradients for an optimizer on the host).
    """

    h2d_bytes: int
    d2h_bytes: int


def _kind(tap_value: Any) -> str | None:
    """The memory kind of a trained argument's tap (its pieces'), ``None`` for a frozen argument."""
    if tap_value is None:
        return None
    x = tap_value[0] if isinstance(tap_value, tuple) else tap_value
    return "pinned_host" if jax.typeof(x).memory_space.name == "Host" else "device"


def _signature(leaves: Sequence[Any]) -> tuple:
    """What selects a compiled program besides the trace: each leaf's type and sharding."""
    return tuple((jax.typeof(x), getattr(x, "sharding", None)) for x in leaves)


# [Note: scanned runs]
# XLA keeps every gathered weight of an unrolled stack of N jax.checkpoint-ed unit calls alive across
# the program (temp bytes grow with depth; measured on XLA:CPU even for a plain
# checkpoint-per-layer program), and compiles the unit N times. A lax.scan over the stacked
# parameters of N alike units compiles the unit once and keeps one iteration's gathered weights. So
# a run of alike unit calls (zinf_jax.engine.runs.find_runs: same program key, parameter layouts and
# trained flags, each call reading the previous one's output) takes its parameters as one stacked
# argument per parameter position, (N, *stored shape) with the stored sharding below the run axis,
# in the tier's memory: on the cpu tier on the host (the optimizer's masters kept as the rows of one
# array, [Note: masters in rows] in zinf_jax.optim.state_io, or the tier's shards stacked), on the
# device tier by one jitted stack; a stack is rebuilt only when the store wrote one of its paths.
# Each iteration slices its unit's shards, moves them to device memory (from the host: one iteration
# ahead, [Note: moves ahead] in zinf_jax.engine.staged) and gathers them; the
# gradients leave stacked and the sink splits them per path (GradSink.add_stacked). An
# optimization_barrier on the device copies keeps the all-gather after the slice: without it XLA
# gathers the (1, shard) slice before squeezing it, lays the whole stacked argument out for that
# gather, and hoists that relayout copy out of the loop (a stack-sized temp).


# [Note: stacks in scans]
# A unit whose parameters are a stack of layers, called inside the model's own scan (nnx.scan over an
# nnx.vmap stack, jax.lax.scan over its nnx.split state), stays inside that scan here: the trace is not
# unrolled (TraceCache.trace(unroll_nested=False)), and the glue segment holding the scan runs through
# zinf_jax.engine.unroll.evaluate, which binds the scan again with the stack's stored arguments as further
# scanned inputs. Each iteration's call then reads its layer's slice of them, moves it to device memory and
# gathers it as any unit call does (the layer's layout: partition.layer_layout), like a scanned run of
# alike units ([Note: scanned runs]) whose stack the model itself made: one layer gathered at a time, the
# unit compiled once, and the stacked gradient leaving as the stacked parameter's own.


class CompiledModel:
    """Runs a wrapped model's loss as one compiled program per step (forward and backward).

    The interface is :class:`~zinf_jax.engine.streamed.StreamedModel`'s (``forward_backward``,
    ``forward``, ``state``, ``sink``, ``plan``), so :class:`~zinf_jax.engine.stepping.Stepper`
    and the checkpoint state see no difference.

    Args:
      adapter: the NNX or Linen adapter.
      store: the parameter store (param tier: device memory or ``pinned_host``).
      host_params: the parameters' shards live in ``pinned_host`` (the cpu tier); each unit's are
        moved to device memory inside the program, where the unit uses them.
      grads_on_host: the gradients leave the program in ``pinned_host`` (the optimizer is on the host).
      activation_checkpointing: recompute each unit in the backward from its inputs.
      param_loss: a per-parameter loss term (see :func:`zinf_jax.initialize`).
      trainable: the paths differentiated (the others are frozen).
      sink: where the parameters' gradients go.
      gate: holds the fetch of the parameters until an optimizer step in flight has written them.
      fused: the optimizer whose update the train program runs too (device-memory state and params;
        the sink then gets no gradients), or ``None``.
      model_mesh: how the model's own code sees the mesh (its Explicit axes; default: none).
    """

    def __init__(self, adapter: Any, store: ParamStore, *, host_params: bool, grads_on_host: bool,
                 activation_checkpointing: bool = True, param_loss: Callable | None = None,
                 trainable: Collection[str] | None = None, sink: GradSink | None = None,
                 gate: WriteGate | None = None, fused: FusedAdam | None = None,
                 model_mesh: ModelMesh | None = None):
        self.adapter = adapter
        self.store = store
        self.mesh = store.mesh
        self.model_mesh = model_mesh or ModelMesh(store.mesh)
        self.units = adapter.units
        self.host_params = host_params
        self.grads_on_host = grads_on_host
        self.activation_checkpointing = activation_checkpointing
        self.param_loss = param_loss
        self.compute_dtype = jnp.dtype(store.compute_dtype)
        self.sink = sink or GradSink(store.layouts, store.mesh)
        self.gate = gate or WriteGate()
        self.fused = fused
        paths = list(dict.fromkeys(p for u in self.units for p in u.param_paths))
        self.unit_paths = paths
        trained = set(paths) if trainable is None else set(trainable)
        self._train_paths = [p for p in paths if p in trained and _floating(store.layouts[p].dtype)]
        self._frozen_paths = [p for p in paths if p not in set(self._train_paths)]
        self._layouts = [[store.layouts[p] for p in u.param_paths] for u in self.units]
        self._layers = [layer_count([l.shape for l in lays]) for lays in self._layouts]
        self.state = adapter.init_state(NamedSharding(self.mesh, P()))
        self.plan: Plan | None = None
        self._traces = TraceCache(tuple(self.units))
        self._programs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # GlueProgram -> {key: Compiled}
        self._slots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # GlueProgram -> Slots
        self.peak_device_bytes = 0
        self._rep = NamedSharding(self.mesh, P())
        self.args = ProgramArgs(store, host_params=host_params, paths=paths, gate=self.gate)

    def compiler_options(self, platform: str) -> dict[str, int]:
        """The XLA options a step is compiled with on ``platform`` (see :func:`compiler_options`): a loop's
        iteration moves a unit's parameters in (host parameters) and its gradients out (a host optimizer)."""
        most = max((len(u.param_paths) for u in self.units), default=0)
        return compiler_options(platform, most * (int(self.host_params) + int(self.grads_on_host)))

    # --- the interface the stepper and the checkpoint state use --------------------
    def replace_state(self, state: Any) -> Any:
        """Sets the model's non-parameter state; returns the old one (see ``StreamedModel.replace_state``)."""
        old, self.state = self.state, state
        return old

    @property
    def fetch_wait_s(self) -> float:
        """Seconds so far reading the param shards into the program's arguments."""
        return self.args.fetch_wait_s

    def close(self) -> None:
        """Nothing to stop (no prefetch threads)."""

    # --- the program ------------------------------------------------------------------
    def _traced(self, loss_fn: Callable, batch: Any, glue: Sequence[jax.Array], train: bool) -> Traced:
        hit = self._traces.trace(self.adapter, loss_fn, list(glue), self.state, batch, train,
                                 unit_out_shapes(self.adapter, self.store, train, self.model_mesh), self.model_mesh,
                                 [self.store.layouts[p].gathered_spec for p in self.adapter.glue_paths],
                                 layers=self._layers.__getitem__, unroll_nested=False)  # See [Note: stacks in scans]
        for c in hit.program.calls:
            if c.layer == -1:
                self._layer_layouts(c.uid)  # refuses a stack split along its layers before anything compiles
        self.plan = hit.plan
        return hit

    def _layer_layouts(self, uid: int) -> list[ParamLayout]:
        return [layer_layout(l, self._layers[uid]) for l in self._layouts[uid]]

    def _read(self, lay: ParamLayout, x: Any, dtype: Any) -> jax.Array:
        """A parameter argument read in the program, gathered in ``dtype``: a trained one as its
        ``(tap, stored)`` pair through :func:`~zinf_jax.engine.staging.staged_read`, a frozen one as stored."""
        if isinstance(x, tuple):
            tap_value, stored = x
            kind = "pinned_host" if jax.typeof(tap_value).memory_space.name == "Host" else "device"
            return staged_read(lay, self.mesh, str(jnp.dtype(dtype)), self.host_params, kind)(tap_value, stored)
        return read(lay, x, self.mesh, dtype, self.host_params)

    def _gather(self, layouts: Sequence[ParamLayout], stored: Sequence[Any]) -> list[jax.Array]:
        return [checkpoint_name(self._read(lay, x, self.compute_dtype), GATHERED) for lay, x in zip(layouts, stored)]

    def _model_call(self, uid: int, method: str, sig: tuple, train: bool, lays: Sequence[ParamLayout]) -> Callable:
        """A unit call as a function of its gathered parameters and array inputs (see ``model_call``)."""
        return model_call(self.adapter.unit_fn(uid, method, train), sig, lays, self.model_mesh)

    def _unit(self, uid: int, method: str, sig: tuple, train: bool, grad: bool, layer: bool = False) -> Callable:
        """A unit call's function of its stored shards (``layer``: of one layer of its stacked parameters)."""
        lays = self._layer_layouts(uid) if layer else self._layouts[uid]
        call = self._model_call(uid, method, sig, train, lays)

        def run(stored, dyn):
            return call(self._gather(lays, stored), dyn)

        if not grad:
            return run
        if self.activation_checkpointing:  # only the unit's inputs (and its shards) are kept
            return jax.checkpoint(run, prevent_cse=not self.host_params)
        return jax.checkpoint(run, policy=keep_all_but_params)  # never the params: [Note: gradient taps]

    def _staging(self) -> Staging:
        return Staging(self.mesh, self.compute_dtype, self.host_params, self.activation_checkpointing)

    def _pieces(self, n: int, grad: bool) -> tuple[tuple[int, int], ...]:
        """The layer ranges a run's trained stacks come and go in (see ``staged.pieces``)."""
        return pieces(n, self.host_params and grad)

    def _call(self, k: int, c: Any, value: Callable[[str], Any], dyn: list, train: bool, grad: bool,
              reads: Mapping[tuple, Any]) -> list:
        """A unit call alone: its parameters staged in (see :func:`~zinf_jax.engine.staged.call_staged`), read
        from the program arguments :meth:`_reads` gives this call, where it has its own."""
        lays = self._layouts[c.uid]
        paths = self.units[c.uid].param_paths
        model = self._model_call(c.uid, c.method, c.sig, train, lays)
        vals = [value(p) for p in paths]
        taps = [v[0] if isinstance(v, tuple) else None for v in vals]
        stored = [reads.get((k, p, "forward"), v[1] if isinstance(v, tuple) else v) for p, v in zip(paths, vals)]
        again = [reads[(k, p, "backward")] for p in paths] if grad and self.host_params else None
        return call_staged(lambda ps, d: c.out_tree.flatten_up_to(model(ps, d)), lays, stored, taps, dyn,
                           self._staging(), grad=grad, tap_kinds=[_kind(t) for t in taps], again=again)

    def _penalty(self, paths: Sequence[str], values: Sequence[Any]) -> Any:
        """The parameter loss over ``paths``: unit parameters read as the units read them (in float32), glue
        parameters (device arrays) as they are."""
        total = jnp.float32(0)
        for path, x in zip(paths, values):
            lay = self.store.layouts[path]
            if isinstance(x, tuple) or path not in self.adapter.glue_paths:
                full = self._read(lay, x, jnp.float32)
                if lay.gathered:
                    full = jax.lax.with_sharding_constraint(full, self._rep)
            else:
                full = from_stored(lay, jax.lax.with_sharding_constraint(x.astype(jnp.float32), self._rep))
            total = total + jnp.asarray(self.param_loss(path, full), jnp.float32)
        return total

    def _slots_of(self, traced: Traced, train: bool) -> Slots:
        """The program's parameter arguments: its scanned runs' stacks, and one per other path (cached)."""
        hit = self._slots.get(traced.program)
        if hit is not None:
            return hit
        program, units, trained = traced.program, self.units, set(self._train_paths)

        def key(c: Any) -> tuple:
            lays = tuple((l.kind, l.shape, l.dtype, l.dim, l.num_shards, l.axes, l.gathered)
                         for l in self._layouts[c.uid])
            return (self.adapter.program_key(c.uid, c.method, train), lays,
                    tuple(p in trained for p in units[c.uid].param_paths))

        runs = tuple(find_runs(program.steps, program.calls, program.outvars, key))
        stacks, run_stacks = [], {}
        for run in runs:
            uids = [program.calls[k].uid for k in run.calls]
            run_stacks[run.start] = tuple(range(len(stacks), len(stacks) + len(units[uids[0]].param_paths)))
            stacks += [tuple(units[u].param_paths[j] for u in uids) for j in range(len(units[uids[0]].param_paths))]
        in_stack = {p for paths in stacks for p in paths}
        hit = self._slots[traced.program] = Slots(
            runs, tuple(stacks), run_stacks,
            (*[p for p in self._train_paths if p not in in_stack],
             *[g for g, ps in enumerate(stacks) if ps[0] in trained]),
            (*[p for p in self._frozen_paths if p not in in_stack],
             *[g for g, ps in enumerate(stacks) if ps[0] not in trained]),
            frozenset(self._layered(traced)))
        return hit

    def _scan(self, calls: Sequence[Any], run: Run, stacked: Sequence[Any], ins: list[list[Any]],
              train: bool, grad: bool) -> list[list[Any]]:
        """A run of alike unit calls as loops over its stacked parameters (see [Note: scanned runs] and
        :func:`~zinf_jax.engine.staged.run_staged`).

        ``ins``/the result: as ``call_run`` of :class:`~zinf_jax.engine.glue.GlueProgram`.
        """
        c0, n = calls[run.calls[0]], len(run.calls)
        lays = self._layouts[c0.uid]
        model = self._model_call(c0.uid, c0.method, c0.sig, train, lays)
        first = ins[0]
        carried = [p for p, o in enumerate(run.carry) if o is not None]
        per_call = [p for p, o in enumerate(run.carry) if o is None and not run.invariant[p]]
        fixed = [p for p, o in enumerate(run.carry)
                 if o is None and run.invariant[p] and isinstance(first[p], jax.Array)]
        template = [None if p in carried or p in per_call or p in fixed else v for p, v in enumerate(first)]

        def fn(params: list, c: list, f: list, x: list) -> tuple[list, list]:
            dyn = list(template)
            for ps, vs in ((carried, c), (per_call, x), (fixed, f)):
                for p, v in zip(ps, vs):
                    dyn[p] = v
            outs = c0.out_tree.flatten_up_to(model(params, dyn))
            return [outs[run.carry[p]] for p in carried], [outs[o] for o in run.outputs]

        taps = [x[0] if isinstance(x, tuple) else None for x in stacked]
        final, ys = run_staged(fn, lays, [x[1] if isinstance(x, tuple) else x for x in stacked], taps, n,
                               [first[p] for p in carried], [first[p] for p in fixed],
                               [jnp.stack([ins[k][p] for k in range(n)]) for p in per_call], self._staging(),
                               grad=grad, tap_kinds=[_kind(t) for t in taps])
        return self._run_result(run, c0, final, ys, n)

    @staticmethod
    def _run_result(run: Run, c0: Any, final: Sequence[Any], ys: Sequence[Any], n: int) -> list[list[Any]]:
        """Each call's outputs from a run's loop: the stacked ``ys`` of ``run.outputs``, the last call's
        carried values ``final`` (``None`` where nothing after the run reads one)."""
        result: list[list[Any]] = [[None] * c0.out_tree.num_leaves for _ in range(n)]
        for o, y in zip(run.outputs, ys):
            for k in range(n):
                result[k][o] = y[k]
        carried = [p for p, o in enumerate(run.carry) if o is not None]
        for p, v in zip(carried, final):
            result[-1][run.carry[p]] = v
        return result

    def _loss_fn(self, traced: Traced, slots: Slots, train: bool, grad: bool) -> Callable:
        """``(trained, glue, frozen, rest, reads) -> (out, state, batch_state)`` over the stored shards
        (``reads``: :meth:`_reads`'s arrays)."""
        program, calls, units = traced.program, traced.program.calls, self.units
        keys = self._read_keys(traced, slots, grad)

        def loss_of(trained, glue, frozen, rest, reads=()):
            value, stacked = slots.values(trained, frozen, self._pieces)
            reads_of = dict(zip(keys, reads))

            def call(k, dyn, layer_params=None):
                c = calls[k]
                if layer_params is None:
                    return self._call(k, c, value, list(dyn), train, grad, reads_of)
                if isinstance(layer_params, tuple) and layer_params[0] == "gathered":  # in a staged loop
                    model = self._model_call(c.uid, c.method, c.sig, train, self._layer_layouts(c.uid))
                    return c.out_tree.flatten_up_to(model(list(layer_params[1]), list(dyn)))
                if grad and self.host_params:
                    raise EngineError(f"zinf_jax: unit {units[c.uid].path!r} holds a stack of layers that the model "
                                      "scans in reverse, or in a scan that also calls a unit with its whole "
                                      "parameters; with offload_param='cpu' the engine runs a stack's layers in a "
                                      "forward scan of their own only. Scan forward, or keep the parameters in "
                                      "device memory (offload_param='none')")
                fn = self._unit(c.uid, c.method, c.sig, train, grad, layer=True)
                return c.out_tree.flatten_up_to(fn(list(layer_params), dyn))

            def run_layers(uids, body, carry, consts, xs, n):  # See [Note: stacks in scans]
                lays, vals, counts = [], [], []
                for u in uids:
                    counts.append(len(units[u].param_paths))
                    lays += self._layer_layouts(u)
                    vals += [value(p) for p in units[u].param_paths]
                taps = [v[0] if isinstance(v, tuple) else None for v in vals]

                def fn(params, c, f, x):
                    it = iter(params)
                    return body([[next(it) for _ in range(k)] for k in counts], c, f, x)

                return run_staged(fn, lays, [v[1] if isinstance(v, tuple) else v for v in vals], taps, n, carry,
                                  consts, xs, self._staging(), grad=grad, tap_kinds=[_kind(t) for t in taps])

            def call_run(run, ins):
                return self._scan(calls, run, [stacked[g] for g in slots.run_stacks[run.start]], ins, train, grad)

            def segment(i, ins):  # See [Note: stacks in scans]
                s = program.steps[i]
                if not s.nested:
                    return s.fn(*ins)
                return evaluate(s.jaxpr, [], ins, unit_call_p, calls, call,
                                lambda uid: [value(p) for p in units[uid].param_paths], self._layers.__getitem__,
                                lambda uid: units[uid].path, run_layers)

            return traced.unflatten(program([*glue, *rest], call, slots.runs, call_run, call_segment=segment))

        return loss_of

    def _tap_kinds(self, traced: Traced, slots: Slots) -> list[str]:
        """Per trained argument, its tap's memory (see [Note: gradient taps]): ``pinned_host`` where the
        gradients go to a host optimizer and each of its paths is read once in the step, else ``device``."""
        if not self.grads_on_host:
            return ["device"] * len(slots.trained)
        reads: dict[str, int] = {}
        for c in traced.program.calls:
            for p in self.units[c.uid].param_paths:
                reads[p] = reads.get(p, 0) + (2 if self.param_loss is not None else 1)
        paths = [[x] if isinstance(x, str) else slots.stacks[x] for x in slots.trained]
        return ["pinned_host" if all(reads.get(p, 0) <= 1 for p in ps) else "device" for ps in paths]

    def _layered(self, traced: Traced) -> set[str]:
        """The paths of the stacks of layers the model itself scans (see [Note: stacks in scans])."""
        return {p for c in traced.program.calls if c.layer == -1 for p in self.units[c.uid].param_paths}

    def _taps(self, slots: Slots, kinds: Sequence[str], layered: Collection[str] = ()) -> list[Any]:
        """The trained arguments' taps: float32 placeholders shaped and sharded as their stored shards; a
        stack's, and a model-scanned stack's, in the pieces its backward makes (see [Note: staged gradients])."""
        out: list[Any] = []
        for slot, kind in zip(slots.trained, kinds):
            lay = self.store.layouts[slot if isinstance(slot, str) else slots.stacks[slot][0]]
            if isinstance(slot, str) and slot in layered and len(self._pieces(lay.stored_shape[0], True)) > 1:
                out.append(tuple(tap((b - a, *lay.stored_shape[1:]), lay.spec, self.mesh, kind)
                                 for a, b in self._pieces(lay.stored_shape[0], True)))
            elif isinstance(slot, str):
                out.append(tap(tuple(lay.stored_shape), lay.spec, self.mesh, kind))
            else:
                out.append(tuple(tap((b - a, *lay.stored_shape), P(None, *lay.spec), self.mesh, kind)
                                 for a, b in self._pieces(len(slots.stacks[slot]), True)))
        return out

    def _grad_out(self, slots: Slots, slot: Any, g: Any, kind: str) -> Any:
        """A trained argument's gradient as it leaves the program (already float32 and reduce-scattered, in its
        tap's ``kind`` of memory): moved to host memory as the last operation where the optimizer is there."""
        if not self.grads_on_host or kind == "pinned_host":
            return g
        lay = self.store.layouts[slot if isinstance(slot, str) else slots.stacks[slot][0]]
        spec = lay.spec if isinstance(slot, str) else P(None, *lay.spec)
        return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(self.mesh, spec, memory_kind="pinned_host")), g)

    def _read_keys(self, traced: Traced, slots: Slots, grad: bool) -> list[tuple[int, str, str]]:
        """The parameter arguments a program takes more than once: with host parameters, each call alone reads
        its parameters from an argument of its own, ``(call, path, "forward")`` (but the first call of a path,
        which reads the path's argument), and in a differentiated program its backward from another,
        ``(call, path, "backward")``. The same buffers, passed again: two reads of one argument are two
        identical moves, which XLA merges into one copy kept between them (for a tied embedding, from the
        lookup to the head), where a unit's parameters are to be moved in for each use and released after."""
        if not self.host_params:
            return []
        in_runs = {k for run in slots.runs for k in run.calls}
        seen: set[str] = set()
        keys = []
        for k, c in enumerate(traced.program.calls):
            if k in in_runs or c.layer == -1:
                continue
            for p in self.units[c.uid].param_paths:
                if p in seen:
                    keys.append((k, p, "forward"))
                seen.add(p)
                if grad:
                    keys.append((k, p, "backward"))
        return keys

    def _reads(self, traced: Traced, slots: Slots, grad: bool, trained: Sequence[Any],
               frozen: Sequence[Any]) -> list[Any]:
        """The arrays of :meth:`_read_keys`: each the path's own argument again."""
        singles = dict(zip((*slots.trained, *slots.frozen), (*trained, *frozen)))
        return [singles[p] for _, p, _ in self._read_keys(traced, slots, grad)]

    def _train_program(self, traced: Traced, slots: Slots, has_aux: bool) -> Callable:
        loss_of = self._loss_fn(traced, slots, True, True)
        called = list(dict.fromkeys(c.uid for c in traced.program.calls))
        kinds = self._tap_kinds(traced, slots)

        def step(trained, glue, frozen, rest, scale, reads):
            def f(taps, g):  # differentiated by the taps: [Note: staged gradients]
                t = list(zip(taps, trained))
                out, new_state, batch_state = loss_of(t, g, frozen, rest, reads)
                loss, aux = out if has_aux else (out, None)
                if self.param_loss is not None:  # as the streamed engine: the glue, and each unit called
                    value, _ = slots.values(t, frozen, self._pieces)
                    loss = loss + self._penalty(self.adapter.glue_paths, g)
                    for uid in called:
                        paths = self.units[uid].param_paths
                        loss = loss + self._penalty(paths, [value(p) for p in paths])
                return loss, (aux, new_state, batch_state)

            taps = self._taps(slots, kinds, self._layered(traced))
            loss, vjp, (aux, new_state, batch_state) = jax.vjp(f, taps, glue, has_aux=True)
            if jnp.shape(loss) != ():
                raise EngineError(f"loss_fn must return a scalar loss, got shape {jnp.shape(loss)}; reduce it "
                                  "(e.g. jnp.mean) — nothing was applied")
            g_trained, g_glue = vjp(jnp.full_like(loss, scale))
            g_trained = [self._grad_out(slots, slot, g, k) for slot, g, k in zip(slots.trained, g_trained, kinds)]
            g_glue = [jax.lax.with_sharding_constraint(g, self._glue_grad_sharding(path))  # see stepping
                      for path, g in zip(self.adapter.glue_paths, g_glue)]
            return loss, aux, new_state, batch_state, g_trained, g_glue

        return step

    def _glue_grad_sharding(self, path: str) -> NamedSharding:
        """A glue parameter's gradient leaves the program as the parameter is stored: one copy of a persistent one
        (replicated), a sharded one reduce-scattered (a large parameter of the root: [Note: the root's parameters])."""
        lay = self.store.layouts[path]
        return self._rep if lay.kind == "persistent" else NamedSharding(self.mesh, lay.spec)

    def _fused_paths(self, slots: Slots) -> tuple[list[list[str]], list[int], list[str]]:
        """The paths of each trained argument, the trained glue parameters' positions, and all those paths."""
        per_slot = [[x] if isinstance(x, str) else list(slots.stacks[x]) for x in slots.trained]
        glue = [j for j, p in enumerate(self.adapter.glue_paths) if p in self.fused.layouts]
        return per_slot, glue, [p for ps in per_slot for p in ps] + [self.adapter.glue_paths[j] for j in glue]

    # [Note: a line search]
    # optax.lbfgs (and any transform built on scale_by_zoom_linesearch or scale_by_backtracking_linesearch)
    # calls value_fn, the loss as a function of the parameters, at trial points inside its update, and
    # differentiates it (jax.value_and_grad). Only the fused train program has the loss at hand: the update
    # runs in the same program as the step, with params and state in device memory. There value_fn is the
    # step's own loss function at the trial values (the same batch, model state and RNG; new model state
    # discarded), and its gradient is the step's own backward (the gradient taps): a custom_vjp whose
    # forward runs the step program's body once and keeps its gradients for the pullback, so a trial point
    # costs one forward and backward, as under plain jax.value_and_grad. Every other placement refuses the
    # transform up front (update_in_program).

    def _fused_program(self, traced: Traced, slots: Slots, has_aux: bool) -> Callable:
        """The train program with the optimizer step in it (see :mod:`zinf_jax.optim.fused`)."""
        step = self._train_program(traced, slots, has_aux)
        per_slot, glue_trained, paths = self._fused_paths(slots)

        def stored(path: str, master: jax.Array) -> jax.Array:
            lay = self.store.layouts[path]
            x = master.astype(self.store.dtype_of(path))
            return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, lay.spec))

        def as_slots(by_path: dict[str, jax.Array], glue: Sequence[jax.Array]) -> tuple[list, list]:
            """The trained arguments and the glue of stored-form values ``by_path``."""
            new_slots = []
            for slot, ps in zip(slots.trained, per_slot):
                if isinstance(slot, str):
                    new_slots.append(by_path[slot])
                else:
                    spec = P(None, *self.store.layouts[ps[0]].spec)
                    new_slots.append(jax.lax.with_sharding_constraint(jnp.stack([by_path[p] for p in ps]),
                                                                      NamedSharding(self.mesh, spec)))
            new_glue = list(glue)
            for j in glue_trained:
                new_glue[j] = by_path[self.adapter.glue_paths[j]]
            return new_slots, new_glue

        def flat_grads(g_trained: Sequence[Any], g_glue: Sequence[Any]) -> list[jax.Array]:
            """The gradients in ``paths`` order (a stack's in its pieces: [Note: staged gradients])."""
            grads = []
            for slot, g in zip(slots.trained, g_trained):
                if isinstance(slot, str):
                    grads.append(jnp.concatenate(g) if isinstance(g, tuple) else g)
                else:
                    grads += [piece[k] for piece in g for k in range(piece.shape[0])]
            return grads + [g_glue[j] for j in glue_trained]

        def loss_at(glue, frozen, rest, reads) -> Callable[[dict[str, jax.Array]], jax.Array]:
            """The step's loss at other values of the trained parameters (``{path: value}``, own shapes), for a
            line search (``value_fn``): differentiated by the step's own backward (see [Note: a line search])."""
            lays = [self.store.layouts[p] for p in paths]

            def run_at(values):
                by_path = {p: stored(p, to_stored(lay, v)) for p, lay, v in zip(paths, lays, values)}
                t, g = as_slots(by_path, glue)
                loss, _, _, _, g_trained, g_glue = step(t, g, frozen, rest, jnp.float32(1), reads)
                return loss, [from_stored(lay, x) for lay, x in zip(lays, flat_grads(g_trained, g_glue))]

            @jax.custom_vjp
            def value(values):
                return run_at(values)[0]

            value.defvjp(run_at, lambda grads, ct: ([ct * x for x in grads],))
            return lambda by_path: value([by_path[p] for p in paths])

        def run(trained, glue, frozen, rest, scale, reads, states, scalars):
            loss, aux, new_state, batch_state, g_trained, g_glue = step(trained, glue, frozen, rest, scale, reads)
            grads = flat_grads(g_trained, g_glue)
            value_fn = loss_at(glue, frozen, rest, reads) if self.fused.calls_loss else None
            masters, new_states, norm, finite = self.fused.update(paths, grads, states, scalars, value=loss,
                                                                  value_fn=value_fn)
            new_params = [stored(p, m) for p, m in zip(paths, masters)]
            new_slots, _ = as_slots(dict(zip(paths, new_params)), glue)
            return loss, aux, new_state, batch_state, new_slots, new_params, new_states, norm, finite

        return run

    def _fused_step(self, loss_fn: Callable, batch: Any, glue: Sequence[jax.Array], has_aux: bool,
                    loss_scale: float, before_backward: Callable[[], None] | None) -> tuple[jax.Array, Any, list]:
        """``forward_backward`` with the optimizer step in the program: the new params and states are kept."""
        t0 = time.perf_counter()
        traced, slots, args = self._train_args(loss_fn, batch, glue, loss_scale)
        _, _, paths = self._fused_paths(slots)
        scalars = self.fused.scalars()
        full = (*args, self.fused.states(paths), scalars)
        _, prog = self._compiled(traced, ("fused", has_aux), lambda: self._fused_program(traced, slots, has_aux), full)
        if before_backward is not None:
            before_backward()
        loss, aux, new_state, batch_state, new_slots, new_params, new_states, norm, finite = prog(*full)
        del args, full
        self.store.adopt(paths, new_params)  # the tier's new values, and the next step's arguments as they are
        self.args.adopt(slots, new_slots)
        self.fused.adopt(paths, new_states)
        norm, finite = jax.device_get((norm, finite))
        self.fused.applied(float(norm), bool(finite), float(scalars[0]), time.perf_counter() - t0)
        self.state = new_state
        self.adapter.update_batch(batch, batch_state)
        return loss, aux, []

    def _compiled(self, traced: Traced, kind: tuple, make: Callable, args: tuple,
                  platforms: Sequence[str] | None = None) -> Any:
        """The program of ``traced`` (``kind``: train/eval variant) compiled for ``args``, built once.

        With ``platforms`` (e.g. ``("cuda",)``), the program lowered for those backends instead, not
        compiled nor kept: ``(lowered, None)`` (see :meth:`lower`).
        """
        if platforms is not None:
            return jax.jit(make()).trace(*args).lower(lowering_platforms=tuple(platforms)), None
        progs = self._programs.setdefault(traced.program, {})
        key = (kind, _signature(jax.tree.leaves(args[1:])))
        hit = progs.get(key)
        if hit is None:
            what = {"fused": "train (with the optimizer's update)", "train": "train", "eval": "eval"}[kind[0]]
            log.info("compiling the %s step program (once per batch shape and dtype)", what)
            t0 = time.perf_counter()
            lowered = jax.jit(make()).lower(*args)
            options = self.compiler_options(self.mesh.devices.flat[0].platform)
            hit = progs[key] = (lowered, lowered.compile(compiler_options=options or None))
            log.info("compiled the %s step program in %.1f s", what, time.perf_counter() - t0)
            self._note_memory(hit[1])
        return hit

    def _note_memory(self, compiled: Any) -> None:
        stats = compiled.memory_analysis()
        if stats is None:  # a backend without it
            return
        per_device = stats.temp_size_in_bytes + stats.argument_size_in_bytes + stats.output_size_in_bytes \
            - stats.alias_size_in_bytes
        self.peak_device_bytes = max(self.peak_device_bytes, int(per_device) * len(self.mesh.local_devices))

    # --- passes ---------------------------------------------------------------------------
    def _check_eager(self, batch: Any, glue: Sequence[jax.Array]) -> None:
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((batch, list(glue)))):
            raise EngineError(JIT_MESSAGE)

    def _train_args(self, loss_fn: Callable, batch: Any, glue: Sequence[jax.Array], loss_scale: float):
        self._check_eager(batch, glue)
        traced = self._traced(loss_fn, batch, glue, True)
        slots = self._slots_of(traced, True)
        trained, frozen = self.args(slots)
        rest = traced.args[len(glue):]
        return traced, slots, (trained, list(glue), frozen, rest, np.float32(loss_scale),
                               self._reads(traced, slots, True, trained, frozen))

    def lower(self, loss_fn: Callable, batch: Any, glue: Sequence[jax.Array], *, has_aux: bool,
              loss_scale: float = 1.0, program: str = "train",
              platforms: Sequence[str] | None = None) -> jax.stages.Lowered:
        """A step's program for ``batch``, lowered.

        Args:
          program: ``"train"``: forward, backward, gradients out (with :attr:`fused`, the optimizer step
            too); ``"eval"``: the forward of ``eval_step``.
          platforms: lower for these backends (``("cuda",)``, ``("tpu",)``) instead of the mesh's own,
            from this machine: the program as it would run there (moves between memory kinds are
            no-ops on the CPU backend, not in a GPU or TPU lowering). Not compiled.
        """
        if program == "eval":
            self._check_eager(batch, glue)
            traced = self._traced(loss_fn, batch, glue, False)
            slots = self._slots_of(traced, False)
            trained, frozen = self.args(slots)
            args = (trained, list(glue), frozen, traced.args[len(glue):], self._reads(traced, slots, False, trained, frozen))
            return self._compiled(traced, ("eval", False), lambda: self._loss_fn(traced, slots, False, False), args,
                                  platforms)[0]
        if program != "train":
            raise EngineError(f"lower(program=...) takes 'train' or 'eval', got {program!r}")
        traced, slots, args = self._train_args(loss_fn, batch, glue, loss_scale)
        if self.fused is not None:  # the program train_step runs: the optimizer step in it
            full = (*args, self.fused.states(self._fused_paths(slots)[2]), self.fused.scalars())
            return self._compiled(traced, ("fused", has_aux), lambda: self._fused_program(traced, slots, has_aux),
                                  full, platforms)[0]
        return self._compiled(traced, ("train", has_aux), lambda: self._train_program(traced, slots, has_aux), args,
                              platforms)[0]

    def transfer_budget(self, loss_fn: Callable, batch: Any, glue: Sequence[jax.Array], *,
                        program: str = "train") -> TransferBudget:
        """The fewest bytes a step's program moves between host and device memory, per device (see
        [Note: moves ahead] and [Note: staged gradients] in :mod:`zinf_jax.engine.staged`): host parameters
        moved in once per call, and once more for the backward of a training step; with a host optimizer, each
        trained parameter's float32 gradient moved out once; with the update in the program and the state on a host
        tier, each state moved in and out once. What XLA can show it moves."""
        train = program == "train"
        traced = self._traced(loss_fn, batch, glue, train)
        slots = self._slots_of(traced, train)
        calls = traced.program.calls

        def nbytes(path: str, layers: int = 1, dtype: Any = None) -> int:
            lay = self.store.layouts[path]
            item = jnp.dtype(dtype or self.args.stack_dtype(path, path in slots.layered)).itemsize
            return int(np.prod(lay.shard_shape)) * item // layers

        h2d = d2h = 0
        if self.host_params:
            uses = 2 if train else 1
            in_runs = {k for run in slots.runs for k in run.calls}
            for run in slots.runs:
                h2d += uses * len(run.calls) * sum(nbytes(p) for p in self.units[calls[run.calls[0]].uid].param_paths)
            single = lambda p: nbytes(p, dtype=self.store.dtype_of(p))  # noqa: E731 - a call alone's argument
            for k, c in enumerate(calls):
                if k in in_runs:
                    continue
                if c.layer == -1:
                    n = self._layers[c.uid]
                    h2d += uses * n * sum(nbytes(p, n) for p in self.units[c.uid].param_paths)
                else:
                    h2d += uses * sum(single(p) for p in self.units[c.uid].param_paths)
            if train and self.param_loss is not None:  # each called unit's parameters read for the penalty
                h2d += sum(single(p) for uid in dict.fromkeys(c.uid for c in calls) for p in self.units[uid].param_paths)
        if train and self.grads_on_host and self.fused is None:
            d2h = sum(nbytes(p, dtype=jnp.float32) for p in self._train_paths)
        if train and self.fused is not None:  # a host tier's states, in and out once: [Note: states moved in the program]
            moved = self.fused.moved_bytes(self._fused_paths(slots)[2])
            h2d, d2h = h2d + moved, d2h + moved
        return TransferBudget(h2d_bytes=h2d, d2h_bytes=d2h)

    def forward_backward(
        self, loss_fn: Callable, batch: Any, glue: Sequence[jax.Array], *, has_aux: bool, loss_scale: float = 1.0,
        accumulate: bool = False, before_backward: Callable[[], None] | None = None,
    ) -> tuple[jax.Array, Any, list[jax.Array]]:
        """Loss, aux and glue-parameter gradients; the unit parameters' gradients go to :attr:`sink`.

        As ``StreamedModel.forward_backward``: seeded with ``loss_scale``; ``accumulate`` adds to the
        sink's gradients; ``before_backward()`` runs before the program (forward and backward are one).
        """
        if self.fused is not None:  # one step per batch (no accumulation): the update is in the program
            return self._fused_step(loss_fn, batch, glue, has_aux, loss_scale, before_backward)
        if not accumulate:
            self.sink.clear()
        traced, slots, args = self._train_args(loss_fn, batch, glue, loss_scale)
        _, prog = self._compiled(traced, ("train", has_aux), lambda: self._train_program(traced, slots, has_aux), args)
        if before_backward is not None:
            before_backward()
        loss, aux, new_state, batch_state, g_trained, g_glue = prog(*args)
        del args
        singles = [(x, g) for x, g in zip(slots.trained, g_trained) if isinstance(x, str) and not isinstance(g, tuple)]
        self.sink.add_many([x for x, _ in singles], [g for _, g in singles])
        for x, g in zip(slots.trained, g_trained):
            if isinstance(x, str) and isinstance(g, tuple):  # a model-scanned stack's, in pieces
                starts = [a for a, _ in self._pieces(self.store.layouts[x].stored_shape[0], True)]
                self.sink.add_rows(x, list(zip(starts, g)))
        for x, g in zip(slots.trained, g_trained):
            if not isinstance(x, str):  # in the pieces of its run's backward: [Note: staged gradients]
                paths = slots.stacks[x]
                for (a, b), piece in zip(self._pieces(len(paths), True), g):
                    self.sink.add_stacked(paths[a:b], piece)
        self.state = new_state
        self.adapter.update_batch(batch, batch_state)
        return loss, aux, g_glue

    def forward(self, loss_fn: Callable, batch: Any, glue: Sequence[jax.Array], *, has_aux: bool,
                train: bool = False) -> tuple[Any, Any]:
        """Loss (and aux) of a forward pass only, compiled (see ``StreamedModel.forward``)."""
        self._check_eager(batch, glue)
        traced = self._traced(loss_fn, batch, glue, train)
        slots = self._slots_of(traced, train)
        trained, frozen = self.args(slots)
        args = (trained, list(glue), frozen, traced.args[len(glue):], self._reads(traced, slots, False, trained, frozen))
        _, prog = self._compiled(traced, ("eval", train), lambda: self._loss_fn(traced, slots, train, False), args)
        out, new_state, batch_state = prog(*args)
        if train:
            self.state = new_state
            self.adapter.update_batch(batch, batch_state)
        return out if has_aux else (out, None)
