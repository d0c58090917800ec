"""The parameter store: stored-form parameters in the param tier, by path.

Each parameter is kept in its *stored form* (see :mod:`zinf_jax.plan.partition`) and
in the compute dtype, one tier key per parameter, one tier shard per shard of
the zero axes that this process owns. :meth:`ParamStore.fetch` turns the
shards of a unit back into sharded device arrays (the "bandwidth-centric" read:
every process reads only its own shards; the all-gather happens later, inside
the compiled unit program).

With float32 compute and both tiers on NVMe, a trained parameter's tier copy
would equal its float32 master bit for bit; the store then keeps no copy of its
own and reads the optimizer's master instead (``master=``): one copy of the
parameter on disk, and no parameter write after the optimizer step. See
[Note: shared fp32 master] in :mod:`zinf_jax.plan.placement`, which decides it.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Callable, Collection, Mapping, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from zinf_jax.plan.partition import ParamLayout, assemble_many, local_shard_devices, split_local
from zinf_jax._internal.futures import done_future, then
from zinf_jax.tiers.base import ShardSpec, Tier, TierError
from zinf_jax.errors import ParamMismatchError

__all__ = ["ParamStore", "ParamMismatchError", "local_indices_of"]

class MasterSource(Protocol):
    """Where the float32 master shards of trained parameters are read (the optimizer,
    :class:`~zinf_jax.optim.driver.StreamedOptimizer`)."""

    def read_state_async(self, path: str, index: int, name: str = "master") -> Future:
        """A future of a copy of one master shard, stored form."""
        ...

    def host_master(self, path: str, index: int) -> np.ndarray | None:
        """The master shard itself in host RAM (changed in place by every step), or ``None``."""
        ...

    def host_master_rows(self, paths: Sequence[str], index: int) -> np.ndarray | None:
        """The master shards ``index`` of ``paths`` as the rows of one host array (kept so), or ``None``."""
        ...

    @property
    def master_version(self) -> int:
        """Grows with every write of the masters."""
        ...


def local_indices_of(layouts: Mapping[str, ParamLayout], mesh: Mesh) -> Callable[[str], list[int]]:
    """``local_indices(path)``: the shard indices of a parameter this process stores."""
    local = list(local_shard_devices(mesh, next((lay.axes for lay in layouts.values()), None)))
    return lambda path: [0] if layouts[path].dim is None else list(local)


class ParamStore:
    """Parameters of a model in a tier, in compute dtype and stored form.

    Args:
      tier: the param tier.
      layouts: path to layout for every parameter.
      mesh: the mesh.
      compute_dtype: dtype of floating parameters in the tier and in compute.
      master: the optimizer, whose float32 master shards of ``master_paths`` are their values (cast to
        ``compute_dtype`` as they are read): those paths are not stored here at all.
      master_paths: the parameters read from ``master``.
    """

    def __init__(self, tier: Tier, layouts: Mapping[str, ParamLayout], mesh: Mesh, compute_dtype: str, *,
                 master: MasterSource | None = None, master_paths: Collection[str] = ()):
        self.tier = tier
        self.layouts = dict(layouts)
        self.mesh = mesh
        self.compute_dtype = compute_dtype
        if master_paths and master is None:
            raise ValueError("master_paths need the master they are read from (master=)")
        self._master, self.master_paths = master, frozenset(master_paths)
        self.local_indices = local_indices_of(self.layouts, mesh)
        """``local_indices(path)``: shard indices of ``path`` this process stores."""
        self._writes: dict[str, int] = {}  # per path: writes so far (see :meth:`writes`)
        for path, lay in self.layouts.items():
            if path in self.master_paths:
                continue
            spec = ShardSpec(shard_shape=lay.shard_shape, dtype=self.dtype_of(path), num_shards=lay.num_shards)
            try:
                tier.declare(path, spec, self.local_indices(path))
            except TierError as e:
                raise ParamMismatchError(
                    f"the model's parameter {path!r} (stored as {spec}) does not match the stored one: {e}"
                ) from e

    def dtype_of(self, path: str) -> str:
        """Dtype of ``path`` in the tier: compute dtype for floats, else its own."""
        d = self.layouts[path].dtype
        return self.compute_dtype if jnp.issubdtype(jnp.dtype(d), jnp.floating) else d

    def nbytes(self, paths: Sequence[str]) -> int:
        """Device bytes of fetched ``paths`` summed over this process's devices."""
        n_dev = sum(len(v) for v in local_shard_devices(self.mesh).values())
        return sum(self.layouts[p].bytes_per_device(self.dtype_of(p)) * n_dev for p in paths)

    def put_array(self, path: str, stored: jax.Array) -> list[Future]:
        """Writes a sharded stored-form array (any dtype; cast to the tier's)."""
        dt = jnp.dtype(self.dtype_of(path))
        if stored.dtype != dt:
            stored = stored.astype(dt)
        if path in self.master_paths:  # See [Note: shared fp32 master]: the optimizer's master is the copy
            return []
        self._writes[path] = self._writes.get(path, 0) + 1
        lay = self.layouts[path]
        return [self.tier.put(path, i, s) for i, s in split_local(lay, self.mesh, stored).items()]

    def adopt(self, paths: Sequence[str], arrays: Sequence[jax.Array]) -> None:
        """Makes sharded stored-form device arrays of the tier's dtype the new values of ``paths``, their shards
        kept as they are (a device tier's ``put_arrays``: no copy; the compiled step's new params)."""
        items = []
        for path, arr in zip(paths, arrays):
            if path in self.master_paths:  # See [Note: shared fp32 master]
                continue
            self._writes[path] = self._writes.get(path, 0) + 1
            items += [(path, i, x) for i, x in split_local(self.layouts[path], self.mesh, arr).items()]
        self.tier.put_arrays(items)

    def put_local(self, path: str, index: int, value: np.ndarray) -> Future:
        """Writes one local shard given as a host array (cast to the tier's dtype)."""
        if path in self.master_paths:  # See [Note: shared fp32 master]
            return done_future()
        self._writes[path] = self._writes.get(path, 0) + 1
        return self.tier.put(path, index, value)

    def put_local_many(self, items: Sequence[tuple[str, int, np.ndarray]]) -> list[Future]:
        """:meth:`put_local` of several ``(path, index, value)`` shards at once (see ``Tier.put_many``)."""
        items = [it for it in items if it[0] not in self.master_paths]  # See [Note: shared fp32 master]
        for path, _, _ in items:
            self._writes[path] = self._writes.get(path, 0) + 1
        return self.tier.put_many(items) if items else []

    def writes(self, path: str) -> int:
        """Grows with every write of ``path``: a value read when it was the same is still current.

        (For a path read from the optimizer's master, the optimizer's writes: :attr:`MasterSource.master_version`.)
        """
        if path in self.master_paths:  # See [Note: shared fp32 master]
            return self._master.master_version
        return self._writes.get(path, 0)

    def read_local(self, path: str, index: int) -> Future:
        """A future of one local shard as stored (a host array, or a device array on the device tier)."""
        if path in self.master_paths:  # See [Note: shared fp32 master]
            fut = self._master.read_state_async(path, index)
            dt = np.dtype(self.dtype_of(path))
            return fut if dt == np.float32 else then(fut, lambda x: x.astype(dt))
        return self.tier.get(path, index)

    def host_view(self, path: str) -> dict[int, np.ndarray] | None:
        """This process's shards of ``path`` as the host buffers that hold them (not copies), or ``None`` if they
        are not such buffers: the optimizer's masters in host RAM, which change in place at its next step (see
        [Note: masters in rows] in :mod:`zinf_jax.optim.state_io`). They are float32, whatever
        :meth:`dtype_of` the path: the reader casts them."""
        if path not in self.master_paths:
            return None
        out = {i: self._master.host_master(path, i) for i in self.local_indices(path)}
        return None if any(x is None for x in out.values()) else out

    def host_rows(self, paths: Sequence[str]) -> dict[int, np.ndarray] | None:
        """Per local shard index, the shards of ``paths`` (one layout) as the rows of one host buffer that holds
        them (and keeps them so), or ``None`` where :meth:`host_view` of one of them is."""
        if not all(p in self.master_paths for p in paths):
            return None
        out = {i: self._master.host_master_rows(paths, i) for i in self.local_indices(paths[0])}
        return None if any(x is None for x in out.values()) else out

    def fetch(self, paths: Sequence[str], memory_kind: str | None = None) -> list[jax.Array]:
        """Reads ``paths`` from the tier as sharded device arrays (stored form).

        ``memory_kind``: where the arrays go (default: each device's default memory); ``"pinned_host"``
        keeps the cpu tier's shards where they are (the compiled engine moves them inside its program).

        Raises:
          TierError: a shard cannot be read.
        """
        return assemble_many([self.layouts[p] for p in paths], self.mesh, self.read_shards(paths),
                             memory_kind=memory_kind)

    def read_shards(self, paths: Sequence[str]) -> list[dict[int, object]]:
        """This process's shards of ``paths`` as stored (``{index: host or device array}`` per path), all read
        concurrently.

        Raises:
          TierError: a shard cannot be read.
        """
        futs = [{i: self.read_local(p, i) for i in self.local_indices(p)} for p in paths]
        return [{i: f.result() for i, f in fs.items()} for fs in futs]

    def sharding(self, path: str) -> NamedSharding:
        """Sharding of the stored form of ``path``."""
        return NamedSharding(self.mesh, self.layouts[path].spec)

    def commit(self, metadata: Mapping | None = None) -> None:
        """Publishes every write so far (atomically on the nvme tier)."""
        self.tier.commit(metadata)
