"""Any optax transform as an update rule of the streamed optimizer: chunk by chunk, or whole tensor by tensor.

Each trained parameter takes one of two paths, decided once per parameter by a proof on its real
path, shape and cut (:func:`~zinf_jax.optim.optax_probe.classify`, [Note: element-wise proof]):

* **chunk** (the transform is element-wise on this parameter: SGD, momentum, the Adam family, Lion,
  Adagrad, RMSProp, schedules, weight decay, masks): each sub-group (a chunk of one shard) is
  presented to the transform alone, as a one-leaf tree at the parameter's own path with the
  parameter's rank (``(chunk, 1, ...)``). State leaves shaped like the chunk are stored in the
  optimizer tier like Adam's moments; scalar leaves (step counts) are kept per parameter in the
  optimizer's metadata.
* **whole** (the transform couples the elements of one tensor: ``lamb``, ``lars`` with a trust-ratio
  mask, ``novograd``, ``adafactor``, ``sm3``, ``optax.contrib.muon``): the driver brings the whole
  parameter's master, gradient and states together (:class:`~zinf_jax.optim.subgroups.Whole`), and the
  transform runs on a one-leaf tree at the parameter's path and its own shape. State leaves shaped
  like the parameter are stored in the tier, sharded and chunked like the master; scalar leaves as
  above; every other leaf (Adafactor's factored row and column moments, SM3's accumulators) keeps
  its own shape and is held in host RAM and stored with the optimizer's metadata and checkpoints
  (a factored moment is a few vectors, not a full tensor).

Transforms that couple *parameters* are handled before either path: ``optax.clip_by_global_norm``
at the head of an ``optax.chain`` is taken out of the transform's hands (the driver computes the
global norm over every shard anyway and scales the gradient first); any other coupling between
parameters (a global-norm clip in the middle of a chain) is refused
(:func:`~zinf_jax.optim.optax_probe.tensor_coupling`). ``optax.MultiSteps`` runs as its
``gradient_transformation()`` (accumulating in the optimizer state, as optax does).

One update is one jitted program on the host's CPU backend, compiled once per distinct program and
input types: the paths a transform treats alike (the blocks of a deep model) share it.
"""
from __future__ import annotations

import base64
import dataclasses
import inspect
from typing import Any, Callable, Hashable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from zinf_jax.errors import ConfigError
from zinf_jax.optim.optax_probe import Cut, host_device, leaf, nest, tensor_coupling, verdict
from zinf_jax.optim.subgroups import Span

__all__ = ["OptaxRule", "leading_global_clip", "as_transform"]

_F32 = np.float32


def as_transform(tx: Any) -> Any:
    """``tx`` as a ``GradientTransformation``: an ``optax.MultiSteps`` becomes its ``gradient_transformation()``."""
    import optax

    if isinstance(tx, optax.MultiSteps):
        return tx.gradient_transformation()
    return tx


def describe(tx: Any) -> str:
    """A short name of an optax transform for messages (the function that built its ``update``)."""
    fn = getattr(tx, "update", None)
    name = getattr(fn, "__qualname__", type(tx).__name__).split(".<locals>")[0]
    return f"optax transform {name!r}"


def leading_global_clip(tx: Any) -> float | None:
    """``max_norm`` of an ``optax.clip_by_global_norm`` that ``tx`` is or that heads its ``optax.chain``."""
    fn = getattr(tx, "update", None)
    for _ in range(4):  # chain -> with_extra_args_support wrapper -> the transform
        if fn is None or not inspect.isfunction(fn):
            return None
        if fn.__qualname__.startswith("clip_by_global_norm."):
            return float(inspect.getclosurevars(fn).nonlocals["max_norm"])
        cells = inspect.getclosurevars(fn).nonlocals
        if "update_fns" in cells:  # optax.chain: look at its first transform
            fn = cells["update_fns"][0]
        elif "tx" in cells and hasattr(cells["tx"], "update"):
            fn = cells["tx"].update
        else:
            return None
    return None


@dataclasses.dataclass(frozen=True)
class _PathInfo:
    keys: tuple[str, ...]  # the path as nested dict keys
    whole: bool  # the whole-tensor path (else chunk by chunk)
    shape: tuple[int, ...]  # what the transform sees: (chunk, 1, ...) for a chunk, the parameter's shape whole
    treedef: Any  # of the transform's state for that shape
    kinds: tuple[str, ...]  # per state leaf: "elem" (shaped like the leaf: in the tier), "scalar" or "odd"
    dtypes: tuple[Any, ...]
    fills: tuple[float, ...] = ()  # whole: the initial value of each "elem" leaf (constant)


class OptaxRule:
    """An optax ``GradientTransformation`` as an update rule of the streamed optimizer (see module doc).

    Args:
      tx: the transform (e.g. ``optax.chain(optax.clip_by_global_norm(1.0), optax.lion(1e-4))``), or an
        ``optax.MultiSteps``.
      layouts: parameter path to layout.
      chunks: elements of one sub-group of each path.

    Raises:
      ConfigError: the transform couples parameters other than through a leading global-norm clip, its
        masks or labels cannot be applied to one parameter, or a whole-tensor state starts from the
        parameter's values (with the reason and the fix).
    """

    def __init__(self, tx: Any, layouts: Mapping[str, Any], chunks: Mapping[str, int]):
        self.tx = tx = as_transform(tx)
        self.name = describe(tx)
        self.clip_norm = leading_global_clip(tx)
        self._info: dict[str, _PathInfo] = {}
        self._scalars: dict[str, list[np.ndarray]] = {}
        self._odd: dict[str, list[np.ndarray]] = {}  # whole path: leaves of their own shapes, in RAM
        self._pending: dict[str, list[np.ndarray]] = {}
        self._pending_odd: dict[str, list[np.ndarray]] = {}
        self._progs: dict[str, Any] = {}
        self._inits: dict[str, Any] = {}
        self._by_key: dict[Hashable, Any] = {}  # (program text, input types) -> compiled
        self.why: dict[str, str] = {}
        """Why a parameter takes the whole-tensor path (only those that do)."""
        cuts = {path: Cut.of(lay, chunks[path]) for path, lay in layouts.items()}
        for path, lay in layouts.items():
            keys = tuple(path.split("/"))
            try:
                v = verdict(tx, keys, cuts[path], self.clip_norm)
            except (TypeError, ValueError, KeyError) as e:
                raise self._error(f"it cannot be applied to the one parameter {path!r} ({type(e).__name__}: {e})",
                                  "give masks and labels (optax.masked, multi_transform, weight-decay masks) as "
                                  "callables of the params tree, not as fixed pytrees") from e
            if not v.elementwise:
                self.why[path] = v.why
            self._info[path] = self._whole_info(path, keys, lay) if not v.elementwise else \
                self._chunk_info(keys, cuts[path])
        why = tensor_coupling(tx, [(tuple(p.split("/")), cuts[p]) for p in list(layouts)[:2]], self.clip_norm)
        if why is not None:
            raise self._error(why, "put optax.clip_by_global_norm at the head of the optax.chain (or use "
                                   "ZeroConfig.gradient_clipping); the engine applies it across every shard")
        for path, info in self._info.items():
            if not info.whole:
                self._scalars[path] = [np.asarray(x) for x, k in zip(
                    self._init(path, np.zeros(int(np.prod(info.shape)), _F32)), info.kinds) if k == "scalar"]

    def _error(self, why: str, fix: str) -> ConfigError:
        return ConfigError(f"optimizer: the {self.name} is not supported: {why}. Fix: {fix}", field="optimizer",
                           detail=why)

    # --- classification -------------------------------------------------------------
    def _chunk_info(self, keys: tuple[str, ...], cut: Cut) -> _PathInfo:
        shape = cut.presented()
        with jax.default_device(host_device()):
            state = jax.eval_shape(self.tx.init, nest(keys, jax.ShapeDtypeStruct(shape, jnp.float32)))
        leaves, treedef = jax.tree.flatten(state)
        kinds = tuple("elem" if tuple(x.shape) == shape else "scalar" for x in leaves)  # (classify checked)
        return _PathInfo(keys, False, shape, treedef, kinds, tuple(x.dtype for x in leaves))

    def _whole_info(self, path: str, keys: tuple[str, ...], lay: Any) -> _PathInfo:
        shape = tuple(lay.shape)
        tx = self.tx
        with jax.default_device(host_device()):
            state = jax.eval_shape(tx.init, nest(keys, jax.ShapeDtypeStruct(shape, jnp.float32)))
            leaves, treedef = jax.tree.flatten(state)
            kinds = tuple("elem" if tuple(x.shape) == shape else "scalar" if x.shape == () else "odd" for x in leaves)
            small = Cut(shape=shape, flat=False, dim=None, num_shards=1, chunk=1, n_chunks=1).probe().shape
            rng = np.random.default_rng(0)
            inits = [jax.tree.leaves(tx.init(nest(keys, jnp.asarray(rng.standard_normal(small).astype(_F32)))))
                     for _ in range(2)]
            fills = []
            for a, b, k in zip(*inits, kinds):
                a, b = np.asarray(a), np.asarray(b)
                if not np.array_equal(a, b) or (k == "elem" and a.size and not np.all(a == a.reshape(-1)[0])):
                    raise self._error(f"its state for {path!r} starts from the parameter's values, and the "
                                      "parameter's update runs on the whole tensor",
                                      "use a transform whose state starts from constants")
                if k == "elem":
                    fills.append(float(a.reshape(-1)[0]) if a.size else 0.0)
            own = jax.jit(lambda: [x for x, k in zip(jax.tree.leaves(tx.init(nest(keys, jnp.zeros(shape, jnp.float32)))),
                                                     kinds) if k != "elem"])()
        it = iter(own)
        start = [np.asarray(next(it)) for k in kinds if k != "elem"]
        self._scalars[path] = [x for x, k in zip(start, [k for k in kinds if k != "elem"]) if k == "scalar"]
        self._odd[path] = [x for x, k in zip(start, [k for k in kinds if k != "elem"]) if k == "odd"]
        return _PathInfo(keys, True, shape, treedef, kinds, tuple(x.dtype for x in leaves), tuple(fills))

    def whole(self, path: str) -> bool:
        """Whether ``path``'s update runs on the whole tensor (:meth:`update_whole`), not chunk by chunk."""
        return self._info[path].whole

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
        """The leaves of ``tx.init`` of ``path``'s chunk ``master`` (chunk path; a flat list, so paths share it)."""
        prog = self._inits.get(path)
        if prog is None:
            info = self._info[path]
            prog = self._inits[path] = self._compiled(
                lambda p: jax.tree.leaves(self.tx.init(nest(info.keys, p.reshape(info.shape)))), (master,))
        with jax.default_device(host_device()):
            return prog(master)

    def _state(self, info: _PathInfo, elems: Sequence[Any], scalars: Sequence[Any], odd: Sequence[Any],
               shape_elem: Callable[[Any], Any]) -> Any:
        ie, isc, io = iter(elems), iter(scalars), iter(odd)
        leaves = [shape_elem(next(ie)).astype(dt) if k == "elem" else next(isc) if k == "scalar" else next(io)
                  for k, dt in zip(info.kinds, info.dtypes)]
        return jax.tree.unflatten(info.treedef, leaves)

    def _program(self, path: str, args: tuple) -> Any:
        """The compiled update of ``path``'s chunks (chunk path), for arguments like ``args``."""
        prog = self._progs.get(path)
        if prog is not None:
            return prog
        import optax

        info, tx = self._info[path], self.tx

        def run(p, g, elems, scalars, mult):
            params = nest(info.keys, p.reshape(info.shape))
            grads = nest(info.keys, (g * mult).reshape(info.shape))
            state = self._state(info, elems, scalars, (), lambda x: x.reshape(info.shape))
            updates, new_state = tx.update(grads, state, params)
            new_p = leaf(info.keys, optax.apply_updates(params, updates)).reshape(-1)
            new_leaves = jax.tree.leaves(new_state)
            return (new_p, [x.reshape(-1).astype(jnp.float32) for x, k in zip(new_leaves, info.kinds) if k == "elem"],
                    [x for x, k in zip(new_leaves, info.kinds) if k == "scalar"])

        prog = self._progs[path] = self._compiled(run, args)
        return prog

    def _whole_program(self, path: str, lay: Any, shards: int, per_shard: int, args: tuple) -> Any:
        """The compiled whole-tensor update of ``path`` over its flat, shard-major, padded buffers."""
        prog = self._progs.get(path)
        if prog is not None:
            return prog
        import optax

        from zinf_jax.plan.partition import from_stored, to_stored

        info, tx = self._info[path], self.tx
        numel = int(np.prod(lay.shard_shape))

        def real(x):  # flat shard-major padded -> the parameter's own shape
            x = x.reshape(shards, per_shard)[:, :numel].reshape(shards, *lay.shard_shape)
            stored = x[0] if lay.dim is None else jnp.concatenate(list(x), axis=lay.dim)
            return from_stored(lay, stored)

        def flat(y):  # inverse of real
            s = to_stored(lay, y)
            parts = [s] if lay.dim is None else jnp.split(s, shards, axis=lay.dim)
            x = jnp.stack([q.reshape(-1) for q in parts])
            return jnp.pad(x, ((0, 0), (0, per_shard - numel))).reshape(-1)

        def run(p, g, elems, odd, scalars, mult):
            params = nest(info.keys, real(p))
            grads = nest(info.keys, real(g * mult))
            state = self._state(info, elems, scalars, odd, real)
            updates, new_state = tx.update(grads, state, params)
            new_p = flat(leaf(info.keys, optax.apply_updates(params, updates)))
            new_leaves = jax.tree.leaves(new_state)
            return (new_p, [flat(x).astype(jnp.float32) for x, k in zip(new_leaves, info.kinds) if k == "elem"],
                    [x for x, k in zip(new_leaves, info.kinds) if k == "odd"],
                    [x for x, k in zip(new_leaves, info.kinds) if k == "scalar"])

        prog = self._progs[path] = self._compiled(run, args)
        return prog

    # --- the UpdateRule protocol ------------------------------------------------
    def state_names(self, path: str) -> tuple[str, ...]:
        return tuple(f"s{i}" for i in range(sum(k == "elem" for k in self._info[path].kinds)))

    def init_states(self, path: str, master: np.ndarray) -> list[np.ndarray] | None:
        info = self._info[path]
        if info.whole:
            return [np.full(master.shape[0], f, _F32) for f in info.fills]
        leaves = self._init(path, master)
        return [np.asarray(x, _F32).reshape(-1) for x, k in zip(leaves, info.kinds) if k == "elem"]

    def lr_at(self, count: int) -> float | None:
        return None  # an optax transform has no single learning rate to report

    def update(self, path: str, shape: tuple[int, ...], arrays: Sequence[np.ndarray], grad: np.ndarray, *,
               valid: int, step: int, lr: float | None, mult: np.float32) -> None:
        p, *elems = arrays
        g = np.zeros_like(p)
        g[:valid] = grad
        args = (p, g, elems, self._scalars[path], np.float32(mult))
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
        p, *elems = arrays
        args = (p, grad, list(elems), self._odd[path], self._scalars[path], np.float32(mult))
        with jax.default_device(host_device()):
            new_p, new_elems, new_odd, new_scalars = self._whole_program(path, layout, shards, per_shard, args)(*args)
        np.copyto(p, np.asarray(new_p))
        for a, x in zip(elems, new_elems):
            np.copyto(a, np.asarray(x))
        self._pending[path] = [np.asarray(x) for x in new_scalars]
        self._pending_odd[path] = [np.asarray(x) for x in new_odd]

    def pack_key(self, path: str, shape: tuple[int, ...]) -> Hashable:
        return 0  # each shard runs its own program (update_many loops)

    def update_many(self, spans: Sequence[Span], arrays: Sequence[np.ndarray], grad: np.ndarray, *,
                    step: int, lr: float | None, mult: np.float32) -> None:
        for path, shape, start, stop in spans:
            self.update(path, shape, [a[start:stop] for a in arrays], grad[start:stop], valid=stop - start,
                        step=step, lr=lr, mult=mult)

    def update_each(self, shards: Sequence[Any], *, step: int, lr: float | None, mult: np.float32) -> None:
        for path, shape, arrays, g in shards:
            self.update(path, shape, arrays, g, valid=g.shape[0], step=step, lr=lr, mult=mult)

    def end_step(self, applied: bool) -> None:
        if applied:
            self._scalars.update(self._pending)
            self._odd.update(self._pending_odd)
        self._pending, self._pending_odd = {}, {}

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {path: [[str(x.dtype), x.tolist()] for x in xs] for path, xs in self._scalars.items()}
        odd = {path: [[str(x.dtype), list(x.shape), base64.b64encode(np.ascontiguousarray(x).tobytes()).decode()]
                      for x in xs] for path, xs in self._odd.items() if xs}
        if odd:
            out["__odd__"] = odd
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for path, xs in state.items():
            if path in self._scalars:
                self._scalars[path] = [np.asarray(v, dtype=d) for d, v in xs]
        for path, xs in state.get("__odd__", {}).items():
            if path in self._odd:
                self._odd[path] = [np.frombuffer(base64.b64decode(b), dtype=d).reshape(s).copy() for d, s, b in xs]
