"""Checkpoints: the whole training state, unit by unit, atomically, verified on restore.

In data-flow order:

* :mod:`~zinf_jax.checkpoint.format`: the on-disk names (``step_<N>``, ``zinf_meta.json``,
  ``checksums.json``, the ``.tmp_``/``.del_``/``.bad_`` prefixes) and listing steps; the only module
  that spells them (standard library only).
* :mod:`~zinf_jax.checkpoint.state`: :class:`TrainingState`, the engine's state as a checkpoint
  sees it, per (parameter, shard, state name), and which checkpoint an engine holds exactly.
* :mod:`~zinf_jax.checkpoint.tree`: that state as orbax trees of global arrays.
* :mod:`~zinf_jax.checkpoint.save`: :func:`save`, assembled under a temporary name and renamed.
* :mod:`~zinf_jax.checkpoint.restore`: :func:`latest_step_dir`, :func:`read_meta`, :func:`restore_into`.
* :mod:`~zinf_jax.checkpoint.integrity`: a crc32 per file, verified just before each read.
* :mod:`~zinf_jax.checkpoint.failures`: a failed write (a full disk) as one error line.
* :mod:`~zinf_jax.checkpoint.policies`: when to save (orbax's save-decision policies).
* :mod:`~zinf_jax.checkpoint.retention`: ``max_to_keep`` (orbax's ``LatestN``), crash-safe deletes.

Reading without zinf_jax, on any device count (the arrays come back as numpy)::

    import jax, numpy as np, orbax.checkpoint as ocp
    group = "ckpt/step_00000030/group_0003"  # zinf_meta.json's "groups" lists the params of each
    ckptr = ocp.PyTreeCheckpointer()
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
                            ckptr.metadata(group).item_metadata.tree)
    tree = ckptr.restore(group, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
    tree["master"]["blocks"]["3"]["mlp"]["kernel"]   # float32 numpy array
"""
from zinf_jax.checkpoint.format import META
from zinf_jax.checkpoint.restore import latest_step_dir, read_meta, restore_into
from zinf_jax.checkpoint.save import save
from zinf_jax.checkpoint.state import FROZEN, TrainingState
from zinf_jax.errors import CheckpointError

__all__ = ["save", "restore_into", "latest_step_dir", "read_meta", "TrainingState", "CheckpointError", "META",
           "FROZEN"]
