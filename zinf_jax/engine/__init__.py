"""Hooks and executors: a Flax model run unit by unit over parameters that live in tiers.

The modules, in data-flow order:

* wrapping the model: :mod:`~zinf_jax.engine.adapters` (the ``Adapter``/``Hook`` protocols),
  :mod:`~zinf_jax.engine.nnx_adapter`, :mod:`~zinf_jax.engine.linen_adapter`, and
  :mod:`~zinf_jax.engine.wrap` (which adapter for which model, which params are trained);
* creating the parameters: :mod:`~zinf_jax.engine.pretrained` (values given by the user),
  :mod:`~zinf_jax.engine.init` (unit by unit, sharded, never the whole model in RAM);
* holding them: :mod:`~zinf_jax.engine.store` (params in a tier, compute dtype, stored form),
  :mod:`~zinf_jax.engine.prefetch` (the next units' reads in flight);
* running units: :mod:`~zinf_jax.engine.programs` (one compiled program per unit signature),
  :mod:`~zinf_jax.engine.glue` (the loss traced once, cut at unit calls into compiled segments),
  :mod:`~zinf_jax.engine.streamed` (the hooks: fetch, run, release; backward: fetch, recompute,
  vjp), :mod:`~zinf_jax.engine.tape` (the training pass's reverse walk over the traced loss, calling
  those hooks), :mod:`~zinf_jax.engine.compiled` (the same traced loss as one XLA program
  per step; :mod:`~zinf_jax.engine.runs` finds the runs of alike unit calls it scans,
  :mod:`~zinf_jax.engine.arguments` hands it the stored shards as arguments, one per path or stacked
  per run, :mod:`~zinf_jax.engine.staging` moves and gathers them inside it with the gradients formed
  in device memory, and :mod:`~zinf_jax.engine.hostcheck` reads its GPU or TPU lowering for compute
  on host-memory values),
  :mod:`~zinf_jax.engine.grads` (gradients reduce-scattered to a sink; freed host pages returned
  after a large unit's call by :mod:`zinf_jax._internal.native_memory`);
* stepping: :mod:`~zinf_jax.engine.batching` (a batch on the mesh, micro-batches),
  :mod:`~zinf_jax.engine.overlap` (the write gate), :mod:`~zinf_jax.engine.lifecycle`
  (ready / looping / closed), :mod:`~zinf_jax.engine.build` (everything wired once into
  ``Components``), :mod:`~zinf_jax.engine.stepping` (``train_step`` and ``train_steps``).

[Note: two engines]
There are two ways to run the passes, chosen once per engine by
:attr:`~zinf_jax.plan.placement.Placement.engine` (``ZeroConfig.engine``; ``"auto"``: compiled unless
the params are on nvme or activations are offloaded). Both start from the same traced loss
(:class:`~zinf_jax.engine.glue.TraceCache`, unit calls as ``zinf_unit_call`` equations) and hand
their gradients to the same :class:`~zinf_jax.engine.grads.GradSink`, so the optimizer, the commit,
the checkpoints (one format: a checkpoint saved by one restores into the other) and
:class:`~zinf_jax.engine.stepping.Stepper` do not know which ran. The *compiled* engine
(:mod:`~zinf_jax.engine.compiled`) turns the trace into one jitted function of every unit's stored
shards: each unit call stages its shards to device memory and gathers them inside the program,
under ``jax.checkpoint`` at the unit boundary; a run of alike unit calls (a transformer's blocks) is
one ``lax.scan`` over their stacked shards, so the program's size and device memory do not grow
with depth ([Note: scanned runs]); XLA schedules the whole step. With params and optimizer state
both in device memory (and zinf's Adam), the optimizer step is part of that program too
(:mod:`zinf_jax.optim.fused`: the sink then stays empty, and the stepper's optimizer step only
reports what the program applied). The *streamed* engine
(:mod:`~zinf_jax.engine.streamed`) interprets it eagerly, because a parameter on nvme must be read
between two unit programs. The parts below ``Components`` receive one of them as ``passes``.

Design: the streamed engine is an eager interpreter. Each unit call of the wrapped model is a hook
run outside ``jit`` on concrete arrays, in call order (forward) and reverse call order (backward),
so it may do I/O between unit programs. The reverse walk is the engine's own
(:class:`~zinf_jax.engine.tape.Tape`: each glue segment's vjp compiled, the unit hooks called in
turn), computing what an outer ``jax.vjp`` over a ``jax.custom_vjp`` per unit call would (the
design's first form, whose per-call tracing cost ~45 ms of a 300 ms small-model step). The unit
order is known after one abstract trace (a static plan, not a recording). The parts receive one
frozen ``Components`` object, never the public ``Engine`` (:mod:`zinf_jax.api`), which only
delegates to them.

[Note: write gate]
``engine.train_steps`` runs step N's optimizer on a worker thread while step N+1's forward goes on.
The optimizer updates parameters in the next forward's order (glue first, then units in call
order); every fetch of a unit waits on :class:`~zinf_jax.engine.overlap.WriteGate` until all of
that unit's new values are written (and the norm all-reduce, a collective, is done), and the next
backward waits until the optimizer has read every gradient. So each number equals sequential
``train_step`` calls, bitwise. Enforced in ``stepping`` and ``streamed`` where cited by name.
"""
