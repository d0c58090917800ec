"""The public training API: :func:`initialize` and :class:`Engine`.

``initialize`` plans the partition, opens the param and optimizer tiers (and,
with the optimizer on nvme, a scratch tier the gradients go to as they are
produced), creates the parameters unit by unit (:func:`restore` fills them from
a checkpoint instead), and returns an :class:`Engine` whose ``train_step`` runs
the streamed forward/backward and the streamed CPU optimizer step, then commits
the tiers (atomically, or in place with a half-updated mark; see
:mod:`zinf_jax.tiers.nvme`).
"""
from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh

from zinf_jax.checkpoint import TrainingState, latest_step_dir, restore_into, save
from zinf_jax.checkpoint.export import save_safetensors
from zinf_jax.checkpoint.owner import Owner
from zinf_jax.config import ZeroConfig
from zinf_jax.engine.adapters import model_sharding_explained
from zinf_jax.engine.batching import check_batch, micro_batches, shard_batch
from zinf_jax.engine.build import Components, build, close_quietly
from zinf_jax.engine.opt_state import optimizer_state, rule_of
from zinf_jax.engine.stepping import Loss, Stepper
from zinf_jax.engine.summary import advice, describe
from zinf_jax.engine.streamed import ParamLoss
from zinf_jax.engine.wrap import make_adapter
from zinf_jax.errors import EngineError
from zinf_jax.optim.choose import choose_optimizer
from zinf_jax.plan.partition import make_mesh, no_mesh
from zinf_jax.plan.units import UnitPolicy

__all__ = ["initialize", "restore", "Engine", "EngineError", "close_quietly"]

log = logging.getLogger(__name__)


class Engine:
    """A model trained with ZeRO-3 partitioning and tiered offload.

    Build it with :func:`initialize` or :func:`zinf_jax.restore`; do not call
    the constructor directly. Its parts (tiers, optimizer, store, streamed
    model) are wired once into :attr:`components`
    (:class:`~zinf_jax.engine.build.Components`) and read through the
    properties below.
    """

    def __init__(self, *, adapter: Any, config: ZeroConfig, mesh: Mesh, optimizer: Any, loss_fn: Callable,
                 has_aux: bool = False, **build_kw: Any):
        self.optimizer_spec = optimizer
        self.loss_fn, self.has_aux = loss_fn, has_aux  # the training loss (``(loss, aux)`` when has_aux)
        with no_mesh(), model_sharding_explained():
            self.components: Components = build(adapter, config=config, mesh=mesh, optimizer=optimizer, **build_kw)
        self._stepper = Stepper(self.components)
        self._owner = Owner()  # the checkpoint directories this engine saves into (zinf_jax.checkpoint.owner)
        if inert := config.inert_settings():
            warnings.warn("zinf_jax: these settings are accepted for DeepSpeed compatibility but have no effect: "
                          + ", ".join(inert), UserWarning, stacklevel=3)
        if self.mode == "compiled" and (streamed_only := _streamed_only(config, build_kw.get("track_live_arrays"))):
            warnings.warn("zinf_jax: the compiled engine runs (engine.mode == 'compiled'); these settings of the "
                          f"streamed engine have no effect: {', '.join(streamed_only)} (ZeroConfig(engine='streamed') "
                          "to use them)", UserWarning, stacklevel=3)

    adapter = property(lambda self: self.components.adapter, doc="The model's adapter (NNX or Linen).")
    config = property(lambda self: self.components.config, doc="The engine's :class:`ZeroConfig`.")
    mesh = property(lambda self: self.components.mesh, doc="The device mesh.")
    layouts = property(lambda self: self.components.layouts, doc="How each parameter is partitioned, by path.")
    trainable = property(lambda self: self.components.trainable, doc="The paths of the trained parameters.")
    compute_dtype = property(lambda self: self.components.compute_dtype, doc="The resolved compute dtype.")
    param_tier = property(lambda self: self.components.param_tier, doc="The tier of the compute-dtype params.")
    opt_tier = property(lambda self: self.components.opt_tier, doc="The tier of the master and optimizer states.")
    grad_tier = property(lambda self: self.components.grad_tier, doc="The scratch gradient tier, or None.")
    optimizer = property(lambda self: self.components.optimizer, doc="The streamed optimizer.")
    store = property(lambda self: self.components.store, doc="The parameter store over the param tier.")
    passes = property(lambda self: self.components.passes,
                      doc="The forward/backward passes (a ``CompiledModel`` or a ``StreamedModel``, see :attr:`mode`).")

    @property
    def mode(self) -> str:
        """Which engine runs the steps: ``"compiled"`` (one XLA program per step) or ``"streamed"``
        (units fetched from their tier between unit programs). See ``ZeroConfig.engine``."""
        return self.components.placement.engine

    @property
    def streamed(self) -> Any:
        """The streamed forward/backward (``mode == "streamed"`` only)."""
        if self.mode != "streamed":
            raise EngineError("engine.streamed: this engine runs the compiled engine (engine.mode == 'compiled'); "
                              "use engine.passes, or ZeroConfig(engine='streamed') for the streamed one")
        return self.components.passes
    gate = property(lambda self: self.components.gate, doc="The write gate of overlapped steps.")

    @property
    def user_state(self) -> dict[str, Any]:
        """JSON data saved with each checkpoint (a restore sets it to the checkpoint's)."""
        return self.components.user_state

    @user_state.setter
    def user_state(self, value: Mapping[str, Any]) -> None:
        self.components.user_state.clear()
        self.components.user_state.update(value)

    # --- steps ---------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Optimizer steps applied so far."""
        return self.optimizer.step_count

    def shard_batch(self, batch: Any) -> Any:
        """Places a process-local batch on the mesh, split over the data-parallel axes.

        Typed PRNG keys (``jax.random.key(step)``) are replicated, and NNX objects
        (an ``nnx.Rngs``) pass through as state.
        """
        return shard_batch(batch, self.mesh, self.components.model_mesh.model_axes)

    def train_step(self, batch: Any) -> dict[str, Any]:
        """One streamed forward/backward (per micro-batch) and one optimizer step.

        With ``config.gradient_accumulation_steps = k > 1`` the batch's leading
        axis is cut into ``k`` equal micro-batches (per process); their mean
        gradient makes one optimizer step, ``loss`` is their mean loss.

        Returns:
          ``loss``, ``grad_norm``, ``skipped``, ``loss_scale``, ``lr``, ``step``,
          ``step_time_s``, ``time_split`` (seconds: ``forward_backward_s`` of which
          ``fetch_wait_s`` waiting for parameter reads and ``grads_out_s`` writing
          gradients out, and the optimizer's ``optimizer_*`` phases: ``read_wait_s``,
          ``adam_s``, ``write_wait_s``, ``total_s``...), ``tokens_per_s`` (elements of the first batch leaf),
          ``peak_device_bytes``, ``bytes_param_tier``, ``bytes_optimizer_tier``,
          and ``aux`` when ``loss_fn`` returns one (a list of ``k`` auxes with accumulation).

        Raises:
          ValueError: the batch does not split into ``k`` micro-batches (before anything changes).
          EngineError: after :meth:`close`, under an outer ``jax.jit``/``grad``, or a
            ``loss_fn`` that returns a non-scalar: before any state changes.
        """
        self._usable("train_step", batch)
        return self._stepper.step(batch, Loss(self.loss_fn, self.has_aux))

    def train_steps(self, batches: Iterable[Any]) -> Iterator[dict[str, Any]]:
        """:meth:`train_step` over ``batches``, each step's optimizer overlapped with the next step's forward.

        While step ``N``'s optimizer runs (on a worker thread), the next batch is
        drawn and its forward starts; the optimizer writes the parameters in the
        order the forward uses them and each unit's forward waits for its own
        new values, so every number equals that of sequential ``train_step``
        calls, bitwise (see :mod:`zinf_jax.engine.overlap`).

        Yields the metrics of each step (as :meth:`train_step` returns them;
        ``step_time_s`` and ``tokens_per_s`` measured between yields) once that
        step is committed. In the loop body the engine is exactly at that step:
        ``save``, ``params``, ``eval_step`` see it, not the next batch's pending
        gradients or model state. Breaking out of the loop discards the
        gradients of the batch drawn after the last yielded step (the iterator
        has given it, it was not trained on).

        Example::

            for metrics in engine.train_steps(batch_at(data, s, 16, 64) for s in range(100)):
                print(metrics["step"], metrics["loss"])
        """
        self._usable("train_steps")
        return self._stepper.steps(batches, Loss(self.loss_fn, self.has_aux))

    def eval_step(self, batch: Any, *, loss_fn: Callable | None = None) -> Any:
        """Forward only, streamed, in evaluation mode: the loss (and aux if the loss returns one).

        NNX models run as after ``model.eval()`` (dropout off, batch-norm running
        averages used), and nothing a training step depends on changes (RNG
        counters included): training after an evaluation continues exactly as
        without it.

        Args:
          batch: a process-local batch, as for :meth:`train_step`.
          loss_fn: the loss to evaluate (default: the training loss), e.g. one
            that returns accuracy as aux. Linen modules take their mode as a call
            argument: pass a loss that calls the model with it (``train=False``).
        """
        self._usable("eval_step", batch)
        check_batch(batch)
        with self.components.model_mesh.running(), model_sharding_explained():
            batch = self.shard_batch(batch)
            glue = self.store.fetch(self.adapter.glue_paths)
            return self.passes.forward(loss_fn or self.loss_fn, batch, glue, has_aux=True)  # as the loss returns it

    def describe(self) -> str:
        """What the engine decided, in words: the engine, what is sharded and what stays whole (and why), the
        units, where each tier is and what it holds, how the optimizer runs, and a ``note:`` line for each
        choice that is probably not what you wanted (nothing sharded; one unit holding most of the model).

        :func:`initialize` and :func:`restore` log the same summary (logger ``zinf_jax``: the summary at INFO,
        each note at WARNING).
        """
        return describe(self.components)

    def lower(self, batch: Any, *, program: str = "train", platforms: Sequence[str] | None = None,
              loss_fn: Callable | None = None) -> jax.stages.Lowered:
        """A step's program for ``batch`` (compiled mode), lowered: read its HLO (``.as_text()``),
        ``.cost_analysis()``, and ``.compile().memory_analysis()``.

        Nothing changes: it is the program the engine runs for a batch of this signature.

        Args:
          batch: a process-local batch, as for :meth:`train_step`.
          program: ``"train"``: the program ``train_step`` and ``train_steps`` run (forward, backward and
            the gradients out to the optimizer; a micro-batch's with gradient accumulation; the update
            too where it runs in the program); ``"eval"``: the program of :meth:`eval_step`.
          platforms: lower for other backends, e.g. ``("cuda",)`` or ``("tpu",)``, from this machine
            (not compilable here): the program as a GPU or TPU would run it. On the CPU backend a move
            between memory kinds is a no-op; in these lowerings it is a real copy, which
            :func:`zinf_jax.check_host_compute` reads.
          loss_fn: with ``program="eval"``, the loss :meth:`eval_step` is given (default: the training loss).

        Raises:
          EngineError: the streamed engine runs (``engine.mode == "streamed"``): it has no one program.
        """
        self._one_program("lower", batch)
        with self.components.model_mesh.running(), model_sharding_explained():
            glue = self.store.fetch(self.adapter.glue_paths)
            if program == "eval":
                return self.passes.lower(loss_fn or self.loss_fn, self.shard_batch(batch), glue, has_aux=True,
                                         program="eval", platforms=platforms)
            k = self.config.gradient_accumulation_steps
            part = self.shard_batch(micro_batches(batch, k)[0])
            return self.passes.lower(self.loss_fn, part, glue, has_aux=self.has_aux,
                                     loss_scale=self.optimizer.loss_scale / k, program=program, platforms=platforms)

    def compile_for(self, target: str, batch: Any, *, program: str = "train", timeout: float = 300.0) -> Any:
        """A step's program as an accelerator's own compiler compiles it, on this machine, without the accelerator.

        The program :meth:`lower` gives for the target's platform, compiled by XLA's GPU compiler (CUDA plugin, a
        GPU description) or libtpu's compile-only client, with the XLA options the engine itself compiles with
        there, in a child process under ``timeout``. Needs that compiler's wheels at the installed jax's version
        (``scripts/setup_compilers.sh``).

        Args:
          target: ``"h100"``, ``"h200"``, ``"v5e"`` or ``"v6e"`` (:data:`zinf_jax.xla.TARGETS`).
          batch: a process-local batch, as for :meth:`train_step`.
          program: ``"train"`` or ``"eval"``, as for :meth:`lower`.
          timeout: seconds the compile may take.

        Returns:
          A :class:`zinf_jax.xla.CompiledProgram`: ``ok``/``error``, XLA's host-compute warnings, and
          ``summary`` (bytes moved per device per step, the share of a loop's moves that overlap compute,
          host compute, the types of the cross-device reductions); compare with :meth:`transfer_budget`.

        Raises:
          EngineError: the streamed engine runs (it has no one program).
          RuntimeError: the target's compiler is not installed (the message says what to install).
        """
        from zinf_jax.xla import compile_programs, target as find_target

        t = find_target(target)
        lowered = self.lower(batch, program=program, platforms=(t.platform,))
        options = self.passes.compiler_options("cuda" if t.platform == "cuda" else t.platform)
        return compile_programs([(program, lowered)], t, options=options, timeout=timeout)[0]

    def transfer_budget(self, batch: Any, *, program: str = "train") -> Any:
        """The fewest bytes the step's program moves between host and device memory per device per step
        (:class:`zinf_jax.engine.compiled.TransferBudget`): each host parameter moved in once per call, and
        again for the backward; with the optimizer on the host each trained parameter's float32 gradient moved
        out once. :meth:`compile_for`'s ``summary`` gives what the compiled program moves.

        Raises:
          EngineError: the streamed engine runs.
        """
        self._one_program("transfer_budget", batch)
        with self.components.model_mesh.running(), model_sharding_explained():
            glue = self.store.fetch(self.adapter.glue_paths)
            if program != "train":
                return self.passes.transfer_budget(self.loss_fn, self.shard_batch(batch), glue, program=program)
            part = self.shard_batch(micro_batches(batch, self.config.gradient_accumulation_steps)[0])
            return self.passes.transfer_budget(self.loss_fn, part, glue, program="train")

    def _one_program(self, what: str, batch: Any) -> None:
        self._usable(what, batch)
        if self.mode != "compiled":
            raise EngineError(f"engine.{what}(): the streamed engine runs this model (engine.mode == 'streamed'), a "
                              "program per unit with I/O between them, not one step program; the compiled engine "
                              "needs params in device or host memory (offload_param 'none' or 'cpu') and "
                              "ZeroConfig(engine='auto' or 'compiled')")

    # --- reading back -----------------------------------------------------------------
    def param_arrays(self) -> dict[str, np.ndarray]:
        """float32 master values of every parameter as full host arrays, by path.

        Frozen parameters (see ``trainable``) have no master copy: their stored
        compute-dtype values are returned, as float32.
        """
        self._usable("params")
        view = TrainingState(self.components)
        return {path: view.value(path) for path in self.layouts}

    def params(self) -> Any:
        """float32 master values in the model's own structure (``nnx.State`` or Linen params dict)."""
        return self.adapter.structure(self.param_arrays())

    def model_state(self) -> Any:
        """The model's non-parameter state (NNX: RNG keys and counts, ``BatchStat``; Linen: ``batch_stats``
        and other kept collections), as host arrays in the model's own structure."""
        self._usable("model_state")
        host = jax.tree.map(lambda x: x if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else np.asarray(x),
                            self.passes.state)
        return self.adapter.model_state(host)

    # --- the optimizer, as optax users read and set it ------------------------------------
    @property
    def hyperparams(self) -> dict[str, float]:
        """The optimizer's ``optax.inject_hyperparams`` hyperparameters by name (``{"learning_rate": 0.001, ...}``).
        See :mod:`zinf_jax.engine.opt_state`."""
        self._usable("hyperparams")
        return rule_of(self.components, "hyperparams").hyperparams()

    def set_hyperparams(self, **values: float) -> None:
        """Sets ``optax.inject_hyperparams`` hyperparameters (``engine.set_hyperparams(learning_rate=1e-4)``); they
        take effect at the next step, in every placement, and are saved with checkpoints (the plain-optax
        ``opt_state.hyperparams['learning_rate'] = x``).

        Raises:
          ConfigError: the optimizer injects no such hyperparameter, it follows a schedule, or the optimizer is
            zinf's own Adam.
        """
        self._usable("set_hyperparams")
        rule_of(self.components, "set_hyperparams").set_hyperparams(**values)

    def optimizer_state(self, path: str | None = None) -> Any:
        """The optax state as a plain optax loop holds it: of the whole model (the structure ``tx.init(params)``
        gives for :meth:`params`), or of one parameter (``path``: a one-leaf tree's state, read from its tier alone).
        Host arrays; e.g. ``optax.contrib.schedule_free_eval_params(engine.optimizer_state(), engine.params())``.

        Raises:
          ConfigError: the optimizer is zinf's own Adam (no optax state), or ``path`` is not a trained parameter.
        """
        self._usable("optimizer_state")
        return optimizer_state(self.components, path)

    def save(self, directory: str | os.PathLike, *, user_state: Mapping[str, Any] | None = None,
             max_to_keep: int | None = None, overwrite: bool = False) -> Path:
        """Saves the whole training state with orbax (atomic). See :mod:`zinf_jax.checkpoint`.

        The engine holds ``directory`` from its first save there until :meth:`close`: another job's save there is
        refused (:mod:`zinf_jax.checkpoint.owner`).

        Args:
          directory: the checkpoint directory (its ``step_<N>`` subdirectories).
          user_state: JSON data stored with it (the data position...; default :attr:`user_state`).
          max_to_keep: once this checkpoint is complete, delete the oldest ones so that at most this many
            remain (never this one, nor a newer one; ``None`` keeps all).
          overwrite: save although the directory holds a newer checkpoint (a run restored from an older step
            going on); without it that is a :class:`CheckpointError`.
        """
        self._usable("save")
        with no_mesh():
            return save(TrainingState(self.components), directory, user_state=user_state, max_to_keep=max_to_keep,
                        owner=self._owner, overwrite=overwrite)

    def save_safetensors(self, directory: str | os.PathLike, *, rename: Callable | None = None,
                         dtype: str | None = None, max_shard_bytes: int = 5 << 30) -> list[Path]:
        """Writes the trained parameters as safetensors, unit by unit, in shards of at most ``max_shard_bytes``.

        Readable by ``safetensors.numpy.load_file`` and any Hugging Face loader (one ``model.safetensors``,
        or ``model-0000k-of-0000n.safetensors`` files and a ``model.safetensors.index.json``). See
        :mod:`zinf_jax.checkpoint.export`.

        Args:
          directory: where the files go (created).
          rename: model path -> tensor name, a :class:`~zinf_jax.TensorMap` (name and transpose/reshape),
            or None to leave a parameter out (default: the path with ``/`` as ``.``).
          dtype: the files' dtype (``"bfloat16"``, ``"float16"``; default ``"float32"``, the masters as they are).
          max_shard_bytes: the largest shard file.

        Returns:
          The files written (the index last, if any).
        """
        self._usable("save_safetensors")
        return save_safetensors(TrainingState(self.components), directory, rename=rename, dtype=dtype,
                                max_shard_bytes=max_shard_bytes)

    def _usable(self, what: str, batch: Any = None) -> None:
        """Refuses a call after :meth:`close` or under an outer transformation, before anything changes."""
        self.components.life.check(what, batch)

    def close(self) -> None:
        """Finishes I/O and releases the tiers and checkpoint directories (their locks), all of them even if one fails.

        Idempotent; every later call but ``close`` raises :class:`EngineError`.
        """
        c = self.components
        if not c.life.close():
            return
        self._owner.release()
        self._stepper.close()
        try:
            c.passes.close()
        finally:
            try:
                c.param_tier.close()
            finally:
                try:
                    c.opt_tier.close()
                finally:
                    if c.grad_tier is not None:
                        c.grad_tier.close()


def _streamed_only(config: ZeroConfig, track_live_arrays: bool | None) -> list[str]:
    """The streamed engine's settings that differ from their defaults (no effect in compiled mode)."""
    default = ZeroConfig()
    return [f"{name}={getattr(config, name)!r}" for name in ("prefetch_depth", "max_live_bytes")
            if getattr(config, name) != getattr(default, name)] + (["track_live_arrays=True"] if track_live_arrays else [])


def initialize(
    model: Callable[[], Any] | nn.Module,
    *,
    config: ZeroConfig | None = None,
    mesh: Mesh | None = None,
    optimizer: Any = None,
    loss_fn: Callable,
    init_args: tuple = (),
    init_kwargs: Mapping[str, Any] | None = None,
    unit_policy: UnitPolicy | None = None,
    has_aux: bool = False,
    param_loss: ParamLoss | None = None,
    logical_axis_rules: Any = None,
    trainable: Any = None,
    params: Any = None,
    track_live_arrays: bool = False,
) -> Engine:
    """Builds a ZeRO-3/Infinity engine for a Flax model.

    Args:
      model: an NNX constructor (``lambda: GPT(cfg, rngs=nnx.Rngs(0))``; it is
        traced abstractly, never materialised whole) or a Linen module.
      config: tiers, prefetching, dtypes (default :class:`ZeroConfig`).
      mesh: the mesh, with any axis names and types (``jax.make_mesh``'s Explicit axes included: a model
        whose parameters declare their shardings then runs its code with them, see
        :mod:`zinf_jax.plan.model_mesh`). Default: the mesh set with ``jax.set_mesh``, else
        :func:`zinf_jax.make_mesh` (every device on ``fsdp``).
      optimizer: :func:`zinf_jax.adamw` / :func:`zinf_jax.adam` (the fused
        kernel), or an optax ``GradientTransformation``: element-wise ones
        (sgd, the adam family, lion, ...) run chunk by chunk, ones that couple
        a tensor's elements (lamb, lars, novograd, adafactor, sm3, muon) tensor
        by tensor, and any of them inside the step's program when params and
        optimizer state are in device memory (see the optimizers guide). Default
        from ``config.optimizer`` (a DeepSpeed config), else AdamW(1e-3).
      loss_fn: ``loss_fn(model, batch) -> loss`` (or ``(loss, aux)`` with
        ``has_aux=True``); ``model`` is the wrapped NNX module, or for Linen a
        callable ``model(*args, **kwargs)``.
      init_args, init_kwargs: Linen only: arguments of ``module.init``.
      unit_policy: which submodules are units (default: blocks, embedding, head).
      has_aux: ``loss_fn`` returns ``(loss, aux)``.
      param_loss: ``param_loss(path, value) -> scalar``, a loss term per
        parameter added to the training loss (e.g. L2 on kernels:
        ``lambda path, w: 5e-4 * jnp.sum(w ** 2) if path.endswith("kernel") else 0.0``).
        ``loss_fn`` never sees the parameters of streamed units; this is
        applied unit by unit where they are gathered anyway, exactly.
      logical_axis_rules: Linen: rules mapping the logical axis names of
        ``nn.with_logical_partitioning`` parameters to mesh axes; the dimension
        mapped to ``fsdp`` is the one sharded (default: the rules of an
        enclosing ``nn.logical_axis_rules`` context, if any).
      trainable: which parameters are trained; the others are frozen: streamed
        for forward and backward like the rest, but never differentiated, with
        no optimizer state and never rewritten (fine-tuning, LoRA). NNX: a
        filter as ``nnx.Optimizer(wrt=...)`` takes (``nnx.LoRAParam``, a
        Variable type, ``nnx.PathContains("head")``, a ``(path, value)``
        predicate); Linen: a predicate on the ``/``-joined parameter path.
        Default: every parameter.
      params: initial values instead of the model's initialisers: a pytree of
        host arrays in the model's own structure (``nnx.state(model,
        nnx.Param)`` or the Linen params dict), or the directory of a plain
        orbax checkpoint of one (read unit by unit), or
        :func:`zinf_jax.from_safetensors` (read lazily, each process its own slices). See
        :class:`~zinf_jax.engine.pretrained.Pretrained`.
      track_live_arrays: record ``jax.live_arrays()`` peaks (tests, benchmarks).

    Raises:
      ConfigError, TierError, UnitPolicyError, ParamMismatchError: with a message
        naming the problem and the fix.
    """
    return _announced(_build(model, config=config, mesh=mesh, optimizer=optimizer, init_args=init_args,
                             init_kwargs=init_kwargs, unit_policy=unit_policy, logical_axis_rules=logical_axis_rules,
                             init="fresh", loss_fn=loss_fn, has_aux=has_aux, param_loss=param_loss,
                             trainable=trainable, params=params, track_live_arrays=track_live_arrays))


def _announced(engine: Engine) -> Engine:
    """``engine``, its build summary logged (INFO) with each note of :func:`~zinf_jax.engine.summary.advice` (WARNING:
    Python shows it even where logging is not set up). Once per engine that opened, with its tiers filled."""
    if log.isEnabledFor(logging.INFO):
        log.info("%s", describe(engine.components).split("\nnote: ")[0])
    for note in advice(engine.components):
        log.warning("zinf_jax: %s", note)
    return engine


def _build(model: Any, *, config: ZeroConfig | None = None, mesh: Mesh | None = None, optimizer: Any = None,
           init_args: tuple = (), init_kwargs: Mapping[str, Any] | None = None,
           unit_policy: UnitPolicy | None = None, logical_axis_rules: Any = None, **engine_kw: Any) -> Engine:
    config = config or ZeroConfig()
    if mesh is None:  # a mesh the caller set with jax.set_mesh, else every device on one fsdp axis
        current = getattr(jax.sharding, "get_mesh", lambda: None)()
        mesh = current if current is not None and not current.empty else make_mesh()
    optimizer = choose_optimizer(optimizer, config)
    with no_mesh(), model_sharding_explained():  # traced abstractly, placed by the engine (not the caller's mesh)
        adapter = make_adapter(model, policy=unit_policy, threshold=config.persistence_threshold, seed=config.seed,
                               persistent=config.persistent_params, init_args=init_args, init_kwargs=init_kwargs,
                               logical_axis_rules=logical_axis_rules, mesh=mesh)
    return Engine(adapter=adapter, config=config, mesh=mesh, optimizer=optimizer, **engine_kw)


def restore(
    directory: str | os.PathLike,
    model: Callable[[], Any] | nn.Module,
    **kwargs: Any,
) -> Engine:
    """Rebuilds an engine from the newest checkpoint under ``directory``.

    Takes the same keyword arguments as :func:`initialize`; the mesh size and the
    tiers may differ from the run that saved it (8 devices -> 4, nvme -> cpu).
    The checkpoint's user state is in ``engine.user_state``.

    Raises:
      CheckpointError: no checkpoint there, or one of another model.
    """
    step_dir = latest_step_dir(directory)
    if "params" in kwargs:
        raise TypeError("restore() takes its values from the checkpoint; params= is for initialize()")
    engine = _build(model, init="none", **kwargs)
    try:
        with no_mesh():
            restore_into(TrainingState(engine.components), step_dir)
    except BaseException:
        close_quietly(engine)
        raise
    return _announced(engine)
