"""Which parameters an optax transform may update chunk by chunk: a proof per parameter, or the whole tensor.

The streamed optimizer cuts a parameter as the partition plan stores it (padded and flattened for a
``flat`` layout), splits it into shards along the layout's dimension, flattens each shard and cuts
it into sub-groups of at most ``sub_group_size`` elements, each presented to the transform as a
one-leaf tree at the parameter's own path with the parameter's rank (``(chunk, 1, ...)``). That
gives the numbers of the transform on the whole tree only when the transform is *element-wise on
that parameter*. A vector probe does not prove it: ``optax.lars(..., trust_ratio_mask=<ndim > 1>)``
is element-wise on vectors and couples every element of a matrix.

[Note: element-wise proof]
:func:`classify` decides per parameter, with the transform's own masks and labels evaluated on the
parameter's real path and shape (its rank, and its size up to :data:`PROBE_ELEMENTS`; larger
parameters are probed at a smaller shape of the same rank and the same number of shards and
chunks). Two probes, two steps each (state coupling shows in the second), on random values:

1. *cut*: the whole tensor against the engine's own cut of it, each chunk presented as the driver
   presents it, reassembled;
2. *perturbation*: a random half of the elements of the gradient and the parameter changed; every
   other element of the new parameter and of every state shaped like the parameter must come out
   bitwise the same (an element-wise update reads no other element).

A parameter passes only if both hold and every state leaf is shaped like the chunk or is a scalar;
otherwise its update runs whole (:mod:`~zinf_jax.optim.optax_rule`). A wrong "coupled" verdict only
costs speed; a wrong "element-wise" one would be silent, so the comparisons are strict.

:func:`tensor_coupling` checks the other direction, once per transform: the update of one parameter
must not depend on another parameter (a global-norm clip in the middle of a chain does; the one at
the head of a chain is taken out of the transform's hands by the driver, see
:func:`~zinf_jax.optim.optax_rule.leading_global_clip`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from zinf_jax.optim.subgroups import sub_groups

__all__ = ["PROBE_ELEMENTS", "Cut", "Verdict", "classify", "verdict", "signature", "tensor_coupling", "nest", "leaf",
           "host_device"]

PROBE_ELEMENTS = 1 << 16
"""Parameters of at most this many elements are probed at their own shape; larger ones at a smaller
shape of the same rank, the same number of shards and the same number of chunks per shard."""

_F32 = np.float32


def host_device() -> jax.Device:
    """This process's first CPU device, where host-side optax programs run (``jax.devices("cpu")[0]`` is process
    0's in a multi-process job, which other processes cannot read)."""
    return jax.local_devices(backend="cpu")[0]


def nest(keys: Sequence[str], x: Any) -> dict:
    """``x`` as a one-leaf tree at ``keys`` (``{"blocks": {"0": {"kernel": x}}}``)."""
    tree: Any = x
    for k in reversed(keys):
        tree = {k: tree}
    return tree


def leaf(keys: Sequence[str], tree: Any) -> Any:
    """The leaf of ``tree`` at ``keys``."""
    for k in keys:
        tree = tree[k]
    return tree


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cut:
    """How the engine cuts one parameter (a :class:`~zinf_jax.plan.partition.ParamLayout` and its chunking).

    Attributes:
      shape: the parameter's own shape.
      flat: the stored form is padded and flattened (layout kind ``"flat"``).
      dim: the stored form's sharded dimension (``None``: one shard).
      num_shards: shards of the stored form.
      chunk: elements of one sub-group.
      n_chunks: sub-groups per shard.
    """

    shape: tuple[int, ...]
    flat: bool
    dim: int | None
    num_shards: int
    chunk: int
    n_chunks: int

    @classmethod
    def of(cls, layout: Any, chunk: int) -> "Cut":
        """The cut of ``layout`` in chunks of ``chunk`` elements."""
        numel = math.prod(layout.shard_shape)
        return cls(shape=tuple(layout.shape), flat=layout.kind == "flat", dim=layout.dim,
                   num_shards=layout.num_shards, chunk=int(chunk), n_chunks=-(-max(numel, 1) // int(chunk)))

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def presented(self) -> tuple[int, ...]:
        """The shape a chunk is presented in: ``(chunk, 1, ...)`` with the parameter's rank."""
        return (self.chunk,) + (1,) * max(len(self.shape) - 1, 0)

    def probe(self) -> "Cut":
        """This cut, or a smaller one of the same rank, shards and chunks per shard (:data:`PROBE_ELEMENTS`)."""
        if self.size <= PROBE_ELEMENTS:
            return self
        n = self.num_shards
        shape = [min(s, 8) for s in self.shape]
        if not self.flat and self.dim is not None:
            shape[self.dim] = n * min(self.shape[self.dim] // n, 8)
        size = math.prod(shape)
        stored = -(-size // n) * n if self.flat else size
        shard = stored // n if (self.flat or self.dim is not None) else stored
        chunk, n_chunks = sub_groups(shard, -(-shard // min(self.n_chunks, shard)))
        return dataclasses.replace(self, shape=tuple(shape), chunk=chunk, n_chunks=n_chunks)

    def chunks(self, x: np.ndarray) -> list[np.ndarray]:
        """``x`` (the parameter's shape) cut as the engine cuts it: flat, zero-padded chunks, shard by shard."""
        stored = x.reshape(-1) if self.flat else x
        if self.flat:
            stored = np.pad(stored, (0, -(-self.size // self.num_shards) * self.num_shards - self.size))
        shards = [stored] if self.dim is None else np.split(stored, self.num_shards, axis=self.dim)
        out = []
        for s in shards:
            s = np.ascontiguousarray(s).reshape(-1)
            s = np.pad(s, (0, self.n_chunks * self.chunk - s.shape[0]))
            out += [s[c * self.chunk:(c + 1) * self.chunk] for c in range(self.n_chunks)]
        return out

    def join(self, chunks: Sequence[np.ndarray]) -> np.ndarray:
        """Inverse of :meth:`chunks`."""
        n = 1 if self.dim is None else self.num_shards
        stored_size = -(-self.size // self.num_shards) * self.num_shards if self.flat else self.size
        numel = stored_size // n
        per = [np.concatenate(chunks[i * self.n_chunks:(i + 1) * self.n_chunks])[:numel] for i in range(n)]
        if self.flat:
            return np.concatenate(per)[:self.size].reshape(self.shape)
        if self.dim is None:
            return per[0].reshape(self.shape)
        shard_shape = list(self.shape)
        shard_shape[self.dim] //= n
        return np.concatenate([p.reshape(shard_shape) for p in per], axis=self.dim)


@dataclasses.dataclass(frozen=True)
class Verdict:
    """:func:`classify`'s answer: ``elementwise`` (stream it chunk by chunk) or why not."""

    elementwise: bool
    why: str = ""


def _run(tx: Any, keys: Sequence[str], p: Any, gs: Sequence[Any]) -> tuple[Any, list]:
    """Steps of ``tx`` on the one-leaf tree ``p`` at ``keys`` (traced): the updates (steps first), the state's leaves."""
    import optax

    params = nest(keys, p)
    state = tx.init(params)
    us = []
    for g in gs:
        u, state = tx.update(nest(keys, g), state, params)
        params = optax.apply_updates(params, u)
        us.append(leaf(keys, u))
    return jnp.stack(us), jax.tree.leaves(state)


def _steps(tx: Any, keys: Sequence[str], p: np.ndarray, gs: Sequence[np.ndarray]) -> tuple[np.ndarray, list]:
    """:func:`_run` compiled on the host, as numpy arrays."""
    us, st = jax.jit(lambda p, *g: _run(tx, keys, p, g))(p, *gs)
    return np.asarray(us), [np.asarray(x) for x in st]


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    """Updates ``a`` and ``b`` (steps first) agree to float32 rounding, step by step, relative to each step's size."""
    for x, y in zip(a, b):
        scale = max(float(np.max(np.abs(x))), 1e-30)
        if not np.allclose(x, y, rtol=1e-5, atol=1e-5 * scale):
            return False
    return True


def signature(tx: Any, keys: Sequence[str], cut: Cut) -> str:
    """What decides :func:`classify`'s verdict for a parameter: its probe cut and the program of its update
    (a mask or label that treats two paths alike gives them the same program)."""
    pc = cut.probe()
    spec = jax.ShapeDtypeStruct(pc.shape, jnp.float32)
    with jax.default_device(host_device()):
        jaxpr = jax.make_jaxpr(lambda p, g: _run(tx, keys, p, [g]))(spec, spec)
    return f"{pc}\n{jaxpr}"


def _data(shape: tuple[int, ...], seed: int, clip: float | None) -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    p = (rng.uniform(0.5, 1.5, shape) * rng.choice([-1.0, 1.0], shape)).astype(_F32)
    gs = [rng.standard_normal(shape).astype(_F32) for _ in range(2)]
    if clip is not None:  # keep the head clip (taken out of the transform's hands) inactive
        gs = [(g * _F32(0.25 * clip / max(float(np.linalg.norm(g)), 1e-30))).astype(_F32) for g in gs]
    return p, gs


_VERDICTS: dict[tuple, Verdict] = {}
""":func:`verdict`'s answers by (transform, signature, clip), at most :data:`_VERDICTS_MAX` of them."""
_VERDICTS_MAX = 4096


def verdict(tx: Any, keys: Sequence[str], cut: Cut, clip: float | None) -> Verdict:
    """:func:`classify`, proved once per transform object and :func:`signature`: parameters whose update is the
    same program share a proof, and a transform given to ``estimate_from_model`` and then to ``initialize`` (or
    to ``restore``, or to a second engine) is not probed again. (A transform that cannot be hashed is probed
    for every parameter.)"""
    key = (tx, signature(tx, keys, cut), clip)
    try:
        hit = _VERDICTS.get(key)
    except TypeError:
        return classify(tx, keys, cut, clip)
    if hit is None:
        if len(_VERDICTS) >= _VERDICTS_MAX:
            _VERDICTS.clear()
        hit = _VERDICTS[key] = classify(tx, keys, cut, clip)
    return hit


def classify(tx: Any, keys: Sequence[str], cut: Cut, clip: float | None) -> Verdict:
    """Whether ``tx`` may update the parameter at ``keys`` chunk by chunk (see [Note: element-wise proof]).

    Args:
      tx: the transform.
      keys: the parameter's path as nested dict keys.
      cut: how the engine cuts it.
      clip: ``max_norm`` of a global-norm clip at the head of ``tx`` (the driver applies it).
    """
    pc = cut.probe()
    chunk_shape = pc.presented()
    with jax.default_device(host_device()):
        for shape in (pc.shape, chunk_shape):
            state = jax.eval_shape(tx.init, nest(keys, jax.ShapeDtypeStruct(shape, jnp.float32)))
            for x in jax.tree.leaves(state):
                if tuple(x.shape) not in (tuple(shape), ()):
                    return Verdict(False, f"its state has a leaf of shape {tuple(x.shape)} for a parameter of shape "
                                          f"{tuple(shape)} (factored or per-tensor state)")
        p, gs = _data(pc.shape, 0, clip)
        flip = np.random.default_rng(1).random(pc.shape) < 0.5
        p2 = np.where(flip, p * _F32(0.5), p)
        gs2 = [np.where(flip, g * _F32(-2.0), g) for g in gs]
        cs = [np.stack([x.reshape(chunk_shape) for x in pc.chunks(a)]) for a in (p, *gs)]

        def probe(p, gs, p2, gs2, cs):  # one program: the whole tensor, perturbed, and cut
            return (_run(tx, keys, p, gs), _run(tx, keys, p2, gs2),
                    jax.vmap(lambda c, *g: _run(tx, keys, c, g)[0])(*cs))

        (whole, sa), (other, sb), parts = jax.tree.map(np.asarray, jax.jit(probe)(p, gs, p2, gs2, cs))
        joined = np.stack([pc.join([x.reshape(-1) for x in parts[:, k]]) for k in range(len(gs))])
        if not _close(joined, whole):
            return Verdict(False, "its update of one chunk differs from the whole tensor's (it couples the elements "
                                  "of one tensor: a trust ratio, a per-tensor norm, a matrix moment)")
        same = ~flip
        if not all(np.array_equal(x[same], y[same]) for x, y in zip(whole, other)) or any(
                x.shape == pc.shape and not np.array_equal(x[same], y[same]) for x, y in zip(sa, sb)):
            return Verdict(False, "changing some elements of its gradient changes the update of others")
    return Verdict(True)


def _merged(*trees: dict) -> dict:
    """One-leaf nested dicts merged into one tree."""
    out: dict = {}
    for t in trees:
        node, src = out, t
        while True:
            (k, v), = src.items()
            if isinstance(v, dict) and isinstance(node.get(k), dict):
                node, src = node[k], v
                continue
            node[k] = v
            break
    return out


def tensor_coupling(tx: Any, probes: Sequence[tuple[Sequence[str], Cut]], clip: float | None) -> str | None:
    """Why the update of one parameter depends on another (``None``: it does not), from two parameters.

    Args:
      tx: the transform.
      probes: two parameters as ``(keys, cut)`` (their real paths and shapes, see :meth:`Cut.probe`).
      clip: as for :func:`classify`.
    """
    import optax

    if len(probes) < 2:
        return None
    (ka, ca), (kb, cb) = probes[:2]
    pa, ga = _data(ca.probe().shape, 2, None)
    pb, gb = _data(cb.probe().shape, 3, None)
    if clip is not None:  # the head clip sees both: keep it inactive for the pair
        total = math.sqrt(sum(float(np.sum(np.square(g, dtype=np.float64))) for g in (*ga, *gb)))
        s = _F32(0.25 * clip / max(total, 1e-30))
        ga, gb = [(g * s).astype(_F32) for g in ga], [(g * s).astype(_F32) for g in gb]

    def pair(pa, pb, *gs):
        params = _merged(nest(ka, pa), nest(kb, pb))
        state, us = tx.init(params), []
        for g1, g2 in zip(gs[:len(gs) // 2], gs[len(gs) // 2:]):
            u, state = tx.update(_merged(nest(ka, g1), nest(kb, g2)), state, params)
            params = optax.apply_updates(params, u)
            us.append(leaf(ka, u))
        return jnp.stack(us)

    with jax.default_device(host_device()):
        alone, _ = _steps(tx, ka, pa, ga)
        both = np.asarray(jax.jit(pair)(pa, pb, *ga, *gb))
    if not _close(alone, both):
        return ("its update of one parameter depends on the others (a global-norm clip or another statistic over "
                "the whole tree that is not at the head of an optax.chain)")
    return None
