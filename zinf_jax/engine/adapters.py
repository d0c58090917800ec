"""Flax NNX and Linen models seen the same way by the engine.

An adapter finds the units of a model, gives each unit call as a pure function
``(full_params, rest, args) -> (out, new_rest)``, initialises any subset of the
parameters inside ``jit`` (so XLA computes only those: the model is never
materialised whole), and runs the user's loss on a *wrapped* model whose unit
calls go to the engine:

* NNX: a copy of the abstract model whose unit submodules are replaced by
  :class:`UnitProxy` modules (``proxy(x)`` and ``proxy.attend(x)`` both reach
  the engine); the copy holds only the small parameters outside every unit.
* Linen: a callable ``model(*args, **kwargs)`` that applies the module with the
  parameters outside units, under ``nn.intercept_methods`` routing unit calls
  to the engine.
"""
from __future__ import annotations

import threading

from typing import Any, Callable, Hashable, Sequence

import jax
from flax import nnx
from flax import linen as nn
from flax import traverse_util

from zinf_jax.units import Unit, UnitPolicy, nbytes_of, path_str, select_units

__all__ = ["NnxAdapter", "LinenAdapter", "UnitProxy", "Dispatch"]

Call = Callable[[int, str, tuple, dict], Any]


class Dispatch:
    """Where wrapped unit calls go; the engine sets :attr:`call`."""

    def __init__(self) -> None:
        self.call: Call | None = None

    def __call__(self, uid: int, method: str, args: tuple, kwargs: dict) -> Any:
        if self.call is None:
            raise RuntimeError("zinf_jax: this wrapped model is not attached to an engine")
        return self.call(uid, method, args, kwargs)


class UnitProxy(nnx.Module):
    """Stands in for a unit inside the wrapped NNX model; every method call goes to the engine."""

    def __init__(self, dispatch: Dispatch, uid: int, path: str):
        self.dispatch = nnx.static(dispatch)
        self.uid = uid
        self.path = path

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.dispatch(self.uid, "__call__", args, kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        d, uid = object.__getattribute__(self, "dispatch"), object.__getattribute__(self, "uid")
        return lambda *args, **kwargs: d(uid, name, args, kwargs)


# XLA's algebraic simplifier reassociates constant multiplies (x * sqrt2 * std), so a
# jitted initialiser would differ in the last bit from eager construction. With it
# off, the unit-by-unit init reproduces eager construction bit for bit.
_EXACT = {"xla_disable_hlo_passes": "algsimp"}


def exact_jit_call(fn: Callable[[], Any], out_shardings: Any) -> Any:
    """Compiles ``fn`` (no arguments) with eager-exact arithmetic and runs it."""
    return jax.jit(fn, out_shardings=out_shardings).lower().compile(compiler_options=_EXACT)()


def _kp_tuple(kp: Sequence[Any]) -> tuple[Any, ...]:
    out = []
    for k in kp:
        if isinstance(k, jax.tree_util.DictKey):
            out.append(k.key)
        elif isinstance(k, jax.tree_util.SequenceKey):
            out.append(k.idx)
        elif isinstance(k, jax.tree_util.GetAttrKey) and k.name != "value":
            out.append(k.name)
    return tuple(out)


def _leaf_paths(tree: Any) -> list[tuple[Any, ...]]:
    return [_kp_tuple(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _get(module: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        module = module[p] if isinstance(p, int) else getattr(module, p)
    return module


def _set(module: Any, path: tuple[Any, ...], value: Any) -> None:
    parent = _get(module, path[:-1])
    if isinstance(path[-1], int):
        parent[path[-1]] = value
    else:
        setattr(parent, path[-1], value)


class NnxAdapter:
    """A Flax NNX model given by its constructor."""

    def __init__(self, constructor: Callable[[], nnx.Module], policy: UnitPolicy, threshold: int):
        self.constructor = constructor
        self.dispatch = Dispatch()
        abstract = nnx.eval_shape(constructor)
        modules = dict(nnx.iter_modules(abstract))
        pstate = nnx.state(abstract, nnx.Param)
        leaves = jax.tree.leaves(pstate)
        paths = _leaf_paths(pstate)
        self.abstract_params = {path_str(p): jax.ShapeDtypeStruct(l.shape, l.dtype) for p, l in zip(paths, leaves)}
        sizes = {p: int(l.size) for p, l in zip(paths, leaves)}
        self._unit_paths = select_units(
            modules, sizes, policy, threshold, is_embedding=lambda m: isinstance(m, nnx.Embed)
        )
        self.units: list[Unit] = []
        self._gdef, self._ptree = [], []
        for uid, up in enumerate(self._unit_paths):
            gdef, params, _ = nnx.split(modules[up], nnx.Param, ...)
            full = tuple(path_str(up + p) for p in _leaf_paths(params))
            ls = jax.tree.leaves(params)
            self.units.append(Unit(uid=uid, path=path_str(up), param_paths=full, nbytes=nbytes_of((l.shape, l.dtype) for l in ls)))
            self._gdef.append(gdef)
            self._ptree.append(jax.tree.structure(params))
        self._wrap(abstract)
        self._glue_gdef, gparams, _ = nnx.split(abstract, nnx.Param, ...)
        self._glue_ptree = jax.tree.structure(gparams)
        self.glue_paths = [path_str(p) for p in _leaf_paths(gparams)]
        self._eval_gdefs: tuple[list[Any], Any] | None = None  # built on first evaluation

    def _gdefs(self, train: bool) -> tuple[list[Any], Any]:
        """Graph definitions of the units and the glue in training or evaluation mode.

        Evaluation mode is what ``model.eval()`` gives: ``deterministic=True`` and
        ``use_running_average=True`` on every submodule that has them (dropout off,
        batch statistics frozen). They are static attributes, so they live in
        the graph definitions (and the program cache keys), not in the state.
        """
        if train:
            return self._gdef, self._glue_gdef
        if self._eval_gdefs is None:
            model = nnx.eval_shape(self.constructor)
            model.eval()
            units = [nnx.split(_get(model, up), nnx.Param, ...)[0] for up in self._unit_paths]
            self._wrap(model)
            self._eval_gdefs = (units, nnx.split(model, nnx.Param, ...)[0])
        return self._eval_gdefs

    def _wrap(self, model: nnx.Module) -> None:
        for u, up in zip(self.units, self._unit_paths):
            _set(model, up, UnitProxy(self.dispatch, u.uid, u.path))

    def program_key(self, uid: int, method: str, kwkey: tuple, train: bool = True) -> Hashable:
        return ("nnx", self._gdefs(train)[0][uid], method, kwkey)

    def unit_fn(self, uid: int, method: str, kwargs: dict, train: bool = True) -> Callable:
        gdef, ptree = self._gdefs(train)[0][uid], self._ptree[uid]

        def fn(full, rest, args):
            rest = jax.tree.map(lambda x: x, rest)  # fresh Variables in the current trace
            m = nnx.merge(gdef, jax.tree.unflatten(ptree, full), rest)
            out = getattr(m, method)(*args, **kwargs)
            return out, nnx.split(m, nnx.Param, ...)[2]

        return fn

    def init_params(self, paths: Sequence[str], transform: Callable, shardings: Sequence[Any]) -> list[jax.Array]:
        def f():
            st = nnx.state(self.constructor(), nnx.Param)
            flat = dict(zip((path_str(p) for p in _leaf_paths(st)), jax.tree.leaves(st)))
            return [transform(p, flat[p]) for p in paths]

        return exact_jit_call(f, list(shardings))

    def init_state(self, sharding: Any) -> tuple[list[Any], Any]:
        def f():
            model = self.constructor()
            rests = [nnx.split(_get(model, up), nnx.Param, ...)[2] for up in self._unit_paths]
            self._wrap(model)
            return rests, nnx.split(model, nnx.Param, ...)[2]

        return exact_jit_call(f, sharding)

    def run(self, loss_fn: Callable, glue: Sequence[jax.Array], glue_rest: Any, batch: Any,
            train: bool = True) -> tuple[Any, Any]:
        model = nnx.merge(self._gdefs(train)[1], jax.tree.unflatten(self._glue_ptree, list(glue)), glue_rest)
        out = loss_fn(model, batch)
        return out, nnx.split(model, nnx.Param, ...)[2]

    def structure(self, flat: dict[str, Any]) -> nnx.State:
        """Path -> value as an ``nnx.State`` shaped like the model's params."""
        st = nnx.state(nnx.eval_shape(self.constructor), nnx.Param)
        paths = [path_str(p) for p in _leaf_paths(st)]
        return jax.tree.unflatten(jax.tree.structure(st), [flat[p] for p in paths])


class LinenAdapter:
    """A Flax Linen module with the arguments of its ``init``."""

    def __init__(self, module: nn.Module, init_args: tuple, init_kwargs: dict, policy: UnitPolicy, threshold: int, seed: int):
        self.module, self.init_args, self.init_kwargs, self.seed = module, init_args, init_kwargs, seed
        self.dispatch = Dispatch()
        self._inside = threading.local()  # depth of unit programs being traced on this thread
        seen: dict[tuple, nn.Module] = {}

        def record(next_fun, args, kwargs, ctx):
            seen.setdefault(tuple(ctx.module.scope.path), ctx.module)
            return next_fun(*args, **kwargs)

        with nn.intercept_methods(record):
            variables = jax.eval_shape(self._init)
        other = [c for c in variables if c != "params"]
        if other:
            raise NotImplementedError(f"zinf_jax streams Linen 'params' only; collections {other} are not supported yet")
        flat = traverse_util.flatten_dict(variables["params"])
        self.abstract_params = {path_str(p): jax.ShapeDtypeStruct(v.shape, v.dtype) for p, v in flat.items()}
        sizes = {p: int(v.size) for p, v in flat.items()}
        modules = {p: seen[p] for p in sorted(seen, key=len)}
        unit_paths = select_units(modules, sizes, policy, threshold, is_embedding=lambda m: isinstance(m, nn.Embed))
        self.units, self._clones, self._rel = [], [], []
        for uid, up in enumerate(unit_paths):
            rel = [p[len(up):] for p in flat if p[: len(up)] == up]
            self._rel.append(rel)
            self._clones.append(modules[up].clone(parent=None))
            self.units.append(Unit(
                uid=uid, path=path_str(up), param_paths=tuple(path_str(up + r) for r in rel),
                nbytes=nbytes_of((flat[up + r].shape, flat[up + r].dtype) for r in rel),
            ))
        self._by_path = {up: uid for uid, up in enumerate(unit_paths)}
        covered = {p for u in self.units for p in u.param_paths}
        self._glue = [p for p in flat if path_str(p) not in covered]
        self.glue_paths = [path_str(p) for p in self._glue]

    def _init(self) -> Any:
        return self.module.init(jax.random.key(self.seed), *self.init_args, **self.init_kwargs)

    # Linen modules take their mode as call arguments (``train=False``): ``train`` is
    # accepted for the common interface and changes nothing; the loss function
    # given to eval_step passes the module's own flag.
    def program_key(self, uid: int, method: str, kwkey: tuple, train: bool = True) -> Hashable:
        return ("linen", type(self._clones[uid]), repr(self._clones[uid]), tuple(self._rel[uid]), method, kwkey)

    def unit_fn(self, uid: int, method: str, kwargs: dict, train: bool = True) -> Callable:
        clone, rel = self._clones[uid], self._rel[uid]

        def fn(full, rest, args):
            tree = traverse_util.unflatten_dict(dict(zip(rel, full)))
            self._inside.depth = getattr(self._inside, "depth", 0) + 1
            try:  # the unit runs as a root module: its children's paths must not be taken for units
                out = clone.apply({"params": tree}, *args, method=None if method == "__call__" else method, **kwargs)
            finally:
                self._inside.depth -= 1
            return out, rest

        return fn

    def init_params(self, paths: Sequence[str], transform: Callable, shardings: Sequence[Any]) -> list[jax.Array]:
        def f():
            flat = {path_str(p): v for p, v in traverse_util.flatten_dict(self._init()["params"]).items()}
            return [transform(p, flat[p]) for p in paths]

        return exact_jit_call(f, list(shardings))

    def init_state(self, sharding: Any) -> tuple[list[Any], Any]:
        return [None] * len(self.units), None

    def _intercept(self, next_fun, args, kwargs, ctx):
        if getattr(self._inside, "depth", 0):  # tracing a unit program
            return next_fun(*args, **kwargs)
        uid = self._by_path.get(tuple(ctx.module.scope.path)) if ctx.module.scope is not None else None
        if uid is None or ctx.method_name == "setup":
            return next_fun(*args, **kwargs)
        return self.dispatch(uid, ctx.method_name, args, kwargs)

    def run(self, loss_fn: Callable, glue: Sequence[jax.Array], glue_rest: Any, batch: Any,
            train: bool = True) -> tuple[Any, Any]:
        params = traverse_util.unflatten_dict(dict(zip(self._glue, glue)))

        def model(*args, **kwargs):
            with nn.intercept_methods(self._intercept):
                return self.module.apply({"params": params}, *args, **kwargs)

        return loss_fn(model, batch), None

    def structure(self, flat: dict[str, Any]) -> dict:
        """Path -> value as the Linen params dict."""
        return traverse_util.unflatten_dict({tuple(p.split("/")): v for p, v in flat.items()})
