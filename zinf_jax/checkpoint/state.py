"""The training state as a checkpoint sees it: a small view of an engine's :class:`~zinf_jax.engine.build.Components`.

Everything a checkpoint stores or restores goes through :class:`TrainingState`,
so that saving and restoring know nothing of tiers, stores or the optimizer
driver. The state is addressed as ``(path, shard index, state name)``:

* ``path``: a parameter (``"blocks/3/mlp/kernel"``), see ``layouts``;
* ``shard index``: one of ``local_indices(path)`` (this process's shards, in
  the parameter's stored form, see :mod:`zinf_jax.plan.partition`);
* ``state name``: the optimizer's (``"master"``, ``"m"``, ``"v"`` for Adam;
  ``"master"``, ``"s0"``, ... for an optax transform), or ``"frozen"`` for a
  parameter that is not trained (its value, read from the param tier).

Besides the arrays: the optimizer's counters (step, skips, loss scale: JSON
data), the model's non-parameter state (RNG keys, batch statistics) and the
user state. :meth:`commit` publishes restored values atomically in both tiers.
"""
from __future__ import annotations

import json
import os
import weakref
from typing import Any, Mapping

import numpy as np

from zinf_jax.engine.build import Components
from zinf_jax.engine.init import param_groups
from zinf_jax.optim.driver import METADATA_KEY
from zinf_jax.plan.partition import ParamLayout, from_stored

__all__ = ["TrainingState", "FROZEN", "remember", "is_known"]

FROZEN = "frozen"  # the one state of a frozen parameter (see ``initialize(trainable=...)``): its value


class TrainingState:
    """Read/write access to an engine's persistent state, per (parameter, shard, state).

    Args:
      components: a built engine's parts (``engine.components`` after ``initialize`` or ``restore``).
    """

    def __init__(self, components: Components):
        self._c = components
        self.mesh = components.mesh
        self.layouts: Mapping[str, ParamLayout] = components.layouts
        self.groups: list[tuple[str, ...]] = param_groups(components.adapter)  # units, then the persistent params

    @property
    def key(self) -> Components:
        """What identifies the engine this views (the same for every view of it)."""
        return self._c

    @property
    def step(self) -> int:
        """Optimizer steps applied so far."""
        return self._c.optimizer.step_count

    def counters(self) -> dict[str, Any]:
        """The optimizer's counters (applied and skipped steps, loss scaler, the rule's own), JSON-ready."""
        return self._c.optimizer.state_dict()

    def config(self) -> dict[str, Any]:
        """The engine's ``ZeroConfig`` as a dict."""
        return self._c.config.to_dict()

    def version(self) -> str:
        """Changes whenever a training step is applied or skipped (the counters move either way)."""
        return json.dumps([self.step, self.counters()], sort_keys=True, default=str)

    def states(self, path: str) -> tuple[str, ...]:
        """What is stored of ``path``: the optimizer's states, or ``("frozen",)``."""
        c = self._c
        return c.optimizer.state_names(path) if path in c.trainable else (FROZEN,)

    def local_indices(self, path: str) -> list[int]:
        """The shard indices of ``path`` this process holds."""
        return self._c.store.local_indices(path)

    def read(self, path: str, index: int, state: str) -> np.ndarray:
        """One state of one shard, float32, stored form (``layouts[path].shard_shape``)."""
        c = self._c
        if state == FROZEN:  # only its compute-dtype copy exists, in the param tier
            return np.asarray(c.param_tier.get(path, index).result(), np.float32)
        return c.optimizer.read_state(path, index, state)

    def value(self, path: str) -> np.ndarray:
        """The whole parameter, float32, in its own shape: the master of a trained one, the stored value of a
        frozen one.

        Raises:
          RuntimeError: this process holds only some of its shards (a multi-process job).
        """
        lay = self.layouts[path]
        state = "master" if path in self._c.trainable else FROZEN
        shards = [self.read(path, i, state) for i in self.local_indices(path)]
        if len(shards) != lay.num_shards:
            raise RuntimeError("params(): this process holds only some shards; use checkpoints to read all")
        full = shards[0] if lay.dim is None else np.concatenate(shards, axis=lay.dim)
        return np.asarray(from_stored(lay, full))

    def write(self, path: str, index: int, saved: Mapping[str, np.ndarray]) -> bool:
        """Writes one shard's saved states, and its value into the param tier (uncommitted).

        Args:
          saved: state name to float32 stored-form shard; holds ``"master"`` or ``"frozen"``.

        Returns:
          True when the parameter is trained now but ``saved`` lacks some of the
          optimizer's states (frozen then, or another optimizer): its optimizer
          state then starts fresh from the saved value.
        """
        c = self._c
        value = saved["master" if "master" in saved else FROZEN]
        restart = path in c.trainable and not set(self.states(path)) <= set(saved)
        if restart:
            c.optimizer.init_shard(path, index, value)
        elif path in c.trainable:
            for s in self.states(path):
                c.optimizer.write_state(path, index, s, saved[s])
        c.store.put_local(path, index, value).result()
        return restart

    @property
    def model_state(self) -> Any:
        """The model's non-parameter state (a pytree of global arrays, typed PRNG keys among them)."""
        return self._c.passes.state

    @model_state.setter
    def model_state(self, value: Any) -> None:
        self._c.passes.replace_state(value)

    @property
    def user_state(self) -> dict[str, Any]:
        """JSON data stored with a checkpoint (``engine.user_state``)."""
        return self._c.user_state

    @user_state.setter
    def user_state(self, value: Mapping[str, Any]) -> None:
        new = dict(value)
        self._c.user_state.clear()
        self._c.user_state.update(new)

    def commit(self, step: int, counters: Mapping[str, Any]) -> None:
        """Publishes everything written since the last commit as ``step``, with the optimizer's ``counters``."""
        c = self._c
        c.opt_tier.commit({"step": step, METADATA_KEY: dict(counters)})
        c.optimizer.restore_state()
        c.store.commit({"step": step})


_KNOWN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Components -> {step dir: (save_id, version)}


def remember(view: TrainingState, step_dir: str | os.PathLike, save_id: str | None) -> None:
    """Records that the engine now holds exactly the checkpoint ``step_dir`` (it wrote or restored it)."""
    _KNOWN.setdefault(view.key, {})[str(step_dir)] = (save_id, view.version())


def is_known(view: TrainingState, step_dir: str | os.PathLike, save_id: str | None) -> bool:
    """Whether the engine still holds exactly ``step_dir`` (no step since it wrote or restored it, same save)."""
    return _KNOWN.get(view.key, {}).get(str(step_dir)) == (save_id, view.version())
