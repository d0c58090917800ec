"""Pretrained weights: initial parameter values from a pytree, a plain orbax checkpoint or safetensors.

``initialize(..., params=...)`` starts from given values instead of the
model's initialisers. The source is a pytree of host arrays in the
model's own structure (``nnx.state(model, nnx.Param)``, its pure dict, a Linen
``{"params": ...}`` dict, boxed or not), the directory of an orbax PyTree
checkpoint of such a tree written by plain JAX/Flax, or safetensors files
(:func:`~zinf_jax.engine.weights.from_safetensors`). A checkpoint is read one
group of parameters (one unit) at a time with orbax's partial restore, so the
whole tree is never in host RAM at once; safetensors tensors are read lazily,
each process only the slices of its own shards.

Leaves are matched by their ``/``-joined path (``blocks/0/mlp/kernel``); the
``value`` level of NNX variables and a top-level ``params`` collection are
ignored. Every model parameter must be present with its exact shape, and every
leaf of the source must be a model parameter: anything else is an error that
names the path.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
import numpy as np

from zinf_jax.engine.adapters import kp_tuple
from zinf_jax.engine.store import ParamMismatchError
from zinf_jax.engine.weights import lazy_values
from zinf_jax.plan.units import path_str

__all__ = ["Pretrained"]


def _key(kp: Sequence[Any]) -> Any:
    """A jax key-path entry as the key orbax restores it under."""
    if isinstance(kp, jax.tree_util.DictKey):
        return kp.key
    if isinstance(kp, jax.tree_util.SequenceKey):
        return kp.idx
    return getattr(kp, "name", kp)


def _normalise(raw: list[tuple[str, Any]], model: Mapping[str, Any]) -> dict[str, Any]:
    """Maps source paths onto model paths: a trailing ``/value`` and a leading ``params/`` are dropped."""
    out: dict[str, Any] = {}
    for path, item in raw:
        p = path
        if p not in model and p.endswith("/value"):
            p = p[: -len("/value")]
        if p not in model and p.startswith("params/"):
            p = p[len("params/"):]
        out[p] = item
    return out


class Pretrained:
    """Initial values of a model's parameters, read group by group.

    Args:
      source: a pytree of arrays in the model's structure, or an orbax PyTree
        checkpoint directory (``str`` / ``os.PathLike``).
      model_params: the model's parameters, path to ``ShapeDtypeStruct``.

    Raises:
      ParamMismatchError: a model parameter is missing from the source, the
        source holds a leaf that is not a model parameter, or a shape differs
        (the message names the path and both shapes).
      FileNotFoundError: the directory holds no orbax checkpoint.
    """

    def __init__(self, source: Any, model_params: Mapping[str, jax.ShapeDtypeStruct]):
        self._dir: Path | None = None
        self._lazy = lazy_values(source) is not None
        if self._lazy:
            raw = [(p, (None, t.shape, t)) for p, t in lazy_values(source).items()]
            what = repr(source)
        elif isinstance(source, (str, os.PathLike)):
            self._dir = Path(source).absolute()
            raw = self._checkpoint_leaves(self._dir)
            what = f"orbax checkpoint {str(self._dir)!r}"
        else:
            flat = jax.tree_util.tree_flatten_with_path(nn.meta.unbox(source))[0]
            raw = [(path_str(kp_tuple(kp)), (None, np.shape(v), v)) for kp, v in flat]
            what = "params="
        self._items = _normalise(raw, model_params)
        missing = [p for p in model_params if p not in self._items]
        extra = [p for p in self._items if p not in model_params]
        if missing or extra:
            raise ParamMismatchError(
                f"{what} does not match the model's parameters: missing {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}, not in the model {extra[:5]}{' ...' if len(extra) > 5 else ''}; "
                "pass the tree of the same model (nnx.state(model, nnx.Param), or the Linen params dict)")
        for p, s in model_params.items():
            shape = tuple(self._items[p][1])
            if shape != tuple(s.shape):
                raise ParamMismatchError(f"{what}: {p!r} has shape {shape}, the model's parameter has {tuple(s.shape)}")

    @staticmethod
    def _checkpoint_leaves(directory: Path) -> list[tuple[str, Any]]:
        import orbax.checkpoint as ocp

        if not directory.is_dir():
            raise FileNotFoundError(f"params={str(directory)!r}: no such directory (expected an orbax checkpoint)")
        try:
            meta = ocp.PyTreeCheckpointer().metadata(directory).item_metadata
        except Exception as e:  # noqa: BLE001 (orbax raises several types for a non-checkpoint)
            raise FileNotFoundError(f"params={str(directory)!r} is not a readable orbax PyTree checkpoint: {e}") from e
        flat = jax.tree_util.tree_flatten_with_path(getattr(meta, "tree", meta))[0]
        if not flat:
            raise FileNotFoundError(f"params={str(directory)!r} is not a readable orbax PyTree checkpoint: "
                                    "it holds no arrays (pass the directory orbax saved the params tree to)")
        return [(path_str(kp_tuple(kp)), (tuple(_key(k) for k in kp), tuple(m.shape), None)) for kp, m in flat]

    def read(self, paths: Sequence[str]) -> list[Any]:
        """The values of ``paths`` as host arrays (only these are read from a checkpoint), or lazy tensors
        whose slices are read when indexed (safetensors)."""
        if self._lazy:
            return [self._items[p][2] for p in paths]
        if self._dir is None:
            return [np.asarray(self._items[p][2]) for p in paths]
        import orbax.checkpoint as ocp

        item: dict = {}
        for p in paths:
            keys = self._items[p][0]
            d = item
            for k in keys[:-1]:
                d = d.setdefault(k, {})
            d[keys[-1]] = np.zeros((), np.float32)  # a placeholder: restore_type decides what comes back
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
        out = ocp.PyTreeCheckpointer().restore(
            self._dir, args=ocp.args.PyTreeRestore(item=item, restore_args=args, partial_restore=True))
        values = []
        for p in paths:
            v = out
            for k in self._items[p][0]:
                v = v[k]
            values.append(np.asarray(v))
        return values
