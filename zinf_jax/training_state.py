"""The training state as a checkpoint sees it: a small view of an :class:`~zinf_jax.api.Engine`.

Everything a checkpoint stores or restores goes through :class:`TrainingState`,
so that ``checkpoint.py`` knows nothing of tiers, stores or the optimizer
driver. The state is addressed as ``(path, shard index, state name)``:

* ``path``: a parameter (``"blocks/3/mlp/kernel"``), see ``layouts``;
* ``shard index``: one of ``local_indices(path)`` (this process's shards, in
  the parameter's stored form, see :mod:`zinf_jax.sharding`);
* ``state name``: the optimizer's (``"master"``, ``"m"``, ``"v"`` for Adam;
  ``"master"``, ``"s0"``, ... for an optax transform), or ``"frozen"`` for a
  parameter that is not trained (its value, read from the param tier).

Besides the arrays: the optimizer's counters (step, skips, loss scale: JSON
data), the model's non-parameter state (RNG keys, batch statistics) and the
user state. :meth:`commit` publishes restored values atomically in both tiers.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

import numpy as np

from zinf_jax.engine.init import param_groups
from zinf_jax.optim.driver import METADATA_KEY
from zinf_jax.sharding import ParamLayout

__all__ = ["TrainingState", "FROZEN"]

FROZEN = "frozen"  # the one state of a frozen parameter (see ``initialize(trainable=...)``): its value


class TrainingState:
    """Read/write access to an engine's persistent state, per (parameter, shard, state).

    Args:
      engine: a built engine (``initialize`` or ``restore``).
    """

    def __init__(self, engine: Any):
        self._engine = engine
        self.mesh = engine.mesh
        self.layouts: Mapping[str, ParamLayout] = engine.layouts
        self.groups: list[tuple[str, ...]] = param_groups(engine.adapter)  # units, then the persistent params

    @property
    def step(self) -> int:
        """Optimizer steps applied so far."""
        return self._engine.step

    def counters(self) -> dict[str, Any]:
        """The optimizer's counters (applied and skipped steps, loss scaler, the rule's own), JSON-ready."""
        return self._engine.optimizer.state_dict()

    def config(self) -> dict[str, Any]:
        """The engine's ``ZeroConfig`` as a dict."""
        return self._engine.config.to_dict()

    def version(self) -> str:
        """Changes whenever a training step is applied or skipped (the counters move either way)."""
        return json.dumps([self.step, self.counters()], sort_keys=True, default=str)

    def states(self, path: str) -> tuple[str, ...]:
        """What is stored of ``path``: the optimizer's states, or ``("frozen",)``."""
        e = self._engine
        return e.optimizer.state_names(path) if path in e.trainable else (FROZEN,)

    def local_indices(self, path: str) -> list[int]:
        """The shard indices of ``path`` this process holds."""
        return self._engine.store.local_indices(path)

    def read(self, path: str, index: int, state: str) -> np.ndarray:
        """One state of one shard, float32, stored form (``layouts[path].shard_shape``)."""
        e = self._engine
        if state == FROZEN:  # only its compute-dtype copy exists, in the param tier
            return np.asarray(e.param_tier.get(path, index).result(), np.float32)
        return e.optimizer.read_state(path, index, state)

    def write(self, path: str, index: int, saved: Mapping[str, np.ndarray]) -> bool:
        """Writes one shard's saved states, and its value into the param tier (uncommitted).

        Args:
          saved: state name to float32 stored-form shard; holds ``"master"`` or ``"frozen"``.

        Returns:
          True when the parameter is trained now but ``saved`` lacks some of the
          optimizer's states (frozen then, or another optimizer): its optimizer
          state then starts fresh from the saved value.
        """
        e = self._engine
        value = saved["master" if "master" in saved else FROZEN]
        restart = path in e.trainable and not set(self.states(path)) <= set(saved)
        if restart:
            e.optimizer.init_shard(path, index, value)
        elif path in e.trainable:
            for s in self.states(path):
                e.optimizer.write_state(path, index, s, saved[s])
        e.store.put_local(path, index, value).result()
        return restart

    @property
    def model_state(self) -> Any:
        """The model's non-parameter state (a pytree of global arrays, typed PRNG keys among them)."""
        return self._engine.streamed.state

    @model_state.setter
    def model_state(self, value: Any) -> None:
        self._engine.streamed.state = value

    @property
    def user_state(self) -> dict[str, Any]:
        """JSON data stored with a checkpoint (``engine.user_state``)."""
        return self._engine.user_state

    @user_state.setter
    def user_state(self, value: Mapping[str, Any]) -> None:
        self._engine.user_state = dict(value)

    def commit(self, step: int, counters: Mapping[str, Any]) -> None:
        """Publishes everything written since the last commit as ``step``, with the optimizer's ``counters``."""
        e = self._engine
        e.opt_tier.commit({"step": step, METADATA_KEY: dict(counters)})
        e.optimizer.restore_state()
        e.store.commit({"step": step})
