"""The accelerators a step is compiled for without one: named GPU descriptions and TPU topologies.

XLA's GPU compiler needs no GPU when it is given a description of one (a ``GpuTargetConfigProto``: the
device's limits, core count, memory and bandwidth), and libtpu's compile-only client needs no TPU when it
is given a topology. :data:`TARGETS` names the ones the suite compiles for; :func:`target` finds one.
The GPU descriptions below hold the fields XLA's cost models read, with the values NVIDIA publishes for
the H100 SXM and the H200 (both compute capability 9.0).
"""
from __future__ import annotations

import dataclasses

__all__ = ["Target", "TARGETS", "target", "gpu_description"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    """An accelerator to compile for.

    Attributes:
      name: the short name (``"h100"``, ``"v5e"``).
      platform: ``"cuda"`` or ``"tpu"`` (what a program is lowered for).
      device_kind: the device's name as its runtime reports it.
      gpu: for a GPU, its description's fields (:func:`gpu_description`).
      tpu_topology: for a TPU, the topology name prefix (``"v5e"``): ``"v5e:2x4"`` for 8 chips.
      tpu_accelerator_type: for a TPU, what ``TPU_ACCELERATOR_TYPE`` names an 8-chip slice of it.
      pinned_host_limit_gb: the pinned host memory a process may hold by default (a GPU runtime's pool:
        ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``, 64 GB unless set), or ``None`` where no pool is capped.
    """

    name: str
    platform: str
    device_kind: str
    gpu: dict | None = None
    tpu_topology: str | None = None
    tpu_accelerator_type: str | None = None
    pinned_host_limit_gb: float | None = None


def _hopper(name: str, memory: int, bandwidth: int, mem_clock_khz: int) -> dict:
    return {
        "threads_per_block_limit": 1024, "threads_per_warp": 32, "shared_memory_per_block": 49152,
        "shared_memory_per_core": 233472, "threads_per_core_limit": 2048, "core_count": 132, "fpus_per_core": 128,
        "block_dim_limit_x": 2147483647, "block_dim_limit_y": 65535, "block_dim_limit_z": 65535,
        "memory_bandwidth": bandwidth, "l2_cache_size": 52428800, "clock_rate_ghz": 1.98,
        "device_memory_size": memory, "shared_memory_per_block_optin": 232448,
        "registers_per_core_limit": 65536, "registers_per_block_limit": 65536,
        "name": name, "model_str": f"sm_9.0 with {memory}B RAM, 132 cores, 1980000KHz clock, {mem_clock_khz}KHz mem clock",
        "pcie_bandwidth": 34359738368, "compute_capability": (9, 0),
    }


TARGETS: tuple[Target, ...] = (
    Target(name="h100", platform="cuda", device_kind="NVIDIA H100 80GB HBM3", pinned_host_limit_gb=64.0,
           gpu=_hopper("NVIDIA H100 80GB HBM3", 84942979072, 3352320000000, 2619000)),
    Target(name="h200", platform="cuda", device_kind="NVIDIA H200 141GB HBM3e", pinned_host_limit_gb=64.0,
           gpu=_hopper("NVIDIA H200 141GB HBM3e", 151397597184, 4800000000000, 3750000)),
    Target(name="v5e", platform="tpu", device_kind="TPU v5 lite", tpu_topology="v5e",
           tpu_accelerator_type="v5litepod-8"),
    Target(name="v6e", platform="tpu", device_kind="TPU v6 lite", tpu_topology="v6e",
           tpu_accelerator_type="v6e-8"),
)
"""The targets :mod:`zinf_jax.xla.deviceless` compiles for: two GPUs (XLA's CUDA compiler) and two TPUs (libtpu)."""


def target(name: str) -> Target:
    """The target called ``name``.

    Raises:
      ValueError: no such target; the message lists the names.
    """
    for t in TARGETS:
        if t.name == name:
            return t
    raise ValueError(f"no compile target {name!r}; the targets are {', '.join(t.name for t in TARGETS)}")


def gpu_description(t: Target) -> str:
    """A GPU target's ``GpuTargetConfigProto`` in text format (what XLA's deviceless GPU compiler reads)."""
    if t.gpu is None:
        raise ValueError(f"{t.name} is not a GPU")
    g = dict(t.gpu)
    major, minor = g.pop("compute_capability")
    name, model, pcie = g.pop("name"), g.pop("model_str"), g.pop("pcie_bandwidth")
    lines = ["gpu_device_info {"]
    lines += [f"  {k}: {v}" for k, v in g.items()]
    lines += [f"  cuda_compute_capability {{ major: {major} minor: {minor} }}",
              '  device_vendor: "NVIDIA Corporation"', f'  model_str: "{model}"', f'  name: "{name}"',
              f"  pcie_bandwidth: {pcie}", "}", 'platform_name: "CUDA"',
              "dnn_version_info { major: 9 minor: 10 patch: 0 }", f'device_description_str: "{name}"']
    return "\n".join(lines) + "\n"
