"""Multi-process jobs in your own training loop: join with lost-peer detection, stop together on a signal.

* :mod:`~zinf_jax.distributed.join`: :func:`initialize` (``jax.distributed`` in JAX's recoverable mode,
  plus the peer watch) and the :class:`Job` it returns (leaves the job in order);
* :mod:`~zinf_jax.distributed.peers`: :class:`PeerWatch`, the thread that ends this process with one
  line naming a lost peer and the last complete checkpoint (:data:`EXIT_PEER_LOST`);
* :mod:`~zinf_jax.distributed.stop`: :class:`StopAgreement`, SIGTERM/SIGINT/SIGHUP on any one process
  turned into one step at which every process stops (JAX's preemption service).

Nothing here loads JAX at import: a program may install the signal handlers before JAX starts.
"""
from zinf_jax.distributed.join import Job, current, initialize
from zinf_jax.distributed.peers import EXIT_PEER_LOST, RESTART, PeerWatch, enable_recovery, last_checkpoint_phrase
from zinf_jax.distributed.stop import SIGNALS, StopAgreement

__all__ = ["initialize", "current", "Job", "StopAgreement", "SIGNALS", "PeerWatch", "EXIT_PEER_LOST", "RESTART",
           "enable_recovery", "last_checkpoint_phrase"]
