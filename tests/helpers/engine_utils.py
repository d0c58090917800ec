"""Builds a StreamedModel over a chosen param tier, and reads its gradients back."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import zinf_jax as zinf
from zinf_jax.engine.linen_adapter import LinenAdapter
from zinf_jax.engine.nnx_adapter import NnxAdapter
from zinf_jax.engine.init import INIT_BATCH_BYTES, init_unit_by_unit
from zinf_jax.engine.adapters import leaf_paths
from zinf_jax.engine.store import ParamStore
from zinf_jax.engine.streamed import StreamedModel
from zinf_jax.models import lm_loss
from zinf_jax.plan.partition import from_stored, local_shard_devices, make_mesh, plan_partition
from zinf_jax.tiers import CpuTier, DeviceTier, NvmeTier
from zinf_jax.plan.units import UnitPolicy, path_str


def open_param_tier(kind, mesh, path=None):
    loc = local_shard_devices(mesh)
    place = lambda i: loc[i][0]  # noqa: E731
    if kind == "device":
        return DeviceTier(placement=place)
    if kind == "cpu":
        return CpuTier(placement=place)
    return NvmeTier(path)


def fill_random(store, seed=0):
    """Random parameters straight into the store: for tests about memory and compilation, not values."""
    rng = np.random.default_rng(seed)
    futures = []
    for path, lay in store.layouts.items():
        value = (rng.standard_normal(lay.stored_shape) * 0.05).astype(np.float32)
        futures += store.put_array(path, jax.device_put(value, store.sharding(path)))
    for f in futures:
        f.result()
    store.commit()


def build(adapter, tier_kind, *, threshold, path=None, depth=2, mesh=None, compute_dtype="float32",
          init="model", init_batch_bytes=INIT_BATCH_BYTES, **kw):
    mesh = mesh or make_mesh()
    lays = plan_partition(adapter.abstract_params, mesh, threshold, adapter.layout_hints)
    store = ParamStore(open_param_tier(tier_kind, mesh, path), lays, mesh, compute_dtype)
    if init == "model":
        init_unit_by_unit(adapter, store, batch_bytes=init_batch_bytes)
    else:
        fill_random(store)
    return StreamedModel(adapter, store, prefetch_depth=depth, **kw)


def nnx_adapter(ctor, threshold, policy=None):
    return NnxAdapter(ctor, policy or UnitPolicy(), threshold)


def linen_adapter(module, x, threshold, policy=None, seed=0):
    return LinenAdapter(module, (x,), {}, policy or UnitPolicy(), threshold, seed)


def streamed_grads(sm, g_glue):
    """Full float32 gradient of every parameter, by path."""
    out = {}
    glue = sm.adapter.glue_paths
    for path, lay in sm.store.layouts.items():
        if path in glue:
            out[path] = np.asarray(g_glue[glue.index(path)])
            continue
        shards = [sm.sink.get(path, i) for i in sm.store.local_indices(path)]
        full = shards[0] if lay.dim is None else np.concatenate(shards, axis=lay.dim)
        out[path] = np.asarray(from_stored(lay, full))
    return out


def nest_paths(flat_paths):
    """``{"a/b": x}`` as the nested dict ``{"a": {"b": x}}`` (an optimizer's view of a flat param dict)."""
    out = {}
    for p, v in flat_paths.items():
        node = out
        *head, last = p.split("/")
        for k in head:
            node = node.setdefault(k, {})
        node[last] = v
    return out


def unnest_paths(tree, prefix=""):
    """The inverse of :func:`nest_paths`."""
    out = {}
    for k, v in tree.items():
        out.update(unnest_paths(v, f"{prefix}{k}/") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def assert_params_close(got, ref, rtol=1e-5, atol=1e-6):
    """Every path of ``ref`` in ``got`` (``path -> array``), equal within ``rtol``/``atol``."""
    assert set(ref) <= set(got), sorted(set(ref) - set(got))
    for path, r in ref.items():
        np.testing.assert_allclose(got[path], r, rtol=rtol, atol=atol, err_msg=path)


def flat(state):
    """An nnx.State (or params pytree) as ``path -> numpy array``."""
    return {path_str(p): np.asarray(v) for p, v in zip(leaf_paths(state), jax.tree.leaves(state))}


def optax_steps(model_of, params, tx, data, loss_fn, place=lambda x: x, place_state=lambda x: x,
                line_search=False):
    """Plain ``jit(value_and_grad)`` + optax over ``params``: ``loss_fn(model_of(params), batch)`` for each batch
    (placed by ``place``; the optimizer state by ``place_state``; a ``GradientTransformationExtraArgs`` given the
    loss as ``value=``, and with ``line_search`` the gradient and the loss function as ``grad=`` and ``value_fn=``,
    as optax's lbfgs example does); the losses and the final params."""
    opt_state = jax.tree.map(place_state, tx.init(params))
    extra = isinstance(tx, optax.GradientTransformationExtraArgs)  # given the loss, as optax's examples do

    @jax.jit
    def step(params, opt_state, b):
        f = lambda p: loss_fn(model_of(p), b)  # noqa: E731
        loss, g = jax.value_and_grad(f)(params)
        more = {"grad": g, "value_fn": f} if line_search else {}
        updates, opt_state = tx.update(g, opt_state, params, **({"value": loss} if extra else {}), **more)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for b in data:
        params, opt_state, loss = step(params, opt_state, place(b))
        losses.append(float(loss))
    return losses, params


def optax_run(model, tx, data, loss_fn=lm_loss, wrt=nnx.Param, place=jnp.asarray, line_search=False):
    """The reference: plain jit(value_and_grad) + optax on the unwrapped NNX model; losses and final params.

    ``place`` puts the params, optimizer state and each batch where the step runs (default: as they are;
    e.g. replicated on a mesh set with ``jax.set_mesh``); ``line_search``: see :func:`optax_steps`.
    """
    gdef, params, rest = nnx.split(model, wrt, ...)
    params, rest = jax.tree.map(place, (params, rest))
    losses, params = optax_steps(lambda p: nnx.merge(gdef, p, rest), params, tx, data, loss_fn, place, place,
                                 line_search)
    return losses, flat(nnx.state(nnx.merge(gdef, params, rest), nnx.Param))


def placement_config(tmp_path, where):
    """The config of a placement named ``"cpu"``, ``"nvme"``, ``"none"`` (params and optimizer there) or
    ``"<tier>-device"`` (the optimizer there, ``optimizer_update="device"``); threshold 600 elements."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    tier, _, update = where.partition("-")
    off = zinf.Offload(tier, path=str(tmp_path)) if tier == "nvme" else zinf.Offload(tier)
    if update:
        return zinf.ZeroConfig(offload_optimizer=off, optimizer_update=update, persistence_threshold=600)
    return zinf.ZeroConfig(offload_param=off, offload_optimizer=off, persistence_threshold=600)
