"""Flax NNX and Linen models seen the same way by the engine.

An adapter finds the units of a model, gives each unit call as a pure function
``(full_params, inputs) -> outputs``, initialises any subset of the parameters
inside ``jit`` (so XLA computes only those: the model is never materialised
whole), and runs the user's loss on a *wrapped* model whose unit calls go to a
:data:`Hook` that the engine passes to :meth:`run`.

The engine sees a unit call only as ``hook(uid, method, inputs)``: ``inputs``
is a pytree whose array leaves are traced (or differentiated) and whose other
leaves are static. The adapter puts everything the unit needs into it — the
call's arguments, the unit's non-parameter state (RNG counters, batch
statistics), RNG streams — and takes the unit's new state back out of the
outputs. State therefore flows through the call like any other value: the
backward recompute replays exactly the forward's random bits, and nothing is
mutated behind JAX's back.

This module holds what both frameworks share; :mod:`.nnx_adapter` and
:mod:`.linen_adapter` hold the two adapters.
"""
from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Hashable, Iterator, Mapping, Protocol, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zinf_jax._internal import jax_private
from zinf_jax._internal.futures import done_future
from zinf_jax.errors import EngineError

__all__ = ["InitTrace", "Hook", "HookSlot", "Adapter", "EngineError", "exact_jit_call", "EXACT_COMPILE_OPTIONS",
           "leaf_paths", "get_path"]


READ = "__read__:"
"""Method name of a parameter read outside its unit's call (``model.embed.embedding[...]``): a unit call whose
program returns that parameter, gathered, so the glue gets its value and its gradient goes to the unit (NNX: a Param attribute of a unit proxy; Linen: a
parameter a unit's ``setup`` defines, read through the parent)."""


_OWN_SHARDING = ("mesh context", "auto mesh", "of type Auto")
"""What JAX and Flax say when code places arrays by a mesh that is not there."""


@contextlib.contextmanager
def model_sharding_explained() -> Iterator[None]:
    """Turns the errors of a model that shards its own arrays without Explicit mesh axes into one
    :class:`EngineError` naming the fix.

    Models written for JAX's sharding-in-types (``PartitionSpec`` s in their code:
    ``.at[...].get(out_sharding=...)``, ``jax.sharding.reshard``, ``out_sharding=`` arguments) need
    their mesh's axes Explicit while they trace (:mod:`zinf_jax.plan.model_mesh`); on a mesh with
    Auto axes (``zinf.make_mesh()``, or one made with ``AxisType.Auto``) such code fails inside JAX
    with a message about a missing mesh.
    """
    try:
        yield
    except ValueError as e:
        text = str(e)
        if not any(h in text for h in _OWN_SHARDING):
            raise
        raise EngineError(
            "the model shards its own arrays (PartitionSpecs in its code: .at[...].get(out_sharding=...), "
            "jax.sharding.reshard, out_sharding= arguments), which needs Explicit mesh axes while it traces. "
            "zinf_jax runs a model's code with Explicit axes when the mesh passed to zinf.initialize(mesh=...) "
            "has them (jax.make_mesh's default) and the model's parameters declare their shardings (Flax "
            "out_sharding metadata: kernel_metadata={'out_sharding': P(...)}, nnx.with_partitioning), as "
            "nnx.jit on that mesh would; it composes its ZeRO sharding with the model's (ZeRO over "
            "ZeroConfig.zero_axes, the model's own spec on the other axes). JAX said: "
            f"{text.splitlines()[0][:300]}") from e


class Hook(Protocol):
    """Where wrapped unit calls go: ``hook(uid, method, inputs) -> outputs``."""

    def __call__(self, uid: int, method: str, inputs: Any) -> Any: ...


class HookSlot:
    """The hook of the pass in progress on this thread (set by :meth:`Adapter.run` only)."""

    def __init__(self) -> None:
        self._local = threading.local()

    @contextlib.contextmanager
    def installed(self, hook: Hook) -> Iterator[None]:
        prev = getattr(self._local, "hook", None)
        self._local.hook = hook
        try:
            yield
        finally:
            self._local.hook = prev

    def __call__(self, uid: int, method: str, inputs: Any) -> Any:
        hook = getattr(self._local, "hook", None)
        if hook is None:
            raise RuntimeError(
                "zinf_jax: a unit of the wrapped model was called outside engine.train_step/eval_step "
                "(the wrapped model is only valid inside loss_fn)"
            )
        return hook(uid, method, inputs)


class Adapter(Protocol):
    """What the engine needs from a model adapter (implemented by NNX and Linen)."""

    units: list[Any]
    glue_paths: list[str]
    abstract_params: dict[str, jax.ShapeDtypeStruct]
    layout_hints: dict[str, Any]  # path -> dim to shard first, or the mesh axes of each dim (see plan_partition)
    own_shardings: bool  # written for sharding-in-types: its code runs with Explicit axes (plan.model_mesh)

    def program_key(self, uid: int, method: str, train: bool) -> Hashable: ...

    def unit_fn(self, uid: int, method: str, train: bool) -> Callable[[list[jax.Array], Any], Any]: ...

    def call_state(self, inputs: Any) -> Any: ...

    def init_params(self, paths: Sequence[str], transform: Callable, shardings: Sequence[Any]) -> list[jax.Array]: ...

    def prepare_init(self, requests: Sequence[tuple[Sequence[str], Callable, Sequence[Any]]]) -> None: ...

    def init_state(self, sharding: Any) -> Any: ...

    def abstract_state(self) -> Any: ...

    def run(self, loss_fn: Callable, glue: Sequence[jax.Array], state: Any, batch: Any, hook: Hook,
            train: bool) -> tuple[Any, Any, Any]: ...

    def batch_state(self, batch: Any) -> Any: ...

    def update_batch(self, batch: Any, batch_state: Any) -> None: ...

    def model_state(self, state: Any) -> Any: ...

    def structure(self, flat: dict[str, Any]) -> Any: ...

    def select(self, which: Any) -> set[str]: ...


# XLA's algebraic simplifier reassociates constant multiplies (x * sqrt2 * std), so a
# jitted initialiser would differ in the last bit from eager construction. With it
# off, the unit-by-unit init reproduces eager construction bit for bit. Copy insertion
# with region analysis (off by default on CPU) drops the copies of the threefry loop
# that XLA's CPU backend keeps rolled: the same bits, a block of the 1.61B GPT made
# in 0.55-0.61 s instead of 0.66-0.73 s by a default jit (2 CPU devices).
EXACT_COMPILE_OPTIONS = {"xla_disable_hlo_passes": "algsimp,constant_folding",
                         "xla_cpu_copy_insertion_use_region_analysis": True}


def exact_jit_call(fn: Callable[[], Any], out_shardings: Any) -> Any:
    """Compiles ``fn`` (no arguments) with eager-exact arithmetic and runs it."""
    return jax.jit(fn, out_shardings=out_shardings).lower().compile(compiler_options=EXACT_COMPILE_OPTIONS)()


def _info(what: str, ins: Sequence[Any], outs: Sequence[Any]) -> Any:
    return jax_private.DebugInfo("zinf_jax init", what, tuple(f"in{i}" for i in range(len(ins))),
                                 tuple(f"out{i}" for i in range(len(outs))))


def _is_scalar(v: Any) -> bool:
    return isinstance(v, jax_private.Literal) or tuple(getattr(v.aval, "shape", (None,))) == ()


class InitTrace:
    """A model's initialisers traced once, then cut down to each batch of parameters and compiled alone.

    Tracing the whole constructor for every batch of units made init time grow
    with depth squared (each trace is as long as the model). Here the
    constructor is traced once to a jaxpr; a batch keeps only the equations its
    parameters depend on (dead-code elimination), so each program is as small
    as its units and init time grows linearly in depth. The equations are the
    constructor's own, so the values are bitwise those of eager construction.

    The scalar equations (the RNG streams' counters and keys, a chain through the whole model) are
    evaluated once, eagerly, and enter each batch's program as arguments: the programs of alike
    batches (a model's identical blocks) are then the same program, compiled once. A program needs
    only the scalars' types, so :meth:`prepare` lowers programs and compiles them in background
    threads (XLA's compiler releases the GIL) while the first :meth:`run` evaluates the scalars.

    Args:
      values: ``values() -> {name: array}``, every output (a parameter's path) of the constructed model.
      order: the names, in a fixed order; ``None``: the order ``values`` returns them in.
      region: ``region(fn, in_specs)``: runs the constructor's equations as the model's code (with the
        mesh's Explicit axes, when its code names shardings: see ``ModelMesh.region``); ``None``: as they are.
      mesh: the mesh set (``jax.set_mesh``) while the constructor is traced and its scalars are evaluated
        (then they are replicated over it); ``None``: none (they are uncommitted, on the default device).

    Attributes:
      avals: name -> the abstract value (shape, dtype) of each output, in the outputs' order.
    """

    COMPILE_THREADS = 2
    """Programs compiled at once by :meth:`prepare`."""

    def __init__(self, values: Callable[[], Mapping[str, Any]], order: Sequence[str] | None = None,
                 region: Callable[[Callable, Any], Callable] | None = None, mesh: Mesh | None = None):
        self._region = region
        self._mesh = mesh
        names: list[str] = list(order) if order is not None else []

        def all_values() -> list[Any]:
            flat = values()  # the constructor runs once
            if order is None:
                names.extend(flat)
            return [flat[p] for p in names]

        with self._evaluating():
            closed = jax_private.discharge_refs(jax.make_jaxpr(all_values)())  # a constructor may build with Refs
        self._order = {p: i for i, p in enumerate(names)}
        self.avals = dict(zip(names, closed.out_avals))
        self._jaxpr = jax_private.convert_constvars_jaxpr(closed.jaxpr)  # constants become leading inputs
        self._consts = list(closed.consts)
        self._scalar_eqns, self._scalar_vars = self._find_scalars()
        self._scalars: dict[Any, Any] | None = None  # their values, computed at the first run
        self._compiled: dict[str, Future] = {}  # lowered program text -> compiled
        self._by_body: dict[tuple, Future] = {}  # a batch's body text, argument and output types -> compiled
        self._producer = {v: k for k, e in enumerate(self._jaxpr.eqns) for v in e.outvars}  # var -> its equation
        self._effects = [k for k, e in enumerate(self._jaxpr.eqns) if e.effects]  # (jax's DCE keeps them)

    def _find_scalars(self) -> tuple[list[Any], set[Any]]:
        """The equations whose inputs and outputs are all scalars computable before any array (in order),
        and every scalar variable they and the constants define."""
        known = {v for v in self._jaxpr.invars[:len(self._consts)] if _is_scalar(v)}
        eqns = []
        for eqn in self._jaxpr.eqns:
            if eqn.effects or not all(_is_scalar(v) for v in [*eqn.invars, *eqn.outvars]):
                continue
            if all(isinstance(v, jax_private.Literal) or v in known for v in eqn.invars):
                eqns.append(eqn)
                known.update(eqn.outvars)
        return eqns, known

    def _evaluating(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self._mesh is None else jax.set_mesh(self._mesh)

    def _eval_scalars(self) -> dict[Any, Any]:
        """The values of the scalar variables (:meth:`_find_scalars`), computed eagerly."""
        known = {v: c for v, c in zip(self._jaxpr.invars, self._consts) if v in self._scalar_vars}
        with self._evaluating():
            for eqn in self._scalar_eqns:  # (bound directly: a jaxpr per equation, 0.94 s at 1.61B; 0.33 s)
                out = eqn.primitive.bind(*[v.val if isinstance(v, jax_private.Literal) else known[v]
                                           for v in eqn.invars], **eqn.params)
                known.update(zip(eqn.outvars, out if eqn.primitive.multiple_results else [out]))
        return known

    def prepare(self, requests: Sequence[tuple[Sequence[str], Callable[[str, Any], Any], Sequence[Any]]]) -> None:
        """Starts compiling the programs of ``requests`` (``(paths, transform, shardings)`` as :meth:`run` takes
        them) in background threads; :meth:`run` compiles what was not prepared itself."""
        pool = ThreadPoolExecutor(self.COMPILE_THREADS, thread_name_prefix="zinf-init-compile")
        try:
            for paths, transform, shardings in requests:
                self._program(paths, transform, shardings, pool.submit)
        finally:
            pool.shutdown(wait=False)  # its threads end once the compiles are done

    def run(self, paths: Sequence[str], transform: Callable[[str, Any], Any], shardings: Sequence[Any]) -> list[Any]:
        """``transform(path, value)`` of ``paths``, computed by one compiled program, placed with ``shardings``."""
        compiled, consts, lifted = self._program(paths, transform, shardings, _now)
        if self._scalars is None:  # (meanwhile the prepared programs compile)
            self._scalars = self._eval_scalars()
        return compiled.result()(*consts, *[self._scalars[v] for v in lifted])

    def _slice(self, want: Sequence[int]) -> tuple[Any, list[bool]]:
        """The constructor's jaxpr cut down to outputs ``want``, without the scalar equations (their variables
        become inputs), and which of the constants it reads.

        Walks back from the outputs through the equations that define them only, so a batch costs as much as its
        units (dead-code elimination of the whole model's jaxpr for every batch made init quadratic in depth);
        jax's DCE then prunes the kept equations' own sub-jaxprs.
        """
        eqns_all = self._jaxpr.eqns
        const_vars = self._jaxpr.invars[:len(self._consts)]
        is_const = set(const_vars)
        outvars = [self._jaxpr.outvars[i] for i in want]
        kept = set(self._effects)
        reached: set[Any] = set()
        todo = [v for k in kept for v in eqns_all[k].invars] + outvars
        while todo:
            v = todo.pop()
            if isinstance(v, jax_private.Literal) or v in reached:
                continue
            reached.add(v)
            k = self._producer.get(v)
            if k is None or v in self._scalar_vars or k in kept:  # a constant, a scalar (lifted), or seen
                continue
            kept.add(k)
            todo.extend(eqns_all[k].invars)
        eqns = [eqns_all[k] for k in sorted(kept)]
        consts = [v for v in const_vars if v in reached]
        read = dict.fromkeys(v for v in [*(v for e in eqns for v in e.invars), *outvars]
                             if not isinstance(v, jax_private.Literal))
        free = [v for v in read if v not in is_const and self._producer.get(v) not in kept]  # the lifted scalars
        ins = [*consts, *free]
        cut = jax_private.Jaxpr([], ins, outvars, eqns, jax_private.join_effects(*(e.effects for e in eqns)),
                                debug_info=_info("batch", ins, outvars))
        cut, used = jax_private.dce_jaxpr(cut, [True] * len(outvars))
        used_consts = {v for v, u in zip(consts, used) if u}
        # the constants this batch reads become its leading inputs; the scalars stay free (lifted by the caller)
        ins = [v for v in consts if v in used_consts]
        return (jax_private.Jaxpr([], ins, cut.outvars, cut.eqns, cut.effects, debug_info=_info("batch", ins, outvars)),
                [v in used_consts for v in self._jaxpr.invars])

    def _program(self, paths: Sequence[str], transform: Callable[[str, Any], Any], shardings: Sequence[Any],
                 submit: Callable[..., Future]) -> tuple[Future, list[Any], list[Any]]:
        """The future of the compiled program of ``paths`` (compiled by ``submit(fn, ...)`` if new) and its
        arguments: the constants, then the scalar variables whose values follow them."""
        want = [self._order[p] for p in paths]
        jaxpr, used_in = self._slice(want)
        consts = [c for c, u in zip(self._consts, used_in) if u]
        env = set(jaxpr.invars)
        eqns = jaxpr.eqns
        lifted = list(dict.fromkeys(v for e in eqns for v in e.invars
                                    if not isinstance(v, jax_private.Literal) and v in self._scalar_vars
                                    and v not in env))
        lifted += [v for v in dict.fromkeys(v for v in jaxpr.outvars if not isinstance(v, jax_private.Literal))
                   if v in self._scalar_vars and v not in env and v not in lifted]
        ins = [*jaxpr.invars, *lifted]
        body = jax_private.Jaxpr([], ins, list(jaxpr.outvars), eqns, jaxpr.effects,
                                 debug_info=_info("batch", ins, jaxpr.outvars))
        pos = {i: k for k, i in enumerate(sorted(set(want)))}  # the kept outputs stay in their order

        def evaluate(*xs):
            return jax_private.eval_jaxpr(body, [], *xs)

        if self._region is not None:
            evaluate = self._region(evaluate, tuple(P() for _ in ins))

        def init_batch(*xs):
            outs = evaluate(*xs)
            return [transform(p, outs[pos[i]]) for p, i in zip(paths, want)]

        # Alike batches (a model's identical blocks) have the same body: found by its text, their program is
        # neither traced nor lowered again (each cost ~0.3 s per batch at 0.40B); else by the lowered text.
        types = [*map(jax.typeof, consts), *(v.aval for v in lifted)]
        outs = [jax.ShapeDtypeStruct(body.outvars[pos[i]].aval.shape, body.outvars[pos[i]].aval.dtype) for i in want]
        stored = jax.eval_shape(lambda *xs: [transform(p, x) for p, x in zip(paths, xs)], *outs)  # (traced at once)
        key = (str(body), tuple(pos[i] for i in want), tuple(types), tuple(shardings), tuple(map(jax.typeof, stored)))
        compiled = self._by_body.get(key)
        if compiled is None:
            here = None if self._mesh is None else NamedSharding(self._mesh, P())  # where the scalars will be
            specs = [jax.ShapeDtypeStruct(t.shape, t.dtype, weak_type=t.weak_type, sharding=here)
                     for t in types[len(consts):]]
            lowered = jax.jit(init_batch, out_shardings=list(shardings)).lower(*consts, *specs)
            text = lowered.as_text()
            compiled = self._compiled.get(text)
            if compiled is None:
                compiled = self._compiled[text] = submit(lowered.compile, compiler_options=EXACT_COMPILE_OPTIONS)
            self._by_body[key] = compiled
        return compiled, consts, lifted


def _now(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
    """``fn(*args, **kwargs)`` run here, as a resolved future (what :meth:`InitTrace.run` compiles with)."""
    return done_future(fn(*args, **kwargs))


def kp_tuple(kp: Sequence[Any]) -> tuple[Any, ...]:
    """A jax key path as plain names and indices (``.value`` of NNX Variables dropped)."""
    out = []
    for k in kp:
        if isinstance(k, jax.tree_util.DictKey):
            out.append(k.key)
        elif isinstance(k, jax.tree_util.SequenceKey):
            out.append(k.idx)
        elif isinstance(k, jax.tree_util.GetAttrKey) and k.name != "value":
            out.append(k.name)
    return tuple(out)


def leaf_paths(tree: Any) -> list[tuple[Any, ...]]:
    """Paths of the leaves of ``tree``, in leaf order."""
    return [kp_tuple(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def get_path(module: Any, path: tuple[Any, ...]) -> Any:
    """The submodule at ``path``."""
    for p in path:
        module = module[p] if isinstance(p, int) else getattr(module, p)
    return module
