"""One training step replayed for the estimator (:mod:`zinf_jax.estimate`): what a process holds and moves.

:func:`trace_calls` finds a step's unit calls by one abstract evaluation of the loss;
:class:`StepDigest` is everything the estimate needs about one model on one process;
:func:`simulate` replays the streamed engine's prefetcher over a step's schedule for the device
and host peaks, :func:`step_io` counts the bytes a step reads and writes on disk.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp

from zinf_jax._internal import jax_private
from zinf_jax._internal.flops import matmul_flops
from zinf_jax.config import ZeroConfig
from zinf_jax.optim.rules import WholeSets

__all__ = ["StepDigest", "simulate", "step_io", "trace_calls", "nbytes_of_tree"]


def nbytes_of_tree(tree: Any) -> int:
    """Bytes of the arrays (or abstract arrays) in ``tree``."""
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def _layer_uids(n_units: int, layers: Sequence[int | None]) -> dict[int, int]:
    """For each unit that is a stack of layers, the first of the uids its layers take after the units' own."""
    out, at = {}, n_units
    for uid, n in enumerate(layers):
        if n:
            out[uid], at = at, at + n
    return out


def trace_calls(adapter: Any, dtype_of: Callable[[str], str], layouts: Mapping[str, Any], loss_fn: Callable,
                 example: Any, layers: Sequence[int | None]) -> tuple[list[tuple[int, int, int]], int, int, int]:
    """The unit calls of one abstract evaluation of the loss (for :class:`StepDigest`): ``[(uid, sharded checkpoint bytes, replicated bytes)]``,
    model-state bytes, largest output, and the forward's FLOPs (:func:`~zinf_jax._internal.flops.matmul_flops`).

    A stack of layers called inside the model's scan (``layers[uid]`` layers) is recorded as that many calls of
    one layer each, under the uids :func:`_layer_uids` gives them (the engines fetch and gather one layer per call).
    """
    calls, info, outer = [], {"out": 0}, []
    first = _layer_uids(len(adapter.units), layers)

    def record(uid: int, method: str, inputs: Any) -> Any:
        rep = nbytes_of_tree(adapter.call_state(inputs))  # model state in the checkpoint: on every device
        n = layers[uid] if jax_private.current_trace() is not outer[0] else None
        ids = [uid] if n is None else range(first[uid], first[uid] + n)
        calls.extend((i, nbytes_of_tree(inputs) - rep, rep) for i in ids)
        full = [jnp.zeros(layouts[p].shape[1 if n else 0:], dtype_of(p)) for p in adapter.units[uid].param_paths]
        out = adapter.unit_fn(uid, method)(full, inputs)
        info["out"] = max(info["out"], nbytes_of_tree(out))
        return out

    def run(batch: Any, state: Any) -> Any:
        outer.append(jax_private.current_trace())
        glue = [jnp.zeros(layouts[p].shape, dtype_of(p)) for p in adapter.glue_paths]
        return adapter.run(loss_fn, glue, state, batch, record)[0]

    state = adapter.abstract_state()
    traced = jax.make_jaxpr(run)(example, state)
    return calls, nbytes_of_tree(state), info["out"], matmul_flops(traced)


@dataclasses.dataclass(frozen=True)
class StepDigest:
    """Everything the estimate needs about one model on one process (bytes unless noted)."""

    n_local: int  # devices of this process
    n_idx: int  # shard indices of this process (devices holding distinct shards)
    n_processes: int
    compute_dtype: str
    params: int  # elements
    unit_held: tuple[int, ...]  # a unit's stored shards on the local devices
    unit_gathered: tuple[int, ...]  # a whole unit times the local devices
    unit_kept: tuple[bool, ...]  # the unit's params are all whole: held from its first call to its last of a pass
    unit_grad: tuple[int, ...]  # float32 of a unit's local shards
    calls: tuple[tuple[int, int], ...]  # (uid, checkpoint bytes on the local devices) per unit call
    rests: int  # non-parameter unit state, local devices
    glue: int  # persistent params outside units, local devices
    store: int  # param shards of this process in the tier (one copy)
    store_sharded: int  # the part of ``store`` split over devices
    store_disk: int  # chunk files of one param slot
    store_disk_trained: int  # the part of ``store_disk`` that trained params take (fp32: the master replaces it)
    store_io_trained: int  # bytes a step writes of them (packed shards without their page padding)
    grad: int  # grad sink
    grad_ram: int  # with gradients out: the small shards kept in host RAM (grads_out.IN_RAM_BELOW)
    grad_disk: int  # with gradients out: the scratch tier's files (the other shards' chunks and key metadata)
    grad_io: int  # bytes a step writes (and reads back) of them
    opt: int  # master + m + v
    opt_disk: int  # chunk and pack files of one optimizer slot
    opt_io: int  # bytes a step reads (and writes) of them
    groups: int  # the optimizer's units of work: sub-groups, small whole shards in packs (optim.driver)
    max_chunk: int  # elements of one buffer set: the largest sub-group or pack
    packs: bool  # a pack's gradient is gathered into its buffer set (one more array)
    assembly: int  # driver's multi-chunk shard buffer
    param_meta: int  # nvme metadata of the param tier
    workspace: int  # XLA working set per device (transient guess)
    forward_flops: int  # matrix products of one forward over the whole job's batch
    whole: WholeSets = WholeSets()  # the optimizer's whole-tensor parameters' buffers (optim.rules.whole_sets)
    largest_shard: int = 0  # elements of the largest parameter shard (whether the update fits the step's program)
    optimizer: Any = None  # the optimizer as the engine takes it (zinf's Adam or an optax transform; None: Adam)


def simulate(d: StepDigest, depth: int, max_live: int | None, activations: str, grads_out: bool) -> tuple[dict, dict]:
    """Replays the prefetcher over the forward+backward schedule; the device and host peaks (local sums).
    Saved activations count where ``activations`` (``Placement.activations``) keeps them (nvme: neither)."""
    sched = [u for u, _ in d.calls] + [u for u, _ in reversed(d.calls)]
    n, prefix = len(d.calls), list(itertools.accumulate((b for _, b in d.calls), initial=0))
    last = {u: p for p, u in enumerate(sched)}
    kept: set[int] = set()  # Prefetcher's keep: units of whole params, held for their later calls
    inflight: dict[int, int] = {}  # schedule position -> uid, fetched ahead
    dev_best, host_best, grads_done = {}, {}, set()
    for p, uid in enumerate(sched):
        inflight.pop(p, None)
        if d.unit_kept[uid] and last[uid] > p:
            kept.add(uid)
        else:
            kept.discard(uid)
        held = lambda: sum(d.unit_held[u] for u in {uid, *inflight.values(), *kept})  # noqa: E731
        for q in range(p + 1, min(len(sched), p + 1 + depth)):  # Prefetcher._fill after take()
            new = q not in inflight and sched[q] != uid and sched[q] not in {*inflight.values(), *kept}
            if new and max_live is not None and held() + d.unit_held[sched[q]] > max_live:
                break
            inflight.setdefault(q, sched[q])
        saved = prefix[p] if p < n else prefix[2 * n - 1 - p]  # a backward call pops its checkpoint first
        dev = {"gathered_unit": d.unit_gathered[uid], "prefetched_shards": held(),
               "activations": saved if activations == "device" else 0}
        host = {"activations": saved if activations == "cpu" else 0,
                "grad_sink": d.unit_grad[uid] if grads_out and p >= n else sum(d.unit_grad[u] for u in grads_done)}
        dev_best = max(dev_best, dev, key=lambda x: sum(x.values()))
        host_best = max(host_best, host, key=lambda x: sum(x.values()))
        grads_done |= {uid} if p >= n else set()
    return dev_best, host_best


def step_io(d: StepDigest, config: ZeroConfig, pt: str, ot: str, grads_out: bool,
             shared: bool) -> tuple[tuple[int, int], tuple[int, int]]:
    """Disk bytes (read, written) of one process in one step, and the forward+backward's part of them, from the
    bytes the tiers hold."""
    read = write = pass_read = pass_write = 0
    if pt == "nvme":  # every unit call fetches its shards (a call right after one of the same unit reuses them),
        calls = [u for u, _ in d.calls]  # but a unit of whole params is read once a step (Prefetcher's keep)
        fetches = [u for i, u in enumerate(calls) if (i == 0 or calls[i - 1] != u) and not d.unit_kept[u]]
        passes = 2 if config.activation_checkpointing else 1
        once = {u for u in calls if d.unit_kept[u]}
        pass_read += (passes * sum(d.unit_held[u] * d.n_idx // d.n_local for u in fetches) + d.glue // d.n_local
                      + sum(d.unit_held[u] // d.n_local for u in once))  # whole: one stored copy, on every device
        if not shared:  # the new compute-dtype values of the trained params
            write += d.store_io_trained
    if ot == "nvme":
        read += d.opt_io
        write += d.opt_io
        if grads_out:  # written in the backward, read back by the optimizer
            read += d.grad_io
            pass_write += d.grad_io
    return (int(read + pass_read), int(write + pass_write)), (int(pass_read), int(pass_write))
