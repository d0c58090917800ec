"""The ``zinf-jax`` command and its main job: an application on top of the library.

* :mod:`~zinf_jax.app.cli`: ``zinf-jax train | estimate | inspect``; parses flags, maps errors to exit codes.
  Signals become a stop request at a safe point through the library's
  :class:`zinf_jax.distributed.StopAgreement` (installed before JAX loads: this package imports nothing heavy
  at the top).
* :mod:`~zinf_jax.app.job`: the main job as one process of a multi-process job (joined, watched and left through
  :mod:`zinf_jax.distributed`).
* :mod:`~zinf_jax.app.train`: the main job's loop: build or resume, train, save, report.
* :mod:`~zinf_jax.app.checks`: every flag checked before anything is built.
* :mod:`~zinf_jax.app.settings`: the flags, or a config file (zinf, DeepSpeed, accelerate) with the flags given
  explicitly on top; the resolution ``train`` prints, each setting with its source.
* :mod:`~zinf_jax.app.rundir`: the run directory: lock, reuse refusal, leftovers of killed saves.
* :mod:`~zinf_jax.app.progress`: the live progress line.
* :mod:`~zinf_jax.app.inspect`: what a checkpoint or an nvme tier holds, as text.
* :mod:`~zinf_jax.app.models`: the demo GPT and its corpus (also importable as ``zinf_jax.models``).

The library never imports this package (a layering test in the suite enforces it), except the
``zinf_jax.models`` re-export kept for its old import path.
"""
