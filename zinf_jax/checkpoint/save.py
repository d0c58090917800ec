"""Saving a checkpoint with orbax: the whole training state, unit by unit, atomically.

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
    checksums.json     size and crc32 of every other file (see :mod:`zinf_jax.checkpoint.integrity`)

(the names: :mod:`zinf_jax.checkpoint.format`)

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
written anew. Retention (``max_to_keep``): see :mod:`zinf_jax.checkpoint.retention`;
restoring: :mod:`zinf_jax.checkpoint.restore`.

Reading a checkpoint without zinf_jax: see :mod:`zinf_jax.checkpoint`.
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Mapping

import orbax.checkpoint as ocp

from zinf_jax._internal.fs import fsync_dir, write_json
from zinf_jax._internal.multihost import Procs
from zinf_jax.checkpoint import format as fmt
from zinf_jax.checkpoint.failures import orbax_noise_held, write_error
from zinf_jax.checkpoint.integrity import write_checksums
from zinf_jax.checkpoint.owner import Owner
from zinf_jax.checkpoint.restore import first_difference, read_meta
from zinf_jax.checkpoint.retention import apply_retention, check_max_to_keep, remove_doomed_leftovers
from zinf_jax.checkpoint.state import TrainingState, is_known, remember
from zinf_jax.checkpoint.tree import global_state, nest, rng_tree, signature
from zinf_jax.errors import CheckpointError

__all__ = ["save"]

_SAME = ("step", "params", "groups", "states", "optimizer", "user_state")  # must match to re-save a step


def _write_arrays(view: TrainingState, tmp: Path) -> None:
    ckptr = ocp.PyTreeCheckpointer()
    for k, group in enumerate(view.groups):
        flat: dict[str, dict[str, Any]] = {}
        for p in group:
            for s in view.states(p):
                flat.setdefault(s, {})[p] = global_state(view, p, s)
        tree = {s: nest(v) for s, v in flat.items()}
        del flat
        ckptr.save(tmp / fmt.group_name(k), tree)
        del tree
    rng = rng_tree(view)
    if rng:
        ckptr.save(tmp / fmt.RNG, rng)


def save(view: TrainingState, directory: str | os.PathLike, *, user_state: Mapping[str, Any] | None = None,
         max_to_keep: int | None = None, owner: Owner | None = None, overwrite: bool = False) -> Path:
    """Writes ``<directory>/step_<N>`` for the engine's current step (see module doc).

    Every process of a multi-process job calls it, with the same ``directory``.

    Args:
      view: the engine's training state (``TrainingState(engine.components)``).
      directory: parent directory of the step directories (created).
      user_state: JSON-serialisable data stored with it (e.g. the data position);
        default ``engine.user_state``, which then becomes this (as a restore sets it).
      max_to_keep: once the new checkpoint is complete, delete the oldest complete
        ``step_*`` checkpoints so that at most this many remain (the new one is
        never deleted, nor one newer than it; nothing is deleted if the save fails). ``None`` keeps all.
      owner: the directories the engine holds (:mod:`zinf_jax.checkpoint.owner`): process 0 takes this one's lock.
      overwrite: save even if the directory holds a newer complete checkpoint (a run restored from an older
        step going on); without it that is an error, as orbax's CheckpointManager refuses a step at or below its
        latest.

    Returns:
      The step directory.

    Raises:
      ValueError: ``max_to_keep`` is not a positive int or None.
      TypeError: ``user_state`` is not JSON data (before anything is written).
      CheckpointError: ``step_<N>`` exists and holds another state; a newer step is there (and not
        ``overwrite``); another job holds the directory; the disk is full or another I/O error (the temporary
        directory is removed first).
    """
    check_max_to_keep(max_to_keep)
    root = Path(directory).absolute()  # orbax wants absolute paths
    final = root / fmt.step_name(view.step)
    meta = json.loads(json.dumps({  # as it reads back; raises TypeError now if user_state is not JSON data
        "format": fmt.FORMAT, "step": view.step, "optimizer": view.counters(), "config": view.config(),
        "params": signature(view), "groups": [list(g) for g in view.groups],
        "states": {p: list(view.states(p)) for p in view.layouts},
        "user_state": dict(user_state if user_state is not None else view.user_state),
    }, default=str))
    procs = Procs(f"zinf_save:{final}")
    if procs.primary:
        root.mkdir(parents=True, exist_ok=True)
        if owner is not None:
            owner.hold(root)  # See zinf_jax.checkpoint.owner
        newer = [n for n, _ in fmt.list_steps(root) if n > view.step]
        if newer and not overwrite:
            raise CheckpointError(
                f"{str(root)!r} holds a newer checkpoint (step {max(newer)}) than this one (step {view.step}): a run "
                "restored from an older step is going on. Save with overwrite=True to keep both (retention never "
                "deletes the newer ones), or save into another directory")
        remove_doomed_leftovers(root)
    token = f"{procs.gather(int.from_bytes(os.urandom(4), 'little') >> 1)[0]:08x}"  # process 0's
    meta["save_id"] = token
    if _existing(view, final, meta, procs):
        view.user_state = meta["user_state"]
        if procs.primary:
            apply_retention(root, final, max_to_keep)
        return final
    tmp = root / fmt.temp_name(final.name, token)
    with orbax_noise_held(tmp, remove_on_failure=procs.primary):  # removes tmp (process 0) if this fails
        try:
            if procs.primary:
                tmp.mkdir()
            procs.sync("tmp")
            _write_arrays(view, tmp)
            procs.sync("arrays")
            if procs.primary:
                write_json(tmp / fmt.META, meta, indent=1)
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
    remember(view, final, token)
    view.user_state = meta["user_state"]
    if procs.primary:
        apply_retention(root, final, max_to_keep)
    return final


def _compare_meta(view: TrainingState, final: Path, meta: dict) -> tuple[int, str]:
    """1: same state, known; 2: same metadata, arrays to compare; 3: damaged; 4: another state (message)."""
    try:
        old = read_meta(final)
    except CheckpointError as e:
        return 3, str(e)
    if old.get("format") not in fmt.FORMATS:
        return 4, f"{str(final / fmt.META)!r} is of another format ({old.get('format')!r})"
    diff = next((k for k in _SAME if old.get(k) != meta[k]), None)
    if diff is not None:
        return 4, (f"checkpoint {str(final)!r} already exists and holds another training state ({diff!r} differs: "
                   f"{_short(old.get(diff))} there, {_short(meta[diff])} now); save to another directory, or "
                   "delete it to overwrite")
    return (1, "") if is_known(view, final, old.get("save_id")) else (2, "")


def _short(x: Any) -> str:
    s = json.dumps(x, default=str)
    return s if len(s) <= 120 else s[:117] + "..."


def _existing(view: TrainingState, final: Path, meta: dict, procs: Procs) -> bool:
    """Whether ``final`` already holds this state (a damaged one is set aside: False).

    Raises:
      CheckpointError: it holds another state.
    """
    code, msg = _compare_meta(view, final, meta) if procs.primary and final.exists() else (0, "")
    code = procs.gather(code)[0]
    old_id = read_meta(final).get("save_id") if code in (1, 2) else None
    if code == 2:
        try:
            diff = first_difference(view, final, read_meta(final), procs)
            code, msg = (4, f"checkpoint {str(final)!r} already exists and holds another training state ({diff} "
                            "differs); save to another directory, or delete it to overwrite") if diff else (1, "")
        except CheckpointError as e:
            code, msg = 3, str(e)
    if code == 4:
        raise CheckpointError(msg or _compare_meta(view, final, meta)[1] or f"{final} holds another state")
    if code == 3:
        if procs.primary:
            aside = fmt.set_aside(final, fmt.BAD)
            warnings.warn(f"{msg}; set it aside as {str(aside)!r} and saving this step anew", RuntimeWarning,
                          stacklevel=3)
        procs.sync("set aside")
    if code == 1:
        remember(view, final, old_id)
    return code == 1
