"""Open weights in: safetensors files as a lazy source of initial parameter values.

:func:`from_safetensors` opens one ``.safetensors`` file, a directory of them, or a sharded
``model.safetensors.index.json``, reads only the headers, and maps each tensor's name onto a
model path with ``rename`` (which may also transpose or reshape it: Hugging Face's ``[out, in]``
Linear weights are Flax's ``[in, out]`` kernels). Nothing is read until the engine asks: each
parameter is a :class:`LazyTensor` that reads the slices each device's shard needs, straight
from the memory-mapped file (``safetensors.safe_open(...).get_slice``), converted to the model's
dtype. So a process reads only its own shards (the bandwidth-centric load of ZeRO-Infinity), one
init batch at a time, and the whole model is never in host RAM. The file handles are opened per
read and closed after it: the mapped pages a read touched leave the process with it.

Tied weights: ``rename`` may map one file tensor to several model paths (a list: the embedding
table that is also a separate head's kernel), and ``fill`` names, for a tensor a file may lack,
the tensor that stands in for it (``{"lm_head.weight": "model.embed_tokens.weight"}``:
:data:`TIED_EMBEDDINGS`, what Qwen3, Gemma and Llama 3.2 checkpoints with tied embeddings need
for a model with its own head).

Reads: a process reads each byte of a tensor at most once per parameter it feeds
(:meth:`LazyTensor.read_slices`): the slices of its devices are read together, a slice shared by
several of its devices once, and a reshaped tensor whole once for all of them.

Errors name the tensor: a model parameter no file holds, a file tensor ``rename`` maps nowhere
(return ``None`` from ``rename`` to skip one on purpose), two tensors mapped to one parameter,
or a shape that differs from the model's.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

__all__ = ["TensorMap", "Rename", "LazyTensor", "SafetensorsSource", "from_safetensors", "INDEX", "TIED_EMBEDDINGS"]

INDEX = "model.safetensors.index.json"
"""The index file of a sharded checkpoint (Hugging Face's name): ``{"weight_map": {tensor: file}}``."""


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """Where a tensor goes, and how it changes on the way.

    Attributes:
      path: the other side's name: the model path (``"layers/0/attn/q/kernel"``) when loading, the
        file's tensor name when exporting.
      transpose: axes permutation applied to the tensor (``(1, 0)``: ``[out, in]`` <-> ``[in, out]``).
      reshape: the shape after the transpose (e.g. splitting heads: ``(d_model, n_heads, head_dim)``).
    """

    path: str
    transpose: tuple[int, ...] | None = None
    reshape: tuple[int, ...] | None = None


Rename = Callable[[str], "str | TensorMap | Sequence[str | TensorMap] | None"]
"""``rename(name) -> path | TensorMap | [path | TensorMap, ...] | None``: where a tensor goes (a list: to
each of several model paths, e.g. a tied embedding that is also a head's kernel; ``None``: skip it)."""

TIED_EMBEDDINGS: Mapping[str, str] = {"lm_head.weight": "model.embed_tokens.weight"}
"""``from_safetensors(..., fill=TIED_EMBEDDINGS)``: a Hugging Face checkpoint with tied embeddings (no
``lm_head.weight``) read into a model with a separate head, the head taken from the embedding table."""


def _as_map(target: str | TensorMap | None) -> TensorMap | None:
    return TensorMap(target) if isinstance(target, str) else target


def _as_maps(target: Any) -> list[TensorMap]:
    """``rename``'s answer as a list of maps (empty: skip the tensor)."""
    if target is None:
        return []
    if isinstance(target, (str, TensorMap)):
        return [_as_map(target)]
    return [_as_map(t) for t in target if t is not None]


def slice_key(idx: Any, shape: Sequence[int]) -> tuple[tuple[int, int, int], ...]:
    """An index of ``shape`` (a tuple of slices, as ``jax.make_array_from_callback`` passes) as a hashable
    key: ``(start, stop, step)`` per dimension."""
    idx = idx if isinstance(idx, tuple) else (idx,)
    idx = idx + (slice(None),) * (len(shape) - len(idx))
    return tuple(s.indices(n) for s, n in zip(idx, shape))


def _load_ml_dtypes() -> None:
    import ml_dtypes  # noqa: F401  (registers bfloat16 & co with numpy, which safetensors' numpy reader needs)


class _Counter:
    """Bytes read from the files, across threads."""

    def __init__(self) -> None:
        self.bytes = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.bytes += n


class LazyTensor:
    """One model parameter, read from a safetensors file on demand, slice by slice.

    Indexing (``t[idx]``, as :func:`jax.make_array_from_callback` does per device) reads only
    that slice when ``rename`` only transposed (or did nothing); a reshape reads the whole tensor.
    ``np.asarray(t)`` reads all of it. :meth:`read_slices` reads the slices of a process's devices
    together, each byte once.

    Attributes:
      shape: the shape in the model (after the transpose and reshape).
      dtype: the file's dtype (the engine converts to the model's).
      name: the tensor's name in the file; file: its file.
    """

    def __init__(self, file: Path, name: str, file_shape: tuple[int, ...], dtype: np.dtype, how: TensorMap,
                 counter: _Counter):
        self.file, self.name, self.dtype, self._how, self._counter = file, name, dtype, how, counter
        self._file_shape = file_shape
        shape = file_shape if how.transpose is None else tuple(file_shape[a] for a in how.transpose)
        if how.reshape is not None:
            if math.prod(how.reshape) != math.prod(shape):
                raise ValueError(f"safetensors {str(file)!r}: {name!r} of shape {file_shape} cannot be reshaped to "
                                 f"{tuple(how.reshape)} (rename's TensorMap for {how.path!r})")
            shape = tuple(how.reshape)
        self.shape: tuple[int, ...] = shape
        self.ndim = len(shape)

    def _read(self, file_index: tuple) -> np.ndarray:
        from safetensors import safe_open

        _load_ml_dtypes()
        with safe_open(str(self.file), framework="numpy") as f:
            out = np.array(f.get_slice(self.name)[file_index], copy=True)  # a copy: the mapping closes here
        self._counter.add(out.nbytes)
        return out

    def __getitem__(self, idx: Any) -> np.ndarray:
        idx = idx if isinstance(idx, tuple) else (idx,)
        if self._how.reshape is not None:  # a reshaped tensor is read whole, then cut
            return self.__array__()[idx]
        idx = idx + (slice(None),) * (len(self.shape) - len(idx))
        perm = self._how.transpose
        if perm is None:
            return self._read(idx)
        file_index = [slice(None)] * len(perm)
        for k, axis in enumerate(perm):  # model axis k is file axis perm[k]
            file_index[axis] = idx[k]
        return np.transpose(self._read(tuple(file_index)), perm)

    def read_slices(self, indices: Sequence[Any]) -> list[np.ndarray]:
        """The values at each of ``indices`` (as :meth:`__getitem__` takes them), each byte read once.

        Equal indices (devices of one process that hold the same shard: replicas over a mesh axis the
        parameter is not split on) are read once; a reshaped tensor is read whole once and cut for all
        (a slice of the reshaped tensor is not a slice of the file's).
        """
        keys = [slice_key(i, self.shape) for i in indices]
        if self._how.reshape is not None and keys:
            full = self.__array__()
            return [full[tuple(slice(*k) for k in key)] for key in keys]
        read: dict[tuple, np.ndarray] = {}
        for key in keys:
            if key not in read:
                read[key] = self[tuple(slice(*k) for k in key)]
        return [read[key] for key in keys]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        full = self._read(tuple(slice(None) for _ in self._file_shape))
        if self._how.transpose is not None:
            full = np.transpose(full, self._how.transpose)
        if self._how.reshape is not None:
            full = full.reshape(self._how.reshape)
        return full if dtype is None else full.astype(dtype)

    def __repr__(self) -> str:
        return f"LazyTensor({self.name!r} in {self.file.name}, shape={self.shape}, dtype={self.dtype})"


def _files(path: Path) -> list[Path]:
    """The safetensors files a path names: one file, an index's shards, or a directory's files."""
    if path.is_dir():
        index = path / INDEX
        if index.exists():
            return _files(index)
        found = sorted(path.glob("*.safetensors"))
        if not found:
            raise FileNotFoundError(f"from_safetensors({str(path)!r}): no *.safetensors file and no {INDEX} there")
        return found
    if not path.exists():
        raise FileNotFoundError(f"from_safetensors({str(path)!r}): no such file or directory")
    if path.name.endswith(".json"):
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"from_safetensors({str(path)!r}): not a safetensors index (a JSON object with a "
                             f"\"weight_map\" of tensor name to file): {e}") from None
        files = [path.parent / f for f in dict.fromkeys(weight_map.values())]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"safetensors index {str(path)!r} names files that are not there: {missing[:3]}")
        return files
    return [path]


class SafetensorsSource:
    """The tensors of safetensors files, by model path, read lazily (see the module doc).

    Pass it as ``initialize(params=...)``. ``bytes_read`` counts what this process has read.

    Args:
      path: a ``.safetensors`` file, a directory holding them (or an index), or a
        ``model.safetensors.index.json``.
      rename: ``rename(name) -> model path | TensorMap | [path | TensorMap, ...] | None`` (default:
        the name itself, with ``.`` read as ``/``: ``layers.0.mlp.kernel`` is ``layers/0/mlp/kernel``).
      fill: ``{name: other}``: where the files hold no tensor ``name``, tensor ``other`` is read in its
        place (then renamed as ``name``): :data:`TIED_EMBEDDINGS`. A name the files hold is read as it is.

    Raises:
      FileNotFoundError: nothing to read there.
      ValueError: an unreadable index or header, two tensors renamed onto one path, a bad reshape, a
        ``fill`` whose stand-in the files do not hold either.
    """

    def __init__(self, path: str | os.PathLike, rename: Rename | None = None, fill: Mapping[str, str] | None = None):
        from safetensors import safe_open

        _load_ml_dtypes()
        self.path = Path(path)
        self._counter = _Counter()
        self.skipped: list[str] = []  # tensors rename mapped to None
        self.tensors: dict[str, LazyTensor] = {}
        origin: dict[str, str] = {}
        header: dict[str, tuple[Path, str, tuple[int, ...], np.dtype]] = {}  # name -> (file, stored name, ...)
        for file in _files(self.path):
            try:
                with safe_open(str(file), framework="numpy") as f:
                    header.update({n: (file, n, tuple(f.get_slice(n).get_shape()), self._dtype(f, n))
                                   for n in f.keys()})
            except Exception as e:  # noqa: BLE001 (safetensors raises its own SafetensorError, OSError...)
                raise ValueError(f"safetensors file {str(file)!r} cannot be read: {e}") from e
        for name, other in (fill or {}).items():
            if name in header:
                continue
            if other not in header:
                raise ValueError(f"from_safetensors(fill=...): the files hold neither {name!r} nor {other!r}, "
                                 "its stand-in")
            header[name] = header[other]
        self.filled = [n for n in (fill or {}) if header[n][1] != n]  # names read from their stand-in
        for name, (file, stored, shape, dtype) in header.items():
            maps = _as_maps(rename(name) if rename is not None else name.replace(".", "/"))
            if not maps:
                self.skipped.append(name)
            for how in maps:
                if how.path in origin:
                    raise ValueError(f"from_safetensors: {name!r} and {origin[how.path]!r} are both renamed to "
                                     f"{how.path!r}")
                origin[how.path] = name
                self.tensors[how.path] = LazyTensor(file, stored, shape, dtype, how, self._counter)

    @staticmethod
    def _dtype(f: Any, name: str) -> np.dtype:
        """A tensor's numpy dtype, from an empty slice of it (reads no data)."""
        s = f.get_slice(name)
        shape = s.get_shape()
        return np.asarray(s[tuple(slice(0, 0) for _ in shape)] if shape else s[()]).dtype

    @property
    def bytes_read(self) -> int:
        """Bytes of tensor data this process has read so far."""
        return self._counter.bytes

    def items(self) -> Iterator[tuple[str, LazyTensor]]:
        """``(model path, tensor)`` pairs."""
        return iter(self.tensors.items())

    def __repr__(self) -> str:
        return f"SafetensorsSource({str(self.path)!r}, {len(self.tensors)} tensors)"


def from_safetensors(path: str | os.PathLike, rename: Rename | None = None,
                     fill: Mapping[str, str] | None = None) -> SafetensorsSource:
    """Open weights as an ``initialize(params=...)`` source, read lazily, each process its own slices.

    Example (a Hugging Face Llama checkpoint onto an NNX model whose paths differ)::

        def hf_to_flax(name):                      # "model.layers.3.self_attn.q_proj.weight"
            if name.endswith("rotary_emb.inv_freq"):
                return None                        # not a parameter: skip
            path = name.removeprefix("model.").replace(".", "/").replace("self_attn", "attn")
            if path.endswith("_proj/weight"):      # [out, in] -> [in, out]
                return zinf.TensorMap(path.replace("/weight", "/kernel"), transpose=(1, 0))
            return path

        engine = zinf.initialize(lambda: Llama(cfg, rngs=nnx.Rngs(0)), params=zinf.from_safetensors(
            "llama/", rename=hf_to_flax), loss_fn=loss_fn)

    A checkpoint with tied embeddings (no ``lm_head.weight``) into a model with its own head:
    ``fill=zinf.TIED_EMBEDDINGS``; into a tied model, ``rename`` skips nothing and maps nothing to a
    head; one tensor into several parameters: ``rename`` returns a list.

    Args:
      path: a ``.safetensors`` file, a directory of them, or a ``model.safetensors.index.json``.
      rename: file tensor name -> model path, :class:`TensorMap` (transpose/reshape too), a list of
        them (one tensor feeding several parameters), or None (skip).
      fill: file tensor name -> the tensor read in its place where the files lack it.

    Returns:
      A :class:`SafetensorsSource`; the engine checks it against the model's parameters (every one
      present, none extra, the same shapes) and names any mismatch.
    """
    return SafetensorsSource(path, rename, fill)


def lazy_values(source: Any) -> Mapping[str, LazyTensor] | None:
    """The lazy tensors of a source, if it is one (the engine's hook for :class:`Pretrained`)."""
    return source.tensors if isinstance(source, SafetensorsSource) else None
