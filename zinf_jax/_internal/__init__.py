"""Helpers every layer may use, none of them zinf-specific: the bottom of the import graph.

* :mod:`~zinf_jax._internal.jax_private`: the only module that touches ``jax._src`` (fenced, with
  the JAX versions it was checked against); everything else imports JAX's public API only.
* :mod:`~zinf_jax._internal.fs`: durable files: fsync of a file or a directory, atomic JSON writes.
* :mod:`~zinf_jax._internal.futures`: resolved futures, "all of these", waiting on a list.
* :mod:`~zinf_jax._internal.multihost`: the job's processes: barriers, gathers, sums across processes.
* :mod:`~zinf_jax._internal.fmt`: bytes for people (one formatter for logs, reports and the CLI).

Not public API: names here may change without notice.
"""
