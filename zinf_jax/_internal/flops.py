"""Floating-point operations of a traced function: its matrix products and convolutions.

The estimator turns a step's FLOPs and a device's achieved rate into compute
seconds. Only ``dot_general`` and ``conv_general_dilated`` are counted (2 per
multiply-add): in the models this library trains they are all but a few percent
of the arithmetic, and the elementwise rest is memory-bound anyway. Nested
programs count too: ``jit``/``remat``/``custom_vjp`` bodies once, a ``scan``
body ``length`` times, the costliest branch of a ``cond``, a ``while`` body
once (its trip count is not known from the trace).
"""
from __future__ import annotations

import math
from typing import Any, Iterator

from zinf_jax._internal.jax_private import ClosedJaxpr, Jaxpr

__all__ = ["matmul_flops"]


def _jaxprs(value: Any) -> Iterator[Jaxpr]:
    if isinstance(value, ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _jaxprs(v)


def _conv_flops(eqn: Any) -> int:
    """2 x output elements x (kernel elements per output feature / feature groups)."""
    rhs = eqn.invars[1].aval.shape
    out_feature = eqn.params["dimension_numbers"].rhs_spec[0]
    per_out = math.prod(rhs) // rhs[out_feature]
    return 2 * math.prod(eqn.outvars[0].aval.shape) * per_out


def matmul_flops(jaxpr: Jaxpr | ClosedJaxpr) -> int:
    """FLOPs of the matrix products and convolutions of ``jaxpr`` (``jax.make_jaxpr`` output or its ``.jaxpr``)."""
    if isinstance(jaxpr, ClosedJaxpr):
        jaxpr = jaxpr.jaxpr
    total = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in contract)
        elif name == "conv_general_dilated":
            total += _conv_flops(eqn)
        subs = [matmul_flops(j) for v in eqn.params.values() for j in _jaxprs(v)]
        if not subs:
            continue
        if name == "cond":
            total += max(subs)
        else:
            total += sum(subs) * (int(eqn.params.get("length", 1)) if name == "scan" else 1)
    return total
