"""What XLA's accelerator compilers make of a program, read on a machine without the accelerator.

Read in data-flow order:

* :mod:`~zinf_jax.xla.targets`: the accelerators to compile for (GPU descriptions, TPU topologies).
* :mod:`~zinf_jax.xla.deviceless`: a lowered program compiled for a target in a child process
  (:mod:`~zinf_jax.xla.worker`), under a time limit, its warnings kept.
* :mod:`~zinf_jax.xla.hlo`: the compiled program read: bytes moved between host and device memory per step,
  which moves overlap compute, host compute, the types of its cross-device reductions.

Nothing here knows the engine: the engine's programs come in as ``jax.stages.Lowered`` objects.
"""
from zinf_jax.xla.deviceless import CompiledProgram, available, compile_programs
from zinf_jax.xla.targets import TARGETS, Target, target

__all__ = ["CompiledProgram", "available", "compile_programs", "TARGETS", "Target", "target"]
