"""The optimizer's stored state as its users see it: written whole at init and restore, read as copies or views.

A mixin of :class:`~zinf_jax.optim.driver.StreamedOptimizer` (its attributes: the tier, the rule, the
layouts, the state names and chunk geometry per path). The driver streams the state through its buffer
pool during a step; everything else that touches the state goes through here: the engine's init (a
shard's master and zero moments), checkpoints (each state of a shard, read and restored whole), and the
parameters read from the master ([Note: shared fp32 master] in :mod:`zinf_jax.plan.placement`).

[Note: masters in rows]
With params and optimizer both in host RAM and float32 compute, a trained parameter's value is its
master ([Note: shared fp32 master] in :mod:`zinf_jax.plan.placement`), and the compiled step reads it
from here at every step: :meth:`StateAccess.host_master` hands out the stored buffer itself, and
the caller copies it once into the memory its program reads (:class:`~zinf_jax.engine.arguments.ProgramArgs`).
For the layers of a scanned run the program takes one stacked array per parameter position; stacking
the masters would copy them a second time, so :meth:`StateAccess.host_master_rows` keeps them as
the rows of one array in the tier (``CpuTier.share_rows``): each step's writes land in their rows, and
the stack is copied out in one piece. One copy of the parameters' bytes a step, however they are called.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable, Sequence

import numpy as np

from zinf_jax._internal.futures import all_of
from zinf_jax.tiers.base import np_dtype
from zinf_jax.tiers.direct import aligned_empty
from zinf_jax.tiers.memory import CpuTier

__all__ = ["StateAccess"]


class StateAccess:
    """Init, read and restore of the optimizer's stored state, shard by shard (a mixin; see module doc)."""

    tier: Any
    rule: Any
    layouts: Any
    buffer_count: int
    _names: dict
    _numel: dict
    _chunk: dict
    _nch: dict
    _zero_buffer: Callable[[], np.ndarray]
    _dtype_of: Callable[[str], str]

    def init_shard(self, path: str, index: int, master: np.ndarray, *, wait: bool = True) -> list[Future]:
        """Writes one shard's initial state: ``master`` and zero moments, chunk by chunk. Moments that start at zero
        (the rule's ``init_states`` is ``None``: Adam's) go to :meth:`Tier.put_zeros` (the nvme tier allocates
        their files instead of writing them: two thirds of init's bytes at fp32).

        Args:
          path: the parameter path.
          index: the shard index (one of ``local_indices(path)``).
          master: the float32 stored-form shard (``layout.shard_shape``); other
            float dtypes are converted one chunk at a time.
          wait: return once the writes are done; ``False``: return the futures
            of the last writes still in flight (``master`` must stay unchanged
            until they resolve), so that the caller can compute meanwhile.

        Raises:
          ValueError: ``master`` has the wrong number of elements.
        """
        flat = np.asarray(master).reshape(-1)
        numel, chunk, n = self._numel[path], self._chunk[path], self._nch[path]
        if flat.shape[0] != numel:
            raise ValueError(f"master shard of {path!r} has {flat.shape[0]} elements, layout says {numel}")
        zeros = self._zero_buffer()[:chunk]
        futs: list[Future] = []
        for c in range(n):
            part = np.ascontiguousarray(flat[c * chunk:(c + 1) * chunk], dtype=np.float32)
            if part.shape[0] < chunk:
                part = np.concatenate([part, zeros[part.shape[0]:]])
            futs.append(self.tier.put(f"master/{path}", index * n + c, part))
            states = self.rule.init_states(path, part)
            for k, s in enumerate(self._names[path][1:]):
                key, at = f"{s}/{path}", index * n + c
                futs.append(self.tier.put_zeros(key, at) if states is None else self.tier.put(key, at, states[k]))
            if len(futs) >= 3 * self.buffer_count:  # bound the caller-visible memory in flight
                futs.pop(0).result()
        if wait:
            for f in futs:
                f.result()
        return futs

    def read_master(self, path: str, index: int) -> np.ndarray:
        """The float32 master shard (stored form, ``layout.shard_shape``) as currently stored."""
        return self.read_state(path, index, "master")

    def read_state(self, path: str, index: int, name: str) -> np.ndarray:
        """One state (``master``, ``m``, ...) of one shard, float32 in stored form, as currently stored."""
        return self.read_state_async(path, index, name).result()

    def read_state_async(self, path: str, index: int, name: str = "master") -> Future:
        """A future of :meth:`read_state` (its chunks are read concurrently)."""
        numel, chunk, n = self._numel[path], self._chunk[path], self._nch[path]
        dtype = np.dtype(np_dtype(self._dtype_of(name)))
        out = aligned_empty(dtype.itemsize * n * chunk).view(dtype)
        futs = [self.tier.get(f"{name}/{path}", index * n + c, out=out[c * chunk:(c + 1) * chunk]) for c in range(n)]
        shape = self.layouts[path].shard_shape
        done: Future = Future()

        def finish(f: Future) -> None:
            if f.exception() is not None:
                done.set_exception(f.exception())
            else:  # float32, whatever the stored dtype
                done.set_result(out[:numel].astype(np.float32, copy=dtype != np.float32).reshape(shape))

        all_of(futs).add_done_callback(finish)
        return done

    @property
    def _host_buffers(self) -> bool:
        """The tier keeps each shard in one numpy buffer that every put overwrites in place."""
        return isinstance(self.tier, CpuTier) and self.tier.memory == "numpy"

    def host_master(self, path: str, index: int) -> np.ndarray | None:
        """The float32 master shard itself (stored form), not a copy, or ``None`` if it is not one host buffer.

        It is one when the tier keeps numpy buffers (``CpuTier(memory="numpy")``) and the shard is one
        sub-group. The optimizer overwrites it in place at every step (see [Note: masters in rows]).
        """
        if not self._host_buffers or self._nch[path] != 1:
            return None
        return self.tier.current(f"master/{path}", index).reshape(self.layouts[path].shard_shape)

    def host_master_rows(self, paths: Sequence[str], index: int) -> np.ndarray | None:
        """The float32 master shards ``index`` of ``paths`` (one shard shape) as the rows of one array, kept there.

        ``None`` where :meth:`host_master` of one of them is. See [Note: masters in rows].
        """
        shapes = {self.layouts[p].shard_shape for p in paths}
        if not self._host_buffers or len(shapes) != 1 or any(self._nch[p] != 1 for p in paths):
            return None
        rows = self.tier.share_rows([f"master/{p}" for p in paths], index)
        return rows.reshape(len(paths), *shapes.pop())

    @property
    def master_version(self) -> int:
        """Grows with every write of the tier (a step's, a restore's): masters read at the same version are current.

        Of the in-memory tiers only (the ones that count their puts).
        """
        return self.tier.version

    def write_state(self, path: str, index: int, name: str, value: np.ndarray) -> None:
        """Writes one state of one shard (a checkpoint being restored), chunk by chunk."""
        numel, chunk, n = self._numel[path], self._chunk[path], self._nch[path]
        flat = np.zeros(n * chunk, np.float32)
        flat[:numel] = np.asarray(value, np.float32).reshape(-1)
        for f in [self.tier.put(f"{name}/{path}", index * n + c, flat[c * chunk:(c + 1) * chunk]) for c in range(n)]:
            f.result()
