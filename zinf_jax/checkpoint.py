"""Checkpoints with orbax: the whole training state, unit by unit, atomically.

A checkpoint is a directory ``<dir>/step_<N>/`` holding::

    zinf_meta.json     step, optimizer counters (loss scale, skips), config,
                       parameter table (path, shape, dtype, unit), user state
    group_<k>/         one orbax PyTree checkpoint per unit (then one for the
                       persistent params): {state: {path...: array}}, float32,
                       in the parameters' own shapes; the states of a trained
                       parameter are the optimizer's ("master", "m", "v" for
                       Adam; "master", "s0", ... for an optax transform), a
                       frozen one is stored once, as "frozen"
    rng/               orbax PyTree checkpoint of the RNG and other non-param state

Groups are written one at a time from the optimizer tier, so the state is never
all in RAM at once, even when it lives on NVMe. Every group is an ordinary orbax
save (orbax's own tmp-dir + commit protocol); the step directory itself is
assembled under a temporary name and renamed into place only when complete, so
a crash mid-save leaves the previous checkpoint as it was.

Retention: ``save(..., max_to_keep=N)`` then deletes the oldest complete
checkpoints so that at most N remain (never the one just written, and nothing
when the save fails). A doomed ``step_<N>`` is first renamed to a hidden
``.del_step_<N>_*`` and only then removed, so a crash mid-delete never leaves a
half-deleted directory that looks like a checkpoint; the next save clears such
leftovers.

Reading without zinf_jax::

    import orbax.checkpoint as ocp
    tree = ocp.PyTreeCheckpointer().restore("ckpt/step_00000030/group_0003")
    tree["master"]["blocks"]["3"]["mlp"]["kernel"]   # float32 array
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import shutil
import uuid
import warnings
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
LEGACY_STATES = ("master", "m", "v")  # checkpoints written before meta["states"] existed


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


FROZEN = "frozen"  # the one state of a frozen parameter (see ``initialize(trainable=...)``): its value


def states_of(engine: Any, path: str) -> tuple[str, ...]:
    """What a checkpoint stores of ``path``: the optimizer's states (``master``, ``m``, ``v``...) or ``frozen``."""
    return engine.optimizer.state_names(path) if path in engine.trainable else (FROZEN,)


def _read_state(engine: Any, path: str, index: int, which: str) -> np.ndarray:
    if which == FROZEN:  # only its compute-dtype copy exists, in the param tier
        return np.asarray(engine.param_tier.get(path, index).result(), np.float32)
    return engine.optimizer.read_state(path, index, which)


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


_STEP_DIR = re.compile(r"step_(\d+)")
_DOOMED = ".del_"  # prefix of a step directory being deleted (hidden, and not ``step_*``)


def _check_max_to_keep(max_to_keep: Any) -> None:
    if max_to_keep is None:
        return
    if isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1:
        raise ValueError(f"max_to_keep must be a positive int or None (keep all), got {max_to_keep!r}")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _complete_steps(root: Path) -> list[tuple[int, Path]]:
    """The complete ``step_<N>`` directories under ``root``, oldest first."""
    out = []
    for p in root.iterdir():
        m = _STEP_DIR.fullmatch(p.name)
        if m and (p / META).is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


@dataclasses.dataclass(frozen=True)
class _StepInfo:
    """One checkpoint as orbax's preservation policies see it (``PolicyCheckpointInfo``)."""

    step: int
    time: datetime.datetime
    metrics: dict[str, Any] | None = None


def _doomed_steps(root: Path, keep: Path, max_to_keep: int) -> list[Path]:
    """The complete checkpoints to delete so that at most ``max_to_keep`` remain, ``keep`` among them.

    The choice is orbax's own ``LatestN`` preservation policy (the one its
    CheckpointManager applies for ``max_to_keep``), used on its own: zinf assembles
    the step directories itself, so no CheckpointManager owns them. ``keep`` (the
    checkpoint just written) is always kept, and the newest ``max_to_keep - 1``
    of the others with it.
    """
    others = [p for _, p in _complete_steps(root) if p.name != keep.name]
    infos = [_StepInfo(step=int(_STEP_DIR.fullmatch(p.name).group(1)),
                       time=datetime.datetime.fromtimestamp((p / META).stat().st_mtime)) for p in others]
    policy = ocp.checkpoint_managers.LatestN(n=max_to_keep - 1)
    preserve = policy.should_preserve(infos, context=ocp.checkpoint_managers.PreservationContext())
    return [p for p, kept in zip(others, preserve) if not kept]


def _remove_doomed_leftovers(root: Path) -> None:
    """Finishes deletions a crash interrupted (``.del_*`` directories)."""
    for p in root.glob(_DOOMED + "*"):
        shutil.rmtree(p, ignore_errors=True)


def _apply_retention(root: Path, keep: Path, max_to_keep: int | None) -> None:
    """Deletes the oldest complete checkpoints beyond ``max_to_keep`` (rename out of ``step_*``, then remove).

    Runs only after ``keep`` is complete and durable. A failure to delete is a
    warning, not an error: the checkpoint just written is good.
    """
    if max_to_keep is None:
        return
    try:
        doomed = []
        for p in _doomed_steps(root, keep, max_to_keep):
            hidden = root / f"{_DOOMED}{p.name}_{uuid.uuid4().hex[:8]}"
            os.rename(p, hidden)
            doomed.append(hidden)
        if doomed:
            _fsync_dir(root)  # the renames are durable before any file goes
        for p in doomed:
            shutil.rmtree(p)
    except OSError as e:
        warnings.warn(f"checkpoint retention (max_to_keep={max_to_keep}) in {str(root)!r}: could not delete an old "
                      f"checkpoint: {e}", RuntimeWarning, stacklevel=3)


def save(engine: Any, directory: str | os.PathLike, *, user_state: Mapping[str, Any] | None = None,
         max_to_keep: int | None = None) -> Path:
    """Writes ``<directory>/step_<N>`` for the engine's current step (see module doc).

    Args:
      engine: the engine.
      directory: parent directory of the step directories (created).
      user_state: JSON-serialisable data stored with it (e.g. the data position).
      max_to_keep: once the new checkpoint is complete, delete the oldest complete
        ``step_*`` checkpoints so that at most this many remain (the new one is
        never deleted; nothing is deleted if the save fails). ``None`` keeps all.

    Returns:
      The step directory.

    Raises:
      ValueError: ``max_to_keep`` is not a positive int or None.
    """
    _check_max_to_keep(max_to_keep)
    root = Path(directory).absolute()  # orbax wants absolute paths
    root.mkdir(parents=True, exist_ok=True)
    _remove_doomed_leftovers(root)
    final = root / f"step_{engine.step:08d}"
    if (final / META).exists():
        _apply_retention(root, final, max_to_keep)
        return final
    tmp = root / f".tmp_step_{engine.step:08d}_{uuid.uuid4().hex[:8]}"
    ckptr = ocp.PyTreeCheckpointer()
    groups = param_groups(engine.adapter)
    try:
        for k, group in enumerate(groups):
            flat: dict[str, dict[str, jax.Array]] = {}
            for p in group:
                for s in states_of(engine, p):
                    flat.setdefault(s, {})[p] = _global_state(engine, p, s)
            tree = {s: _nest(v) for s, v in flat.items()}
            del flat
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
            "states": {p: list(states_of(engine, p)) for p in engine.layouts},
            "user_state": dict(user_state if user_state is not None else engine.user_state),
        }
        with open(tmp / META, "w") as f:
            json.dump(meta, f, indent=1, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _apply_retention(root, final, max_to_keep)
    return final


def _target(engine: Any, path: str) -> jax.ShapeDtypeStruct:
    lay = engine.layouts[path]
    return jax.ShapeDtypeStruct(lay.shape, jnp.float32, sharding=_save_sharding(engine, lay))


def _restore_param(engine: Any, path: str, saved: dict[str, jax.Array]) -> list[str]:
    """Writes one parameter's saved states into the engine; ``[path]`` if its optimizer state starts fresh."""
    lay = engine.layouts[path]
    parts = {}
    for s, arr in saved.items():
        if lay.kind == "flat":
            arr = jax.jit(lambda a: to_stored(lay, a), out_shardings=NamedSharding(engine.mesh, lay.spec))(arr)
        parts[s] = {i: np.asarray(x, np.float32) for i, x in split_local(lay, engine.mesh, arr).items()}
    value = parts["master" if "master" in parts else FROZEN]
    want = states_of(engine, path)
    restart = path in engine.trainable and not set(want) <= set(parts)
    for i in engine.store.local_indices(path):
        if restart:
            engine.optimizer.init_shard(path, i, value[i])
        elif path in engine.trainable:
            for s in want:
                engine.optimizer.write_state(path, i, s, parts[s][i])
        engine.store.put_local(path, i, value[i]).result()
    return [path] if restart else []


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
    saved_states = meta.get("states") or {p: list(LEGACY_STATES) for p in mine}
    fresh: list[str] = []  # trained now, but the checkpoint has other (or no) optimizer state for them
    for k, group in enumerate(meta["groups"]):
        by_state: dict[str, dict[str, Any]] = {}
        for p in group:
            for s in saved_states[p]:
                by_state.setdefault(s, {})[p] = _target(engine, p)
        target = {s: _nest(v) for s, v in by_state.items()}
        args = ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))
        flat = {s: _flatten(t) for s, t in ckptr.restore(step_dir / f"group_{k:04d}", args=args).items()}
        for path in group:
            fresh += _restore_param(engine, path, {s: flat[s][path] for s in saved_states[path]})
        del flat
    if fresh:
        warnings.warn(f"checkpoint {str(step_dir)!r}: {len(fresh)} trained parameters (e.g. {fresh[0]!r}) have no "
                      "matching optimizer state there (frozen then, or another optimizer): their optimizer state "
                      "starts fresh from the saved values", UserWarning, stacklevel=3)
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
