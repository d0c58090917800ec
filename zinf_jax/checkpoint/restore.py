"""Reading checkpoints back: the newest complete one, its metadata, and every shard into a fresh engine.

Every file is checked against ``checksums.json`` just before it is read
(:mod:`~zinf_jax.checkpoint.integrity`); damage is a :class:`CheckpointError`
naming the file, never NaNs in the next step. A checkpoint restores onto any
mesh size and any tiers: each parameter is read as one global array with the
target's own sharding and cut into this process's shards.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

from zinf_jax._internal.multihost import Procs
from zinf_jax.checkpoint import format as fmt
from zinf_jax.checkpoint.integrity import read_json, read_table, verify
from zinf_jax.checkpoint.state import TrainingState, remember
from zinf_jax.checkpoint.tree import flatten, host_value, nest, rng_tree, sharding_of, signature
from zinf_jax.errors import CheckpointError
from zinf_jax.plan.partition import split_local, to_stored

__all__ = ["latest_step_dir", "read_meta", "restore_into", "read_params", "read_rng", "first_difference",
           "LEGACY_STATES"]

LEGACY_STATES = ("master", "m", "v")  # checkpoints written before meta["states"] existed
_REQUIRED = ("step", "optimizer", "params", "groups")


def latest_step_dir(directory: str | os.PathLike) -> Path:
    """The newest complete ``step_<N>`` under ``directory`` (or ``directory`` itself if it is one).

    Raises:
      CheckpointError: no complete checkpoint there.
    """
    root = Path(directory)
    if fmt.is_complete(root):
        return root
    steps = fmt.list_steps(root)
    if not steps:
        raise CheckpointError(f"no zinf_jax checkpoint in {str(root)!r} (expected step_<N>/{fmt.META}); check the path")
    return steps[-1][1]


def read_meta(step_dir: str | os.PathLike) -> dict[str, Any]:
    """The ``zinf_meta.json`` of one checkpoint (:class:`CheckpointError` naming it if missing or damaged)."""
    path = Path(step_dir) / fmt.META
    meta = read_json(path, "metadata")
    missing = [k for k in _REQUIRED if k not in meta] if isinstance(meta, dict) else list(_REQUIRED)
    if missing:
        raise CheckpointError(f"checkpoint metadata {str(path)!r} is damaged: no {', '.join(missing)}")
    return meta


def checksum_table(step_dir: Path, meta: Mapping[str, Any]) -> dict[str, list] | None:
    """The checksum table (None for a checkpoint written before checksums existed)."""
    if meta.get("format") == fmt.FORMATS[1] and not (step_dir / fmt.CHECKSUMS).exists():
        return None
    return read_table(step_dir)


def orbax_read(step_dir: Path, name: str, target: dict) -> dict:
    args = ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))
    try:
        return ocp.PyTreeCheckpointer().restore(step_dir / name, args=args)
    except Exception as e:
        line = next((ln for ln in str(e).splitlines() if ln.strip()), "")[:300]
        raise CheckpointError(f"checkpoint {str(step_dir / name)!r} cannot be read: {type(e).__name__}: {line}") from e


def read_params(view: TrainingState, step_dir: Path, meta: Mapping[str, Any], table: Any,
                 procs: Procs) -> Iterator[tuple[str, dict[str, dict[int, np.ndarray]]]]:
    """Each saved parameter's states as this process's shards: ``(path, {state: {index: float32 stored form}})``."""
    states = meta.get("states") or {p: list(LEGACY_STATES) for p in meta["params"]}
    for k, group in enumerate(meta["groups"]):
        name = fmt.group_name(k)
        verify(step_dir, table, name, procs)
        by_state: dict[str, dict[str, Any]] = {}
        for p in group:
            lay = view.layouts[p]
            for s in states[p]:
                by_state.setdefault(s, {})[p] = jax.ShapeDtypeStruct(lay.shape, jnp.float32,
                                                                     sharding=sharding_of(view, lay))
        tree = orbax_read(step_dir, name, {s: nest(v) for s, v in by_state.items()})
        flat = {s: flatten(t) for s, t in tree.items()}
        del tree
        for p in group:
            lay = view.layouts[p]
            out = {}
            for s in states[p]:
                arr = flat[s].pop(p)
                if lay.kind == "flat":
                    arr = jax.jit(lambda a: to_stored(lay, a), out_shardings=NamedSharding(view.mesh, lay.spec))(arr)
                out[s] = {i: np.asarray(x, np.float32) for i, x in split_local(lay, view.mesh, arr).items()}
            yield p, out


def read_rng(view: TrainingState, step_dir: Path, table: Any, procs: Procs) -> dict[str, Any] | None:
    if not (step_dir / fmt.RNG).exists() and (table is None or not any(n.startswith(fmt.RNG + "/") for n in table)):
        return None
    verify(step_dir, table, fmt.RNG, procs)
    rep = NamedSharding(view.mesh, P())
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rep) for k, v in rng_tree(view).items()}
    return orbax_read(step_dir, fmt.RNG, target)


def first_difference(view: TrainingState, step_dir: Path, meta: Mapping[str, Any], procs: Procs) -> str | None:
    """The first state that differs between the engine and a checkpoint of the same metadata, else None.

    Reads (and verifies) the whole checkpoint and the engine's state once; collective.
    """
    table = checksum_table(step_dir, meta)
    verify(step_dir, table, fmt.META, procs)
    diff = None
    for path, saved in read_params(view, step_dir, meta, table, procs):
        for s, shards in saved.items():
            for i, v in shards.items():
                if diff is None and not np.array_equal(v.view(np.uint32), view.read(path, i, s).view(np.uint32)):
                    diff = f"{s!r} of {path!r}"
    rng = read_rng(view, step_dir, table, procs)
    for k, v in (rng or {}).items():
        if diff is None and not np.array_equal(host_value(v), host_value(rng_tree(view)[k])):
            diff = f"the model state ({k})"
    hits = procs.gather(int(diff is not None))
    return diff or (f"a state on process {hits.index(1)}" if any(hits) else None)


def restore_into(view: TrainingState, step_dir: str | os.PathLike) -> dict[str, Any]:
    """Fills a freshly built engine's tiers from a checkpoint (any mesh size, any tier).

    Args:
      view: the engine's training state (``TrainingState(engine.components)``).
      step_dir: a complete ``step_<N>`` directory (:func:`latest_step_dir`).

    Every file is checked against ``checksums.json`` just before it is read.

    Returns:
      The checkpoint's metadata.

    Raises:
      CheckpointError: the checkpoint belongs to another model, or is damaged
        (the message names the file: missing, garbage, or not what was written).
    """
    step_dir = Path(step_dir).absolute()
    procs = Procs(f"zinf_restore:{step_dir}")
    meta = read_meta(step_dir)
    table = checksum_table(step_dir, meta)
    verify(step_dir, table, fmt.META, procs)
    mine, theirs = signature(view), meta["params"]
    if mine != theirs:
        diff = [p for p in sorted(set(mine) | set(theirs)) if mine.get(p) != theirs.get(p)][:3]
        raise CheckpointError(
            f"checkpoint {str(step_dir)!r} holds another model: parameters differ at {diff} "
            f"(model: {[mine.get(p) for p in diff]}, checkpoint: {[theirs.get(p) for p in diff]})"
        )
    fresh: list[str] = []  # trained now, but the checkpoint has other (or no) optimizer state for them
    for path, saved in read_params(view, step_dir, meta, table, procs):
        restarted = [view.write(path, i, {s: v[i] for s, v in saved.items()}) for i in view.local_indices(path)]
        fresh += [path] if any(restarted) else []
    if fresh:
        warnings.warn(f"checkpoint {str(step_dir)!r}: {len(fresh)} trained parameters (e.g. {fresh[0]!r}) have no "
                      "matching optimizer state there (frozen then, or another optimizer): their optimizer state "
                      "starts fresh from the saved values", UserWarning, stacklevel=3)
    saved_rng = read_rng(view, step_dir, table, procs)
    if saved_rng is not None:
        leaves, tree = jax.tree.flatten(view.model_state)
        new = []
        for i, x in enumerate(leaves):
            v = saved_rng[f"leaf_{i:04d}"]
            if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
                v = jax.random.wrap_key_data(jnp.asarray(v), impl=jax.random.key_impl(x))
            new.append(jax.device_put(v, x.sharding))
        view.model_state = jax.tree.unflatten(tree, new)
    view.user_state = meta.get("user_state", {})
    view.commit(meta["step"], meta["optimizer"])
    if not fresh:  # the engine now holds exactly this checkpoint: saving this step again needs no comparison
        remember(view, step_dir, meta.get("save_id"))
    return meta
