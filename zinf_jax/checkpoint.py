"""Checkpoints with orbax: the whole training state, unit by unit, atomically, verified on restore.

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
    checksums.json     size and crc32 of every other file (see :mod:`zinf_jax.ckpt_integrity`)

Groups are written one at a time from the optimizer tier, so the state is never
all in RAM at once, even when it lives on NVMe. The step directory is assembled
under a hidden temporary name (``.tmp_step_<N>_<token>``) and renamed into place
only when complete and durable, so a kill at any moment leaves the previous
checkpoints as they were and no half ``step_<N>``. ``restore_into`` verifies
every file against ``checksums.json`` just before reading it: damage is a
:class:`CheckpointError` naming the file, never NaNs in the next step.

Multi-host: every process writes its own shards (orbax's multi-process save of
global arrays, into the same directory, on a file system all processes see);
process 0 alone creates the temporary directory (its token broadcast), writes
the metadata and the checksum table, renames, and applies retention; barriers
(``sync_global_devices``) order these steps.

Saving a step that is already saved returns that checkpoint if it holds the same
state (metadata equal, and the arrays equal unless this engine wrote or restored
that very checkpoint since its last step); another state there is a
:class:`CheckpointError`, so no run silently keeps another run's checkpoint. A
damaged one there is set aside as ``.bad_step_<N>_*`` (with a warning) and
written anew. Retention (``max_to_keep``): see :mod:`zinf_jax.retention`.

Reading without zinf_jax, on any device count (the arrays come back as numpy)::

    import jax, numpy as np, orbax.checkpoint as ocp
    group = "ckpt/step_00000030/group_0003"  # zinf_meta.json's "groups" lists the params of each
    ckptr = ocp.PyTreeCheckpointer()
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
                            ckptr.metadata(group).item_metadata.tree)
    tree = ckptr.restore(group, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
    tree["master"]["blocks"]["3"]["mlp"]["kernel"]   # float32 numpy array
"""
from __future__ import annotations

import json
import os
import warnings
import weakref
from pathlib import Path
from typing import Any, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec as P

from zinf_jax import ckpt_integrity as integrity
from zinf_jax.ckpt_failures import orbax_noise_held, write_error
from zinf_jax.ckpt_integrity import CHECKSUMS, CheckpointError, Procs, verify, write_checksums
from zinf_jax.retention import META, apply_retention, check_max_to_keep, fsync_dir, remove_doomed_leftovers, set_aside
from zinf_jax.sharding import ParamLayout, assemble, from_stored, split_local, to_stored
from zinf_jax.training_state import FROZEN, TrainingState

__all__ = ["save", "restore_into", "latest_step_dir", "read_meta", "CheckpointError", "META", "FROZEN"]

FORMAT = "zinf_jax.checkpoint/2"  # /2: checksums.json; /1 checkpoints are read unverified
LEGACY_STATES = ("master", "m", "v")  # checkpoints written before meta["states"] existed
_REQUIRED = ("step", "optimizer", "params", "groups")
_SAME = ("step", "params", "groups", "states", "optimizer", "user_state")  # must match to re-save a step
_SAVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> {step dir: (save_id, version)}


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
    """The ``zinf_meta.json`` of one checkpoint (:class:`CheckpointError` naming it if missing or damaged)."""
    path = Path(step_dir) / META
    meta = integrity.read_json(path, "metadata")
    missing = [k for k in _REQUIRED if k not in meta] if isinstance(meta, dict) else list(_REQUIRED)
    if missing:
        raise CheckpointError(f"checkpoint metadata {str(path)!r} is damaged: no {', '.join(missing)}")
    return meta


def _signature(view: TrainingState) -> dict[str, list]:
    return {p: [list(l.shape), l.dtype] for p, l in view.layouts.items()}


def _nest(flat: Mapping[str, Any]) -> dict:
    return traverse_util.unflatten_dict({tuple(k.split("/")): v for k, v in flat.items()})


def _flatten(tree: Mapping) -> dict[str, Any]:
    return {"/".join(k): v for k, v in traverse_util.flatten_dict(tree).items()}


def _sharding(view: TrainingState, lay: ParamLayout) -> NamedSharding:
    """How a parameter is written: its own sharding, or replicated when it is ``flat`` (no dimension divides)."""
    return NamedSharding(view.mesh, P() if lay.kind == "flat" else lay.spec)


def _global_state(view: TrainingState, path: str, which: str) -> jax.Array:
    """One state of one parameter as a global array in its own shape."""
    lay = view.layouts[path]
    stored = assemble(lay, view.mesh, {i: view.read(path, i, which) for i in view.local_indices(path)})
    if lay.kind != "flat":
        return stored
    return jax.jit(lambda s: from_stored(lay, s), out_shardings=_sharding(view, lay))(stored)


def _rng_tree(view: TrainingState) -> dict[str, Any]:
    leaves = jax.tree.leaves(view.model_state)
    return {f"leaf_{i:04d}": jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
            for i, x in enumerate(leaves)}


def _write_arrays(view: TrainingState, tmp: Path) -> None:
    ckptr = ocp.PyTreeCheckpointer()
    for k, group in enumerate(view.groups):
        flat: dict[str, dict[str, jax.Array]] = {}
        for p in group:
            for s in view.states(p):
                flat.setdefault(s, {})[p] = _global_state(view, p, s)
        tree = {s: _nest(v) for s, v in flat.items()}
        del flat
        ckptr.save(tmp / f"group_{k:04d}", tree)
        del tree
    rng = _rng_tree(view)
    if rng:
        ckptr.save(tmp / "rng", rng)


def save(engine: Any, directory: str | os.PathLike, *, user_state: Mapping[str, Any] | None = None,
         max_to_keep: int | None = None) -> Path:
    """Writes ``<directory>/step_<N>`` for the engine's current step (see module doc).

    Every process of a multi-process job calls it, with the same ``directory``.

    Args:
      engine: the engine.
      directory: parent directory of the step directories (created).
      user_state: JSON-serialisable data stored with it (e.g. the data position);
        default ``engine.user_state``, which then becomes this (as a restore sets it).
      max_to_keep: once the new checkpoint is complete, delete the oldest complete
        ``step_*`` checkpoints so that at most this many remain (the new one is
        never deleted; nothing is deleted if the save fails). ``None`` keeps all.

    Returns:
      The step directory.

    Raises:
      ValueError: ``max_to_keep`` is not a positive int or None.
      TypeError: ``user_state`` is not JSON data (before anything is written).
      CheckpointError: ``step_<N>`` exists and holds another state; the disk is
        full or another I/O error (the temporary directory is removed first).
    """
    check_max_to_keep(max_to_keep)
    view = TrainingState(engine)
    root = Path(directory).absolute()  # orbax wants absolute paths
    final = root / f"step_{view.step:08d}"
    meta = json.loads(json.dumps({  # as it reads back; raises TypeError now if user_state is not JSON data
        "format": FORMAT, "step": view.step, "optimizer": view.counters(), "config": view.config(),
        "params": _signature(view), "groups": [list(g) for g in view.groups],
        "states": {p: list(view.states(p)) for p in view.layouts},
        "user_state": dict(user_state if user_state is not None else view.user_state),
    }, default=str))
    procs = Procs(f"zinf_save:{final}")
    if procs.primary:
        root.mkdir(parents=True, exist_ok=True)
        remove_doomed_leftovers(root)
    token = f"{procs.gather(int.from_bytes(os.urandom(4), 'little') >> 1)[0]:08x}"  # process 0's
    meta["save_id"] = token
    if _existing(engine, view, final, meta, procs):
        view.user_state = meta["user_state"]
        if procs.primary:
            apply_retention(root, final, max_to_keep)
        return final
    tmp = root / f".tmp_{final.name}_{token}"
    with orbax_noise_held(tmp, remove_on_failure=procs.primary):  # removes tmp (process 0) if this fails
        try:
            if procs.primary:
                tmp.mkdir()
            procs.sync("tmp")
            _write_arrays(view, tmp)
            procs.sync("arrays")
            if procs.primary:
                integrity.write_json(tmp / META, meta)
            procs.sync("meta")
            write_checksums(tmp, procs)
            if procs.primary:
                os.rename(tmp, final)
                fsync_dir(root)
            procs.sync("renamed")
        except BaseException as e:
            err = write_error(e, final, sum(4 * l.size * len(view.states(p)) for p, l in view.layouts.items()))
            if err is None:
                raise
            e.__traceback__ = None  # frees orbax's failed futures (they log when collected, held here)
            raise err from e
    _SAVED.setdefault(engine, {})[str(final)] = (token, view.version())
    view.user_state = meta["user_state"]
    if procs.primary:
        apply_retention(root, final, max_to_keep)
    return final


def _compare_meta(engine: Any, view: TrainingState, final: Path, meta: dict) -> tuple[int, str]:
    """1: same state, known; 2: same metadata, arrays to compare; 3: damaged; 4: another state (message)."""
    try:
        old = read_meta(final)
    except CheckpointError as e:
        return 3, str(e)
    if old.get("format") not in (FORMAT, "zinf_jax.checkpoint/1"):
        return 4, f"{str(final / META)!r} is of another format ({old.get('format')!r})"
    diff = next((k for k in _SAME if old.get(k) != meta[k]), None)
    if diff is not None:
        return 4, (f"checkpoint {str(final)!r} already exists and holds another training state ({diff!r} differs: "
                   f"{_short(old.get(diff))} there, {_short(meta[diff])} now); save to another directory, or "
                   "delete it to overwrite")
    known = _SAVED.get(engine, {}).get(str(final))
    return (1, "") if known == (old.get("save_id"), view.version()) else (2, "")


def _short(x: Any) -> str:
    s = json.dumps(x, default=str)
    return s if len(s) <= 120 else s[:117] + "..."


def _existing(engine: Any, view: TrainingState, final: Path, meta: dict, procs: Procs) -> bool:
    """Whether ``final`` already holds this state (a damaged one is set aside: False).

    Raises:
      CheckpointError: it holds another state.
    """
    code, msg = _compare_meta(engine, view, final, meta) if procs.primary and final.exists() else (0, "")
    code = procs.gather(code)[0]
    old_id = read_meta(final).get("save_id") if code in (1, 2) else None
    if code == 2:
        try:
            diff = _first_difference(view, final, read_meta(final), procs)
            code, msg = (4, f"checkpoint {str(final)!r} already exists and holds another training state ({diff} "
                            "differs); save to another directory, or delete it to overwrite") if diff else (1, "")
        except CheckpointError as e:
            code, msg = 3, str(e)
    if code == 4:
        raise CheckpointError(msg or _compare_meta(engine, view, final, meta)[1] or f"{final} holds another state")
    if code == 3:
        if procs.primary:
            aside = set_aside(final, ".bad_")
            warnings.warn(f"{msg}; set it aside as {str(aside)!r} and saving this step anew", RuntimeWarning,
                          stacklevel=3)
        procs.sync("set aside")
    if code == 1:
        _SAVED.setdefault(engine, {})[str(final)] = (old_id, view.version())
    return code == 1


def _table(step_dir: Path, meta: Mapping[str, Any]) -> dict[str, list] | None:
    """The checksum table (None for a checkpoint written before checksums existed)."""
    if meta.get("format") == "zinf_jax.checkpoint/1" and not (step_dir / CHECKSUMS).exists():
        return None
    return integrity.read_table(step_dir)


def _orbax_read(step_dir: Path, name: str, target: dict) -> dict:
    args = ocp.args.PyTreeRestore(item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target))
    try:
        return ocp.PyTreeCheckpointer().restore(step_dir / name, args=args)
    except Exception as e:
        line = next((ln for ln in str(e).splitlines() if ln.strip()), "")[:300]
        raise CheckpointError(f"checkpoint {str(step_dir / name)!r} cannot be read: {type(e).__name__}: {line}") from e


def _read_params(view: TrainingState, step_dir: Path, meta: Mapping[str, Any], table: Any,
                 procs: Procs) -> Iterator[tuple[str, dict[str, dict[int, np.ndarray]]]]:
    """Each saved parameter's states as this process's shards: ``(path, {state: {index: float32 stored form}})``."""
    states = meta.get("states") or {p: list(LEGACY_STATES) for p in meta["params"]}
    for k, group in enumerate(meta["groups"]):
        name = f"group_{k:04d}"
        verify(step_dir, table, name, procs)
        by_state: dict[str, dict[str, Any]] = {}
        for p in group:
            lay = view.layouts[p]
            for s in states[p]:
                by_state.setdefault(s, {})[p] = jax.ShapeDtypeStruct(lay.shape, jnp.float32,
                                                                     sharding=_sharding(view, lay))
        tree = _orbax_read(step_dir, name, {s: _nest(v) for s, v in by_state.items()})
        flat = {s: _flatten(t) for s, t in tree.items()}
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


def _read_rng(view: TrainingState, step_dir: Path, table: Any, procs: Procs) -> dict[str, Any] | None:
    if not (step_dir / "rng").exists() and (table is None or not any(n.startswith("rng/") for n in table)):
        return None
    verify(step_dir, table, "rng", procs)
    rep = NamedSharding(view.mesh, P())
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rep) for k, v in _rng_tree(view).items()}
    return _orbax_read(step_dir, "rng", target)


def _host(x: Any) -> np.ndarray:
    """A replicated array's value (of this process's first device: no cross-process fetch)."""
    return np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x)


def _first_difference(view: TrainingState, step_dir: Path, meta: Mapping[str, Any], procs: Procs) -> str | None:
    """The first state that differs between the engine and a checkpoint of the same metadata, else None.

    Reads (and verifies) the whole checkpoint and the engine's state once; collective.
    """
    table = _table(step_dir, meta)
    verify(step_dir, table, META, procs)
    diff = None
    for path, saved in _read_params(view, step_dir, meta, table, procs):
        for s, shards in saved.items():
            for i, v in shards.items():
                if diff is None and not np.array_equal(v.view(np.uint32), view.read(path, i, s).view(np.uint32)):
                    diff = f"{s!r} of {path!r}"
    rng = _read_rng(view, step_dir, table, procs)
    for k, v in (rng or {}).items():
        if diff is None and not np.array_equal(_host(v), _host(_rng_tree(view)[k])):
            diff = f"the model state ({k})"
    hits = procs.gather(int(diff is not None))
    return diff or (f"a state on process {hits.index(1)}" if any(hits) else None)


def restore_into(engine: Any, step_dir: str | os.PathLike) -> dict[str, Any]:
    """Fills a freshly built engine's tiers from a checkpoint (any mesh size, any tier).

    Every file is checked against ``checksums.json`` just before it is read.

    Returns:
      The checkpoint's metadata.

    Raises:
      CheckpointError: the checkpoint belongs to another model, or is damaged
        (the message names the file: missing, garbage, or not what was written).
    """
    view = TrainingState(engine)
    step_dir = Path(step_dir).absolute()
    procs = Procs(f"zinf_restore:{step_dir}")
    meta = read_meta(step_dir)
    table = _table(step_dir, meta)
    verify(step_dir, table, META, procs)
    mine, theirs = _signature(view), meta["params"]
    if mine != theirs:
        diff = [p for p in sorted(set(mine) | set(theirs)) if mine.get(p) != theirs.get(p)][:3]
        raise CheckpointError(
            f"checkpoint {str(step_dir)!r} holds another model: parameters differ at {diff} "
            f"(model: {[mine.get(p) for p in diff]}, checkpoint: {[theirs.get(p) for p in diff]})"
        )
    fresh: list[str] = []  # trained now, but the checkpoint has other (or no) optimizer state for them
    for path, saved in _read_params(view, step_dir, meta, table, procs):
        restarted = [view.write(path, i, {s: v[i] for s, v in saved.items()}) for i in view.local_indices(path)]
        fresh += [path] if any(restarted) else []
    if fresh:
        warnings.warn(f"checkpoint {str(step_dir)!r}: {len(fresh)} trained parameters (e.g. {fresh[0]!r}) have no "
                      "matching optimizer state there (frozen then, or another optimizer): their optimizer state "
                      "starts fresh from the saved values", UserWarning, stacklevel=3)
    saved_rng = _read_rng(view, step_dir, table, procs)
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
        _SAVED.setdefault(engine, {})[str(step_dir)] = (meta.get("save_id"), view.version())
    return meta
