"""What goes where, as plain data decided before any parameter exists.

Read in data-flow order:

* :mod:`~zinf_jax.plan.units`: which submodules are *units* (gathered and released together):
  :class:`UnitPolicy` picks them, :class:`Plan` is the call order one abstract trace finds.
* :mod:`~zinf_jax.plan.partition`: the mesh (:func:`make_mesh`) and the ZeRO-3 rule per parameter
  (:class:`ParamLayout`: sharded along a dimension, flat-padded, or persistent), which process
  owns which shard, and assembling global arrays from shards.
* :mod:`~zinf_jax.plan.placement`: which tier holds params, optimizer state and gradients, how an
  nvme tier applies a step (:class:`UpdateMode`), and the shared fp32 master. The engine opens
  what it says; the estimator (:mod:`zinf_jax.estimate`) counts what it says.

Nothing here touches a tier or runs a model; the engine and the estimator both start from here.
"""
