"""Wiring an engine once: tiers, optimizer, parameter store, streamed model, into :class:`Components`.

:func:`build` opens the tiers that :func:`~zinf_jax.plan.placement.place` names, the streamed
optimizer over the optimizer tier, the :class:`~zinf_jax.engine.store.ParamStore` over the param
tier, creates the parameters unit by unit (``init="fresh"``; a restore fills them from a
checkpoint instead) and the passes that run the model: the
:class:`~zinf_jax.engine.compiled.CompiledModel` (one program per step) or the
:class:`~zinf_jax.engine.streamed.StreamedModel` whose hooks run the units
(:attr:`~zinf_jax.plan.placement.Placement.engine` decides). The result is one small frozen object that the training steps
(:class:`~zinf_jax.engine.stepping.Stepper`) and the checkpoint state
(:class:`~zinf_jax.checkpoint.state.TrainingState`) receive, instead of the whole
:class:`~zinf_jax.api.Engine`: nothing below the API reaches into the engine.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh

from zinf_jax._internal.multihost import allreduce_sum
from zinf_jax.config import ZeroConfig
from zinf_jax.engine.activations import parking_for
from zinf_jax.engine.grads import GradSink
from zinf_jax.engine.host_budget import check_pinned_pool, pinned_of, plan_for, planned_config, sizes_of
from zinf_jax.engine.init import init_unit_by_unit
from zinf_jax.engine.lifecycle import LifeCycle
from zinf_jax.engine.overlap import WriteGate
from zinf_jax.engine.pretrained import Pretrained
from zinf_jax.engine.store import ParamStore, local_indices_of
from zinf_jax.engine.compiled import CompiledModel
from zinf_jax.engine.streamed import ParamLoss, StreamedModel
from zinf_jax.engine.wrap import trainable_paths
from zinf_jax.optim.choose import loss_scaling, with_clipping
from zinf_jax.optim.driver import StreamedOptimizer
from zinf_jax.optim.rules import rule_for, whole_sets
from zinf_jax.optim.fused import FusedAdam, update_in_program
from zinf_jax.plan.model_mesh import ModelMesh
from zinf_jax.plan.partition import (ParamLayout, auto_axes, local_shard_devices, model_axes_of, owns_shard,
                                     plan_partition, split_local)
from zinf_jax.plan.host_memory import HostPlan
from zinf_jax.plan.placement import Placement, TierPlacement, place
from zinf_jax.plan.units import persistent_paths
from zinf_jax.tiers import Tier, open_tier

__all__ = ["Components", "build", "close_quietly"]


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Components:
    """An engine's parts, wired once by :func:`build` (the references never change; their contents do).

    Attributes:
      adapter: the model's adapter (NNX or Linen): units, abstract params, the wrapped model.
      config: the settings.
      mesh: the device mesh the engine runs on (Auto axes).
      model_mesh: the mesh as the model's own code sees it (its Explicit axes, tensor-parallel axes).
      layouts: how each parameter is partitioned, by path.
      trainable: the paths that are trained (the others are frozen).
      compute_dtype: the resolved compute dtype.
      placement: which tier holds what.
      param_tier, opt_tier: the compute-dtype param shards; the fp32 master and optimizer states.
      grad_tier: the scratch gradient tier, or None.
      optimizer: the streamed optimizer over ``opt_tier``.
      store: the parameters in ``param_tier`` (and, shared, the optimizer's master).
      passes: the forward/backward passes: a :class:`~zinf_jax.engine.compiled.CompiledModel` (one
        program per step) or a :class:`~zinf_jax.engine.streamed.StreamedModel` (``placement.engine``).
      gate: the write gate of overlapped steps (see :mod:`zinf_jax.engine.overlap`).
      life: the engine's life cycle.
      user_state: JSON data saved with each checkpoint (the engine's ``user_state``).
      host_plan: the host buffers planned against ``config.host_memory_limit`` (``config`` holds the settings
        it picked).
    """

    adapter: Any
    config: ZeroConfig
    mesh: Mesh
    model_mesh: ModelMesh
    layouts: dict[str, ParamLayout]
    trainable: frozenset[str]
    compute_dtype: str
    placement: Placement
    param_tier: Tier
    opt_tier: Tier
    grad_tier: Tier | None
    optimizer: StreamedOptimizer
    store: ParamStore
    passes: CompiledModel | StreamedModel
    gate: WriteGate
    life: LifeCycle = dataclasses.field(default_factory=LifeCycle)
    user_state: dict[str, Any] = dataclasses.field(default_factory=dict)
    host_plan: HostPlan | None = None

    @property
    def tiers(self) -> list[Tier]:
        """The open tiers, param tier first."""
        return [t for t in (self.param_tier, self.opt_tier, self.grad_tier) if t is not None]


def close_quietly(closable: Any) -> None:
    """Closes a tier or engine while another error is on its way out (that one is the one to report)."""
    with contextlib.suppress(Exception):
        closable.close()


def _open(where: TierPlacement, config: ZeroConfig, device_of: Callable[[int], jax.Device],
          rebuild: bool = False) -> Tier:
    return open_tier(where.device, path=where.path, subdir=where.subdir, host_memory=where.host_memory,
                     direct_io=where.direct_io, update=where.update.value, placement=device_of,
                     max_in_flight_bytes=config.max_in_flight_bytes, chunk_bytes=where.chunk_bytes,
                     threads=config.aio.intra_op_parallelism, rebuild=rebuild)


def build(adapter: Any, *, config: ZeroConfig, mesh: Mesh, optimizer: Any, init: str = "fresh", track_live_arrays: bool = False, param_loss: ParamLoss | None = None,
          trainable: Any = None, params: Any = None) -> Components:
    """Opens the tiers, builds the optimizer, store and streamed model, and (``init="fresh"``) creates the params.

    Args:
      adapter: the model's adapter (:func:`~zinf_jax.engine.wrap.make_adapter`).
      config, mesh, param_loss, trainable, params, track_live_arrays: as for
        :func:`zinf_jax.initialize` (``optimizer`` already chosen: a rule the driver runs; ``mesh`` as the
        user gave it: the engine runs on its Auto view, the model's code with its Explicit axes).
      init: ``"fresh"`` creates the parameters (from ``params`` if given); ``"none"`` leaves the
        tiers empty for a checkpoint restore.

    A failure while building closes every tier opened so far (and releases its lock). With
    ``config.host_memory_limit`` the host buffers are planned first (:mod:`zinf_jax.engine.host_budget`): a plan
    that cannot fit is a ConfigError before any tier is opened; one that fits sets the prefetch depth, live bytes,
    buffer count and trim slack the engine runs.
    """
    trained = trainable_paths(adapter, trainable)
    pretrained = None if params is None else Pretrained(params, adapter.abstract_params)
    compute_dtype = config.resolved_compute_dtype(jax.devices()[0].platform)
    user_mesh, mesh = mesh, auto_axes(mesh)
    layouts = plan_partition(adapter.abstract_params, mesh, config.persistence_threshold, adapter.layout_hints,
                             config.zero_axes, persistent_paths(adapter.abstract_params, config.persistent_params))
    model_mesh = ModelMesh.of(user_mesh, model_axes_of(layouts.values(), mesh), adapter.own_shardings)
    where = place(config, compute_dtype)
    local = local_shard_devices(mesh, config.zero_axes)
    spec = with_clipping(optimizer, config.gradient_clipping)
    opt_layouts = {p: l for p, l in layouts.items() if p in trained}
    local_of = local_indices_of(layouts, mesh)
    rule = rule_for(spec, opt_layouts, config.sub_group_size)
    whole = whole_sets(rule, opt_layouts, {p: len(local_of(p)) for p in opt_layouts}, config.sub_group_size,
                       jax.process_count())
    host_plan = plan_for(sizes_of(layouts, [u.param_paths for u in adapter.units], trained,
                                  n_local=sum(len(v) for v in local.values()), n_idx=len(local), config=config,
                                  where=where, compute_dtype=compute_dtype, platform=jax.devices()[0].platform,
                                  whole=whole),
                         config)  # before anything is opened or written
    config = planned_config(config, host_plan)

    def device_of(index: int) -> jax.Device:
        return local.get(index, [jax.local_devices()[0]])[0]

    def owner(path: str, index: int) -> bool:
        return owns_shard(mesh, layouts[path], index, config.zero_axes)

    scaling = loss_scaling(config, compute_dtype)
    fused = update_in_program(spec, config, where, compute_dtype=compute_dtype,  # the compiled step runs the update
                              largest_shard=max((math.prod(l.shard_shape) for l in layouts.values()), default=0))
    n_idx = len(local)
    check_pinned_pool(pinned_of(layouts, [u.param_paths for u in adapter.units], trained, n_idx=n_idx, where=where,
                                compute_dtype=compute_dtype, fused=fused, state_bytes=config.state_bytes),
                      jax.devices()[0].platform)

    with contextlib.ExitStack() as undo:
        rebuild = init == "none"  # a restore writes every key: a tier a crash left half-updated is rebuilt
        param_tier = _open(where.params, config, device_of, rebuild)
        undo.callback(close_quietly, param_tier)
        opt_tier = _open(where.optimizer, config, device_of, rebuild)
        undo.callback(close_quietly, opt_tier)
        grad_tier = None if where.grads is None else _open(where.grads, config, device_of)  # [Note: scratch gradients]
        undo.callback(close_quietly, grad_tier)
        make = (functools.partial(FusedAdam, mesh=mesh, window=config.max_in_flight_bytes)  # [Note: states moved in
                if fused else StreamedOptimizer)                                          # the program]
        opt = make(
            spec, opt_tier, opt_layouts, local_indices=local_of, owner=owner, rule=rule,
            sub_group_size=config.sub_group_size, buffer_count=config.offload_optimizer.buffer_count,
            loss_scale=scaling, allreduce=allreduce_sum, grad_tier=grad_tier,
            state_dtype=config.moments_dtype,
        )
        opt.declare()
        store = ParamStore(param_tier, layouts, mesh, compute_dtype, master=opt,
                           master_paths=trained if where.shared_master else ())  # See [Note: shared fp32 master]
        if init == "fresh":
            def to_optimizer(path: str, arr: jax.Array) -> list:
                if path not in trained:  # frozen: only its compute-dtype copy in the param tier
                    return []
                return [f for idx, shard in split_local(layouts[path], mesh, arr).items()
                        for f in opt.init_shard(path, idx, np.asarray(shard, np.float32), wait=False)]

            init_unit_by_unit(adapter, store, on_param=to_optimizer, metadata={"step": 0},
                              values=None if pretrained is None else pretrained.read)
            opt.commit({"step": 0})
        gate = WriteGate()
        sink = GradSink(layouts, mesh, target=opt.grads, arena=opt.grad_arena)
        if where.engine == "compiled":
            passes: CompiledModel | StreamedModel = CompiledModel(
                adapter, store, host_params=where.params.device == "cpu",
                grads_on_host=where.optimizer.device != "none" and not fused,
                activation_checkpointing=config.activation_checkpointing, param_loss=param_loss,
                trainable=trained, sink=sink, gate=gate, fused=opt if fused else None, model_mesh=model_mesh)
        else:
            passes = StreamedModel(
                adapter, store, prefetch_depth=config.prefetch_depth, max_live_bytes=config.max_live_bytes,
                activations=parking_for(where.activations, where.activations_path),
                track_live_arrays=track_live_arrays,
                activation_checkpointing=config.activation_checkpointing, param_loss=param_loss,
                trainable=trained, sink=sink, gate=gate, model_mesh=model_mesh, trim_slack=host_plan.trim_slack,
            )
        undo.pop_all()
    return Components(adapter=adapter, config=config, mesh=mesh, model_mesh=model_mesh, layouts=layouts,
                      trainable=trained,
                      compute_dtype=compute_dtype, placement=where, param_tier=param_tier, opt_tier=opt_tier,
                      grad_tier=grad_tier, optimizer=opt, store=store, passes=passes, gate=gate, host_plan=host_plan)
