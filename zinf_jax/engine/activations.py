"""Where the streamed engine keeps the activations it saves for the backward (``ZeroConfig.offload_activations``).

A unit's forward saves its inputs (the activation checkpoint), or everything its backward needs without
checkpointing; the backward takes them back, last saved first. They grow with depth × batch × sequence:
at 90 blocks of d=2048 and 8 × 64 tokens, 0.38 GB held at the end of the forward.

* :class:`OnDevice` keeps them where they are (device memory).
* :class:`PinnedHost` parks them in pinned host memory (DeepSpeed's ``cpu_checkpointing``).
* :class:`OnDisk` writes them to files under the NVMe tier's directory while the forward goes on and reads
  each back (one ahead) in the backward: neither device nor host memory grows with depth.

Arrays that are not committed to devices (``jnp.arange`` made by glue code) stay where they are in every
kind: a round trip would commit them to one device, and the backward program would then refuse them
next to mesh-sharded parameters.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import os
import shutil
from typing import Any

import jax
import numpy as np

from zinf_jax.errors import TierError

__all__ = ["OnDevice", "PinnedHost", "OnDisk", "parking_for"]

log = logging.getLogger(__name__)


def _committed(x: Any) -> bool:
    return isinstance(x, jax.Array) and x.committed


class OnDevice:
    """Saved activations stay in device memory."""

    def park(self, tree: Any) -> Any:
        return tree

    def unpark(self, tree: Any) -> Any:
        return tree

    def prefetch(self, tree: Any) -> None:
        """Starts bringing ``tree`` back (the next backward's activations)."""

    def discard(self, tree: Any) -> None:
        """Drops ``tree`` without bringing it back (a pass stopped by an error)."""

    def close(self) -> None:
        pass


class PinnedHost(OnDevice):
    """Saved activations wait in pinned host memory."""

    def park(self, tree: Any) -> Any:
        return jax.tree.map(
            lambda x: jax.device_put(x, x.sharding.with_memory_kind("pinned_host")) if _committed(x) else x, tree)

    def unpark(self, tree: Any) -> Any:
        return jax.tree.map(
            lambda x: jax.device_put(x, x.sharding.with_memory_kind("device"))
            if isinstance(x, jax.Array) and x.sharding.memory_kind == "pinned_host" else x, tree)


@dataclasses.dataclass
class _Spilled:
    """One array written to files: a file per distinct shard (a replicated array is written once)."""

    shape: tuple[int, ...]
    dtype: Any
    sharding: Any
    files: dict[tuple, tuple[str, tuple[int, ...]]]  # shard index (start, stop, step a dimension) -> file, shape
    written: list[concurrent.futures.Future]
    read: dict[tuple, concurrent.futures.Future] | None = None


def _key(index: tuple[slice, ...]) -> tuple:
    return tuple((s.start, s.stop, s.step) for s in index)


def _spilled(tree: Any) -> list[_Spilled]:
    return [x for x in jax.tree.leaves(tree, is_leaf=lambda v: isinstance(v, _Spilled)) if isinstance(x, _Spilled)]


class OnDisk(OnDevice):
    """Saved activations written to files under ``directory`` and read back for the backward.

    Args:
      directory: this process's spill directory (created; files a killed run left there are removed,
        with a warning). Each array's files are deleted once read back; the directory at ``close``.
    """

    def __init__(self, directory: str):
        self.directory = directory
        if os.path.isdir(directory) and os.listdir(directory):
            log.warning("removing %d activation files a previous run left in %s (it did not finish its step)",
                        len(os.listdir(directory)), directory)
            shutil.rmtree(directory)
        os.makedirs(directory, exist_ok=True)
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="zinf-activations")
        self._names = itertools.count()

    def _write(self, path: str, data: jax.Array) -> None:
        arr = np.asarray(data)
        with open(path, "wb") as f:
            f.write(memoryview(np.ascontiguousarray(arr)).cast("B"))

    def _read(self, path: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        arr = np.fromfile(path, dtype=dtype).reshape(shape)
        os.remove(path)
        return arr

    def _spill(self, x: jax.Array) -> _Spilled:
        files: dict[tuple, tuple[str, tuple[int, ...]]] = {}
        written = []
        for shard in x.addressable_shards:
            key = _key(shard.index)
            if key in files:
                continue
            files[key] = (os.path.join(self.directory, f"{next(self._names)}.bin"), tuple(shard.data.shape))
            written.append(self._pool.submit(self._write, files[key][0], shard.data))
        return _Spilled(tuple(x.shape), x.dtype, x.sharding, files, written)

    def park(self, tree: Any) -> Any:
        # typed PRNG keys (a unit's RNG state at the call: a few bytes) stay in memory
        return jax.tree.map(lambda x: self._spill(x) if _committed(x) and not jax.dtypes.issubdtype(
            x.dtype, jax.dtypes.extended) else x, tree)

    def _start_reads(self, s: _Spilled) -> None:
        if s.read is not None:
            return

        def read(key: tuple) -> np.ndarray:
            for w in s.written:  # the file is whole before it is read
                w.result()
            return self._read(*s.files[key], s.dtype)

        s.read = {key: self._pool.submit(read, key) for key in s.files}

    def prefetch(self, tree: Any) -> None:
        """Starts reading ``tree``'s arrays back (the next backward's), behind the current unit's."""
        for x in _spilled(tree):
            self._start_reads(x)

    def unpark(self, tree: Any) -> Any:
        def back(s: _Spilled) -> jax.Array:
            self._start_reads(s)
            try:
                host = {key: f.result() for key, f in s.read.items()}
            except OSError as e:
                raise TierError(
                    f"could not write or read back saved activations under {self.directory} ({e}); free space "
                    "there, or keep activations in memory (ZeroConfig.offload_activations=False or True)") from e
            return jax.make_array_from_callback(s.shape, s.sharding, lambda idx: host[_key(idx)])

        return jax.tree.map(lambda x: back(x) if isinstance(x, _Spilled) else x, tree,
                            is_leaf=lambda v: isinstance(v, _Spilled))

    def discard(self, tree: Any) -> None:
        for x in _spilled(tree):
            concurrent.futures.wait([*x.written, *(x.read or {}).values()])
            for path, _ in x.files.values():
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        shutil.rmtree(self.directory, ignore_errors=True)


def parking_for(where: str, nvme_path: str | None) -> OnDevice:
    """The parking of a placement's ``activations`` (``"device"``, ``"cpu"``, ``"nvme"``: files under
    ``<nvme_path>/activations/process_<I>``)."""
    if where == "nvme":
        if nvme_path is None:
            raise ValueError("activations on nvme need the offload path to write them under")
        return OnDisk(os.path.join(nvme_path, "activations", f"process_{jax.process_index()}"))
    return PinnedHost() if where == "cpu" else OnDevice()
