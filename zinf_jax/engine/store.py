"""The parameter store: stored-form parameters in the param tier, by path.

Each parameter is kept in its *stored form* (see :mod:`zinf_jax.sharding`) and
in the compute dtype, one tier key per parameter, one tier shard per shard of
the zero axes that this process owns. :meth:`ParamStore.fetch` turns the
shards of a unit back into sharded device arrays (the "bandwidth-centric" read:
every process reads only its own shards; the all-gather happens later, inside
the compiled unit program).
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from zinf_jax.sharding import ParamLayout, assemble, local_shard_devices, split_local
from zinf_jax.tiers.base import ShardSpec, Tier, TierError

__all__ = ["ParamStore", "ParamMismatchError"]


class ParamMismatchError(ValueError):
    """The model's parameters do not match what the tier already stores."""


class ParamStore:
    """Parameters of a model in a tier, in compute dtype and stored form.

    Args:
      tier: the param tier.
      layouts: path to layout for every parameter.
      mesh: the mesh.
      compute_dtype: dtype of floating parameters in the tier and in compute.
    """

    def __init__(self, tier: Tier, layouts: Mapping[str, ParamLayout], mesh: Mesh, compute_dtype: str):
        self.tier = tier
        self.layouts = dict(layouts)
        self.mesh = mesh
        self.compute_dtype = compute_dtype
        self._local = list(local_shard_devices(mesh, next((lay.axes for lay in self.layouts.values()), None)))
        for path, lay in self.layouts.items():
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

    def local_indices(self, path: str) -> list[int]:
        """Shard indices of ``path`` this process stores."""
        return [0] if self.layouts[path].dim is None else list(self._local)

    def nbytes(self, paths: Sequence[str]) -> int:
        """Device bytes of fetched ``paths`` summed over this process's devices."""
        n_dev = sum(len(v) for v in local_shard_devices(self.mesh).values())
        return sum(self.layouts[p].bytes_per_device(self.dtype_of(p)) * n_dev for p in paths)

    def put_array(self, path: str, stored: jax.Array) -> list[Future]:
        """Writes a sharded stored-form array (any dtype; cast to the tier's)."""
        dt = jnp.dtype(self.dtype_of(path))
        if stored.dtype != dt:
            stored = stored.astype(dt)
        lay = self.layouts[path]
        return [self.tier.put(path, i, s) for i, s in split_local(lay, self.mesh, stored).items()]

    def put_local(self, path: str, index: int, value: np.ndarray) -> Future:
        """Writes one local shard given as a host array (cast to the tier's dtype)."""
        return self.tier.put(path, index, value)

    def fetch(self, paths: Sequence[str]) -> list[jax.Array]:
        """Reads ``paths`` from the tier as sharded device arrays (stored form).

        Raises:
          TierError: a shard cannot be read.
        """
        futs = {p: {i: self.tier.get(p, i) for i in self.local_indices(p)} for p in paths}
        out = []
        for p in paths:
            shards = {i: f.result() for i, f in futs[p].items()}
            out.append(assemble(self.layouts[p], self.mesh, shards))
        return out

    def sharding(self, path: str) -> NamedSharding:
        """Sharding of the stored form of ``path``."""
        return NamedSharding(self.mesh, self.layouts[path].spec)

    def commit(self, metadata: Mapping | None = None) -> None:
        """Publishes every write so far (atomically on the nvme tier)."""
        self.tier.commit(metadata)
