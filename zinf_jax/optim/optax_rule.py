"""Any optax transform as an update rule of the streamed optimizer: chunk by chunk, whole tensor, or whole tree.

How a transform is split is proved once from its own program (:func:`~zinf_jax.optim.optax_split.prove`,
[Note: split proofs]), per parameter:

* **chunk** (element-wise on this parameter: SGD, momentum, the Adam family, Lion, Adagrad, RMSProp,
  schedule-free, schedules, weight decay, masks): each sub-group (a chunk of one shard) is presented
  to the transform alone, as a one-leaf tree at the parameter's own path with the parameter's rank
  (``(chunk, 1, ...)``). State leaves shaped like the chunk are stored in the optimizer tier like
  Adam's moments; scalar leaves (step counts) are kept per parameter in the optimizer's metadata.
* **whole** (it couples the elements of one tensor: ``lamb``, ``lars`` with a trust-ratio mask,
  ``novograd``, ``adafactor``, ``sm3``, ``optax.contrib.muon``): the driver brings the whole
  parameter's master, gradient and states together (:class:`~zinf_jax.optim.subgroups.Whole`), and the
  transform runs on a one-leaf tree at the parameter's path and its own shape. State leaves shaped
  like the parameter are stored in the tier, sharded and chunked like the master; scalar leaves as
  above; every other leaf (Adafactor's factored row and column moments, SM3's accumulators) keeps
  its own shape and is held in host RAM and stored with the optimizer's metadata and checkpoints.
* **tree** (one parameter's update reads another's: ``optax.contrib.prodigy``, ``dadapt_adamw``,
  ``mechanize``, ``polyak_sgd``, ``momo``, ``noisy_sgd``, a global-norm clip in the middle of a chain):
  every parameter whole, in one update over the tree (:class:`~zinf_jax.optim.subgroups.Tree`). The
  storage is the same as for whole tensors; a leaf every parameter's state has (a step size estimated
  over the tree, a random key) is kept by each as a copy, all copies equal.

``optax.clip_by_global_norm`` at the head of an ``optax.chain`` is taken out of the transform's hands
(:func:`leading_global_clip`, :func:`without_head_clip`): the driver computes the global norm over every
shard anyway and scales the gradient first. ``optax.MultiSteps`` runs as its
``gradient_transformation()``. A ``GradientTransformationExtraArgs`` gets ``value=`` (the step's loss,
after accumulation: :meth:`OptaxRule.begin_step`). Random keys in the state are stored as their key data.

One update is one jitted program on the host's CPU backend, compiled once per distinct program and
input types: the paths a transform treats alike (the blocks of a deep model) share it.
"""
from __future__ import annotations

import base64
import dataclasses
import inspect
import re
import warnings
from typing import Any, Callable, Hashable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from zinf_jax.errors import ConfigError
from zinf_jax.optim.optax_split import (Refusal, assemble, calls_loss, disassemble, extra_args, host_device, leaf, merged, nest,
                                        proven)
from zinf_jax.optim.subgroups import Span

__all__ = ["OptaxRule", "leading_global_clip", "without_head_clip", "as_transform", "describe"]

_F32 = np.float32
_KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
_HYPERPARAM = re.compile(r"\.hyperparams\['([^']+)'\]$")
"""The key path of a hyperparameter ``optax.inject_hyperparams`` keeps in its state."""


def as_transform(tx: Any) -> Any:
    """``tx`` as a ``GradientTransformation``: an ``optax.MultiSteps`` becomes its ``gradient_transformation()``."""
    import optax

    if isinstance(tx, optax.MultiSteps):
        return tx.gradient_transformation()
    return tx


def _cells(fn: Any) -> dict:
    return dict(inspect.getclosurevars(fn).nonlocals) if inspect.isfunction(fn) else {}


def describe(tx: Any, depth: int = 0) -> str:
    """How the user built ``tx``, for messages: the optax function that made it (``prodigy``), a chain's parts
    (``chain(clip_by_global_norm, scale_by_adam, ...)``), ``inject_hyperparams(adamw)``."""
    fn = getattr(tx, "update", tx)
    name = getattr(fn, "__qualname__", type(tx).__name__).split(".<locals>")[0]
    cells = _cells(fn)
    if name == "with_extra_args_support" and hasattr(cells.get("tx"), "update"):
        return describe(cells["tx"], depth)
    if name == "chain" and "update_fns" in cells and depth < 1:
        return f"chain({', '.join(describe(f, depth + 1) for f in cells['update_fns'])})"
    if name == "inject_hyperparams" and callable(cells.get("inner_factory")):
        return f"inject_hyperparams({getattr(cells['inner_factory'], '__name__', '?')})"
    return name


def leading_global_clip(tx: Any) -> float | None:
    """``max_norm`` of an ``optax.clip_by_global_norm`` that ``tx`` is or that heads its ``optax.chain``."""
    fn = getattr(tx, "update", None)
    for _ in range(4):  # chain -> with_extra_args_support wrapper -> the transform
        if fn is None or not inspect.isfunction(fn):
            return None
        if fn.__qualname__.startswith("clip_by_global_norm."):
            return float(inspect.getclosurevars(fn).nonlocals["max_norm"])
        cells = _cells(fn)
        if "update_fns" in cells:  # optax.chain: look at its first transform
            fn = cells["update_fns"][0]
        elif "tx" in cells and hasattr(cells["tx"], "update"):
            fn = cells["tx"].update
        else:
            return None
    return None


def without_head_clip(tx: Any) -> Any:
    """``tx`` whose leading ``optax.clip_by_global_norm`` (:func:`leading_global_clip`) passes the gradient through
    (the driver clips first); its state unchanged (the clip's is empty)."""
    import optax

    return optax.GradientTransformationExtraArgs(tx.init, _pass_clip(tx.update))


def _pass_clip(fn: Callable) -> Callable:
    """The update function ``fn``, whose first step is a global-norm clip, with that clip passing through."""
    if fn.__qualname__.startswith("clip_by_global_norm."):
        return lambda updates, state, params=None, **extra: (updates, state)
    cells = _cells(fn)
    if "update_fns" in cells:  # optax.chain: its first transform passes the clip through, the rest as they are
        fns = (_pass_clip(cells["update_fns"][0]), *cells["update_fns"][1:])

        def update(updates, state, params=None, **extra):
            new = []
            for f, s in zip(fns, state):
                updates, s = f(updates, s, params, **extra)
                new.append(s)
            return updates, tuple(new)
        return update
    return _pass_clip(cells["tx"].update)  # with_extra_args_support's wrapper


def _scheduled(tx: Any) -> set[str]:
    """The hyperparameters of the ``optax.inject_hyperparams`` transforms in ``tx`` that follow a schedule (they
    are computed again from the step count at every step)."""
    out: set[str] = set()
    todo, seen = [getattr(tx, "update", tx)], set()
    while todo:
        fn = todo.pop()
        if id(fn) in seen or not inspect.isfunction(fn):
            continue
        seen.add(id(fn))
        cells = _cells(fn)
        if fn.__qualname__.startswith("inject_hyperparams."):
            out |= set(cells.get("sched_hps", {}))
        for v in cells.values():
            for x in (v if isinstance(v, (tuple, list)) else v.values() if isinstance(v, dict) else (v,)):
                todo.append(getattr(x, "update", x))
    return out


def _presented(n: int, rank: int) -> tuple[int, ...]:
    """The shape ``n`` elements of a parameter of ``rank`` dimensions are presented in: ``(n, 1, ...)`` of that
    rank (a 0-d parameter's one element as itself)."""
    return () if rank == 0 else (n,) + (1,) * (rank - 1)


def _key_impl(dtype: Any) -> str | None:
    """The PRNG implementation of a key dtype (``None``: not a key)."""
    if not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return None
    for name in _KEY_IMPLS:
        if jax.eval_shape(lambda: jax.random.key(0, impl=name)).dtype == dtype:
            return name
    raise Refusal(f"its state holds a random key of an unknown kind ({dtype})")


def _stored(x: Any) -> Any:
    """A state leaf as stored: a random key as its key data."""
    return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x


@dataclasses.dataclass(frozen=True)
class _PathInfo:
    keys: tuple[str, ...]  # the path as nested dict keys
    whole: bool  # the whole-tensor path (else chunk by chunk)
    shape: tuple[int, ...]  # what the transform sees: (chunk, 1, ...) for a chunk, the parameter's shape whole
    treedef: Any  # of the transform's state for that shape
    kinds: tuple[str, ...]  # per state leaf: "elem" (shaped like the leaf: in the tier), "scalar" or "odd"
    dtypes: tuple[Any, ...]
    impls: tuple[str | None, ...]  # per state leaf: its PRNG implementation (a key), else None
    kps: tuple[str, ...]  # per state leaf: its key path
    fills: tuple[float | None, ...] = ()  # whole: per "elem" leaf, its constant start (None: from the parameter)


def _real_of(lay: Any, shards: int, per_shard: int) -> Callable:
    """Flat shard-major padded buffers -> the parameter's own shape (traced)."""
    from zinf_jax.plan.partition import from_stored

    numel = int(np.prod(lay.shard_shape))

    def real(x):
        x = x.reshape(shards, per_shard)[:, :numel].reshape(shards, *lay.shard_shape)
        stored = x[0] if lay.dim is None else jnp.concatenate(list(x), axis=lay.dim)
        return from_stored(lay, stored)
    return real


def _flat_of(lay: Any, shards: int, per_shard: int) -> Callable:
    """Inverse of :func:`_real_of`."""
    from zinf_jax.plan.partition import to_stored

    numel = int(np.prod(lay.shard_shape))

    def flat(y):
        s = to_stored(lay, y)
        parts = [s] if lay.dim is None else jnp.split(s, shards, axis=lay.dim)
        x = jnp.stack([q.reshape(-1) for q in parts])
        return jnp.pad(x, ((0, 0), (0, per_shard - numel))).reshape(-1)
    return flat


class OptaxRule:
    """An optax ``GradientTransformation`` as an update rule of the streamed optimizer (see module doc).

    Args:
      tx: the transform (e.g. ``optax.chain(optax.clip_by_global_norm(1.0), optax.lion(1e-4))``), or an
        ``optax.MultiSteps``.
      layouts: parameter path to layout.
      chunks: elements of one sub-group of each path.

    Raises:
      ConfigError: the transform's state is not one part per parameter, its initial state is computed from the
        parameters across elements, or its update cannot run on the model's parameters (with the reason and
        the fix).
    """

    def __init__(self, tx: Any, layouts: Mapping[str, Any], chunks: Mapping[str, int]):
        tx = as_transform(tx)
        self.name = describe(tx)
        self.clip_norm = leading_global_clip(tx)
        self.tx = tx = without_head_clip(tx) if self.clip_norm is not None else tx
        self.extras = extra_args(tx)
        self.calls_loss = calls_loss(tx)
        """The transform calls the loss (``value_fn``: a line search); only the compiled step's program gives it."""
        self._info: dict[str, _PathInfo] = {}
        self._scalars: dict[str, list[np.ndarray]] = {}
        self._odd: dict[str, list[np.ndarray]] = {}  # whole path: leaves of their own shapes, in RAM
        self._pending: dict[str, list[np.ndarray]] = {}
        self._pending_odd: dict[str, list[np.ndarray]] = {}
        self._progs: dict[Any, Any] = {}
        self._inits: dict[str, Any] = {}
        self._by_key: dict[Hashable, Any] = {}  # (program text, input types) -> compiled
        self._value: np.float32 | None = None
        shapes = {p: tuple(lay.shape) for p, lay in layouts.items()}
        presented = {p: _presented(int(chunks[p]), len(s)) for p, s in shapes.items()}
        try:
            self.split = proven(tx, shapes, presented)
            for path, lay in layouts.items():
                keys = tuple(path.split("/"))
                self._info[path] = self._whole_info(path, keys, lay) if path in self.split.whole else \
                    self._chunk_info(keys, presented[path])
        except Refusal as e:
            raise self._error(str(e), "use a transform whose state is made per parameter from constants or "
                                      "element-wise from the parameters (as every optax optimizer's is)") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            why = f"its init and update fail on the model's parameters ({type(e).__name__}: {e})"
            fix = ("give masks and labels (optax.masked, multi_transform, weight-decay masks) as callables of the "
                   "params tree, not as fixed pytrees")
            raise self._error(why, fix) from e
        self.tree = self.split.tree
        """Why every parameter is updated in one update over the tree (``None``: each alone)."""
        self.why = dict(self.split.whole)
        """Why a parameter takes the whole-tensor (or whole-tree) path (only those that do)."""
        for path, info in self._info.items():
            if not info.whole:
                self._scalars[path] = [np.asarray(x) for x, k in zip(
                    self._init(path, np.zeros(int(np.prod(info.shape)), _F32)), info.kinds) if k == "scalar"]

    def _error(self, why: str, fix: str) -> ConfigError:
        return ConfigError(f"optimizer: the optax transform {self.name!r} is not supported: {why}. Fix: {fix}",
                           field="optimizer", detail=why)

    @property
    def reads_value(self) -> bool:
        """The transform's update reads ``value=`` (the step's loss)."""
        return self.split.reads_value

    # --- classification -------------------------------------------------------------
    def _leaves_info(self, keys: tuple[str, ...], shape: tuple[int, ...]) -> tuple:
        state = jax.eval_shape(self.tx.init, nest(keys, jax.ShapeDtypeStruct(shape, jnp.float32)))
        pairs, treedef = jax.tree_util.tree_flatten_with_path(state)
        leaves = [x for _, x in pairs]
        kinds = tuple("elem" if tuple(x.shape) == shape and _key_impl(x.dtype) is None else
                      "scalar" if x.shape == () else "odd" for x in leaves)
        return (treedef, kinds, tuple(x.dtype for x in leaves), tuple(_key_impl(x.dtype) for x in leaves),
                tuple(jax.tree_util.keystr(k) for k, _ in pairs))

    def _chunk_info(self, keys: tuple[str, ...], shape: tuple[int, ...]) -> _PathInfo:
        with jax.default_device(host_device()):
            treedef, kinds, dtypes, impls, kps = self._leaves_info(keys, shape)
        return _PathInfo(keys, False, shape, treedef, kinds, dtypes, impls, kps)

    def _whole_info(self, path: str, keys: tuple[str, ...], lay: Any) -> _PathInfo:
        shape = tuple(lay.shape)
        tx = self.tx
        with jax.default_device(host_device()):
            treedef, kinds, dtypes, impls, kps = self._leaves_info(keys, shape)
            reads = self.split.init_reads[path]

            def start():  # each constant tier state's least and greatest value, and the leaves kept beside the tier
                leaves = jax.tree.leaves(tx.init(nest(keys, jnp.zeros(shape, jnp.float32))))
                ranges = [(jnp.min(x), jnp.max(x)) if x.size else (jnp.float32(0), jnp.float32(0))
                          for x, k, kp in zip(leaves, kinds, kps) if k == "elem" and kp not in reads]
                return ranges, [_stored(x) for x, k in zip(leaves, kinds) if k != "elem"]

            ranges, own = jax.jit(start)()
            it = iter(ranges)
            fills = []
            for kp, kind in zip(kps, kinds):
                if kind != "elem":
                    continue
                if kp in reads:
                    fills.append(None)  # made chunk by chunk from the master
                    continue
                lo, hi = (float(x) for x in next(it))
                if lo != hi:
                    raise Refusal(f"its initial state {kp} for {path!r} is not one constant")
                fills.append(lo)
        start = [np.asarray(x) for x in own]
        rest = [k for k in kinds if k != "elem"]
        self._scalars[path] = [x for x, k in zip(start, rest) if k == "scalar"]
        self._odd[path] = [x for x, k in zip(start, rest) if k == "odd"]
        return _PathInfo(keys, True, shape, treedef, kinds, dtypes, impls, kps, tuple(fills))

    def whole(self, path: str) -> bool:
        """Whether ``path``'s update runs on the whole tensor (:meth:`update_whole`, or :meth:`update_tree` with
        every other parameter), not chunk by chunk."""
        return self._info[path].whole

    # --- the one place a transform's update is traced ----------------------------------------
    def leaves(self, path: str, elems: Sequence[Any], scalars: Sequence[Any], odd: Sequence[Any],
               shape_elem: Callable[[Any], Any]) -> list[Any]:
        """``path``'s state leaves in the state's order, from the tier's states (each through ``shape_elem``),
        the scalar leaves and the other-shaped ones, as stored (traced)."""
        info = self._info[path]
        ie, isc, io = iter(elems), iter(scalars), iter(odd)
        return [shape_elem(next(ie)).astype(dt) if k == "elem" else next(isc) if k == "scalar" else next(io)
                for k, dt in zip(info.kinds, info.dtypes)]

    def apply(self, items: Mapping[Any, tuple[Any, Any, Sequence[Any]]], value: Any,
              value_fn: Callable[[dict[str, Any]], Any] | None = None) -> dict[Any, tuple[Any, list]]:
        """The transform's step on ``items`` (traced): per path ``(param, grad, state leaves as stored)`` in the
        shape the rule presents the path in, to ``(new param, new state leaves as stored)``. Every path at once
        for a tree-coupled transform; each alone otherwise (a chunk, a shard or a whole tensor; keyed by its
        path, or by ``(path, k)`` where several pieces of one path are updated together).

        ``value_fn``: the step's loss as a function of ``{path: param}`` (differentiable), for a transform that
        calls the loss (:attr:`calls_loss`: a line search); it gets it as optax's ``value_fn=``, with ``grad=``."""
        import optax

        extra = {"value": jnp.asarray(value, jnp.float32)} if self.extras else {}
        if self.calls_loss:
            if value_fn is None or self.tree is None:
                raise ValueError(f"the optax transform {self.name!r} calls the loss: the compiled step gives it")
            keys = {p: self._info[p].keys for p in items}
            extra["grad"] = merged({p: g for p, (_, g, _) in items.items()})
            extra["value_fn"] = lambda tree: value_fn({p: leaf(k, tree) for p, k in keys.items()})

        def wrapped(path: str, leaves: Sequence[Any]) -> list[Any]:
            return [x if impl is None else jax.random.wrap_key_data(x, impl=impl)
                    for x, impl in zip(leaves, self._info[path].impls)]

        if self.tree is not None:
            if set(items) != set(self._info):
                raise ValueError("a tree-coupled transform updates every parameter at once")
            params = merged({p: x for p, (x, _, _) in items.items()})
            grads = merged({p: g for p, (_, g, _) in items.items()})
            state = jax.tree.unflatten(self.split.state_def,
                                       assemble(self.split, {p: wrapped(p, s) for p, (_, _, s) in items.items()}))
            updates, new_state = self.tx.update(grads, state, params, **extra)
            new = optax.apply_updates(params, updates)
            per = disassemble(self.split, jax.tree.leaves(new_state))
            return {p: (leaf(self._info[p].keys, new), [_stored(x) for x in per[p]]) for p in items}
        out = {}
        for key, (p, g, s) in items.items():
            path = key if isinstance(key, str) else key[0]
            info = self._info[path]
            params = nest(info.keys, p)
            state = jax.tree.unflatten(info.treedef, wrapped(path, s))
            updates, new_state = self.tx.update(nest(info.keys, g), state, params, **extra)
            out[key] = (leaf(info.keys, optax.apply_updates(params, updates)),
                        [_stored(x) for x in jax.tree.leaves(new_state)])
        return out

    def split_kinds(self, path: str, leaves: Sequence[Any]) -> dict[str, list[Any]]:
        """``path``'s state leaves by kind: ``{"elem": [...], "scalar": [...], "odd": [...]}``."""
        kinds = self._info[path].kinds
        return {k: [x for x, kk in zip(leaves, kinds) if kk == k] for k in ("elem", "scalar", "odd")}

    # --- programs ----------------------------------------------------------------------
    def _compiled(self, fn: Callable, args: tuple) -> Any:
        """``fn`` compiled for arguments like ``args`` on the host, once per distinct lowered program *and* input
        types (``jax.jit`` drops arguments a program never reads, so programs of different shapes can share a
        text: a stateless transform, a masked branch)."""
        with jax.default_device(host_device()):
            lowered = jax.jit(fn).lower(*args)
        key = (lowered.as_text(), tuple((np.shape(a), str(np.result_type(a))) for a in jax.tree.leaves(args)))
        prog = self._by_key.get(key)
        if prog is None:
            prog = self._by_key[key] = lowered.compile()
        return prog

    def _init(self, path: str, master: np.ndarray) -> list[Any]:
        """The leaves of ``tx.init`` of ``path``'s chunk ``master`` (chunk path; a flat list, so paths share it;
        random keys as their data)."""
        prog = self._inits.get(path)
        if prog is None:
            keys, shape = self._info[path].keys, _presented(master.shape[0], len(self._info[path].shape))
            prog = self._inits[path] = self._compiled(
                lambda p: [_stored(x) for x in jax.tree.leaves(self.tx.init(nest(keys, p.reshape(shape))))], (master,))
        with jax.default_device(host_device()):
            return prog(master)

    def _value_arg(self) -> np.float32:
        if self._value is None:
            if self.reads_value:
                raise ConfigError(f"optimizer: the optax transform {self.name!r} reads value= (the loss) and this "
                                  "step has none", field="optimizer")
            return np.float32(0)
        return self._value

    def _program(self, path: str, args: tuple) -> Any:
        """The compiled update of ``path``'s chunks (chunk path), for arguments like ``args``."""
        prog = self._progs.get(path)
        if prog is not None:
            return prog
        info = self._info[path]

        def run(p, g, elems, scalars, mult, value):
            leaves = self.leaves(path, elems, scalars, (), lambda x: x.reshape(info.shape))
            new_p, new = self.apply({path: (p.reshape(info.shape), (g * mult).reshape(info.shape), leaves)},
                                    value)[path]
            by = self.split_kinds(path, new)
            return new_p.reshape(-1), [x.reshape(-1).astype(jnp.float32) for x in by["elem"]], by["scalar"]

        prog = self._progs[path] = self._compiled(run, args)
        return prog

    def _whole_program(self, paths: Sequence[str], geos: Sequence[tuple], args: tuple) -> Any:
        """The compiled whole-tensor update of ``paths`` (one, or every path of a tree-coupled transform) over
        their flat, shard-major, padded buffers (``geos``: per path its layout, shards and elements a shard)."""
        key = tuple(paths)
        prog = self._progs.get(key)
        if prog is not None:
            return prog
        reals = [_real_of(*geo) for geo in geos]
        flats = [_flat_of(*geo) for geo in geos]

        def run(ps, gs, elems, odds, scalars, mult, value):
            items = {path: (real(p), real(g * mult), self.leaves(path, e, s, o, real))
                     for path, real, p, g, e, o, s in zip(paths, reals, ps, gs, elems, odds, scalars)}
            out = self.apply(items, value)
            res = []
            for path, flat in zip(paths, flats):
                new_p, new = out[path]
                by = self.split_kinds(path, new)
                res.append((flat(new_p), [flat(x).astype(jnp.float32) for x in by["elem"]], by["odd"], by["scalar"]))
            return res

        prog = self._progs[key] = self._compiled(run, args)
        return prog

    # --- hyperparameters and state, for the user ----------------------------------------------
    def _hyperparam_slots(self) -> dict[str, list[tuple[str, int]]]:
        """Per ``optax.inject_hyperparams`` hyperparameter (by name; by its key path where two share a name): the
        (path, scalar index) of every copy the parameters keep."""
        by_kp: dict[str, list[tuple[str, int]]] = {}
        for path, info in self._info.items():
            kps = [kp for kp, k in zip(info.kps, info.kinds) if k == "scalar"]
            for j, kp in enumerate(kps):
                if _HYPERPARAM.search(kp):
                    by_kp.setdefault(kp, []).append((path, j))
        names = [_HYPERPARAM.search(kp).group(1) for kp in by_kp]
        return {(n if names.count(n) == 1 else kp): slots for n, (kp, slots) in zip(names, by_kp.items())}

    def hyperparams(self) -> dict[str, float]:
        """The current value of each ``optax.inject_hyperparams`` hyperparameter (see :meth:`set_hyperparams`)."""
        return {name: float(self._scalars[slots[0][0]][slots[0][1]]) for name, slots in self._hyperparam_slots().items()}

    def set_hyperparams(self, **values: float) -> None:
        """Sets hyperparameters of the transform's ``optax.inject_hyperparams`` for the next steps (the plain-optax
        ``opt_state.hyperparams['learning_rate'] = x``), in every parameter's copy.

        Raises:
          ConfigError: a name the transform does not inject, or one that follows a schedule.
        """
        slots = self._hyperparam_slots()
        scheduled = _scheduled(self.tx)
        for name, value in values.items():
            if name not in slots:
                raise ConfigError(f"optimizer: the optax transform {self.name!r} has no injected hyperparameter "
                                  f"{name!r} (it has: {sorted(slots) or 'none'}). Fix: build it with "
                                  f"optax.inject_hyperparams(...)(..., {name}=...)", field="optimizer")
            if name in scheduled:
                raise ConfigError(f"optimizer: the hyperparameter {name!r} of {self.name!r} follows a schedule, "
                                  "computed again at every step. Fix: inject it as a number to set it",
                                  field="optimizer")
        for name, value in values.items():
            for path, j in slots[name]:
                old = self._scalars[path][j]
                self._scalars[path] = [*self._scalars[path][:j], np.asarray(value, old.dtype),
                                       *self._scalars[path][j + 1:]]

    def state_of(self, path: str, elems: Sequence[np.ndarray]) -> Any:
        """``path``'s state as optax keeps it (a one-leaf tree's state) from its tier states in the parameter's
        shape; random keys as keys."""
        info = self._info[path]
        shape = tuple(elems[0].shape) if elems else info.shape
        state = jax.eval_shape(self.tx.init, nest(info.keys, jax.ShapeDtypeStruct(shape, jnp.float32)))
        ie, isc, io = iter(elems), iter(self._scalars.get(path, [])), iter(self._odd.get(path, []))
        leaves = []
        for kind, dt, impl in zip(info.kinds, info.dtypes, info.impls):
            x = np.asarray(next(ie)).astype(dt) if kind == "elem" else next(isc) if kind == "scalar" else next(io)
            leaves.append(x if impl is None else jax.random.wrap_key_data(x, impl=impl))
        return jax.tree.unflatten(jax.tree.structure(state), leaves)

    def tree_state(self, states: Mapping[str, Any]) -> Any:
        """The whole tree's state as optax keeps it, from every parameter's :meth:`state_of`."""
        return jax.tree.unflatten(self.split.state_def,
                                  assemble(self.split, {p: jax.tree.leaves(s) for p, s in states.items()}))

    # --- the UpdateRule protocol ------------------------------------------------
    def state_names(self, path: str) -> tuple[str, ...]:
        return tuple(f"s{i}" for i in range(sum(k == "elem" for k in self._info[path].kinds)))

    def init_states(self, path: str, master: np.ndarray) -> list[np.ndarray] | None:
        info = self._info[path]
        if info.whole:
            made = None
            out = []
            for f, k in zip(info.fills, [k for k, kind in zip(info.kps, info.kinds) if kind == "elem"]):
                if f is not None:
                    out.append(np.full(master.shape[0], f, _F32))
                    continue
                if made is None:  # proved element-wise and the same program for a chunk: [Note: split proofs]
                    made = dict(zip(self._chunk_kps(path, master.shape[0]), self._init(path, master)))
                out.append(np.asarray(made[k], _F32).reshape(-1))
            return out
        leaves = self._init(path, master)
        return [np.asarray(x, _F32).reshape(-1) for x, k in zip(leaves, info.kinds) if k == "elem"]

    def _chunk_kps(self, path: str, n: int) -> tuple[str, ...]:
        """The key paths of ``path``'s state for a chunk of ``n`` elements (a whole path's initial state made chunk
        by chunk)."""
        info = self._info[path]
        with jax.default_device(host_device()):
            return self._leaves_info(info.keys, _presented(n, len(info.shape)))[4]

    def lr_at(self, count: int) -> float | None:
        return None  # an optax transform has no single learning rate to report

    def begin_step(self, value: float | None) -> None:
        self._value = None if value is None else np.float32(value)

    def update(self, path: str, shape: tuple[int, ...], arrays: Sequence[np.ndarray], grad: np.ndarray, *,
               valid: int, step: int, lr: float | None, mult: np.float32) -> None:
        p, *elems = arrays
        g = np.zeros_like(p)
        g[:valid] = grad
        args = (p, g, elems, self._scalars[path], np.float32(mult), self._value_arg())
        with jax.default_device(host_device()):
            new_p, new_elems, new_scalars = self._program(path, args)(*args)
        p[:valid] = np.asarray(new_p)[:valid]
        for a, x in zip(elems, new_elems):
            a[:valid] = np.asarray(x)[:valid]
        self._pending[path] = [np.asarray(x) for x in new_scalars]

    def update_whole(self, path: str, layout: Any, arrays: Sequence[np.ndarray], grad: np.ndarray, *,
                     shards: int, per_shard: int, mult: np.float32) -> None:
        """Updates one whole parameter in place (whole path).

        Args:
          path: the parameter.
          layout: its :class:`~zinf_jax.plan.partition.ParamLayout`.
          arrays: master then the tier states, each ``shards * per_shard`` float32 elements: shard ``i``'s
            flat elements at ``i * per_shard`` (zero-padded after ``numel``), every shard of the parameter.
          grad: the gradient in the same form.
          shards, per_shard: as above.
          mult: the gradient multiplier (clipping, unscaling).
        """
        self.update_tree([(path, layout, arrays, grad, shards, per_shard)], mult=mult)

    def update_tree(self, items: Sequence[tuple[str, Any, Sequence[np.ndarray], np.ndarray, int, int]], *,
                    mult: np.float32) -> None:
        """Updates whole parameters in place in one program: every parameter of a tree-coupled transform, or one
        (:meth:`update_whole`). ``items``: ``(path, layout, arrays, grad, shards, per_shard)`` each, as
        :meth:`update_whole` takes them."""
        paths = [it[0] for it in items]
        args = ([it[2][0] for it in items], [it[3] for it in items], [list(it[2][1:]) for it in items],
                [self._odd[p] for p in paths], [self._scalars[p] for p in paths], np.float32(mult),
                self._value_arg())
        geos = [(lay, shards, per_shard) for _, lay, _, _, shards, per_shard in items]
        with jax.default_device(host_device()):
            out = self._whole_program(paths, geos, args)(*args)
        for (path, _, arrays, _, _, _), (new_p, new_elems, new_odd, new_scalars) in zip(items, out):
            np.copyto(arrays[0], np.asarray(new_p))
            for a, x in zip(arrays[1:], new_elems):
                np.copyto(a, np.asarray(x))
            self._pending[path] = [np.asarray(x) for x in new_scalars]
            self._pending_odd[path] = [np.asarray(x) for x in new_odd]

    def pack_key(self, path: str, shape: tuple[int, ...]) -> Hashable:
        return 0  # a pack is one program whatever its members (update_many)

    def update_many(self, spans: Sequence[Span], arrays: Sequence[np.ndarray], grad: np.ndarray, *,
                    step: int, lr: float | None, mult: np.float32) -> None:
        """A pack's members (whole small shards side by side in ``arrays``) in one program: [Note: optax packs]."""
        paths = tuple(path for path, _, _, _ in spans)
        lo, hi = spans[0][2], spans[-1][3]
        sigs = {tuple((x.dtype.str, x.shape) for x in self._scalars[p]) for p in paths}
        if len(spans) == 1 or len(sigs) != 1 or any(s[3] != t[2] for s, t in zip(spans, spans[1:])):
            return self._update_members([(path, [a[start:stop] for a in arrays], grad[start:stop])
                                         for path, _, start, stop in spans], mult)
        stacked = [np.stack([self._scalars[p][j] for p in paths]) for j in range(len(next(iter(sigs))))]
        bounds = tuple((start - lo, stop - lo) for _, _, start, stop in spans)
        groups = self._groups(paths, stacked)
        if groups is not None:  # members running one program on equal scalars: one array each
            paths = tuple(paths[i] for i, _ in groups)
            bounds = tuple((bounds[i][0], bounds[j - 1][1]) for i, j in groups)
            stacked = [x[[i for i, _ in groups]] for x in stacked]
        args = (arrays[0][lo:hi], np.asarray(grad[lo:hi], _F32), [a[lo:hi] for a in arrays[1:]], stacked,
                np.float32(mult), self._value_arg())
        with jax.default_device(host_device()):
            new_p, new_elems, new_scalars = self._packed_program(paths, bounds, args)(*args)
        np.copyto(arrays[0][lo:hi], np.asarray(new_p))
        for a, x in zip(arrays[1:], new_elems):
            np.copyto(a[lo:hi], np.asarray(x))
        new_scalars = [np.asarray(x) for x in new_scalars]
        members = [path for path, _, _, _ in spans]
        for g, (i, j) in enumerate(groups or [(k, k + 1) for k in range(len(members))]):
            for path in members[i:j]:
                self._pending[path] = [x[g] for x in new_scalars]

    def _groups(self, paths: Sequence[str], stacked: Sequence[np.ndarray]) -> list[tuple[int, int]] | None:
        """Runs ``[i, j)`` of consecutive pack members with the same proven element-wise program
        (``split.programs``) and equal scalar state, to be updated as one array each (``None``: no two such)."""
        progs = [self.split.programs.get(p) or None for p in paths]  # ("": a 0-d parameter's, alone)
        cut = np.array([a is None or a != b for a, b in zip(progs[:-1], progs[1:])], bool)
        for x in stacked:  # a scalar that differs from the member before
            cut |= np.any((x[1:] != x[:-1]).reshape(len(paths) - 1, -1), axis=1)
        starts = [0, *(np.flatnonzero(cut) + 1).tolist()]
        if len(starts) == len(paths):
            return None
        return list(zip(starts, [*starts[1:], len(paths)]))

    def _packed_program(self, paths: tuple[str, ...], bounds: tuple[tuple[int, int], ...], args: tuple) -> Any:
        """The compiled update of a pack whose members lie side by side (``bounds``) in one array per state, their
        scalar state leaves stacked (one array per leaf position)."""
        key = ("packed", paths, bounds)
        prog = self._progs.get(key)
        if prog is not None:
            return prog

        def run(p, g, elems, scalars, mult, value):
            items = {}
            for i, (path, (a, b)) in enumerate(zip(paths, bounds)):
                shape = _presented(b - a, len(self._info[path].shape))
                items[(path, i)] = (p[a:b].reshape(shape), (g[a:b] * mult).reshape(shape),
                                    self.leaves(path, [e[a:b] for e in elems], [s[i] for s in scalars], (),
                                                lambda x, shape=shape: x.reshape(shape)))
            out = self.apply(items, value)
            new_p, new_elems, new_scalars = [], [[] for _ in elems], [[] for _ in scalars]
            for i, path in enumerate(paths):
                q, new = out[(path, i)]
                by = self.split_kinds(path, new)
                new_p.append(q.reshape(-1))
                for lst, x in zip(new_elems, by["elem"]):
                    lst.append(x.reshape(-1).astype(jnp.float32))
                for lst, x in zip(new_scalars, by["scalar"]):
                    lst.append(x)
            return (jnp.concatenate(new_p), [jnp.concatenate(x) for x in new_elems],
                    [jnp.stack(x) for x in new_scalars])

        prog = self._progs[key] = self._compiled(run, args)
        return prog

    def update_each(self, shards: Sequence[Any], *, step: int, lr: float | None, mult: np.float32) -> None:
        """A pack's members in the tier's own arrays, in one program: [Note: optax packs]."""
        self._update_members([(path, [a[:g.shape[0]] for a in arrays], g) for path, _, arrays, g in shards], mult)

    def _update_members(self, items: Sequence[tuple[str, Sequence[np.ndarray], np.ndarray]], mult: np.float32) -> None:
        """Updates whole small shards in place, ``(path, arrays (master, states), grad)`` each, in one program.

        [Note: optax packs]
        The driver updates small shards (at most ``PACK_BELOW`` elements, one sub-group each) in packs. A
        program call on the host costs about a millisecond whatever its size, so one call per shard made a
        model of many small leaves (LoRA adapters, biases and norms) spend its step in dispatch. A pack is
        one jitted program instead: it takes every member's arrays as its own inputs and runs, per member,
        the same traced update a member alone would run (:meth:`apply`, a one-leaf tree at the member's
        path and shape), so the numbers are those of the members one by one; it is compiled once per pack
        (its members' paths and sizes are the same every step). Where the members lie side by side
        (:meth:`update_many`: a buffer set, or the tier's runs, ``CpuTier.share_run``), consecutive members
        whose update is proven the same element-wise program (``split.programs``, [Note: split proofs]) and
        whose scalar state is equal run as one array: one update of their elements together, the same
        arithmetic on each element as alone."""
        if len(items) == 1:
            path, arrays, g = items[0]
            return self.update(path, (), arrays, g, valid=g.shape[0], step=0, lr=None, mult=mult)
        paths = tuple(path for path, _, _ in items)
        args = ([a[0] for _, a, _ in items], [np.asarray(g, _F32) for _, _, g in items],
                [list(a[1:]) for _, a, _ in items], [self._scalars[p] for p in paths], np.float32(mult),
                self._value_arg())
        with jax.default_device(host_device()):
            out = self._pack_program(paths, args)(*args)
        for (path, arrays, _), (new_p, new_elems, new_scalars) in zip(items, out):
            np.copyto(arrays[0], np.asarray(new_p))
            for a, x in zip(arrays[1:], new_elems):
                np.copyto(a, np.asarray(x))
            self._pending[path] = [np.asarray(x) for x in new_scalars]

    def _pack_program(self, paths: tuple[str, ...], args: tuple) -> Any:
        """The compiled update of a pack's members (chunk paths, each a whole shard), for arguments like ``args``."""
        key = ("pack", paths, tuple(p.shape[0] for p in args[0]))
        prog = self._progs.get(key)
        if prog is not None:
            return prog

        def run(ps, gs, elems, scalars, mult, value):
            items = {}
            for k, (path, p, g, e, s) in enumerate(zip(paths, ps, gs, elems, scalars)):
                shape = _presented(p.shape[0], len(self._info[path].shape))
                items[(path, k)] = (p.reshape(shape), (g * mult).reshape(shape),
                                    self.leaves(path, e, s, (), lambda x, shape=shape: x.reshape(shape)))
            out = self.apply(items, value)
            res = []
            for k, path in enumerate(paths):
                new_p, new = out[(path, k)]
                by = self.split_kinds(path, new)
                res.append((new_p.reshape(-1), [x.reshape(-1).astype(jnp.float32) for x in by["elem"]], by["scalar"]))
            return res

        prog = self._progs[key] = self._compiled(run, args)
        return prog

    def end_step(self, applied: bool) -> None:
        if applied:
            self._scalars.update(self._pending)
            self._odd.update(self._pending_odd)
        self._pending, self._pending_odd = {}, {}
        self._value = None

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {path: [[str(x.dtype), x.tolist()] for x in xs] for path, xs in self._scalars.items()}
        odd = {path: [[str(x.dtype), list(x.shape), base64.b64encode(np.ascontiguousarray(x).tobytes()).decode()]
                      for x in xs] for path, xs in self._odd.items() if xs}
        if odd:
            out["__odd__"] = odd
        return out

    def load_state_dict(self, state: Mapping[str, Any], *, checkpoint: bool = False) -> None:
        """Inverse of :meth:`state_dict`. ``checkpoint``: the state comes from a checkpoint, read by a rule built
        from the transform the user gave now: an injected hyperparameter that transform sets to another value
        than the checkpoint holds takes the transform's value, with a warning naming both."""
        mine = self.hyperparams() if checkpoint else {}
        for path, xs in state.items():
            if path in self._scalars:
                self._scalars[path] = [np.asarray(v, dtype=d) for d, v in xs]
        now, scheduled = self.hyperparams(), _scheduled(self.tx)  # (a scheduled one follows the step count)
        changed = {k: (v, now[k]) for k, v in mine.items() if now[k] != v and k not in scheduled}
        if changed:
            self.set_hyperparams(**{k: v for k, (v, _) in changed.items()})
            warnings.warn("zinf_jax: restored with the optimizer's hyperparameters as the transform sets them, not as "
                          "the checkpoint holds them: " + ", ".join(f"{k}={new!r} (checkpoint: {old!r})"
                                                                    for k, (new, old) in changed.items())
                          + ". To go on with the checkpoint's, engine.set_hyperparams(...) after the restore",
                          UserWarning, stacklevel=3)
        for path, xs in state.get("__odd__", {}).items():
            if path in self._odd:
                self._odd[path] = [np.frombuffer(base64.b64decode(b), dtype=d).reshape(s).copy() for d, s, b in xs]
