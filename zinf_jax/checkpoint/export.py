"""Trained weights out: the parameters as safetensors files, unit by unit, in size-capped shards.

:func:`save_safetensors` reads one parameter at a time (the fp32 master of a trained one, the
stored value of a frozen one), renames it (and may transpose or reshape it, e.g. back to Hugging
Face's ``[out, in]``), casts it to ``dtype``, and writes a shard file as soon as the next tensor
would take it over ``max_shard_bytes``: host RAM holds one shard at a time, never the model. With
more than one shard, ``model-00001-of-0000N.safetensors`` files and a
``model.safetensors.index.json`` (``{"metadata": {"total_size"}, "weight_map": {name: file}}``)
are written, as Hugging Face does; one shard is a single ``model.safetensors``. Every file is
written under a temporary name and renamed when complete; ``safetensors.numpy.load_file`` (and so
any Hugging Face loader) reads them.

Tied weights: ``rename`` may map several parameters to one tensor name (a head kept equal to the
embedding table it was loaded from, :data:`~zinf_jax.engine.weights.TIED_EMBEDDINGS`); the tensor is
written once, and only if their values, as written, are bitwise equal. A model whose head *is* its
embedding (one parameter read twice) has one parameter, written once.
"""
from __future__ import annotations

import collections
import os
from pathlib import Path
from typing import Callable

import numpy as np

from zinf_jax._internal.fs import fsync_dir, write_json
from zinf_jax.checkpoint import format as fmt
from zinf_jax.checkpoint.state import TrainingState
from zinf_jax.engine.weights import INDEX, TensorMap

__all__ = ["save_safetensors", "SINGLE"]

SINGLE = "model.safetensors"
"""The file name of a one-shard export."""


def _target(rename: Callable | None, path: str) -> TensorMap | None:
    t = rename(path) if rename is not None else path.replace("/", ".")
    return TensorMap(t) if isinstance(t, str) else t


def _write(tensors: dict[str, np.ndarray], final: Path) -> None:
    from safetensors.numpy import save_file

    tmp = final.with_name(fmt.TMP + final.name)
    save_file(tensors, str(tmp), metadata={"format": "np"})
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)


def save_safetensors(view: TrainingState, directory: str | os.PathLike, *, rename: Callable | None = None,
                     dtype: str | None = None, max_shard_bytes: int = 5 << 30) -> list[Path]:
    """Writes the parameters as safetensors (see the module doc); returns the files written.

    Args:
      view: the engine's training state.
      directory: where the files go (created; existing files of the same names are replaced).
      rename: ``rename(model path) -> tensor name | TensorMap | None`` (None: leave it out; default:
        the path with ``/`` as ``.``).
      dtype: the files' dtype (``"bfloat16"``, ``"float16"``, ``"float32"``...; default float32).
      max_shard_bytes: the largest shard file (a tensor larger than this gets a file of its own).

    Raises:
      ValueError: two parameters renamed to one name whose values differ, or a bad reshape.
      RuntimeError: a multi-process job (each process holds only some shards).
    """
    import ml_dtypes  # noqa: F401  (bfloat16 for numpy)

    out_dtype = np.dtype(dtype or "float32") if dtype != "bfloat16" else np.dtype(ml_dtypes.bfloat16)
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = []
    current: dict[str, np.ndarray] = {}
    size, total, names = 0, 0, {}
    tied: dict[str, np.ndarray] = {}  # name -> the value written, of a name two parameters map to
    targets = {path: _target(rename, path) for group in view.groups for path in group}
    uses = collections.Counter(how.path for how in targets.values() if how is not None)
    written: list[Path] = []

    def flush() -> None:
        nonlocal current, size
        if current:
            name = f".part_{len(shards):05d}.safetensors"
            _write(current, root / name)
            written.append(root / name)
            shards.append({k: None for k in current})  # names only: the data is on disk
            current, size = {}, 0

    for group in view.groups:  # unit by unit, in the model's order
        for path in group:
            how = targets[path]
            if how is None:
                continue
            value = view.value(path)
            if how.transpose is not None:
                value = np.transpose(value, how.transpose)
            if how.reshape is not None:
                value = value.reshape(how.reshape)
            value = np.ascontiguousarray(value.astype(out_dtype))
            if how.path in names:  # tied: written once, if the values agree
                first = tied.get(how.path)
                if first is None or first.shape != value.shape or first.tobytes() != value.tobytes():
                    raise ValueError(f"save_safetensors: {path!r} and {names[how.path]!r} are both renamed to "
                                     f"{how.path!r} and their values differ (tied parameters must stay equal; "
                                     "rename one to another name, or to None to leave it out)")
                continue
            names[how.path] = path
            if uses[how.path] > 1:  # kept to compare the others with
                tied[how.path] = value
            if current and size + value.nbytes > max_shard_bytes:
                flush()
            current[how.path] = value
            size += value.nbytes
            total += value.nbytes
    flush()
    n = len(shards)
    final = [root / (SINGLE if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors") for k in range(n)]
    for part, dest in zip(written, final):
        os.replace(part, dest)
    if n > 1:
        weight_map = {name: dest.name for shard, dest in zip(shards, final) for name in shard}
        tmp = root / (fmt.TMP + INDEX)
        write_json(tmp, {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2)
        os.replace(tmp, root / INDEX)
    fsync_dir(root)
    return final + ([root / INDEX] if n > 1 else [])
