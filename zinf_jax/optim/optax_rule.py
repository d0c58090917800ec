"""Any element-wise optax optimizer, streamed over sub-groups like Adam.

An optax transform is *element-wise* when the update of each parameter element
depends only on that element's gradient, parameter and state (SGD, momentum,
Nesterov, the Adam family, Lion, Adagrad, RMSProp, schedules, weight decay,
masks). Such a transform can run on a sub-group (a chunk of one parameter's
shard) alone and give the numbers it gives on the whole tree. The rule:

* presents a chunk to the transform as a one-leaf tree at the parameter's own
  path (``{"blocks": {"0": {"kernel": chunk}}}``) and with the parameter's rank
  (shape ``(chunk, 1, ...)``), so path- or rank-based masks see what they
  would see on the model (a mask given as a fixed pytree cannot be applied to
  one leaf: pass a callable mask);
* classifies the transform's state leaves with ``jax.eval_shape``: a leaf
  shaped like the chunk is per-element state (stored in the optimizer tier
  like Adam's moments, as float32), a scalar leaf (a step count) is kept per
  parameter in the optimizer's metadata; any other shape means the state
  couples elements (Adafactor's factored moments, Shampoo's preconditioners)
  and the transform is refused;
* checks element-wise behaviour once with a probe: two steps on a 16-element
  vector, whole and as two halves, must agree;
* takes ``optax.clip_by_global_norm`` at the head of an ``optax.chain`` out of
  the transform's hands: the driver computes the global norm over every shard
  anyway and scales the gradient before the chunk reaches the transform (the
  clip inside the chain then sees a norm at most ``max_norm`` and is a no-op).

The update of one sub-group is one jitted program per parameter path, run on
the host's CPU backend.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Hashable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from zinf_jax.optim.subgroups import Span

__all__ = ["OptaxRule", "leading_global_clip"]

_F32 = np.float32


def _cpu() -> jax.Device:
    return jax.devices("cpu")[0]


def leading_global_clip(tx: Any) -> float | None:
    """``max_norm`` of an ``optax.clip_by_global_norm`` that ``tx`` is or that heads its ``optax.chain``."""
    fn = getattr(tx, "update", None)
    for _ in range(4):  # chain -> with_extra_args_support wrapper -> the transform
        if fn is None:
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


def _clip(g: np.ndarray, clip: float | None) -> np.ndarray:
    norm = float(np.sqrt(np.sum(np.square(g, dtype=np.float64))))
    return g if clip is None or norm < clip else (g * _F32(clip / norm)).astype(_F32)


def _probe(tx: Any, clip: float | None) -> str | None:
    """Why ``tx`` is not element-wise (``None`` if two probe steps agree whole and in halves)."""
    import optax

    rng = np.random.default_rng(0)
    p0 = rng.standard_normal(16).astype(_F32)
    gs = [_clip((rng.standard_normal(16) * 3).astype(_F32), clip) for _ in range(2)]

    def run(sl: slice) -> np.ndarray:
        params = {"w": jnp.asarray(p0[sl])}
        state = tx.init(params)
        for g in gs:
            u, state = tx.update({"w": jnp.asarray(g[sl])}, state, params)
            params = optax.apply_updates(params, u)
        return np.asarray(params["w"])

    with jax.default_device(_cpu()):
        whole, halves = run(slice(None)), np.concatenate([run(slice(0, 8)), run(slice(8, None))])
    if not np.allclose(whole, halves, rtol=1e-5, atol=1e-6):
        return "its update of one element depends on other elements (updating a vector whole and in halves differs)"
    return None


@dataclasses.dataclass(frozen=True)
class _PathInfo:
    keys: tuple[str, ...]  # the path as nested dict keys
    shape: tuple[int, ...]  # how a chunk is presented: (chunk, 1, ...) with the parameter's rank
    treedef: Any  # of the transform's state for one chunk
    elementwise: tuple[bool, ...]  # per state leaf: shaped like the chunk (else a scalar)
    dtypes: tuple[Any, ...]


def _nest(keys: Sequence[str], x: Any) -> dict:
    tree: Any = x
    for k in reversed(keys):
        tree = {k: tree}
    return tree


def _leaf(keys: Sequence[str], tree: Any) -> Any:
    for k in keys:
        tree = tree[k]
    return tree


class OptaxRule:
    """An element-wise optax ``GradientTransformation`` as an update rule of the streamed optimizer.

    Args:
      tx: the transform (e.g. ``optax.chain(optax.clip_by_global_norm(1.0), optax.lion(1e-4))``).
      layouts: parameter path to layout (its full shape gives the rank).
      chunks: elements of one sub-group of each path.

    Raises:
      ValueError: ``tx`` is not element-wise (with the reason).
    """

    def __init__(self, tx: Any, layouts: Mapping[str, Any], chunks: Mapping[str, int]):
        self.tx = tx
        self.clip_norm = leading_global_clip(tx)
        why = _probe(tx, self.clip_norm)
        if why is not None:
            raise ValueError(f"optimizer= is not element-wise: {why}. The streamed optimizer updates each chunk of a "
                             "parameter alone; use an element-wise transform (sgd, momentum, the adam family, lion, "
                             "adagrad, rmsprop; optax.clip_by_global_norm only at the head of an optax.chain)")
        self._info: dict[str, _PathInfo] = {}
        self._scalars: dict[str, list[np.ndarray]] = {}
        self._pending: dict[str, list[np.ndarray]] = {}
        self._progs: dict[str, Any] = {}
        self._inits: dict[str, Any] = {}
        self._by_text: dict[str, Any] = {}  # lowered program text -> compiled (paths the transform treats alike)
        for path, lay in layouts.items():
            keys = tuple(path.split("/"))
            shape = (int(chunks[path]),) + (1,) * max(len(lay.shape) - 1, 0)
            with jax.default_device(_cpu()):
                state = jax.eval_shape(tx.init, _nest(keys, jax.ShapeDtypeStruct(shape, jnp.float32)))
            leaves, treedef = jax.tree.flatten(state)
            kinds = []
            for leaf in leaves:
                if tuple(leaf.shape) not in (shape, ()):
                    raise ValueError(f"optimizer= is not element-wise: its state for {path!r} has a leaf of shape "
                                     f"{tuple(leaf.shape)} for a parameter chunk of shape {shape} (factored or "
                                     "matrix state couples elements); use an element-wise transform")
                kinds.append(tuple(leaf.shape) == shape)
            self._info[path] = _PathInfo(keys, shape, treedef, tuple(kinds), tuple(l.dtype for l in leaves))
            self._scalars[path] = [np.asarray(x) for x, k in zip(self._init(path, np.zeros(
                int(np.prod(shape)), _F32)), kinds) if not k]

    # --- per path programs ----------------------------------------------------
    def _init(self, path: str, master: np.ndarray) -> list[Any]:
        """The leaves of ``tx.init`` of ``path``'s chunk ``master`` (a flat list: the program's outputs then carry
        no names, so the paths share it)."""
        prog = self._inits.get(path)
        if prog is None:
            info = self._info[path]
            prog = self._inits[path] = self._compiled(
                lambda p: jax.tree.leaves(self.tx.init(_nest(info.keys, p.reshape(info.shape)))), (master,))
        with jax.default_device(_cpu()):
            return prog(master)

    def _compiled(self, fn: Callable, args: tuple) -> Any:
        """``fn`` compiled for arguments like ``args`` on the host, once per distinct lowered program: the paths a
        transform treats alike (the blocks of a deep model) share one (a compile per path: 0.1-0.2 s each)."""
        with jax.default_device(_cpu()):
            lowered = jax.jit(fn).lower(*args)
        text = lowered.as_text()
        prog = self._by_text.get(text)
        if prog is None:
            prog = self._by_text[text] = lowered.compile()
        return prog

    def _program(self, path: str, args: tuple) -> Any:
        """The compiled update of ``path``'s chunks, for arguments like ``args``.

        One program per path (a transform may treat paths differently: ``optax.masked``,
        ``multi_transform`` labels), but compiled once per distinct lowered program: the blocks of a
        deep model share their paths' programs, so the first step does not compile one per parameter.
        """
        prog = self._progs.get(path)
        if prog is not None:
            return prog
        import optax

        info, tx = self._info[path], self.tx

        def run(p, g, elems, scalars, mult):
            params = _nest(info.keys, p.reshape(info.shape))
            grads = _nest(info.keys, (g * mult).reshape(info.shape))
            ie, isc = iter(elems), iter(scalars)
            leaves = [next(ie).reshape(info.shape).astype(dt) if k else next(isc)
                      for k, dt in zip(info.elementwise, info.dtypes)]
            updates, new_state = tx.update(grads, jax.tree.unflatten(info.treedef, leaves), params)
            new_p = _leaf(info.keys, optax.apply_updates(params, updates)).reshape(-1)
            new_leaves = jax.tree.leaves(new_state)
            return (new_p, [x.reshape(-1).astype(jnp.float32) for x, k in zip(new_leaves, info.elementwise) if k],
                    [x for x, k in zip(new_leaves, info.elementwise) if not k])

        prog = self._progs[path] = self._compiled(run, args)
        return prog

    # --- the UpdateRule protocol ------------------------------------------------
    def state_names(self, path: str) -> tuple[str, ...]:
        return tuple(f"s{i}" for i in range(sum(self._info[path].elementwise)))

    def init_states(self, path: str, master: np.ndarray) -> list[np.ndarray] | None:
        leaves = self._init(path, master)
        return [np.asarray(x, _F32).reshape(-1) for x, k in zip(leaves, self._info[path].elementwise) if k]

    def lr_at(self, count: int) -> float | None:
        return None  # an optax transform has no single learning rate to report

    def update(self, path: str, shape: tuple[int, ...], arrays: Sequence[np.ndarray], grad: np.ndarray, *,
               valid: int, step: int, lr: float | None, mult: np.float32) -> None:
        p, *elems = arrays
        g = np.zeros_like(p)
        g[:valid] = grad
        args = (p, g, elems, self._scalars[path], np.float32(mult))
        with jax.default_device(_cpu()):
            new_p, new_elems, new_scalars = self._program(path, args)(*args)
        p[:valid] = np.asarray(new_p)[:valid]
        for a, x in zip(elems, new_elems):
            a[:valid] = np.asarray(x)[:valid]
        self._pending[path] = [np.asarray(x) for x in new_scalars]

    def pack_key(self, path: str, shape: tuple[int, ...]) -> Hashable:
        return 0  # each shard runs its own program (update_many loops)

    def update_many(self, spans: Sequence[Span], arrays: Sequence[np.ndarray], grad: np.ndarray, *,
                    step: int, lr: float | None, mult: np.float32) -> None:
        for path, shape, start, stop in spans:
            self.update(path, shape, [a[start:stop] for a in arrays], grad[start:stop], valid=stop - start,
                        step=step, lr=lr, mult=mult)

    def end_step(self, applied: bool) -> None:
        if applied:
            self._scalars.update(self._pending)
        self._pending = {}

    def state_dict(self) -> dict[str, Any]:
        return {path: [[str(x.dtype), x.tolist()] for x in xs] for path, xs in self._scalars.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for path, xs in state.items():
            if path in self._scalars:
                self._scalars[path] = [np.asarray(v, dtype=d) for d, v in xs]
