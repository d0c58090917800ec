"""The Flax Linen adapter: units of a Linen module, their programs, the wrapped callable.

The wrapped model is a callable with the signature of ``module.apply`` minus
the variables: ``model(*args, rngs=..., mutable=[...], **kwargs)``. It applies
the module with the parameters outside every unit and the engine's copy of the
other collections (``batch_stats`` and the like) under
``nn.intercept_methods``, which routes each unit's method calls to the hook.

A unit call sends the arguments, the unit's variables of the non-parameter
collections, and the unit scope's RNG streams (Flax ``LazyRng`` values, whose
path suffix is static) to the hook. The unit program applies a clone of the
unit as a root module with those, so a unit's first call in a pass draws the
same random bits as in the unwrapped model; the collections it mutated come
back and are written into the outer scope, so ``apply(..., mutable=[...])``
returns what the unwrapped module would. Mutated persistent collections are
kept by the engine after a training pass.

Parameters boxed with ``nn.with_partitioning`` / ``nn.with_logical_partitioning``
are stored unboxed; their axis names give the layout a hint (the dimension
mapped to the ``fsdp`` axis is the one sharded), and :meth:`structure` restores
the boxes.
"""
from __future__ import annotations

import dataclasses
import threading
import warnings
from typing import Any, Callable, Hashable, Sequence

import jax
from flax import errors as flax_errors
from flax import linen as nn
from flax import traverse_util
from flax.core import DenyList, meta
from flax.core.scope import LazyRng

from zinf_jax.engine.adapters import READ, Hook, HookSlot, InitTrace, exact_jit_call
from zinf_jax.plan.units import Unit, UnitPolicy, nbytes_of, path_str, select_units

__all__ = ["LinenAdapter"]

TRANSIENT = ("intermediates",)
"""Collections that live for one call (``sow``), never kept as engine state."""

_SIMPLE = (bool, int, float, str, type(None))
_VARIANT = "\x00mode:"
"""Joins a unit's method name and its mode's number (:meth:`LinenAdapter._variant`) in the name the hook sees."""


def _mode(module: nn.Module) -> tuple:
    """The attributes of a Linen module that are plain values (``use_running_average``, ``deterministic``,
    ``dropout_rate``...): what a compact parent sets per call to choose its child's mode."""
    names = [f.name for f in dataclasses.fields(module) if f.name not in ("parent", "name")]
    out = []
    for k in names:
        v = getattr(module, k, None)
        if isinstance(v, _SIMPLE) or (isinstance(v, tuple) and all(isinstance(x, _SIMPLE) for x in v)):
            out.append((k, v))
    return tuple(out)


def _shape_of(x: Any) -> Any:
    return jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") and hasattr(x, "dtype") else x


def _mesh_axes(box: Any, rules: Any) -> tuple | None:
    """The mesh axes of each dimension of a boxed parameter, if it names any.

    Returned as a layout hint: :func:`zinf_jax.plan.partition.plan_partition` shards
    first the dimension that maps to one of the zero axes.
    """
    if isinstance(box, nn.LogicallyPartitioned):
        rules = rules or box.rules or nn.get_logical_axis_rules()
        if not rules:
            return None
        spec = nn.logical_to_mesh_axes(box.names, rules)
    elif isinstance(box, meta.Partitioned):
        spec = box.names
    else:
        return None
    spec = tuple(spec or ())
    return spec if any(ax is not None for ax in spec) else None


class _LazyParam:
    """A unit's parameter seen from the glue (the parent reads ``self.embed.embedding``): read on first use.

    Flax's ``setup`` of the unit binds this in place of the value; using it as an array (``@``, ``.T``,
    indexing, any ``jnp`` function) makes one unit call whose program returns the parameter, gathered
    (:data:`~zinf_jax.engine.adapters.READ`), once per pass. Shape and dtype are known without a read.
    """

    def __init__(self, read: Callable[[], Any], abstract: jax.ShapeDtypeStruct):
        self._read, self._value = read, None
        self.shape, self.dtype = tuple(abstract.shape), abstract.dtype
        self.ndim, self.size = len(self.shape), int(abstract.size)

    def value(self) -> Any:
        if self._value is None:
            self._value = self._read()
        return self._value

    def __jax_array__(self) -> Any:
        return self.value()

    @property
    def T(self) -> Any:  # noqa: N802 (numpy's name)
        return self.value().T

    def __getitem__(self, idx: Any) -> Any:
        return self.value()[idx]

    def __getattr__(self, name: str) -> Any:  # .at, .astype, .reshape, .sum...
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.value(), name)

    def __repr__(self) -> str:
        return f"_LazyParam(shape={self.shape}, dtype={self.dtype})"


for _op in ("add", "sub", "mul", "truediv", "matmul", "pow"):
    setattr(_LazyParam, f"__{_op}__", lambda self, other, _op=_op: getattr(self.value(), f"__{_op}__")(other))
    setattr(_LazyParam, f"__r{_op}__", lambda self, other, _op=_op: getattr(self.value(), f"__r{_op}__")(other))
_LazyParam.__neg__ = lambda self: -self.value()


def _merge_sown(old: Any, new: Any) -> Any:
    """Combines two values of one variable the way ``sow`` appends: tuples concatenate, dicts merge."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = dict(old)
        for k, v in new.items():
            out[k] = _merge_sown(old[k], v) if k in old else v
        return out
    if isinstance(old, tuple) and isinstance(new, tuple):
        return old + new
    return new


class LinenAdapter:
    """A Flax Linen module with the arguments of its ``init``.

    Args:
      module: the module.
      init_args, init_kwargs: arguments of ``module.init`` (example inputs).
      policy: which submodules are units.
      threshold: persistence threshold in elements.
      seed: seed of the ``params`` RNG at init.
      logical_axis_rules: rules mapping logical axis names of boxed parameters
        to mesh axes (default: the rules of the enclosing ``nn.logical_axis_rules``).
    """

    def __init__(self, module: nn.Module, init_args: tuple, init_kwargs: dict, policy: UnitPolicy, threshold: int,
                 seed: int, logical_axis_rules: Any = None, persistent: Sequence[str] = ()):
        self.module, self.init_args, self.init_kwargs, self.seed = module, init_args, init_kwargs, seed
        self.hook = HookSlot()
        self._inside = threading.local()  # depth of unit programs being traced on this thread
        self._run = threading.local()  # calls per unit in the apply in progress
        self._init_trace: InitTrace | None = None  # the initialisers, traced at the first init_params
        seen: dict[tuple, nn.Module] = {}
        calls: dict[tuple, tuple[str, Any, Any]] = {}
        lifted: dict[tuple, str] = {}  # modules run by a lifted transform of their parent: never units alone

        def record(next_fun, args, kwargs, ctx):
            path = tuple(ctx.module.scope.path)
            seen.setdefault(path, ctx.module)
            if not hasattr(type(ctx.module), ctx.method_name):  # nn.RNN's cell, run by the RNN's nn.scan as scan_fn
                lifted.setdefault(path, f"it runs inside a lifted transform of its parent ({ctx.method_name})")
            elif ctx.method_name != "setup":
                calls.setdefault(path, (ctx.method_name, jax.tree.map(_shape_of, args), jax.tree.map(_shape_of, kwargs)))
            return next_fun(*args, **kwargs)

        with nn.intercept_methods(record):
            variables = jax.eval_shape(self._init)
        boxed = traverse_util.flatten_dict(variables["params"])  # boxes are leaves here
        self._boxes = {path_str(p): v for p, v in boxed.items() if isinstance(v, meta.AxisMetadata)}
        flat = {p: meta.unbox(v) for p, v in boxed.items()}
        self.abstract_params = {path_str(p): jax.ShapeDtypeStruct(v.shape, v.dtype) for p, v in flat.items()}
        self.layout_hints = {p: axes for p, b in self._boxes.items()
                             if (axes := _mesh_axes(b, logical_axis_rules)) is not None}
        self.own_shardings = False  # boxes are pjit's (Auto axes) idiom: the code runs on the Auto view
        self._state_abstract = {c: meta.unbox(v) for c, v in variables.items() if c != "params" and c not in TRANSIENT}
        sizes = {p: int(v.size) for p, v in flat.items()}
        modules = {p: seen[p] for p in sorted(seen, key=len)}
        excluded: dict[tuple, str] = dict(lifted)  # their parameters belong to an enclosing unit or to the root
        while True:
            unit_paths = select_units(modules, sizes, policy, threshold,
                                      is_embedding=lambda m: isinstance(m, nn.Embed), exclude=set(excluded),
                                      persistent=persistent)
            bad = {up: why for up in unit_paths if (why := self._cannot_run(up, modules[up], flat, calls))}
            if not bad:
                break
            for up, why in bad.items():
                warnings.warn(f"zinf_jax: Linen module {path_str(up)!r} cannot run as a unit on its own ({why}); "
                              "its parameters belong to the units inside it, or else to the root (gathered for "
                              "the whole step)",
                              stacklevel=3)
            excluded.update(bad)
        self.units, self._clones, self._rel = [], [], []
        self._modes: list[dict[tuple, int]] = []  # per unit: its modes seen so far, by number (see _variant)
        for uid, up in enumerate(unit_paths):
            rel = [p[len(up):] for p in flat if p[: len(up)] == up]
            self._rel.append(rel)
            self._clones.append([modules[up].clone(parent=None)])
            self._modes.append({_mode(modules[up]): 0})
            self.units.append(Unit(
                uid=uid, path=path_str(up), param_paths=tuple(path_str(up + r) for r in rel),
                nbytes=nbytes_of((flat[up + r].shape, flat[up + r].dtype) for r in rel),
            ))
        self._by_path = {up: uid for uid, up in enumerate(unit_paths)}
        self._unit_tuple = list(unit_paths)
        covered = {p for u in self.units for p in u.param_paths}
        self._glue = [p for p in flat if path_str(p) not in covered]
        self.glue_paths = [path_str(p) for p in self._glue]

    def _init(self) -> Any:
        return self.module.init(jax.random.key(self.seed), *self.init_args, **self.init_kwargs)

    def _cannot_run(self, up: tuple, module: nn.Module, flat: dict, calls: dict) -> str | None:
        """Why ``module`` cannot be applied as a root module with only its own variables (``None``: it can)."""
        if up not in calls:
            return None  # never called at init: nothing to check
        method, args, kwargs = calls[up]
        params = traverse_util.unflatten_dict({p[len(up):]: flat[p] for p in flat if p[: len(up)] == up})
        state = {c: _subtree(v, up) for c, v in self._state_abstract.items()}
        clone = module.clone(parent=None)
        key = jax.random.key(0)

        leaves, tree = jax.tree.flatten((args, kwargs))
        pos = [i for i, x in enumerate(leaves) if isinstance(x, jax.ShapeDtypeStruct)]

        def apply(params, state, dyn):
            ls = list(leaves)
            for i, x in zip(pos, dyn):
                ls[i] = x
            args, kwargs = jax.tree.unflatten(tree, ls)
            # parameters immutable: a missing one is an error here, not silently created
            return clone.apply({"params": params, **{c: v for c, v in state.items() if v}}, *args,
                               rngs={"dropout": key}, mutable=DenyList("params"),
                               method=None if method == "__call__" else method, **kwargs)

        try:
            jax.eval_shape(apply, params, state, [leaves[i] for i in pos])
        except flax_errors.InvalidRngError:
            return None  # an RNG stream the check does not know: the unit gets the caller's streams
        except flax_errors.FlaxError as e:  # variables it reaches outside its own subtree
            return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        except (AttributeError, TypeError, ValueError) as e:  # a module that runs only under its parent's transform
            return f"applied alone it fails: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return None

    # [Note: Linen modes follow the call]
    # Linen modules take their mode as call arguments (``train=False``), and a compact parent often passes it
    # on as a child's attribute (``nn.BatchNorm(use_running_average=not train)``, ``nn.Dropout(deterministic=
    # not train)``). Such a child, when it is a unit, must run with the attributes of the call that reaches
    # it, not those it had at init: each call's module gives its plain-valued attributes (:func:`_mode`),
    # each distinct set is a variant of the unit (a clone of that call's module, numbered in order of first
    # sight), and the hook sees the variant's number in the method name, so each mode has its own program.
    # ``train`` is accepted for the common interface and changes nothing; the loss function given to
    # eval_step passes the module's own flag.
    def _variant(self, uid: int, module: nn.Module) -> int:
        """The number of ``module``'s mode among unit ``uid``'s (a new one is added)."""
        mode = _mode(module)
        n = self._modes[uid].get(mode)
        if n is None:
            n = self._modes[uid][mode] = len(self._clones[uid])
            self._clones[uid].append(module.clone(parent=None))
        return n

    def _clone(self, uid: int, method: str) -> tuple[nn.Module, str]:
        """The unit's clone for ``method`` (a variant's number appended by :meth:`_variant`) and the plain name."""
        name, _, n = method.partition(_VARIANT)
        return self._clones[uid][int(n or 0)], name

    def program_key(self, uid: int, method: str, train: bool = True) -> Hashable:
        clone, name = self._clone(uid, method)
        return ("linen", type(clone), repr(clone), tuple(self._rel[uid]), method)

    def unit_fn(self, uid: int, method: str, train: bool = True) -> Callable:
        clone, method = self._clone(uid, method)
        rel = self._rel[uid]

        def fn(full, inputs):
            args, kwargs, cols, rngs, mutable = inputs
            if method.startswith(READ):  # a parameter read outside the unit's call: its value, gathered
                return dict(zip(map(path_str, rel), full))[method[len(READ):]], {}
            variables = {"params": traverse_util.unflatten_dict(dict(zip(rel, full))), **cols}
            self._inside.depth = getattr(self._inside, "depth", 0) + 1
            try:  # the unit runs as a root module: its children's paths must not be taken for units
                res = clone.apply(variables, *args, rngs=rngs or None, mutable=mutable,
                                  method=None if method == "__call__" else method, **kwargs)
            finally:
                self._inside.depth -= 1
            out, upd = res if mutable is not False else (res, {})
            return out, {c: v for c, v in upd.items() if c != "params"}

        return fn

    @staticmethod
    def call_state(inputs: Any) -> Any:
        """The part of a unit call's inputs that is model state (replicated on every device)."""
        return inputs[2], inputs[3]

    def init_params(self, paths: Sequence[str], transform: Callable, shardings: Sequence[Any]) -> list[jax.Array]:
        return self._initialisers().run(paths, transform, shardings)

    def prepare_init(self, requests: Sequence[tuple[Sequence[str], Callable, Sequence[Any]]]) -> None:
        self._initialisers().prepare(requests)

    def _initialisers(self) -> InitTrace:
        if self._init_trace is None:
            self._init_trace = InitTrace(
                lambda: {path_str(p): v for p, v in traverse_util.flatten_dict(meta.unbox(self._init()["params"])).items()},
                list(self.abstract_params))
        return self._init_trace

    def init_state(self, sharding: Any) -> Any:
        """The non-parameter collections (``batch_stats``, ...) as ``init`` creates them, replicated."""
        if not self._state_abstract:
            return {}
        return exact_jit_call(lambda: {c: meta.unbox(v) for c, v in self._init().items() if c in self._state_abstract},
                              sharding)

    def abstract_state(self) -> Any:
        return self._state_abstract

    def _intercept(self, next_fun, args, kwargs, ctx):
        if getattr(self._inside, "depth", 0):  # tracing a unit program
            return next_fun(*args, **kwargs)
        scope = ctx.module.scope
        uid = self._by_path.get(tuple(scope.path)) if scope is not None else None
        if uid is None:
            return next_fun(*args, **kwargs)
        if ctx.method_name == "setup":  # binds the unit's params to lazy reads (see _LazyParam); no call
            return next_fun(*args, **kwargs)
        n = self._run.calls.get(uid, 0)
        self._run.calls[uid] = n + 1
        # A unit's first call draws the unwrapped model's bits; later calls of the same unit in
        # one pass fold the call index in (Flax would continue the scope's counters).
        rngs = {k: LazyRng.create(r, *(("zinf_call", n) if n else ())) for k, r in scope.rngs.items()}
        cols = {c: v for c, v in ctx.module.variables.items() if c != "params"}
        mutable = scope.mutable if isinstance(scope.mutable, bool) else tuple(
            c for c in (self._state_abstract.keys() | set(TRANSIENT)) if scope.is_mutable_collection(c))
        v = self._variant(uid, ctx.module)  # See [Note: Linen modes follow the call]
        method = ctx.method_name if v == 0 else f"{ctx.method_name}{_VARIANT}{v}"
        out, upd = self.hook(uid, method, (args, kwargs, cols, rngs, mutable))
        for col, tree in upd.items():
            if scope.is_mutable_collection(col):
                for name, value in tree.items():
                    old = scope.get_variable(col, name) if scope.has_variable(col, name) else None
                    scope.put_variable(col, name, value if old is None or col not in TRANSIENT
                                       else _merge_sown(old, value))
        return out

    def run(self, loss_fn: Callable, glue: Sequence[jax.Array], state: Any, batch: Any, hook: Hook,
            train: bool = True) -> tuple[Any, Any, Any]:
        """Runs ``loss_fn(model, batch)``; returns ``(loss_out, new_state, None)``."""
        flat = dict(zip(self._glue, glue))
        for uid, (unit, rel) in enumerate(zip(self.units, self._rel)):  # the units' params: read only if used
            up = tuple(self._unit_tuple[uid])
            for r in rel:
                name = path_str(r)
                flat[up + r] = _LazyParam(lambda uid=uid, name=name: self.hook(uid, READ + name, ((), {}, {}, {}, False))[0],
                                          self.abstract_params[path_str(up + r)])
        params = traverse_util.unflatten_dict(flat)
        current = dict(state or {})

        def model(*args, rngs=None, mutable=False, **kwargs):
            self._run.calls = {}
            with self.hook.installed(hook), nn.intercept_methods(self._intercept):
                res = self.module.apply({"params": params, **current}, *args, rngs=rngs, mutable=mutable, **kwargs)
            if mutable is not False:
                current.update({c: v for c, v in res[1].items() if c in current})
            return res

        return loss_fn(model, batch), current, None

    def batch_state(self, batch: Any) -> None:
        """Linen batches hold no state."""

    def update_batch(self, batch: Any, batch_state: Any) -> None:
        """Linen batches hold no state."""

    def model_state(self, state: Any) -> dict:
        """The kept collections (``{"batch_stats": ...}``), as ``apply`` takes them."""
        return dict(state)

    def select(self, which: Any) -> set[str]:
        """Paths of the parameters a predicate on the ``/``-joined path selects (``lambda p: "lora" in p``)."""
        if not callable(which):
            raise TypeError(f"Linen trainable= takes a predicate on the parameter path (str -> bool), got {which!r}")
        return {p for p in self.abstract_params if which(p)}

    def structure(self, flat: dict[str, Any]) -> dict:
        """Path -> value as the Linen params dict, boxed parameters boxed again."""
        return traverse_util.unflatten_dict({
            tuple(p.split("/")): (self._boxes[p].replace_boxed(v) if p in self._boxes else v) for p, v in flat.items()
        })


def _subtree(tree: Any, path: tuple) -> Any:
    for p in path:
        if not isinstance(tree, dict) or p not in tree:
            return {}
        tree = tree[p]
    return tree
