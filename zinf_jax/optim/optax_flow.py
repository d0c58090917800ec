"""Which inputs each output of a traced program reads, and how: the data flow that proves how a transform splits.

[Note: split proofs]
The engine never runs an optax transform on the whole tree of parameters if it can help it: it presents
one parameter at a time (a one-leaf tree at the parameter's path), and an element-wise transform one
chunk of one shard at a time. Each split is allowed only when a proof from the transform's own program
says the numbers stay those of ``tx.update`` on the whole tree (:mod:`~zinf_jax.optim.optax_split` draws
the conclusions; this module supplies the two tools):

* :func:`flow` follows every equation of a jaxpr and gives, for each output, the inputs it reads
  *element-wise* (output element ``k`` reads input element ``k`` only: arithmetic, comparisons,
  casts, ``select_n``, broadcasts of one element, reshapes that keep the row-major order) and those it
  reads *across elements* (a reduction, a contraction, a transpose, a slice, a random draw, a loop, any
  primitive not known to be element-wise). Calls (``jit``, ``custom_jvp_call``, ...) and ``cond``
  branches are followed inside; everything else is assumed to read all of its inputs across elements.
  An unknown primitive can only make a split less likely, never allow one.
* :func:`program_text` renders the part of a jaxpr that computes some outputs (what JAX's dead-code
  elimination keeps of it, calls and ``cond`` branches pruned inside) as canonical text: primitives, parameters, literals and shapes, inputs named by their role (``g``,
  ``p``, ``s0``...), internal values numbered in order. Two programs with the same text compute the
  same numbers from the same inputs; a shape can be written as a symbol, so the program of a chunk can
  be compared with the program of the whole tensor.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from zinf_jax._internal.jax_private import ClosedJaxpr, Jaxpr, Literal, dce_jaxpr

__all__ = ["Dep", "flow", "program_text", "ELEMENTWISE"]

ELEMENTWISE = frozenset("""
abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp copy copy_p cos cosh digamma div eq erf
erf_inv erfc exp exp2 expm1 floor ge gt imag integer_pow is_finite le lgamma log log1p logistic lt max min mul
ne neg nextafter not or pow real reduce_precision rem round rsqrt select_n sign sin sinh sqrt square sub tan
tanh xor convert_element_type shift_left shift_right_logical shift_right_arithmetic population_count clz
stop_gradient
""".split())
"""Primitives whose output element ``k`` reads element ``k`` of each input of the output's shape (and the one
element of a scalar input)."""

_ORDER_KEEPING = frozenset({"reshape", "squeeze", "expand_dims"})
"""Primitives that keep the row-major order of the elements (output element ``k`` is input element ``k``)."""


@dataclasses.dataclass(frozen=True)
class Dep:
    """What one value reads of a program's inputs (by input position).

    Attributes:
      ew: inputs read element-wise (element ``k`` of the value reads element ``k`` of the input, or the
        input is a single element).
      full: inputs read across elements.
      via: the primitives that read across elements (for messages).
    """

    ew: frozenset = frozenset()
    full: frozenset = frozenset()
    via: frozenset = frozenset()

    @property
    def all(self) -> frozenset:
        return self.ew | self.full

    def __or__(self, other: "Dep") -> "Dep":
        return Dep(self.ew | other.ew, self.full | other.full, self.via | other.via)

    def mixed(self, name: str) -> "Dep":
        """This value read across elements by primitive ``name``."""
        return Dep(frozenset(), self.all, self.via | ({name} if self.all else set()))


_NONE = Dep()


def _size(v: Any) -> int:
    return int(np.prod(getattr(v.aval, "shape", ())))


def _shape(v: Any) -> tuple:
    return tuple(getattr(v.aval, "shape", ()))


def _inner(eqn: Any) -> Jaxpr | None:
    """The jaxpr a call-like equation runs on its own inputs, giving its own outputs (``None``: not a call)."""
    for v in eqn.params.values():
        j = v.jaxpr if isinstance(v, ClosedJaxpr) else v if isinstance(v, Jaxpr) else None
        if j is not None and len(j.invars) == len(eqn.invars) and len(j.outvars) == len(eqn.outvars):
            return j
    return None


def _equation(eqn: Any, ins: list[Dep]) -> list[Dep]:
    name = eqn.primitive.name
    if name == "cond":  # the branch index reads across; each branch's own flow otherwise
        index, ops = ins[0], ins[1:]
        outs = [_NONE] * len(eqn.outvars)
        for br in eqn.params["branches"]:
            outs = [a | b for a, b in zip(outs, flow(br.jaxpr, ops))]
        return [o | index.mixed("cond") for o in outs]
    inner = _inner(eqn)
    if inner is not None and name not in ("while", "scan"):
        return flow(inner, ins)
    union = _NONE
    for d in ins:
        union = union | d
    out_shapes = [_shape(o) for o in eqn.outvars]
    same = all(_size(v) <= 1 or _shape(v) == out_shapes[0] for v in eqn.invars) if eqn.invars else True
    if name in ELEMENTWISE and len(set(out_shapes)) <= 1 and same:
        return [union] * len(eqn.outvars)
    if name in _ORDER_KEEPING or (name == "broadcast_in_dim" and _size(eqn.invars[0]) <= 1) or (
            name == "bitcast_convert_type" and _shape(eqn.invars[0]) == out_shapes[0]):
        return [union] * len(eqn.outvars)
    return [union.mixed(name)] * len(eqn.outvars)


def flow(jaxpr: Jaxpr, ins: Sequence[Dep]) -> list[Dep]:
    """What each output of ``jaxpr`` reads, given what each of its inputs reads (see [Note: split proofs]).

    Args:
      jaxpr: an open jaxpr (its constants read nothing).
      ins: one :class:`Dep` per input (``Dep(ew=frozenset({i}))`` for input ``i`` of the program of interest).
    """
    env: dict[Any, Dep] = dict(zip(jaxpr.invars, ins))

    def read(a: Any) -> Dep:
        return _NONE if isinstance(a, Literal) else env.get(a, _NONE)

    for eqn in jaxpr.eqns:
        for v, d in zip(eqn.outvars, _equation(eqn, [read(a) for a in eqn.invars])):
            env[v] = d
    return [read(v) for v in jaxpr.outvars]


def _render(x: Any, shape: Callable[[tuple], str]) -> str:
    """A parameter of an equation as text (jaxprs printed with shapes written by ``shape``)."""
    if isinstance(x, (ClosedJaxpr, Jaxpr)):
        j = x.jaxpr if isinstance(x, ClosedJaxpr) else x
        return "{" + " ; ".join(_lines(j, list(j.outvars), {v: f"i{k}" for k, v in enumerate(j.invars)}, shape)) + "}"
    if isinstance(x, tuple) and all(isinstance(d, (int, np.integer)) for d in x):
        return shape(tuple(int(d) for d in x))
    if isinstance(x, (tuple, list)):
        return "(" + ",".join(_render(y, shape) for y in x) + ")"
    if callable(x) and not isinstance(x, type):
        return getattr(x, "__qualname__", type(x).__name__)
    return repr(x)


def _aval(v: Any, shape: Callable[[tuple], str]) -> str:
    a = v.aval
    return f"{getattr(a, 'dtype', type(a).__name__)}{'~' if getattr(a, 'weak_type', False) else ''}" \
           f"{shape(tuple(getattr(a, 'shape', ())))}"


def _lines(jaxpr: Jaxpr, outs: Sequence[Any], roles: Mapping[Any, str], shape: Callable[[tuple], str]) -> list[str]:
    needed = {v for v in outs if not isinstance(v, Literal)}
    keep = []
    for eqn in reversed(jaxpr.eqns):
        if any(o in needed for o in eqn.outvars):
            keep.append(eqn)
            needed |= {a for a in eqn.invars if not isinstance(a, Literal)}
    names: dict[Any, str] = dict(roles)
    for v in jaxpr.constvars:
        names.setdefault(v, f"c:{_aval(v, shape)}")

    def ref(a: Any) -> str:
        if isinstance(a, Literal):
            return f"{np.asarray(a.val).tolist()!r}:{_aval(a, shape)}"
        if a not in names:
            raise KeyError(a)  # an input without a role: the slice reads something it should not
        return names[a]

    lines = []
    for eqn in reversed(keep):
        args = ",".join(ref(a) for a in eqn.invars)
        params = ",".join(f"{k}={_render(v, shape)}" for k, v in sorted(eqn.params.items()))
        for o in eqn.outvars:
            names[o] = f"%{len(names)}"
        lines.append(f"{eqn.primitive.name}[{params}]({args})->{','.join(_aval(o, shape) for o in eqn.outvars)}")
    lines.append("out:" + ",".join(ref(v) for v in outs))
    return lines


def program_text(jaxpr: Jaxpr, outs: Sequence[Any], roles: Mapping[Any, str],
                 symbol: Mapping[tuple, str] | None = None) -> str | None:
    """The part of ``jaxpr`` that computes ``outs`` as canonical text (``None``: it reads an input that has no
    role).

    Args:
      jaxpr: the program.
      outs: the outputs of interest (variables of ``jaxpr``).
      roles: a name for each input the slice may read.
      symbol: shapes to write as symbols (e.g. ``{(4, 3): "S"}``), so that programs differing only in those
        shapes compare equal.
    """
    sym = dict(symbol or {})

    def shape(s: tuple) -> str:
        return f"[{sym[s]}]" if s in sym else f"[{','.join(map(str, s))}]"

    # JAX's own dead-code elimination first: a call or cond over many leaves keeps only what ``outs`` need
    positions = [next(i for i, w in enumerate(jaxpr.outvars) if w is v) for v in outs]
    used = [i in positions for i in range(len(jaxpr.outvars))]
    small, _ = dce_jaxpr(jaxpr, used)
    kept = dict(zip([i for i, u in enumerate(used) if u], small.outvars))
    try:
        return "\n".join(_lines(small, [kept[i] for i in positions], roles, shape))
    except KeyError:
        return None
