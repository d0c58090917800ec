"""One training step replayed for the estimator (:mod:`zinf_jax.estimate`): what a process holds and moves.

:class:`StepDigest` is everything the estimate needs about one model on one process;
:func:`simulate` replays the streamed engine's prefetcher over a step's schedule for the device
and host peaks, :func:`step_io` counts the bytes a step reads and writes on disk.
"""
from __future__ import annotations

import dataclasses
import itertools

from zinf_jax.config import ZeroConfig
from zinf_jax.optim.rules import WholeSets

__all__ = ["StepDigest", "simulate", "step_io"]


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
