"""Memory needed per tier (device, host RAM, NVMe) for every offload configuration.

One :class:`MemoryEstimate` per (param tier none/cpu/nvme, optimizer tier cpu/nvme;
``"none"`` means cpu: the streamed Adam runs on the host). :func:`estimate_from_model`
uses real units and layouts (nothing initialised), :func:`estimate_from_sizes` a GPT.
The ``*_bytes`` fields count the state *held by zinf* at its peak, not the RSS:

* device: the gathered unit (whole, compute dtype, on every device), stored shards of
  the current and ``prefetch_depth`` next units (and of units of whole params between their
  forward and backward calls), unit-boundary activation checkpoints
  (one per unit call, unless ``offload_activations``), unit state, persistent params;
  with params on ``none`` the param tier.
* host: the cpu param tier, fp32 master/m/v (12 B/param), the grad sink (4 B/param; with
  the optimizer on nvme gradients leave host RAM as they are produced: only one unit's
  gradient shards are in flight), ``buffer_count`` sub-group buffer sets (12 B/element,
  16 with the gradient read from nvme; none with float32 state in RAM, updated in the tier's
  own arrays), offloaded checkpoints. A memory tier holds one
  copy of its state (updated in place).
* nvme: every key once (``nvme_update="in_place"``, the default) or twice
  (``"double_slot"``): params in the compute dtype (none for trained params with fp32
  compute and both tiers on nvme: the master is their copy), master/m/v 12 B/param,
  float32 gradients 4 B/param (once), and metadata.

Overheads (runtime, I/O copies, XLA working set) count in :meth:`MemoryEstimate.fits`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Any, Callable, Iterable, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from zinf_jax._internal.fmt import human_bytes
from zinf_jax.config import ZeroConfig
from zinf_jax.engine.host_budget import buffer_set_bytes, buffer_sets
from zinf_jax.engine.wrap import make_adapter, trainable_paths
from zinf_jax.estimate_step import StepDigest, simulate, step_io, trace_calls
from zinf_jax.optim.choose import with_clipping
from zinf_jax.errors import ConfigError
from zinf_jax.optim.choose import choose_optimizer
from zinf_jax.optim.fused import MOVE_IN_AHEAD, update_in_program
from zinf_jax.optim.grads_out import ram_bytes, stays_in_ram
from zinf_jax.optim.rules import WholeSets, rule_for, whole_sets
from zinf_jax.optim.subgroups import PACK_BELOW, PACK_ELEMENTS, pool_geometry, sub_groups
from zinf_jax.plan.host_memory import HostPlan, HostSizes, plan_host
from zinf_jax.plan.partition import experts_gathered_whole, local_shard_devices, make_mesh, plan_partition
from zinf_jax.plan.pinned import plan_pinned
from zinf_jax.plan.placement import place
from zinf_jax.plan.units import UnitPolicy, layer_count, persistent_paths
from zinf_jax.tiers.nvme_layout import chunk_shape
from zinf_jax.tiers.nvme_packs import PACK_BELOW_BYTES, packed_nbytes

__all__ = ["Machine", "MemoryEstimate", "CONFIGURATIONS", "RUNTIME_OVERHEAD", "estimate", "estimate_from_sizes",
           "estimate_from_model", "fits", "format_report", "format_host_plans"]

CONFIGURATIONS: tuple[tuple[str, str], ...] = tuple((p, o) for p in ("none", "cpu", "nvme") for o in ("cpu", "nvme"))
"""Every ``(param tier, optimizer tier)`` pair."""
RUNTIME_OVERHEAD: dict[str, tuple[int, int]] = {"cpu": (0, 460 << 20), "gpu": (1 << 30, 3 << 30),
                                                 "tpu": (1 << 28, 2 << 30)}
"""Platform to (bytes per device, host bytes per process) of the JAX runtime alone. cpu: measured (JAX 0.10.2,
flax, tensorstore, numba kernels; 1-8 devices); gpu (CUDA context, cuBLAS/cuDNN workspaces, CUDA libraries) and
tpu: assumed, not measured. On GPU set ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` or XLA reserves 75% of memory."""
_KEY_METADATA_BYTES = 2 * 280 + 130  # an nvme key: zarr.json per slot (measured 266-272 B), MANIFEST entry (~130 B)


@dataclasses.dataclass(frozen=True)
class Machine:
    """One host: its accelerators, RAM and local disk.

    Attributes:
      gpu_bytes: memory of one accelerator.
      host_bytes: RAM of the host.
      disk_bytes: free space on the NVMe offload path.
      n_devices: accelerators of the host (one process per host).
    """

    gpu_bytes: int
    host_bytes: int
    disk_bytes: int
    n_devices: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Memory of one offload configuration (see the module docstring for what counts).

    Attributes:
      param_tier: ``"none"``, ``"cpu"`` or ``"nvme"``.
      optimizer_tier: ``"cpu"`` or ``"nvme"``.
      device_bytes: peak zinf state on the fullest device.
      device_bytes_local: the same peak summed over this process's devices.
      host_bytes: peak zinf state in host RAM of one process.
      nvme_bytes: bytes on the offload disk of one process.
      breakdown: ``"tier.item"`` to bytes at each tier's peak (device: summed over local devices).
      device_overhead_bytes: runtime and XLA working set, per device.
      host_overhead_bytes: runtime and transient I/O copies, per process.
      n_devices: devices of one process.
      n_processes: processes (hosts).
      compute_dtype: dtype of params on device and in the param tier.
      params: parameter count of the model.
      step_read_bytes, step_write_bytes: disk bytes one process reads and writes per training step (nvme
        tiers: the forward's and, with activation checkpointing, the backward's parameter fetches; the
        optimizer's master and moments read and written; the scratch gradients written and read back; the
        new compute-dtype params written). See :meth:`io_seconds`.
      step_pass_read_bytes, step_pass_write_bytes: the forward+backward's part of them (parameter fetches,
        scratch gradients written); the rest is the optimizer step's. See :meth:`step_seconds`.
      step_flops: floating-point operations one process computes per step (its share of the batch): matrix
        products and convolutions of the forward, three times (forward and backward), four with activation
        checkpointing (the forward again in the backward).
      engine: the engine these tiers run (``"compiled"`` or ``"streamed"``, see ``ZeroConfig.engine``). The
        device figures follow the streamed schedule (units gathered ``prefetch_depth`` ahead); a compiled
        engine's program reports its own: ``engine.lower(batch).compile().memory_analysis()``.
      platform: ``"cpu"``, ``"gpu"`` or ``"tpu"``: on ``"cpu"`` the devices also move the tiers' bytes.
      host_plan: the engine's host buffers planned against ``config.host_memory_limit``
        (:mod:`zinf_jax.plan.host_memory`), the process's own memory taken as the runtime overhead; the engine
        plans the same items from its layouts and its measured memory.
      step_host_bytes: the step's working set in host RAM that the plan leaves to the limit's headroom: on a
        CPU mesh the devices' saved activations and XLA working set (0 on an accelerator).
      host_pinned_bytes: the part of the host bytes the compiled step keeps in pinned host memory (a GPU
        runtime's pinned pool: :mod:`zinf_jax.plan.pinned`); the rest of ``host_bytes`` is pageable.
      optimizer_in_program: the compiled step runs the optimizer's update (as the engine decides:
        :func:`zinf_jax.optim.fused.update_in_program`).
      refusal: why :func:`zinf_jax.initialize` refuses this configuration (the message of its ``ConfigError``),
        else ``None``; a refused configuration never fits.
      experts_whole: one line per stack of experts that every device gathers whole (its model names an expert
        axis the partition cannot keep: :func:`~zinf_jax.plan.partition.experts_gathered_whole`), with its
        bytes per device and one expert's.
    """

    param_tier: str
    optimizer_tier: str
    device_bytes: int
    device_bytes_local: int
    host_bytes: int
    nvme_bytes: int
    breakdown: Mapping[str, int]
    device_overhead_bytes: int
    host_overhead_bytes: int
    n_devices: int
    n_processes: int
    compute_dtype: str
    params: int
    engine: str = "streamed"
    step_read_bytes: int = 0
    step_write_bytes: int = 0
    step_pass_read_bytes: int = 0
    step_pass_write_bytes: int = 0
    step_flops: int = 0
    platform: str = "gpu"
    host_plan: HostPlan | None = None
    host_pinned_bytes: int = 0
    step_host_bytes: int = 0
    optimizer_in_program: bool = False
    refusal: str | None = None
    experts_whole: tuple[str, ...] = ()

    @property
    def planned_host_bytes(self) -> int:
        """Host RAM of one process at the step's peak: the host plan's total and the step's working set."""
        return (self.host_plan.total if self.host_plan else 0) + self.step_host_bytes

    def fits_host_limit(self) -> bool | None:
        """Whether :attr:`planned_host_bytes` fits ``host_memory_limit`` (None: no limit given)."""
        if self.host_plan is None or self.host_plan.limit is None:
            return None
        return self.host_plan.fits and self.planned_host_bytes <= self.host_plan.limit

    def io_seconds(self, read_gbps: float, write_gbps: float | None = None) -> float:
        """Seconds a training step's disk traffic of one process needs at these bandwidths (GB/s, 1e9 B).

        The bound a step cannot beat when I/O does not overlap itself: ``step_read_bytes`` at
        ``read_gbps`` plus ``step_write_bytes`` at ``write_gbps`` (default: ``read_gbps``).
        """
        if read_gbps <= 0 or (write_gbps is not None and write_gbps <= 0):
            raise ValueError(f"disk bandwidth must be positive GB/s, got {read_gbps}, {write_gbps}")
        return self.step_read_bytes / (read_gbps * 1e9) + self.step_write_bytes / ((write_gbps or read_gbps) * 1e9)

    @property
    def uses_disk(self) -> bool:
        """Whether a training step reads or writes the offload disk (a tier on nvme)."""
        return bool(self.step_read_bytes or self.step_write_bytes)

    def compute_seconds(self, device_tflops: float) -> float:
        """Seconds one process's devices compute a step (``step_flops``) at ``device_tflops`` each (TFLOP/s)."""
        if device_tflops <= 0:
            raise ValueError(f"device_tflops must be positive TFLOP/s, got {device_tflops}")
        return self.step_flops / (self.n_devices * device_tflops * 1e12)

    def step_seconds(self, device_tflops: float, read_gbps: float | None = None,
                     write_gbps: float | None = None) -> dict[str, float]:
        """A training step's predicted seconds on one process, by phase.

        The forward+backward computes while it fetches parameters and writes gradients out (the engine prefetches
        ahead and writes behind), so on an accelerator it takes the longer of the two; on a CPU mesh the same
        cores compute and move those bytes (reads, checksums, copies), so it takes their sum. The optimizer step reads its state and writes
        it back through the same disk, so it takes its reads plus its writes (its arithmetic, memory-bound Adam,
        is not counted: it overlaps the I/O). Measured against this machine's steps in the README.

        Args:
          device_tflops: the compute rate one device achieves on this model (TFLOP/s: 1e12 FLOP/s), e.g. from a
            plain ``jax.jit`` step of a few of its blocks (``scripts/scale_run.py`` measures it).
          read_gbps, write_gbps: disk bandwidth of one process in GB/s (default write: ``read_gbps``); needed
            when a tier is on nvme.

        Returns:
          ``{"compute", "pass_io", "forward_backward", "optimizer_io", "step"}`` in seconds.
        """
        compute = self.compute_seconds(device_tflops)
        if read_gbps is None and self.uses_disk:
            raise ValueError(f"({self.param_tier}, {self.optimizer_tier}) reads and writes its disk each step: "
                             "give read_gbps (the disk's bandwidth in GB/s)")
        r = (read_gbps or 1.0) * 1e9
        w = (write_gbps or read_gbps or 1.0) * 1e9
        pass_io = self.step_pass_read_bytes / r + self.step_pass_write_bytes / w
        opt_io = (self.step_read_bytes - self.step_pass_read_bytes) / r + (
            self.step_write_bytes - self.step_pass_write_bytes) / w
        fb = compute + pass_io if self.platform == "cpu" else max(compute, pass_io)
        return {"compute": compute, "pass_io": pass_io, "forward_backward": fb, "optimizer_io": opt_io,
                "step": fb + opt_io}

    def required(self) -> dict[str, int]:
        """Bytes needed per tier: state plus overheads (device per device; host, nvme per process)."""
        return {"device": self.device_bytes + self.device_overhead_bytes,
                "host": self.host_bytes + self.host_overhead_bytes, "nvme": self.nvme_bytes}

    def fits_tiers(self, machine: Machine) -> dict[str, bool]:
        """Per tier, whether :meth:`required` fits ``machine``.

        Raises:
          ValueError: the machine has another device count than the estimate.
        """
        if machine.n_devices != self.n_devices:
            raise ValueError(f"estimate made for {self.n_devices} devices per process, machine has {machine.n_devices}")
        r = self.required()
        return {"device": r["device"] <= machine.gpu_bytes, "host": r["host"] <= machine.host_bytes,
                "nvme": r["nvme"] <= machine.disk_bytes}

    def fits(self, machine: Machine) -> bool:
        """Whether every tier fits ``machine`` (see :meth:`fits_tiers`) and the engine accepts the configuration."""
        return self.refusal is None and all(self.fits_tiers(machine).values())




def _estimate(d: StepDigest, config: ZeroConfig, pt: str, ot: str, platform: str) -> MemoryEstimate:
    if pt not in ("none", "cpu", "nvme") or ot not in ("none", "cpu", "nvme"):
        raise ValueError(f"configuration ({pt!r}, {ot!r}): param tier none|cpu|nvme, optimizer tier none|cpu|nvme")
    where = place(config, d.compute_dtype, param_device=pt, optimizer_device=ot)  # what the engine would open
    refusal = None
    try:  # where the update runs, as the engine decides it
        in_program = update_in_program(d.optimizer if d.optimizer is not None else choose_optimizer(None, config),
                                       config, where, compute_dtype=d.compute_dtype, largest_shard=d.largest_shard)
    except ConfigError as e:
        refusal, in_program = str(e), False
    grads_out = where.grads_out  # See [Note: scratch gradients]
    shared = where.shared_master  # See [Note: shared fp32 master]
    stream, host_fb = simulate(d, config.prefetch_depth, config.max_live_bytes, where.activations, grads_out)
    on_dev, cpu_p, cpu_o = d.store if pt == "none" else 0, d.store if pt == "cpu" else 0, d.opt if ot == "cpu" else 0
    # optimizer_update="device": a cpu tier's states move through the step's program, a window at a time on a GPU
    # (all of them at once on a TPU: [Note: states moved in the program]); an nvme tier's are all on the devices
    moved_in = in_program and ot != "none"
    window = d.opt if platform == "tpu" or ot == "nvme" else min(
        d.opt, (config.max_in_flight_bytes + config.state_bytes * d.largest_shard) * d.n_local)
    fixed = {"unit_state": d.rests, "persistent_params": d.glue,
             "optimizer_state": d.opt if ot == "none" else window if moved_in else 0}
    dev = {**stream, **fixed, "param_tier": on_dev}  # the stream's peak; the optimizer step adds nothing on device

    def per_device(items: Mapping[str, int]) -> int:
        tiers = sum(1 for k, v in items.items() if k.startswith("param_tier") and v)
        spread = sum(v for k, v in items.items() if not k.startswith("param_tier"))
        return -(-spread // d.n_local) + tiers * (-(-d.store_sharded // d.n_idx) + d.store - d.store_sharded)

    # float32 master, m, v (and the gradient read back); bf16 moments add their narrow staging buffers
    # (none but the whole-tensor parameters' where the state is updated in place: [Note: updates in place])
    per_set = max(buffer_set_bytes(config, where, d.packs, d.max_chunk), d.whole.set_bytes)
    sets = buffer_sets(config, where, d.groups, d.whole)
    # moved in: an nvme tier's read-ahead; a cpu tier's new states, put in host memory by the program beside the old
    buffers = ((min(d.opt, MOVE_IN_AHEAD) if ot == "nvme" else d.opt) if moved_in
               else min(config.offload_optimizer.buffer_count, sets) * per_set + d.assembly + d.whole.gather_bytes)
    if grads_out:  # the small shards stay in RAM as the backward produces them
        host_fb = {**host_fb, "grad_sink": host_fb.get("grad_sink", 0) + d.grad_ram}
    host = max([{**host_fb, "param_tier": cpu_p, "optimizer_state": cpu_o},
                {"grad_sink": d.grad_ram if grads_out else d.grad, "optimizer_buffers": buffers, "param_tier": cpu_p,
                 "optimizer_state": cpu_o}],
               key=lambda x: sum(x.values()))
    param_disk = d.store_disk - (d.store_disk_trained if shared else 0)
    nvme = {"param_tier": where.params.update.slots * param_disk + d.param_meta if pt == "nvme" else 0,
            "optimizer_state": (where.optimizer.update.slots * d.opt_disk + 3 * d.param_meta  # 3 keys a param
                                if ot == "nvme" else 0),
            "gradients": d.grad_disk if grads_out else 0}
    breakdown = {f"{t}.{k}": int(v) for t, items in (("device", dev), ("host", host), ("nvme", nvme))
                 for k, v in items.items() if v}
    (read, write), (pass_read, pass_write) = step_io(d, config, pt, ot, grads_out, shared)
    flops = d.forward_flops * (4 if config.activation_checkpointing else 3) // d.n_processes
    # transient host copies: nvme param reads before their device copy, tensorstore's copies of optimizer writes
    staging = (pt == "nvme") * (1 + config.prefetch_depth) * max(d.unit_held, default=0) + (ot == "nvme") * buffers
    sizes = HostSizes(unit_held=d.unit_held, unit_gathered=d.unit_gathered, params_on_nvme=pt == "nvme",
                      device_is_host=platform == "cpu",
                      buffer_set=per_set, sets=sets, assembly=d.assembly + d.whole.gather_bytes,
                      optimizer_on_nvme=ot == "nvme",
                      grad_ram=d.grad_ram if grads_out else d.grad,
                      grad_unit=max(d.unit_grad, default=0) if grads_out else 0, resident_tiers=cpu_p + cpu_o)
    host_plan = plan_host(sizes, runtime=RUNTIME_OVERHEAD.get(platform, RUNTIME_OVERHEAD["gpu"])[1],
                          prefetch_depth=config.prefetch_depth, buffer_count=config.offload_optimizer.buffer_count,
                          limit=config.host_memory_limit, max_live_bytes=config.max_live_bytes)
    step_host = (dev.get("activations", 0) + d.workspace * d.n_local) if platform == "cpu" else 0
    item = jnp.dtype(d.compute_dtype).itemsize
    pinned = plan_pinned(params_bytes=cpu_p, trained_params_bytes=d.grad * item // 4, gradient_bytes=d.grad,
                         param_tier=pt, grads_to_host=ot != "none" and not moved_in, compiled=where.engine == "compiled",
                         moved_state_bytes=d.opt if moved_in and ot == "cpu" else 0)
    return MemoryEstimate(
        param_tier=pt, optimizer_tier=ot, device_bytes=per_device(dev), device_bytes_local=sum(dev.values()),
        host_bytes=sum(host.values()), nvme_bytes=sum(nvme.values()), breakdown=breakdown,
        device_overhead_bytes=RUNTIME_OVERHEAD.get(platform, RUNTIME_OVERHEAD["gpu"])[0] + d.workspace,
        host_overhead_bytes=RUNTIME_OVERHEAD.get(platform, RUNTIME_OVERHEAD["gpu"])[1] + staging,
        n_devices=d.n_local, n_processes=d.n_processes, compute_dtype=d.compute_dtype, params=d.params,
        engine=where.engine, step_read_bytes=read, step_write_bytes=write, step_pass_read_bytes=pass_read,
        step_pass_write_bytes=pass_write, step_flops=flops, platform=platform, host_plan=host_plan,
        step_host_bytes=step_host, host_pinned_bytes=pinned.total, optimizer_in_program=in_program, refusal=refusal)


def estimate_from_sizes(
    params: int | None, layers: int, hidden: int, vocab: int, seq: int, batch: int, *, n_devices: int,
    config: ZeroConfig | None = None, n_processes: int = 1, heads: int | None = None, platform: str | None = None,
    configurations: Iterable[tuple[str, str]] = CONFIGURATIONS,
) -> list[MemoryEstimate]:
    """Estimates a GPT from its sizes, for each configuration.

    Assumes blocks of ``12 hidden^2 + 13 hidden`` params and a ``vocab x hidden`` embedding
    tied to the head (more params: an untied head unit); one checkpoint per unit call.

    Args:
      params: total parameter count (``None``: from the sizes).
      layers, hidden, vocab, seq, batch: the GPT and the global batch (sequences x tokens).
      n_devices: devices of the whole job, spread evenly over ``n_processes`` hosts.
      config: depth, sub-group size, buffer count, dtypes (default ``ZeroConfig()``).
      n_processes: hosts; host and nvme figures are per host.
      heads: attention heads, for the working-set guess (default ``hidden // 64``).
      platform: ``"cpu"``/``"gpu"``/``"tpu"`` (default: JAX's): compute dtype, runtime overhead.
      configurations: ``(param tier, optimizer tier)`` pairs (default: all six).

    Raises:
      ValueError: sizes that do not make a model.
    """
    config = config or ZeroConfig()
    _warn_unmodelled(config)
    platform = (platform or jax.default_backend()).lower()
    cd = config.resolved_compute_dtype(platform)
    c, h, n_local, P = jnp.dtype(cd).itemsize, hidden, n_devices // n_processes, n_processes
    block, embed, glue_el = 12 * h * h + 13 * h, vocab * h, 2 * h
    params = layers * block + embed + glue_el if params is None else int(params)
    if min(layers, hidden, vocab, seq, batch, n_local) < 1 or params < embed + glue_el + layers:
        raise ValueError(f"sizes do not make a model: params={params}, layers={layers}, hidden={hidden}, vocab={vocab}")
    block = min(block, (params - embed - glue_el) // layers)
    head = params - layers * block - embed - glue_el
    untied = head > config.persistence_threshold
    units = [embed] + [block] * layers + ([head] if untied else [])
    glue_el += 0 if untied else head
    act = batch * seq * h * c // P
    calls = [(0, batch * seq * 4 // P)] + [(1 + i, act) for i in range(layers)] + [(layers + 1 if untied else 0, act)]
    shard = max(4 * h * h, embed) // n_devices
    tensors = [3 * h * h, h * h, 4 * h * h, 4 * h * h, 3 * h, h, 4 * h, h, h, h, h, h] * layers + [embed, h, h]
    tensors += [head] if untied else []

    def pad(itemsize: int) -> int:
        """The page padding of one process's packed shards of every tensor (see ``_on_disk``)."""
        out = 0
        for t in tensors:
            n, count = (-(-t // n_devices), n_local) if t > config.persistence_threshold else (t, 1)
            out += count * (_on_disk((n,), itemsize, config.aio.chunk_bytes) - n * itemsize)
        return out
    store_pad = pad(c)
    thr = config.persistence_threshold  # the gradient shards a step keeps in RAM (grads_out), bounded:
    grad_ram = ram_bytes(sum(4 * t // P if t > thr else 4 * t for t in tensors
                             if stays_in_ram(-(-t // n_devices) if t > thr else t)))
    grad_out = params * 4 // P - grad_ram if params * 4 // P - grad_ram >= 4 * len(tensors) else 0  # not rounding
    chunk = sub_groups(shard, config.sub_group_size)[0]
    a = heads or max(1, h // 64)  # per-layer activations (Korthikanti et al. 2022) + logits, log-softmax, grad
    workspace = (seq * batch * h * (34 + 5 * a * seq / h) * c / 2 + batch * seq * vocab * (c + 8)) / n_devices
    d = StepDigest(
        n_local=n_local, n_idx=n_local, n_processes=P, compute_dtype=cd, params=params,
        unit_held=tuple(u * c // P for u in units), unit_gathered=tuple(u * c * n_local for u in units),
        unit_kept=(embed <= config.persistence_threshold,) + (4 * h * h <= config.persistence_threshold,) * layers
        + (False,) * untied,
        unit_grad=tuple(u * 4 // P for u in units), calls=tuple(calls), rests=0, glue=glue_el * c * n_local,
        store=params * c // P, store_sharded=(params - glue_el) * c // P,
        store_disk=params * c // P + store_pad, store_disk_trained=params * c // P + store_pad,
        store_io_trained=params * c // P,
        grad=params * 4 // P, opt=config.state_bytes * params // P,
        opt_disk=config.state_bytes * params // P + pad(4) + 2 * pad(config.moment_bytes),
        opt_io=config.state_bytes * params // P,
        grad_ram=grad_ram, grad_disk=grad_out and grad_out + (12 * layers + 3 + untied) * _KEY_METADATA_BYTES,
        grad_io=grad_out,
        **_pool(config, [(shard, max(1, (params // P) // max(shard, 1)))]),
        assembly=4 * shard if shard > chunk else 0, largest_shard=shard,
        param_meta=(12 * layers + 3 + untied) * _KEY_METADATA_BYTES, workspace=int(workspace),
        forward_flops=2 * batch * seq * (layers * block + 2 * layers * seq * h + vocab * h))  # + QK^T and AV
    return [_estimate(d, config, pt, ot, platform) for pt, ot in configurations]


def _pool(config: ZeroConfig, shards: list[tuple[int, int]], extra: int = 0) -> dict[str, Any]:
    """The optimizer's buffer-set geometry for ``(elements, count)`` shards (the driver's packs included), and
    ``extra`` more units of work (whole-tensor parameters)."""
    groups, size, packs = pool_geometry(shards, config.sub_group_size, PACK_BELOW, PACK_ELEMENTS)
    return {"groups": max(groups + extra, 1), "max_chunk": size, "packs": packs}


def _warn_unmodelled(config: ZeroConfig) -> None:
    if not config.activation_checkpointing:
        warnings.warn("zinf_jax estimate: device activations are modelled with activation checkpointing (unit "
                      "inputs only); with activation_checkpointing=False every activation a unit's backward needs "
                      "is kept, so device bytes are underestimated", UserWarning, stacklevel=3)


def _padded(shape: Sequence[int], itemsize: int, chunk_bytes: int) -> int:
    """Bytes of the zarr chunk files of one shard (edge chunks are stored whole): what reading or writing it
    moves (a packed shard is smaller than one chunk: its own bytes). ``chunk_bytes``: the tier's
    (``config.aio.chunk_bytes``, as the engine opens it)."""
    chunk = chunk_shape(shape, itemsize, chunk_bytes)
    return itemsize * math.prod(-(-s // k) * k for s, k in zip(shape, chunk))


def _on_disk(shape: Sequence[int], itemsize: int, chunk_bytes: int) -> int:
    """Bytes one shard takes on disk: a packed one starts on a page of its pack file."""
    nbytes = itemsize * math.prod(shape)
    return packed_nbytes(nbytes) if nbytes < PACK_BELOW_BYTES else _padded(shape, itemsize, chunk_bytes)


def estimate_from_model(
    model: Callable[[], Any] | Any, *, config: ZeroConfig | None = None, mesh: Any = None, batch: int | None = None,
    seq: int | None = None, init_args: tuple = (), init_kwargs: Mapping[str, Any] | None = None,
    loss_fn: Callable | None = None, example_batch: Any = None, unit_policy: Any = None,
    configurations: Iterable[tuple[str, str]] = CONFIGURATIONS, trainable: Any = None, optimizer: Any = None,
) -> list[MemoryEstimate]:
    """Estimates a Flax model from its real units and layouts, for each configuration.

    Nothing is initialised: one ``jax.eval_shape`` of the loss finds the unit calls and inputs.

    Args:
      model: an NNX constructor or a Linen module, as for :func:`zinf_jax.initialize`.
      config: persistence threshold, prefetch depth, sub-groups, dtypes (default ``ZeroConfig()``).
      mesh: the mesh (default :func:`zinf_jax.make_mesh`).
      batch, seq: the global batch: NNX models get int32 tokens ``(batch, seq)``;
        Linen modules get ``init_args`` with the leading dimension set to ``batch``.
      init_args, init_kwargs: Linen only: the arguments of ``module.init``.
      loss_fn: as given to ``initialize`` (default: call the model on the batch).
      example_batch: the global batch for ``loss_fn`` (arrays or ShapeDtypeStructs).
      unit_policy: as for ``initialize``.
      configurations: ``(param tier, optimizer tier)`` pairs (default: all six).
      trainable: as for ``initialize``: frozen parameters get no gradient,
        master copy or optimizer state (default: all trained).
      optimizer: as for ``initialize``: an optax transform that updates some parameters whole tensor by tensor
        makes the host update's buffer sets as large as the largest of them (default: zinf's Adam, chunk by
        chunk). The state's bytes are Adam's either way.

    Raises:
      ValueError: no batch given.
    """
    config, mesh, policy = config or ZeroConfig(), mesh or make_mesh(), unit_policy or UnitPolicy()
    _warn_unmodelled(config)
    linen = isinstance(model, nn.Module)
    adapter = make_adapter(model, policy=policy, threshold=config.persistence_threshold, seed=config.seed,
                           persistent=config.persistent_params,
                           init_args=init_args, init_kwargs=init_kwargs)
    if example_batch is None:
        if batch is None or (seq is None and not linen):
            raise ValueError("estimate_from_model needs example_batch, or batch (and seq for NNX models)")
        example_batch = (tuple(jax.ShapeDtypeStruct((batch, *jnp.shape(x)[1:]), jnp.result_type(x)) for x in init_args)
                         if linen else jax.ShapeDtypeStruct((batch, seq), jnp.int32))
    loss_fn = loss_fn or ((lambda m, b: m(*b)) if linen else (lambda m, b: m(b)))
    example = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), example_batch)  # global
    layouts = plan_partition(adapter.abstract_params, mesh, config.persistence_threshold, adapter.layout_hints,
                             config.zero_axes, persistent_paths(adapter.abstract_params, config.persistent_params))
    trained = trainable_paths(adapter, trainable)
    cd = config.resolved_compute_dtype(platform := mesh.devices.flat[0].platform)
    dtype_of = {p: cd if jnp.issubdtype(jnp.dtype(lay.dtype), jnp.floating) else lay.dtype
                for p, lay in layouts.items()}.__getitem__
    devices = local_shard_devices(mesh, config.zero_axes)
    n_local, n_idx, P = sum(len(v) for v in devices.values()), len(devices), jax.process_count()
    shards = {p: 1 if lay.dim is None else n_idx for p, lay in layouts.items()}  # stored by this process
    item = {p: jnp.dtype(dtype_of(p)).itemsize for p in layouts}
    numel = {p: math.prod(lay.shard_shape) for p, lay in layouts.items()}
    local = {p: numel[p] * shards[p] for p in layouts}  # elements this process stores
    chunk, n_chunks = {}, {}
    for p in layouts:
        chunk[p], n_chunks[p] = sub_groups(numel[p], config.sub_group_size)
    layers = [layer_count([layouts[p].shape for p in u.param_paths]) for u in adapter.units]
    calls, rests, out, flops = trace_calls(adapter, dtype_of, layouts, loss_fn, example, layers)
    whole = _whole_sets(optimizer, config, {p: layouts[p] for p in trained}, shards, P)
    on_disk = functools.partial(_on_disk, chunk_bytes=config.aio.chunk_bytes)
    padded = functools.partial(_padded, chunk_bytes=config.aio.chunk_bytes)
    def unit(f: Callable[[str], int]) -> tuple[int, ...]:  # per unit, then per layer of the stacks (trace_calls)
        whole = tuple(sum(f(p) for p in u.param_paths) for u in adapter.units)
        return whole + tuple(v // n for v, n in zip(whole, layers) if n for _ in range(n))

    d = StepDigest(
        n_local=n_local, n_idx=n_idx, n_processes=P, compute_dtype=cd, params=sum(x.size for x in layouts.values()),
        unit_held=unit(lambda p: layouts[p].bytes_per_device(dtype_of(p)) * n_local),
        unit_gathered=unit(lambda p: layouts[p].gathered_bytes_per_device(dtype_of(p)) * n_local),
        unit_kept=(tuple(all(layouts[p].dim is None for p in u.param_paths) for u in adapter.units)
                   + (False,) * sum(n or 0 for n in layers)),
        unit_grad=unit(lambda p: 4 * local[p] * (p in trained)),
        calls=tuple((u, b // P + r * n_local) for u, b, r in calls), rests=rests * n_local,
        glue=sum(layouts[p].gathered_bytes_per_device(dtype_of(p)) * n_local for p in adapter.glue_paths),  # gathered for the step
        store=sum(item[p] * local[p] for p in layouts),
        store_sharded=sum(item[p] * local[p] for p, lay in layouts.items() if lay.dim is not None),
        store_disk=sum(on_disk(layouts[p].shard_shape, item[p]) * shards[p] for p in layouts),
        store_disk_trained=sum(on_disk(layouts[p].shard_shape, item[p]) * shards[p] for p in trained),
        store_io_trained=sum(padded(layouts[p].shard_shape, item[p]) * shards[p] for p in trained),
        grad=sum(4 * local[p] for p in trained),
        opt=sum(config.state_bytes * n_chunks[p] * chunk[p] * shards[p] for p in trained),
        grad_ram=sum(4 * n_chunks[p] * chunk[p] * shards[p] for p in trained if stays_in_ram(numel[p])),
        grad_disk=sum(n_chunks[p] * shards[p] * on_disk((chunk[p],), 4) + _KEY_METADATA_BYTES + len(p) + 3 * shards[p]
                      for p in trained if not stays_in_ram(numel[p])),
        grad_io=sum(n_chunks[p] * shards[p] * padded((chunk[p],), 4) for p in trained if not stays_in_ram(numel[p])),
        opt_disk=sum(n_chunks[p] * shards[p] * (on_disk((chunk[p],), 4)
                                                + 2 * on_disk((chunk[p],), config.moment_bytes)) for p in trained),
        opt_io=sum(n_chunks[p] * shards[p] * (padded((chunk[p],), 4) + 2 * padded((chunk[p],), config.moment_bytes))
                   for p in trained),
        **_pool(config, [(numel[p], shards[p]) for p in trained if p not in whole.paths], extra=len(whole.paths)),
        assembly=4 * max((numel[p] for p in trained if n_chunks[p] > 1), default=0),
        param_meta=sum(_KEY_METADATA_BYTES + len(p) + 3 * shards[p] for p in layouts),
        workspace=3 * out // (P * n_local),  # the largest unit output (logits): itself, f32 copy, cotangent
        forward_flops=flops, whole=whole, largest_shard=max(numel.values(), default=0),
        optimizer=choose_optimizer(optimizer, config))
    whole_experts = tuple(experts_gathered_whole(layouts, adapter.layout_hints, cd))
    return [dataclasses.replace(_estimate(d, config, pt, ot, platform), experts_whole=whole_experts)
            for pt, ot in configurations]


def _whole_sets(optimizer: Any, config: ZeroConfig, layouts: Mapping[str, Any], shards: Mapping[str, int],
                processes: int) -> WholeSets:
    """The buffers of ``optimizer``'s whole-tensor parameters, as the engine plans them (none without one)."""
    if optimizer is None:
        return WholeSets()
    rule = rule_for(with_clipping(optimizer, config.gradient_clipping), layouts, config.sub_group_size)
    return whole_sets(rule, layouts, shards, config.sub_group_size, processes)


def estimate(model: Any = None, /, **kwargs: Any) -> list[MemoryEstimate]:
    """:func:`estimate_from_model` when a model is given, else :func:`estimate_from_sizes` (keyword sizes)."""
    return estimate_from_sizes(**kwargs) if model is None else estimate_from_model(model, **kwargs)


def fits(estimates: Iterable[MemoryEstimate], machine: Machine) -> list[MemoryEstimate]:
    """The configurations whose every tier fits ``machine``."""
    return [e for e in estimates if e.fits(machine)]


def format_host_plans(estimates: Sequence[MemoryEstimate]) -> str:
    """Per configuration, whether its host plan fits ``host_memory_limit``, the smallest limit that fits and what
    bounds it (:attr:`MemoryEstimate.host_plan`), then the plan's items."""
    lines = []
    for e in estimates:
        plan = e.host_plan
        if plan is None:
            continue
        ok = e.fits_host_limit()
        verdict = "" if ok is None else ("fits" if ok else "does not fit") + f" {human_bytes(plan.limit)}: "
        lines.append(f"({e.param_tier}, {e.optimizer_tier}) host: {verdict}{human_bytes(e.planned_host_bytes)} at "
                     f"prefetch_depth={plan.prefetch_depth}, buffer_count={plan.buffer_count} (the step's working "
                     f"set {human_bytes(e.step_host_bytes)}); smallest limit that fits "
                     f"{human_bytes(plan.minimum + e.step_host_bytes)}; bounded by: {'; '.join(plan.lowering[:3])}")
        lines += ["    " + x.strip() for x in plan.describe().splitlines()[1:]]
    return "\n".join(lines)


def format_report(estimates: Sequence[MemoryEstimate], machine: Machine | None = None,
                  disk_gbps: float | None = None, device_tflops: float | None = None) -> str:
    """A table of the bytes each configuration needs per tier, with ✓/✗ against ``machine``.

    ``disk_gbps``: also each configuration's disk traffic per step and the seconds it needs at that bandwidth.
    ``device_tflops`` (with ``disk_gbps`` when a tier is on nvme): also the predicted step time
    (:meth:`MemoryEstimate.step_seconds`).
    """
    io = ["disk I/O a step", f"I/O s @ {disk_gbps:g} GB/s"] if disk_gbps else []
    timed = ["compute s", "step s"] if device_tflops else []
    rows = [["param", "optimizer", "engine", "device (each)", "host", "nvme"] + io + timed + (["fits"] if machine else [])]
    for e in estimates:
        req, ok = e.required(), e.fits_tiers(machine) if machine else {}
        mark = lambda t: (" ✓" if ok[t] else " ✗") if machine else ""  # noqa: E731
        traffic = ([human_bytes(e.step_read_bytes + e.step_write_bytes), f"{e.io_seconds(disk_gbps):.2f}"]
                   if disk_gbps else [])
        if device_tflops:
            step = (f"{e.step_seconds(device_tflops, disk_gbps)['step']:.2f}" if disk_gbps or not e.uses_disk
                    else "needs --disk-gbps")
            traffic += [f"{e.compute_seconds(device_tflops):.2f}", step]
        rows.append([e.param_tier, e.optimizer_tier, e.engine if e.refusal is None else "refused"]
                    + [human_bytes(req[t]) + mark(t) for t in ("device", "host", "nvme")]
                    + traffic + (["✓" if e.fits(machine) else "✗"] if machine else []))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i > 2 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    e = estimates[0] if estimates else None
    lines += [f"{e.params:,} params, {e.compute_dtype}, {e.n_devices} devices x {e.n_processes} process(es); zinf "
              "state + overheads; device per device, host and nvme per process"] if e else []
    lines += [f"refused ({r.param_tier}, {r.optimizer_tier}): {r.refusal}" for r in estimates if r.refusal]
    lines += [f"experts: {line}" for line in (e.experts_whole if e else ())]
    return "\n".join(lines)
