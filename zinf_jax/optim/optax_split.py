"""How an optax transform may be split over the engine's parameters, proved from its program.

The engine holds each parameter as its own path (``"blocks/0/kernel"``), sharded and cut into chunks,
and updates it as a one-leaf tree at that path (:mod:`~zinf_jax.optim.optax_rule`). :func:`prove`
decides, from the jaxprs of ``tx.init`` and ``tx.update`` on the real tree (shapes only, nothing is
computed), which of three ways keeps the numbers of ``tx.update`` on the whole tree:

* **chunk** (the parameter's update is element-wise): each chunk of each shard alone;
* **whole** (it reads across the elements of its own tensor: a trust ratio, a per-tensor norm, a
  matrix moment, a factored state): the whole tensor, alone;
* **tree** (one parameter's update reads another's gradient, parameter or state, directly or through a
  state computed from them: a global-norm clip in the middle of a chain, Prodigy's or D-Adaptation's
  step size estimated over every parameter, Polyak's step over the whole gradient's norm; or the
  program of one parameter alone is not its part of the tree's program: a random key split over the
  leaves, a label given by position): every parameter in one update.

The proof (see [Note: split proofs] in :mod:`~zinf_jax.optim.optax_flow`):

1. *State per parameter.* ``tx.init`` of each one-leaf tree gives that parameter's state leaves; the
   leaves every parameter has are *shared* (step counts, a global estimate), the others are the
   parameter's *own*; together they must be exactly the leaves of ``tx.init`` of the whole tree (by key
   path), or the transform cannot be stored per parameter and is refused.
2. *No parameter reads another.* In ``tx.update`` of the whole tree, no output of one parameter (its
   update, its own new state) reads an input of another, and no shared output reads any parameter's
   input. Else: **tree**.
3. *One parameter alone is its part of the tree.* The one-leaf update's program text equals what JAX's
   dead-code elimination keeps of the whole tree's program for that parameter's outputs (inputs named by
   role). Else: **tree**.
4. *Element-wise on the tensor.* No own output of a parameter reads its own inputs across elements, every
   leaf of its one-leaf state is shaped like the parameter (or is a scalar), and the program of a chunk (the
   parameter's rank, ``(chunk, 1, ...)``) is the program of the whole tensor with that shape. Else:
   **whole**.
5. *Initial state.* Each own state leaf of ``tx.init`` reads the parameter element-wise or not at all
   (Prodigy's copy of the initial parameters; Adam's zeros), with the same program for a chunk, so it
   is initialized chunk by chunk; the other leaves read no parameter. Else the transform is refused.

A transform proved element-wise or whole runs parameter by parameter exactly as before; a tree-coupled
one runs as one update over every parameter (:class:`~zinf_jax.optim.subgroups.Tree` on the host,
one program over the tree in the step's program), its per-parameter storage unchanged: each parameter's
own leaves and a copy of the shared ones (:func:`assemble`, :func:`disassemble`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp

from zinf_jax.optim.optax_flow import Dep, flow, program_text

__all__ = ["Split", "Refusal", "prove", "proven", "nest", "leaf", "merged", "assemble", "disassemble", "extra_args",
           "calls_loss",
           "host_device"]


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


def merged(items: Mapping[str, Any]) -> dict:
    """The nested tree of ``{path: leaf}`` (paths split at ``/``)."""
    out: dict = {}
    for path, x in items.items():
        node = out
        *head, last = path.split("/")
        for k in head:
            node = node.setdefault(k, {})
        node[last] = x
    return out


def extra_args(tx: Any) -> dict[str, Any]:
    """The extra arguments the engine passes to ``tx.update`` (a ``GradientTransformationExtraArgs``): the
    step's loss as ``value``, a float32 scalar (as abstract values). A transform that also calls the loss
    (:func:`calls_loss`) gets ``grad`` and ``value_fn`` besides."""
    import optax

    if isinstance(tx, optax.GradientTransformationExtraArgs):
        return {"value": jax.ShapeDtypeStruct((), jnp.float32)}
    return {}


def calls_loss(tx: Any) -> bool:
    """Whether ``tx.update`` needs ``value_fn`` (the loss as a function of the parameters) and ``grad``: a line
    search (``optax.lbfgs``, ``scale_by_zoom_linesearch``, ``scale_by_backtracking_linesearch``), asked on a
    one-leaf tree (abstractly)."""
    if not extra_args(tx):
        return False
    p = {"w": jax.ShapeDtypeStruct((2,), jnp.float32)}
    try:
        jax.eval_shape(lambda q: tx.update(q, tx.init(q), q, value=jnp.float32(0)), p)
    except TypeError as e:
        return "value_fn" in str(e)
    return False


def _loss_of_all(params: Any) -> jax.Array:
    """What the proof calls as ``value_fn``: a scalar that reads every element of every parameter (the loss does)."""
    return sum((jnp.sum(x * x) for x in jax.tree.leaves(params)), jnp.float32(0))


@dataclasses.dataclass(frozen=True)
class Split:
    """:func:`prove`'s answer.

    Attributes:
      tree: why every parameter must be in one update (``None``: each parameter alone).
      whole: per parameter updated whole (every one with ``tree``), why.
      reads_value: the update reads the ``value`` extra argument (the loss).
      init_reads: per parameter, the key paths of its initial state leaves computed from the parameter's
        values (element-wise: made chunk by chunk); the others are constants.
      programs: per parameter updated chunk by chunk, its update's program text with the shape written as a
        symbol: parameters with the same text run the same element-wise program on each element, so their
        elements may be updated as one array ([Note: optax packs] in :mod:`~zinf_jax.optim.optax_rule`).
      own: per parameter, the key paths (``jax.tree_util.keystr``) of its one-leaf state, in that state's
        leaf order.
      full: the key paths of the whole tree's state, in its leaf order.
      shared: the key paths every parameter's state has (held by each as a copy).
      state_def: the treedef of the whole tree's state.
    """

    tree: str | None
    whole: Mapping[str, str]
    reads_value: bool
    init_reads: Mapping[str, frozenset]
    programs: Mapping[str, str]
    own: Mapping[str, tuple[str, ...]]
    full: tuple[str, ...]
    shared: frozenset
    state_def: Any


class Refusal(Exception):
    """The transform cannot be run by the engine at all (``why``)."""


def _kps(tree: Any) -> tuple[list[str], list[Any]]:
    pairs = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [jax.tree_util.keystr(k) for k, _ in pairs], [x for _, x in pairs]


def _sds(shape: Sequence[int]) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.float32)


def _update_jaxpr(tx: Any, params: Any, state: Any, extras: Mapping[str, Any]) -> Any:
    """The jaxpr of ``tx.update`` as a function of (gradient leaves, state leaves, param leaves, extras), giving
    (update leaves, new state leaves)."""
    p_leaves, pdef = jax.tree.flatten(params)
    s_leaves, sdef = jax.tree.flatten(state)
    names = sorted(extras)
    loss = calls_loss(tx)

    def run(g, s, p, x):
        more = {"grad": jax.tree.unflatten(pdef, g), "value_fn": _loss_of_all} if loss else {}
        u, ns = tx.update(jax.tree.unflatten(pdef, g), jax.tree.unflatten(sdef, s), jax.tree.unflatten(pdef, p),
                          **dict(zip(names, x)), **more)
        if jax.tree.structure(ns) != sdef:
            raise Refusal(f"its update returns a state of another structure than its init "
                          f"({jax.tree.structure(ns)} vs {sdef})")
        return jax.tree.leaves(u), jax.tree.leaves(ns)

    return jax.make_jaxpr(run)(p_leaves, s_leaves, p_leaves, [extras[k] for k in names])


def prove(tx: Any, shapes: Mapping[str, tuple[int, ...]], presented: Mapping[str, tuple[int, ...]]) -> Split:
    """How ``tx`` may be split over parameters of ``shapes`` (path to shape), each cut into chunks presented at
    ``presented[path]`` (the parameter's rank: ``(chunk, 1, ...)``). See the module doc.

    Raises:
      Refusal: the transform's state is not one part per parameter, or its initial state reads the parameters
        across elements (the reason).
    """
    with jax.default_device(host_device()):
        return _prove(tx, dict(shapes), dict(presented))


def _prove(tx: Any, shapes: dict[str, tuple], presented: dict[str, tuple]) -> Split:
    paths = list(shapes)
    keys = {p: tuple(p.split("/")) for p in paths}
    extras = extra_args(tx)
    params = merged({p: _sds(s) for p, s in shapes.items()})
    order = ["/".join(k.key for k in kp) for kp, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    state = jax.eval_shape(tx.init, params)
    full, full_avals = _kps(state)
    one = {p: _kps(jax.eval_shape(tx.init, nest(keys[p], _sds(shapes[p])))) for p in paths}
    own = {p: tuple(one[p][0]) for p in paths}
    shared = frozenset.intersection(*(frozenset(v) for v in own.values())) if len(paths) > 1 else frozenset()
    owner: dict[str, str | None] = {k: None for k in shared}
    for p in paths:
        for k in own[p]:
            if k not in shared:
                if k in owner:
                    raise Refusal(f"its state leaf {k} belongs to more than one parameter")
                owner[k] = p
    if set(owner) != set(full) or any(k not in owner for p in paths for k in own[p]):
        raise Refusal("its state is not one part per parameter (the state of the whole tree is not the states of "
                      "its parameters alone, joined)")
    aval = dict(zip(full, full_avals))
    for p in paths:
        for k, a in zip(*one[p]):
            if (tuple(a.shape), a.dtype) != (tuple(aval[k].shape), aval[k].dtype):
                raise Refusal(f"its state is not one part per parameter (its leaf {k} is {a.dtype}{list(a.shape)} "
                              f"for {p!r} alone and {aval[k].dtype}{list(aval[k].shape)} for the whole tree)")
    jaxpr = _update_jaxpr(tx, params, state, extras).jaxpr
    n, m, x = len(order), len(full), len(extras)
    in_owner = [*order, *(owner[k] for k in full), *order, *([None] * x)]
    in_role = [*(["gradient"] * n), *(f"state {k}" for k in full), *(["parameter"] * n), *sorted(extras)]
    deps = flow(jaxpr, [Dep(ew=frozenset({i})) for i in range(len(in_owner))])
    out_owner = [*order, *(owner[k] for k in full)]
    reads_value = bool(extras) and any((2 * n + m) in d.all for d in deps)

    init_reads = {p: _init_reads(tx, p, keys[p], shapes[p], presented[p]) for p in paths}
    tree = _tree_reason(deps, in_owner, in_role, out_owner, full, n) if len(paths) > 1 else None
    if tree is None and len(paths) > 1:
        tree = _alone_reason(tx, jaxpr, order, full, own, keys, shapes, extras, n, m)
    if tree is not None:
        return Split(tree=tree, whole={p: f"it updates the whole tree at once: {tree}" for p in paths},
                     reads_value=reads_value, init_reads=init_reads, programs={}, own=own, full=tuple(full), shared=shared,
                     state_def=jax.tree.structure(state))
    whole, programs = {}, {}
    for i, p in enumerate(order):
        mine = {i, n + m + i} | {n + j for j, k in enumerate(full) if owner[k] == p}
        outs = [deps[i]] + [deps[n + j] for j, k in enumerate(full) if owner[k] == p]
        across = [d for d in outs if d.full & mine]
        odd = [a.shape for a in one[p][1] if tuple(a.shape) not in ((), tuple(shapes[p]))]
        if across:
            via = sorted(set().union(*(d.via for d in across)))
            whole[p] = f"it reads across the elements of the tensor ({', '.join(via)})"
        elif odd:
            whole[p] = f"its state has a leaf of shape {tuple(odd[0])} (factored or per-tensor state)"
        else:
            text = _chunk_program(tx, keys[p], shapes[p], presented[p], extras)
            if text is None:
                whole[p] = "its program for a chunk is not its program for the whole tensor (it depends on the shape)"
            else:
                programs[p] = text
    return Split(tree=None, whole=whole, reads_value=reads_value, init_reads=init_reads, programs=programs, own=own,
                 full=tuple(full), shared=shared, state_def=jax.tree.structure(state))


def _tree_reason(deps: list[Dep], in_owner: list, in_role: list, out_owner: list, full: list, n: int) -> str | None:
    for o, (d, who) in enumerate(zip(deps, out_owner)):
        for i in sorted(d.all):
            q = in_owner[i]
            if q is None or q == who:
                continue
            if who is None:
                return (f"its state {full[o - n]} is computed from the {in_role[i]} of {q!r} (a statistic of the whole "
                        "tree, such as a step size estimated over every parameter)")
            what = "update" if o < n else f"state {full[o - n]}"
            return f"its {what} of {who!r} reads the {in_role[i]} of {q!r}"
    return None


def _one_leaf_jaxpr(tx: Any, keys: Sequence[str], shape: tuple, extras: Mapping[str, Any]) -> tuple[Any, list[str]]:
    params = nest(keys, _sds(shape))
    state = jax.eval_shape(tx.init, params)
    return _update_jaxpr(tx, params, state, extras).jaxpr, _kps(state)[0]


def _roles(jaxpr: Any, n_params: int, n_state: int, mine: int | None, state_names: Sequence[str | None],
           n_extra: int) -> dict:
    """Role names of ``jaxpr``'s inputs (from :func:`_update_jaxpr`): parameter ``mine``'s gradient ``g`` and
    parameter ``p``, state leaf ``j`` as ``state_names[j]`` (``None``: no role), the extras ``x0``..."""
    ins = jaxpr.invars
    roles = {}
    if mine is not None:
        roles[ins[mine]] = "g"
        roles[ins[n_params + n_state + mine]] = "p"
    for j, name in enumerate(state_names):
        if name is not None:
            roles[ins[n_params + j]] = name
    for k in range(n_extra):
        roles[ins[2 * n_params + n_state + k]] = f"x{k}"
    return roles


def _alone_reason(tx, jaxpr, order, full, own, keys, shapes, extras, n, m) -> str | None:
    for i, p in enumerate(order):
        one, one_kps = _one_leaf_jaxpr(tx, keys[p], shapes[p], extras)
        name = {k: f"s{j}" for j, k in enumerate(one_kps)}
        alone = program_text(one, list(one.outvars), _roles(one, 1, len(one_kps), 0, [name[k] for k in one_kps],
                                                            len(extras)))
        outs = [jaxpr.outvars[i]] + [jaxpr.outvars[n + full.index(k)] for k in one_kps]
        part = program_text(jaxpr, outs, _roles(jaxpr, n, m, i, [name.get(k) for k in full], len(extras)))
        if alone is None or alone != part:
            return (f"its update of {p!r} alone is not its update of {p!r} in the tree (a random key split over the "
                    "leaves, or a label or mask that depends on the whole tree)")
    return None


def _chunk_program(tx: Any, keys: Sequence[str], shape: tuple, chunk: tuple, extras: Mapping[str, Any]) -> str | None:
    """The one-leaf update's program for a chunk of shape ``chunk``, shapes written as a symbol, if it is its
    program for ``shape`` (``None``: it is not)."""
    texts = []
    mine = jax.tree_util.keystr(tuple(jax.tree_util.DictKey(k) for k in keys))
    for s in dict.fromkeys((tuple(chunk), tuple(shape))):
        jx, kps = _one_leaf_jaxpr(tx, keys, s, extras)
        kps = [k.replace(mine, "[P]") for k in kps]  # (its own path aside: the state's layout)
        text = program_text(jx, list(jx.outvars),
                            _roles(jx, 1, len(kps), 0, [f"s{j}" for j in range(len(kps))], len(extras)),
                            symbol={tuple(s): "S"})
        texts.append(None if text is None else f"{kps}\n{text}")
    if texts[0] is None or len(set(texts)) != 1:
        return None
    return texts[0] if shape else ""  # (a 0-d parameter's program: its scalars are not its elements)


def _init_reads(tx: Any, path: str, keys: Sequence[str], shape: tuple, chunk: tuple) -> frozenset:
    """Step 5 of the proof (module doc): the initial state can be made chunk by chunk. Returns the key paths of
    the leaves computed from the parameter's values.

    Raises:
      Refusal: it cannot.
    """
    progs = []
    for s in (shape, chunk):
        jx = jax.make_jaxpr(lambda p: jax.tree.leaves(tx.init(nest(keys, p))))(_sds(s)).jaxpr
        progs.append((jx, _kps(jax.eval_shape(tx.init, nest(keys, _sds(s))))[0]))
    (whole, names), (part, part_names) = progs
    deps = flow(whole, [Dep(ew=frozenset({0}))])
    reads = set()
    for k, (d, out) in enumerate(zip(deps, whole.outvars)):
        if not d.all:
            continue
        reads.add(names[k])
        if d.full or tuple(out.aval.shape) != tuple(shape):
            raise Refusal(f"its initial state {names[k]} for {path!r} is computed from the parameter's values across "
                          "elements")
        if tuple(chunk) == tuple(shape):
            continue
        j = part_names.index(names[k]) if names[k] in part_names else None
        same = j is not None and program_text(whole, [out], {whole.invars[0]: "p"}, {tuple(shape): "S"}) == \
            program_text(part, [part.outvars[j]], {part.invars[0]: "p"}, {tuple(chunk): "S"})
        if not same:
            raise Refusal(f"its initial state {names[k]} for {path!r} starts from the parameter's values in a way "
                          "that depends on the parameter's shape")
    return frozenset(reads)


_PROOFS: dict[tuple, Split] = {}
""":func:`proven`'s answers by (transform, shapes, chunks), at most :data:`_PROOFS_MAX` of them."""
_PROOFS_MAX = 64


def proven(tx: Any, shapes: Mapping[str, tuple[int, ...]], presented: Mapping[str, tuple[int, ...]]) -> Split:
    """:func:`prove`, once per transform object and geometry: a transform given to ``estimate_from_model`` and
    then to ``initialize`` (or to ``restore``, or to a second engine) is not traced again. (A transform that
    cannot be hashed is proved every time.)"""
    key = (tx, tuple(shapes.items()), tuple(presented.items()))
    try:
        hit = _PROOFS.get(key)
    except TypeError:
        return prove(tx, shapes, presented)
    if hit is None:
        if len(_PROOFS) >= _PROOFS_MAX:
            _PROOFS.clear()
        hit = _PROOFS[key] = prove(tx, shapes, presented)
    return hit


def assemble(split: Split, states: Mapping[str, Sequence[Any]]) -> list[Any]:
    """The whole tree's state leaves from each parameter's one-leaf state leaves (a shared leaf from the first
    parameter's copy; every copy holds the same value)."""
    where: dict[str, Any] = {}
    for path, leaves in states.items():
        for k, x in zip(split.own[path], leaves):
            where.setdefault(k, x)
    return [where[k] for k in split.full]


def disassemble(split: Split, leaves: Sequence[Any]) -> dict[str, list[Any]]:
    """Inverse of :func:`assemble`: each parameter's one-leaf state leaves (shared leaves copied to each)."""
    by = dict(zip(split.full, leaves))
    return {path: [by[k] for k in kps] for path, kps in split.own.items()}
