"""Checkpoints with orbax: the whole training state, unit by unit, atomically.

A checkpoint is a directory ``<dir>/step_<N>/`` holding::

    zinf_meta.json     step, optimizer counters (loss scale, skips), config,
                       parameter table (path, shape, dtype, unit), user state
    group_<k>/         one orbax PyTree checkpoint per unit (then one for the
                       persistent params): {"master"|"m"|"v": {path...: array}}
                       float32, in the parameters' own shapes
    rng/               orbax PyTree checkpoint of the RNG and other non-param state

Groups are written one at a time from the optimizer tier, so the state is never
all in RAM at once, even when it lives on NVMe. Every group is an ordinary orbax
save (orbax's own tmp-dir + commit protocol); the step directory itself is
assembled under a temporary name and renamed into place only when complete, so
a crash mid-save leaves the previous checkpoint as it was.

Reading without zinf_jax::

    import orbax.checkpoint as ocp
    tree = ocp.PyTreeCheckpointer().restore("ckpt/step_00000030/group_0003")
    tree["master"]["blocks"]["3"]["mlp"]["kernel"]   # float32 array
"""
from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from zinf_jax.engine.init import param_groups
from zinf_jax.optim.driver import METADATA_KEY as OPTIMIZER_STATE_KEY
from zinf_jax.sharding import ParamLayout, assemble, from_stored, split_local, to_stored

__all__ = ["save", "restore_into", "latest_step_dir", "read_meta", "CheckpointError", "META"]

META = "zinf_meta.json"
STATES = ("master", "m", "v")


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, or of another model."""


def latest_step_dir(directory: str | os.PathLike) -> Path:
    """The newest complete ``step_<N>`` under ``directory`` (or ``directory`` itself if it is one).

    Raises:
      CheckpointError: no complete checkpoint there.
    """
    root = Path(directory)
    if (root / META).exists():
        return root
    steps = sorted(p for p in root.glob("step_*") if (p / META).exists()) if root.is_dir() else []
    if not steps:
        raise CheckpointError(f"no zinf_jax checkpoint in {str(root)!r} (expected step_<N>/{META}); check the path")
    return steps[-1]


def read_meta(step_dir: str | os.PathLike) -> dict[str, Any]:
    """The ``zinf_meta.json`` of one checkpoint."""
    with open(Path(step_dir) / META) as f:
        return json.load(f)


def _signature(engine: Any) -> dict[str, list]:
    return {p: [list(l.shape), l.dtype] for p, l in engine.layouts.items()}


def _nest(flat: Mapping[str, Any]) -> dict:
    return traverse_util.unflatten_dict({tuple(k.split("/")): v for k, v in flat.items()})


def _flatten(tree: Mapping) -> dict[str, Any]:
    return {"/".join(k): v for k, v in traverse_util.flatten_dict(tree).items()}


def _save_sharding(engine: Any, lay: ParamLayout) -> Any:
    if lay.kind == "flat":  # no dimension divides the mesh: write it from one device
        return SingleDeviceSharding(engine.mesh.devices.flat[0])
    return NamedSharding(engine.mesh, lay.spec)


def _chunking(engine: Any, path: str, which: str) -> tuple[str, int, int, int]:
    """Key, chunks per shard, chunk length and shard length of an optimizer state (the driver's layout)."""
    lay = engine.layouts[path]
    key = f"{which}/{path}"
    spec = engine.opt_tier.spec(key)
    return key, spec.num_shards // lay.num_shards, spec.shard_shape[0], math.prod(lay.shard_shape)


def _read_state(engine: Any, path: str, index: int, which: str) -> np.ndarray:
    key, n, chunk, numel = _chunking(engine, path, which)
    out = np.empty(n * chunk, np.float32)
    for f in [engine.opt_tier.get(key, index * n + c, out=out[c * chunk:(c + 1) * chunk]) for c in range(n)]:
        f.result()
    return out[:numel].reshape(engine.layouts[path].shard_shape)


def _write_state(engine: Any, path: str, index: int, which: str, value: np.ndarray) -> None:
    key, n, chunk, numel = _chunking(engine, path, which)
    flat = np.zeros(n * chunk, np.float32)
    flat[:numel] = np.asarray(value, np.float32).reshape(-1)
    for f in [engine.opt_tier.put(key, index * n + c, flat[c * chunk:(c + 1) * chunk]) for c in range(n)]:
        f.result()


def _global_state(engine: Any, path: str, which: str) -> jax.Array:
    """One optimizer state of one parameter as a global array in its own shape."""
    lay = engine.layouts[path]
    shards = {i: _read_state(engine, path, i, which) for i in engine.store.local_indices(path)}
    stored = assemble(lay, engine.mesh, shards)
    if lay.kind != "flat":
        return stored
    return jax.jit(lambda s: from_stored(lay, s), out_shardings=_save_sharding(engine, lay))(stored)


def _rng_tree(engine: Any) -> dict[str, Any]:
    leaves = jax.tree.leaves(engine.streamed.state)
    return {f"leaf_{i:04d}": jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
            for i, x in enumerate(leaves)}


def save(engine: Any, directory: str | os.PathLike, *, user_state: Mapping[str, Any] | None = None) -> Path:
    """Writes ``<directory>/step_<N>`` for the engine's current step (see module doc).

    Args:
      engine: the engine.
      directory: parent directory of the step directories (created).
      user_state: JSON-serialisable data stored with it (e.g. the data position).

    Returns:
      The step directory.
    """
    root = Path(directory).absolute()  # orbax wants absolute paths
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{engine.step:08d}"
    if (final / META).exists():
        return final
    tmp = root / f".tmp_step_{engine.step:08d}_{uuid.uuid4().hex[:8]}"
    ckptr = ocp.PyTreeCheckpointer()
    groups = param_groups(engine.adapter)
    try:
        for k, group in enumerate(groups):
            tree = {s: _nest({p: _global_state(engine, p, s) for p in group}) for s in STATES}
            ckptr.save(tmp / f"group_{k:04d}", tree)
            del tree
        rng = _rng_tree(engine)
        if rng:
            ckptr.save(tmp / "rng", rng)
        meta = {
            "format": "zinf_jax.checkpoint/1",
            "step": engine.step,
            "optimizer": engine.optimizer.state_dict(),
            "config": engine.config.to_dict(),
            "params": _signature(engine),
            "groups": [list(g) for g in groups],
            "user_state": dict(user_state if user_state is not None else engine.user_state),
        }
        with open(tmp / META, "w") as f:
            json.dump(meta, f, indent=1, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, final)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _target(engine: Any, path: str) -> jax.ShapeDtypeStruct:
    lay = engine.layouts[path]
    return jax.ShapeDtypeStruct(lay.shape, jnp.float32, sharding=_save_sharding(engine, lay))


def restore_into(engine: Any, step_dir: str | os.PathLike) -> dict[str, Any]:
    """Fills a freshly built engine's tiers from a checkpoint (any mesh size, any tier).

    Returns:
      The checkpoint's metadata.

    Raises:
      CheckpointError: the checkpoint belongs to another model.
    """
    step_dir = Path(step_dir).absolute()
    meta = read_meta(step_dir)
    mine, theirs = _signature(engine), meta["params"]
    if mine != theirs:
        diff = [p for p in sorted(set(mine) | set(theirs)) if mine.get(p) != theirs.get(p)][:3]
        raise CheckpointError(
            f"checkpoint {str(step_dir)!r} holds another model: parameters differ at {diff} "
            f"(model: {[mine.get(p) for p in diff]}, checkpoint: {[theirs.get(p) for p in diff]})"
        )
    ckptr = ocp.PyTreeCheckpointer()
    for k, group in enumerate(meta["groups"]):
        target = {s: _nest({p: _target(engine, p) for p in group}) for s in STATES}
        args = ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))
        flat = {s: _flatten(t) for s, t in ckptr.restore(step_dir / f"group_{k:04d}", args=args).items()}
        for path in group:
            lay = engine.layouts[path]
            parts = {}
            for s in STATES:
                arr = flat[s][path]
                if lay.kind == "flat":
                    arr = jax.jit(lambda a: to_stored(lay, a), out_shardings=NamedSharding(engine.mesh, lay.spec))(arr)
                parts[s] = {i: np.asarray(x, np.float32) for i, x in split_local(lay, engine.mesh, arr).items()}
            for i in engine.store.local_indices(path):
                for s in STATES:
                    _write_state(engine, path, i, s, parts[s][i])
                engine.store.put_local(path, i, parts["master"][i]).result()
        del flat
    if (step_dir / "rng").exists():
        cur = engine.streamed.state
        leaves, tree = jax.tree.flatten(cur)
        rep = NamedSharding(engine.mesh, P())
        target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rep) for k, v in _rng_tree(engine).items()}
        saved = ckptr.restore(step_dir / "rng", args=ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)))
        new = []
        for i, x in enumerate(leaves):
            v = saved[f"leaf_{i:04d}"]
            if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
                v = jax.random.wrap_key_data(jnp.asarray(v), impl=jax.random.key_impl(x))
            new.append(jax.device_put(v, x.sharding))
        engine.streamed.state = jax.tree.unflatten(tree, new)
    engine.user_state = dict(meta.get("user_state", {}))
    step_meta = {"step": meta["step"]}
    engine.opt_tier.commit({**step_meta, OPTIMIZER_STATE_KEY: meta["optimizer"]})
    engine.optimizer.restore_state()
    engine.store.commit(step_meta)
    return meta
