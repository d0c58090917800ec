"""The engine's training steps: one at a time, or with the optimizer overlapped with the next forward.

:class:`Stepper` holds what :meth:`Engine.train_step <zinf_jax.api.Engine.train_step>`
and :meth:`Engine.train_steps <zinf_jax.api.Engine.train_steps>` do: the streamed
forward/backward of a batch (per micro-batch, gradients into the sink), then
the streamed optimizer step and the commit of the tiers. ``train_steps`` runs
step ``N``'s optimizer on a worker thread while step ``N+1``'s forward goes on,
behind the :class:`~zinf_jax.engine.overlap.WriteGate`.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import jax
import numpy as np
from flax import nnx
from jax.profiler import TraceAnnotation

from zinf_jax.engine.adapters import model_sharding_explained
from zinf_jax.engine.batching import check_batch, micro_batches, shard_batch
from zinf_jax._internal.interrupts import deferred_interrupts
from zinf_jax.engine.grads import host_copy
from zinf_jax.errors import EngineError
from zinf_jax.optim.driver import NORM_DONE
from zinf_jax.plan.partition import no_mesh

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from zinf_jax.engine.build import Components

__all__ = ["Stepper", "Loss"]

_END = object()


@dataclasses.dataclass(frozen=True)
class Loss:
    """The loss a step trains: ``fn(model, batch) -> loss``, or ``(loss, aux)`` when ``has_aux``."""

    fn: Callable
    has_aux: bool = False


@dataclasses.dataclass
class _Grads:
    """A step's forward/backward done, its gradients in the sink: what the optimizer step needs to report."""

    loss: float
    aux: Any
    t0: float
    t1: float
    tokens: int
    fetch_wait_s: float
    grads_out_s: float
    has_aux: bool = False
    state: Any = None  # train_steps: the model state after this batch, held aside while the loop body runs


class Stepper:
    """The training steps of one engine.

    Args:
      components: the engine's parts (its streamed model, optimizer, store, tiers, gate and life cycle).
    """

    def __init__(self, components: Components):
        self.c = components
        self._pool: ThreadPoolExecutor | None = None  # its optimizer worker
        self._ordered_for: Any = None  # the plan the optimizer's update order follows
        self._first = True  # no step has run yet in this process (its programs are compiled on the way)

    def step(self, batch: Any, loss: Loss) -> dict[str, Any]:
        """One forward/backward and optimizer step (``Engine.train_step``) of ``loss``, as a transaction (see
        [Note: a step is a transaction])."""
        if self.c.life.looping:
            raise EngineError("engine.train_step() inside an engine.train_steps() loop: the loop holds the next "
                              "batch's gradients; take the next step from the loop (or break out of it first)")
        before = self._snapshot(batch)
        try:
            grads = self._forward_backward(batch, loss)
            with deferred_interrupts():  # the optimizer's in-place update, not stopped half-way
                return self._update(grads)
        except BaseException:
            self._roll_back(before)
            raise

    # [Note: a step is a transaction]
    # What a training step changes becomes visible together or not at all: the parameters and the optimizer's
    # state (the tiers commit them at the end of the step: an nvme tier's failed generation is never read), the
    # optimizer's counters (applied and skipped steps, the loss scale, an optax rule's host state), the model's
    # non-parameter state (RNG counts, batch statistics) and the state of NNX objects passed in the batch. A step
    # that raises (a full disk, an I/O error, the loss function, an interrupt) puts back what it had changed:
    # retrying the same batch gives what an uninterrupted run gives, bit for bit. A Ctrl-C (SIGINT) that arrives
    # during the optimizer's update in the main thread is held until the update has committed or failed, then
    # raised: a cpu tier's state is updated in place, and an update stopped half-way could not be put back.
    # train_steps yields every step that completed before it raises.

    def _snapshot(self, batch: Any) -> tuple:
        """What a step changes outside its tiers: the model's state, the batch's NNX state, the optimizer's counters."""
        c = self.c
        return (c.passes.state, batch, c.adapter.batch_state(batch), copy.deepcopy(c.optimizer.state_dict()))

    def _roll_back(self, before: tuple) -> None:
        state, batch, batch_state, counters = before
        c = self.c
        c.passes.replace_state(state)
        if batch_state is not None:
            c.adapter.update_batch(batch, batch_state)
        c.optimizer.restore_state(counters)
        if not c.life.closed:
            c.passes.sink.clear()

    def steps(self, batches: Iterable[Any], loss: Loss) -> Iterator[dict[str, Any]]:
        """``Engine.train_steps``: the steps of ``batches``, each optimizer step overlapped with the next forward."""
        if self.c.life.looping:
            raise EngineError("engine.train_steps() inside another train_steps() loop")
        return self._steps(iter(batches), loss)

    def _steps(self, it: Iterator[Any], loss: Loss) -> Iterator[dict[str, Any]]:
        eng = self.c
        eng.life.enter_loop()
        t_last = time.perf_counter()
        try:
            batch = next(it, _END)
            if batch is _END:
                return
            eng.life.check("train_steps", batch)
            before = self._snapshot(batch)  # See [Note: a step is a transaction]
            try:
                grads = self._forward_backward(batch, loss)
            except BaseException:
                self._roll_back(before)
                raise
            while True:
                eng.gate.arm([NORM_DONE, *eng.optimizer.layouts])  # See [Note: write gate]
                step = self._worker().submit(self._update, grads, clear=False)
                nxt, failed, after = None, None, None
                try:
                    batch = next(it, _END)
                    if batch is not _END:
                        eng.life.check("train_steps", batch)
                        at_step = eng.passes.state  # the model state of step N, for the loop body
                        after = (at_step, *self._snapshot(batch)[1:3])
                        nxt = self._forward_backward(batch, loss, after=self._grads_read)
                        nxt.state = eng.passes.replace_state(at_step)
                except BaseException as e:  # the next batch's forward failed: step N still completes and is yielded
                    failed = e
                try:
                    m = step.result()  # an optimizer error surfaces here, after the forward stopped
                except BaseException:
                    self._roll_back(before)  # step N undone, and the next batch's forward with it
                    if after is not None and after[2] is not None:
                        eng.adapter.update_batch(after[1], after[2])
                    raise
                if failed is not None:
                    eng.passes.replace_state(after[0] if after is not None else eng.passes.state)
                    if after is not None and after[2] is not None:
                        eng.adapter.update_batch(after[1], after[2])
                now = time.perf_counter()
                m["step_time_s"], t_last = now - t_last, now
                m["tokens_per_s"] = grads.tokens / m["step_time_s"]
                yield m
                if failed is not None:
                    raise failed
                if nxt is None:
                    return
                before = (at_step, batch, after[2], copy.deepcopy(eng.optimizer.state_dict()))
                eng.passes.replace_state(nxt.state)
                grads = nxt
        finally:
            eng.life.leave_loop()
            eng.gate.open()
            if not eng.life.closed:
                eng.passes.sink.clear()  # the gradients of a batch drawn but not stepped

    def _worker(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zinf-optimizer")
        return self._pool

    def close(self) -> None:
        """Stops the optimizer worker (after the step it runs, if any)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _grads_read(self) -> None:
        """Before a backward that overlaps an optimizer step: wait until it has read every gradient, then clear.

        See [Note: write gate].
        """
        self.c.gate.wait()
        self.c.passes.sink.clear()

    def _grads_out_s(self) -> float:
        grads = self.c.optimizer.grads
        return 0.0 if grads is None else grads.seconds

    def _forward_backward(self, batch: Any, objective: Loss, after: Callable[[], None] | None = None) -> _Grads:
        """Loss and gradients of ``batch`` (per micro-batch); the gradients go to the sink.

        ``after``: run before the first backward (the sink is then not cleared at the start).
        """
        with self.c.model_mesh.running(), model_sharding_explained():  # not under a mesh the caller set
            return self._forward_backward_on_mesh(batch, objective, after)

    def _forward_backward_on_mesh(self, batch: Any, objective: Loss, after: Callable[[], None] | None) -> _Grads:
        eng = self.c
        t0 = time.perf_counter()
        waits = eng.passes.fetch_wait_s, self._grads_out_s()
        k = eng.config.gradient_accumulation_steps
        check_batch(batch)  # before any state changes: an empty batch is refused,
        parts = micro_batches(batch, k)  # and one that does not split
        if self._first and eng.placement.engine == "streamed":  # the compiled engine says so per program
            log.info("the first step traces and compiles each unit's programs; later steps reuse them")
        self._first = False
        # an optimizer step in flight: its norm all-reduce (a collective, across processes) goes first
        eng.gate.wait([NORM_DONE, *eng.adapter.glue_paths])  # See [Note: write gate]
        glue = eng.store.fetch(eng.adapter.glue_paths)
        losses, auxes = [], []
        try:
            for i, part in enumerate(parts):  # each backward seeded with scale / k: the sink sums the mean gradient
                part = shard_batch(part, eng.mesh, eng.model_mesh.model_axes)
                loss, aux, g_glue = eng.passes.forward_backward(
                    objective.fn, part, glue, has_aux=objective.has_aux, loss_scale=eng.optimizer.loss_scale / k,
                    accumulate=i > 0 or after is not None, before_backward=after if i == 0 else None,
                )
                for path, g in zip(eng.adapter.glue_paths, g_glue):
                    if path not in eng.trainable:
                        continue
                    if eng.layouts[path].kind == "persistent":  # replicated: one copy
                        eng.passes.sink.add_local(path, 0, host_copy(g.addressable_data(0)))
                    else:  # a large parameter of the root, in its shards
                        eng.passes.sink.add(path, g)
                losses.append(float(loss))
                auxes.append(aux)
        except BaseException:
            if after is not None:
                eng.gate.wait()  # the optimizer step in flight may still be reading the sink
            eng.passes.sink.clear()  # no half-accumulated gradient survives a failed step
            raise
        first = next(x for x in jax.tree.leaves(part, is_leaf=nnx.graph.is_graph_node) if hasattr(x, "shape"))
        return _Grads(loss=math.fsum(losses) / k, aux=auxes[0] if k == 1 else auxes, t0=t0,
                      t1=time.perf_counter(), tokens=k * math.prod(first.shape),
                      fetch_wait_s=eng.passes.fetch_wait_s - waits[0],
                      grads_out_s=self._grads_out_s() - waits[1], has_aux=objective.has_aux)

    def _update(self, grads: _Grads, clear: bool = True) -> dict[str, Any]:
        """The optimizer step on the sink's gradients and the commit; the metrics of the step."""
        with no_mesh():
            return self._update_on_mesh(grads, clear)

    def _update_on_mesh(self, grads: _Grads, clear: bool) -> dict[str, Any]:
        eng = self.c

        def write_param(path: str, index: int, value: np.ndarray) -> Any:
            return eng.store.put_local(path, index, value)  # the driver keeps the buffer until this resolves

        plan = eng.passes.plan
        if plan is not None and plan is not self._ordered_for:  # the next forward's order (glue first)
            eng.optimizer.order([*eng.adapter.glue_paths, *(p for uid, _ in plan.calls
                                                           for p in eng.adapter.units[uid].param_paths)])
            self._ordered_for = plan
        t1 = time.perf_counter()
        try:
            with TraceAnnotation("zinf/optimizer_step", step=eng.optimizer.step_count + 1):
                m = eng.optimizer.step(eng.passes.sink.source, write_param, on_written=eng.gate.written,
                                       write_params=eng.store.put_local_many, value=grads.loss)
            if clear:
                eng.passes.sink.clear()
            meta = {"step": eng.optimizer.step_count}
            with TraceAnnotation("zinf/commit", step=meta["step"]):
                eng.optimizer.commit(meta)
                eng.store.commit(meta)
        finally:
            eng.gate.open()
        elapsed = time.perf_counter() - grads.t0
        out = {
            "loss": grads.loss,
            **m,
            "step_time_s": elapsed,
            "time_split": {"forward_backward_s": grads.t1 - grads.t0, "fetch_wait_s": grads.fetch_wait_s,
                           "grads_out_s": grads.grads_out_s, "optimizer_wait_s": t1 - grads.t1,
                           **{f"optimizer_{k}": v for k, v in eng.optimizer.last_stats.items()}},
            "tokens_per_s": grads.tokens / elapsed,
            "peak_device_bytes": eng.passes.peak_device_bytes,
            "bytes_param_tier": _tier_bytes(eng.param_tier),
            "bytes_optimizer_tier": _tier_bytes(eng.opt_tier),
            "compute_dtype": eng.compute_dtype,
        }
        if grads.has_aux:
            out["aux"] = grads.aux
        return out


def _tier_bytes(tier: Any) -> int:
    f = getattr(tier, "stored_bytes", None)
    return int(f()) if f else 0
