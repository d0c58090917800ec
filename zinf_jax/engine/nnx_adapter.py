"""The Flax NNX adapter: units of an NNX model, their programs, the wrapped model.

The wrapped model is a copy of the abstract model in which every unit is
replaced by a :class:`UnitProxy`. A proxy holds no parameters, but it holds the
unit's non-parameter :class:`~flax.nnx.Variable` objects (RNG keys and counts,
batch statistics) — the *same* objects as the unit, so a variable shared by two
units or by a unit and the glue (one ``nnx.Rngs`` held by the model and its
blocks) is one variable of the wrapped model, updated in call order exactly as
in the unwrapped model.

A unit call sends the proxy's variable values, the call's arguments and the
state of any NNX object passed as an argument (``block(x, rngs=rngs)``) to the
engine's hook; the unit program merges them, runs the unit method, and returns
the output, the values the unit sowed (``nnx.Intermediate``) and the new state,
which the proxy writes back. Sown values are attached to the proxy at the
unit's own paths (``blocks/0/attn/scores``), so ``nnx.pop(model,
nnx.Intermediate)`` inside the loss sees what the unwrapped model would; they
live for one pass only. Repeated calls append, like ``sow``'s default.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Hashable, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import spmd as core_spmd
from jax.sharding import Mesh

from zinf_jax.engine.adapters import READ, EngineError, Hook, HookSlot, InitTrace, get_path, leaf_paths
from zinf_jax.plan.model_mesh import ModelMesh, spec_of
from zinf_jax.plan.units import Unit, UnitPolicy, UnitPolicyError, layer_count, nbytes_of, path_str, select_units

__all__ = ["NnxAdapter", "UnitProxy"]


@dataclasses.dataclass(frozen=True)
class _NodeRef:
    """Marks where an NNX object passed to a unit call goes back in the arguments."""

    index: int


class _SownScope(nnx.Module):
    """A placeholder submodule of a proxy under which sown values of nested modules are attached."""


def _set(module: Any, path: tuple[Any, ...], value: Any) -> None:
    parent = get_path(module, path[:-1])
    if isinstance(path[-1], int):
        parent[path[-1]] = value
    else:
        setattr(parent, path[-1], value)


def _variables(module: Any) -> dict[tuple[Any, ...], nnx.Variable]:
    return {p: v for p, v in nnx.iter_graph(module) if isinstance(v, nnx.Variable)}


class _LayerIndex(nnx.Variable):
    """Stands for the layers of a stacked unit in its proxy during a pass: ``arange(layers)``, so that the model's
    own scan over the stack (``nnx.scan``, ``jax.lax.scan`` over its ``nnx.split`` state) has a leading axis to
    scan even though the proxy holds no parameters. Never part of the model's state."""


class _Data(nnx.Variable):
    """Holds, in a unit's proxy, an array attribute of the unit that is not a Variable (``nnx.data(array)``)."""


def _held(unit: nnx.Module) -> list[nnx.Variable]:
    """A unit's non-parameter state, in its split order: its own Variables (shared with the model), and a
    holder for each plain array attribute (``self.position_ids = nnx.data(jnp.arange(n))``)."""
    own = _variables(unit)
    rest = nnx.split(unit, nnx.Param, ...)[2]
    return [own[p] if p in own else _Data(v) for p, v in zip(leaf_paths(rest), jax.tree.leaves(rest))]


def _without_eager_sharding(constructor: Callable[[], nnx.Module]) -> Callable[[], nnx.Module]:
    """The constructor with Flax's eager sharding off: the engine places every parameter itself (its
    ``out_sharding`` metadata is read as the model's own spec, :func:`_own_spec`), and a model built for
    a mesh then traces without one."""
    def build() -> nnx.Module:
        with nnx.use_eager_sharding(False):
            return constructor()

    return build


def _construct_with_refs(constructor: Callable[[], nnx.Module], refs: bool = True) -> nnx.Module:
    """The model built with its Variables as array references, then turned back into plain Variables.

    Under a trace, Flax updates a plain Variable's RNG count by comparing the old and new values'
    ``sharding``; on a tracer that attribute raises, and JAX writes the error's message by walking the
    whole trace so far. Built that way, a deep constructor traces in time quadratic in depth (51 s for a
    90-block GPT); a reference is updated in place without the comparison (4.4 s). The values, the graph
    definition and tied Variables are the same (``tests/engine/test_engine.py``); the trace's reference
    operations are discharged into plain ones (``InitTrace``). Flax before 0.12.4 has no
    ``var_defaults`` and builds as it is (quadratic in 0.12.2 and 0.12.3, which have the comparison).

    Some constructors cannot build with references: ``nnx.split_rngs`` (a stack of layers made with
    ``nnx.vmap``) writes a key of another shape into an RNG stream's scalar key, which a reference refuses;
    :meth:`NnxAdapter._trace` then builds them with plain Variables (``refs=False``).
    """
    if not refs or not hasattr(nnx, "var_defaults"):
        return constructor()
    with nnx.var_defaults(ref=True):
        model = constructor()
    as_values = getattr(nnx, "with_vars", None) or nnx.vars_as  # renamed in Flax 0.12.8
    return as_values(model, ref=False, allow_duplicates=True)


def _own_spec(var: nnx.Variable) -> tuple | None:
    """The mesh axes of each dimension of a parameter, from its ``out_sharding`` metadata (Flax eager
    sharding, ``nnx.with_partitioning``; logical names mapped by its ``sharding_rules`` and the rules in
    context), or ``None`` when it names none."""
    meta = var.get_metadata()
    spec = meta.get("out_sharding")
    if spec is None:
        return None
    spec = core_spmd.apply_rules(spec, meta.get("sharding_rules"))
    spec = tuple(getattr(spec, "spec", spec))
    return spec if any(e is not None for e in spec) else None


def _typed_spec(aval: Any) -> tuple | None:
    """The mesh axes of each dimension of a parameter from its type: the sharding its initialiser gave it
    (``init(key, shape, out_sharding=P(...))``, ``jnp.zeros(..., out_sharding=...)``: JAX's
    sharding-in-types, traced with the mesh's Explicit axes set), or ``None`` when it names none."""
    spec = tuple(spec_of(aval))
    return spec if any(e is not None for e in spec) else None


class _UnitCaller:
    """The adapter's side of one unit: calls through the hook and static attribute reads."""

    def __init__(self, adapter: NnxAdapter, uid: int, abstract_unit: nnx.Module):
        self.adapter, self.uid, self.unit = adapter, uid, abstract_unit

    def call(self, proxy: UnitProxy, method: str, args: tuple, kwargs: dict) -> Any:
        live = getattr(self.adapter._run, "proxies", None)
        if live is None or id(proxy) in live:
            return self._call(proxy, method, args, kwargs)
        try:  # a copy of the proxy: it went through nnx.split/merge, as NNX transforms (nnx.scan...) pass it
            return self._call(proxy, method, args, kwargs)
        except Exception as e:  # noqa: BLE001 (the model's own error, with what most likely caused it)
            parent = proxy.path.rsplit("/", 1)[0] if "/" in proxy.path else None
            fix = (f"make the module that runs the scan a unit: UnitPolicy(patterns=({parent!r},)) if it is {parent!r}"
                   if parent else "move the stack and the scan over it into a submodule of their own and make "
                   "that a unit (UnitPolicy(patterns=(...,)))")
            raise EngineError(
                f"unit {proxy.path!r} failed when called inside a transform of the model's code ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:200]}). If it is a stack of layers applied by a scan (nnx.scan, nnx.vmap, "
                "jax.lax.scan over nnx.split state): the engine applies it one layer per iteration when every "
                "parameter of it is at least 2-D with the layer count as its leading size; otherwise "
                f"{fix} (its stacked parameters are then sharded at rest and gathered for its call)") from e

    def _call(self, proxy: UnitProxy, method: str, args: tuple, kwargs: dict) -> Any:
        nodes: list[Any] = []

        def grab(x: Any) -> Any:
            if isinstance(x, UnitProxy):
                raise EngineError(f"unit {proxy.path}.{method}: another streamed unit ({x.path}) cannot be "
                                  "passed as an argument; call it in the loss or in the model instead")
            if nnx.graph.is_graph_node(x):
                nodes.append(x)
                return _NodeRef(len(nodes) - 1)
            return x

        args, kwargs = jax.tree.map(grab, (args, kwargs), is_leaf=nnx.graph.is_graph_node)
        box = nnx.List(nodes) if nodes else None
        ngdef, nstate = nnx.split(box) if box is not None else (None, None)
        held = [v.get_value() for v in proxy.held]
        out, sown, new_held, new_nstate = self.adapter.hook(self.uid, method, (args, kwargs, ngdef, nstate, held))
        for v, x in zip(proxy.held, new_held):
            v.set_value(x)
        if box is not None:
            nnx.update(box, new_nstate)
        self.adapter.attach_sown(proxy, sown)
        return out

    def attr(self, proxy: UnitProxy, name: str) -> Any:
        try:
            value = getattr(self.unit, name)
        except AttributeError:
            raise AttributeError(f"unit {proxy.path!r} ({type(self.unit).__name__}) has no attribute {name!r}") from None
        where = f"{proxy.path}.{name}"
        if isinstance(value, nnx.Param):  # read outside the unit's call: fetched like a call that returns it
            reads = getattr(self.adapter._run, "reads", None)  # the pass's reads so far: one fetch per parameter
            if reads is None or (self.uid, name) not in reads:
                out = self.call(proxy, READ + name, (), {})
                if reads is None:
                    return type(value)(out)
                reads[(self.uid, name)] = out
            return type(value)(reads[(self.uid, name)])
        if isinstance(value, nnx.Variable):
            raise EngineError(
                f"{where} is a {type(value).__name__} of a streamed unit: its value lives in the engine's tiers, "
                "not in the wrapped model. Use it inside a method of the unit, add a parameter penalty with "
                "zinf.initialize(..., param_loss=fn), or read engine.params() / engine.model_state()")
        if isinstance(value, nnx.Module):
            raise EngineError(
                f"{where} is a submodule of the streamed unit {proxy.path!r}; call the unit's own methods, or make "
                f"{proxy.path}/{name} a unit of its own (UnitPolicy(patterns=({proxy.path + '/' + name!r},)))")
        if callable(value):
            return lambda *a, **k: self.call(proxy, name, a, k)
        return value  # a static attribute (num_heads, features, a dtype)


class UnitProxy(nnx.Module):
    """Stands in for a unit inside the wrapped NNX model.

    Method calls go to the engine; static attributes read through to the unit;
    ``held`` are the unit's non-parameter variables (shared with the model).
    """

    def __init__(self, caller: _UnitCaller, path: str, held: Sequence[nnx.Variable]):
        self.caller = nnx.static(caller)
        self.path = path
        self.held = nnx.List(list(held))
        self.layer_index: _LayerIndex | None = None  # a stack's, during a pass (see _LayerIndex)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.caller.call(self, "__call__", args, kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return object.__getattribute__(self, "caller").attr(self, name)


class NnxAdapter:
    """A Flax NNX model given by its constructor.

    Args:
      constructor: builds the model (traced abstractly; never run whole eagerly).
      policy: which submodules are units.
      threshold: persistence threshold in elements.
      persistent: ``ZeroConfig.persistent_params``.
      mesh: the user's mesh: with Explicit axes, the constructor is traced with them (its own
        ``out_sharding=`` arguments, e.g. to initialisers, need them) and the initialisers run as a
        region of the model's code (:class:`~zinf_jax.plan.model_mesh.ModelMesh`).
    """

    def __init__(self, constructor: Callable[[], nnx.Module], policy: UnitPolicy, threshold: int,
                 persistent: Sequence[str] = (), mesh: Mesh | None = None):
        self.constructor = _without_eager_sharding(constructor)
        self._mesh = ModelMesh.of(mesh, own_shardings=True) if mesh is not None else None
        if self._mesh is not None and not self._mesh.explicit:
            self._mesh = None
        self.hook = HookSlot()
        self._run = threading.local()  # sown attributes added during the pass in progress
        self._init_trace, self._skeleton = self._trace()
        abstract = self._abstract()
        canon = {id(v): path_str(p) for p, v in nnx.iter_graph(abstract) if isinstance(v, nnx.Param)}
        pstate = nnx.state(abstract, nnx.Param)
        paths = leaf_paths(pstate)
        leaves = jax.tree.leaves(pstate)
        self.abstract_params = {path_str(p): jax.ShapeDtypeStruct(l.shape, l.dtype) for p, l in zip(paths, leaves)}
        self.layout_hints = {canon[id(v)]: spec for _, v in nnx.iter_graph(abstract)
                             if isinstance(v, nnx.Param) and (spec := _own_spec(v)) is not None}
        for path in self.abstract_params:  # no metadata: the spec its initialiser gave it (out_sharding=...)
            if path not in self.layout_hints and (spec := _typed_spec(self._init_trace.avals[path])) is not None:
                self.layout_hints[path] = spec
        self.own_shardings = bool(self.layout_hints)  # Flax eager sharding's metadata: see plan.model_mesh
        modules = dict(nnx.iter_modules(abstract))
        sizes = {p: int(l.size) for p, l in zip(paths, leaves)}
        self._unit_paths = select_units(
            modules, sizes, policy, threshold, is_embedding=lambda m: isinstance(m, nnx.Embed), persistent=persistent
        )
        self.units: list[Unit] = []
        self._gdef, self._ptree, self._rtree, self._callers = [], [], [], []
        for uid, up in enumerate(self._unit_paths):
            unit = modules[up]
            gdef, params, rest = nnx.split(unit, nnx.Param, ...)
            own = _variables(unit)
            full = tuple(canon[id(own[p])] for p in leaf_paths(params))
            ls = jax.tree.leaves(params)
            self.units.append(Unit(uid=uid, path=path_str(up), param_paths=full,
                                   nbytes=nbytes_of((l.shape, l.dtype) for l in ls)))
            self._gdef.append(gdef)
            self._ptree.append(jax.tree.structure(params))
            self._rtree.append(jax.tree.structure(rest))
            self._callers.append(_UnitCaller(self, uid, unit))
        self._wrap(abstract)
        self._glue_gdef, gparams, _ = nnx.split(abstract, nnx.Param, ...)
        self._glue_ptree = jax.tree.structure(gparams)
        glue_vars = _variables(abstract)
        self.glue_paths = [canon[id(glue_vars[p])] for p in leaf_paths(gparams)]
        in_units = {p for u in self.units for p in u.param_paths}
        both = [p for p in self.glue_paths if p in in_units]
        if both:
            raise UnitPolicyError(f"parameter {both[0]!r} is used both inside a unit and outside every unit; "
                                  "make the module that holds it a unit, or keep it out of the units")
        self._layers = {u.path: n for u in self.units
                        if (n := layer_count([self.abstract_params[p].shape for p in u.param_paths])) is not None}
        self._eval_gdefs: tuple[list[Any], Any] | None = None  # built on first evaluation
        self._kind_cache: dict[bool, list[int]] = {}  # see _kinds

    def _trace(self) -> tuple[InitTrace, tuple[Any, Any]]:
        """Traces the constructor, once for everything the adapter needs from it: the abstract model, the
        parameters' initialisers and the initial non-parameter state (see ``_construct_with_refs`` for why the
        variables are built as references).

        Returns:
          The trace, whose outputs are the leaves of the model's state in leaf order (a parameter named by its
          canonical path, every other leaf ``#<position>``), and the skeleton: the graph definition and the
          state's tree structure.
        """
        skeleton: list[Any] = []

        def values(refs: bool) -> dict[str, Any]:
            skeleton.clear()
            model = _construct_with_refs(self.constructor, refs)
            own = _variables(model)
            canon = {id(v): path_str(p) for p, v in own.items() if isinstance(v, nnx.Param)}
            gdef, state = nnx.split(model)
            leaves, tree = jax.tree.flatten(state)
            names = [canon[id(own[p])] if isinstance(own.get(p), nnx.Param) else f"#{i}"
                     for i, p in enumerate(leaf_paths(state))]
            skeleton.extend([gdef, tree])
            return dict(zip(names, leaves))

        region = self._mesh.region if self._mesh is not None else None
        mesh = self._mesh.code_mesh if self._mesh is not None else None
        try:
            trace = InitTrace(lambda: values(True), region=region, mesh=mesh)
        except Exception:  # noqa: BLE001 (built as it is below: a constructor's own error is raised from there)
            trace = InitTrace(lambda: values(False), region=region, mesh=mesh)  # see _construct_with_refs
        return trace, (skeleton[0], skeleton[1])

    def _abstract(self, values: Mapping[str, Any] | None = None) -> nnx.Module:
        """A fresh copy of the model, abstract (leaves ``jax.ShapeDtypeStruct``), or with the given ``values``
        (output name -> array) where it has them."""
        gdef, tree = self._skeleton
        avals = self._init_trace.avals
        leaves = [values[n] if values is not None and n in values else
                  jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for n, a in avals.items()]
        return nnx.merge(gdef, jax.tree.unflatten(tree, leaves))

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
            model = self._abstract()
            model.eval()
            units = [nnx.split(get_path(model, up), nnx.Param, ...)[0] for up in self._unit_paths]
            self._wrap(model)
            self._eval_gdefs = (units, nnx.split(model, nnx.Param, ...)[0])
        return self._eval_gdefs

    def _wrap(self, model: nnx.Module) -> None:
        """Replaces every unit of ``model`` by a proxy holding the unit's non-parameter variables."""
        proxies = []
        for caller, u, up in zip(self._callers, self.units, self._unit_paths):
            proxies.append(UnitProxy(caller, u.path, _held(get_path(model, up))))
        for proxy, up in zip(proxies, self._unit_paths):
            _set(model, up, proxy)

    def program_key(self, uid: int, method: str, train: bool = True) -> Hashable:
        return ("nnx", train, self._kinds(train)[uid], method)

    def _kinds(self, train: bool) -> list[int]:
        """Per unit, the index of the first unit whose graph definition equals its own: alike units (a model's
        blocks) share programs. Compared by equality, not by hash: a unit may hold an unhashable static value
        (a frozen config dataclass with a list field) that ``nnx.jit`` accepts too."""
        hit = self._kind_cache.get(train)
        if hit is None:
            reps: list[Any] = []
            hit = []
            for g in self._gdefs(train)[0]:
                k = next((i for i, r in enumerate(reps) if r == g), None)
                if k is None:
                    reps.append(g)
                    k = len(reps) - 1
                hit.append(k)
            self._kind_cache[train] = hit
        return hit

    def unit_fn(self, uid: int, method: str, train: bool = True) -> Callable:
        gdef, ptree, rtree = self._gdefs(train)[0][uid], self._ptree[uid], self._rtree[uid]

        def fn(full, inputs):
            args, kwargs, ngdef, nstate, held = inputs
            m = nnx.merge(gdef, jax.tree.unflatten(ptree, full), jax.tree.unflatten(rtree, list(held)))
            box = nnx.merge(ngdef, nstate) if ngdef is not None else None
            args, kwargs = jax.tree.map(lambda x: box[x.index] if isinstance(x, _NodeRef) else x, (args, kwargs))
            out = getattr(m, method[len(READ):])[...] if method.startswith(READ) else getattr(m, method)(*args, **kwargs)
            sown = nnx.pop(m, nnx.Intermediate)
            new_held = jax.tree.leaves(nnx.split(m, nnx.Param, ...)[2])
            return out, sown, new_held, (nnx.split(box)[1] if box is not None else None)

        return fn

    @staticmethod
    def call_state(inputs: Any) -> Any:
        """The part of a unit call's inputs that is model state (replicated on every device)."""
        return inputs[3], inputs[4]

    def attach_sown(self, proxy: UnitProxy, sown: nnx.State) -> None:
        """Puts values a unit sowed on its proxy at the unit's own paths (appending like ``sow``)."""
        added = getattr(self._run, "added", None)
        for path, var in nnx.to_flat_state(sown):
            parent = proxy
            for name in path[:-1]:
                if name not in vars(parent):
                    setattr(parent, name, _SownScope())
                    if added is not None:
                        added.append((parent, name))
                parent = getattr(parent, name)
            name, value = path[-1], var.get_value()
            if name in vars(parent):
                old = getattr(parent, name)
                old.set_value(tuple(old.get_value()) + tuple(value))
            else:
                setattr(parent, name, nnx.Intermediate(value))
                if added is not None:
                    added.append((parent, name))

    def init_params(self, paths: Sequence[str], transform: Callable, shardings: Sequence[Any]) -> list[jax.Array]:
        return self._init_trace.run(paths, transform, shardings)

    def prepare_init(self, requests: Sequence[tuple[Sequence[str], Callable, Sequence[Any]]]) -> None:
        self._init_trace.prepare(requests)

    def _state_of(self, model: nnx.Module) -> Any:
        self._wrap(model)
        return nnx.split(model, nnx.Param, ...)[2]

    def init_state(self, sharding: Any) -> Any:
        """Every non-parameter variable of the model (units' included), replicated."""
        rest = [n for n in self._init_trace.avals if n not in self.abstract_params]
        values = dict(zip(rest, self._init_trace.run(rest, lambda _, v: v, [sharding] * len(rest)))) if rest else {}
        return self._state_of(self._abstract(values))

    def abstract_state(self) -> Any:
        return self._state_of(self._abstract())

    def run(self, loss_fn: Callable, glue: Sequence[jax.Array], state: Any, batch: Any, hook: Hook,
            train: bool = True) -> tuple[Any, Any, Any]:
        """Runs ``loss_fn(wrapped_model, batch)``.

        Returns:
          ``(loss_out, new_state, batch_state)``: the loss output, the model's new
          non-parameter state, and the new state of NNX objects in the batch.
        """
        state = jax.tree.map(lambda x: x, state)  # fresh Variables in the current trace
        model = nnx.merge(self._gdefs(train)[1], jax.tree.unflatten(self._glue_ptree, list(glue)), state)
        nodes = [x for x in jax.tree.leaves(batch, is_leaf=nnx.graph.is_graph_node) if nnx.graph.is_graph_node(x)]
        box = None
        if nodes:  # NNX objects in the batch (an nnx.Rngs): fresh copies in this trace, written back after
            gdef, st = nnx.split(nnx.List(nodes))
            box = nnx.merge(gdef, jax.tree.map(lambda x: x, st))
            it = iter(box)
            batch = jax.tree.map(lambda x: next(it) if nnx.graph.is_graph_node(x) else x, batch,
                                 is_leaf=nnx.graph.is_graph_node)
        self._run.added = added = []
        proxies = [m for _, m in nnx.iter_modules(model) if isinstance(m, UnitProxy)]
        self._run.proxies = {id(m) for m in proxies}
        for proxy in proxies:  # a stack's proxy: what the model's scan over it scans (see _LayerIndex)
            if (n := self._layers.get(proxy.path)) is not None:
                proxy.layer_index = nnx.data(_LayerIndex(jnp.arange(n, dtype=jnp.int32)))
        self._run.reads = {}  # (uid, name) -> the value of a parameter read outside its unit in this pass
        try:
            with self.hook.installed(hook):
                out = loss_fn(model, batch)
        finally:
            self._run.added = self._run.reads = self._run.proxies = None
        for parent, name in reversed(added):  # sown values live for one pass
            if name in vars(parent):
                delattr(parent, name)
        nnx.pop(model, nnx.Intermediate)
        return out, nnx.split(model, nnx.Param, _LayerIndex, ...)[3], (nnx.split(box)[1] if box is not None else None)

    def batch_state(self, batch: Any) -> Any:
        """The state of the NNX objects in ``batch`` (an ``nnx.Rngs`` passed in), to put back with
        :meth:`update_batch` after a step that failed (``None``: the batch holds none)."""
        nodes = [x for x in jax.tree.leaves(batch, is_leaf=nnx.graph.is_graph_node) if nnx.graph.is_graph_node(x)]
        return nnx.state(nnx.List(nodes)) if nodes else None

    def update_batch(self, batch: Any, batch_state: Any) -> None:
        """Writes the new state of the NNX objects in ``batch`` into them (RNG counters advance)."""
        if batch_state is None:
            return
        nodes = [x for x in jax.tree.leaves(batch, is_leaf=nnx.graph.is_graph_node) if nnx.graph.is_graph_node(x)]
        nnx.update(nnx.List(nodes), batch_state)

    def model_state(self, state: Any) -> nnx.State:
        """The engine's state in the unwrapped model's own structure (``blocks/0/bn/mean``, ...)."""
        model = self._abstract()
        units = [get_path(model, up) for up in self._unit_paths]
        self._wrap(model)  # proxies hold the units' own Variable objects
        nnx.update(model, state)
        for unit, up in zip(units, self._unit_paths):
            _set(model, up, unit)
        return nnx.state(model, nnx.Not(nnx.Param))

    def select(self, which: Any) -> set[str]:
        """Paths of the parameters an NNX filter selects (``nnx.LoRAParam``, a path predicate, ...)."""
        pred = nnx.filterlib.to_predicate(which)
        abstract = self._abstract()
        return {path_str(p) for p, v in nnx.iter_graph(abstract) if isinstance(v, nnx.Param) and pred(p, v)}

    def structure(self, flat: dict[str, Any]) -> nnx.State:
        """Path -> value as an ``nnx.State`` shaped like the model's params."""
        st = nnx.state(self._abstract(), nnx.Param)
        paths = [path_str(p) for p in leaf_paths(st)]
        return jax.tree.unflatten(jax.tree.structure(st), [flat[p] for p in paths])
