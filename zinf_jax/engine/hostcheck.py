"""Reads a lowered step as a GPU or TPU would run it: which operations compute on host-memory values.

On the CPU backend a move between memory kinds is a no-op, so a program that casts, reshards or sums
values in ``pinned_host`` runs there as fast and as exact as one that does not. Lowered for ``cuda`` or
``tpu`` (``engine.lower(batch, platforms=("cuda",))``, possible on any machine), the moves are explicit:
``annotate_device_placement`` custom calls, and ``mhlo.memory_kind`` on the arguments. This module walks
that StableHLO (through calls, loops and branches) and reports:

* every operation that reads a host-memory value and is not a move, a slice of a host array (a scanned
  run's stack), a reshape of one, a write of a moved value into a host buffer (XLA's offload pattern),
  a sharding annotation that only feeds a move (JAX lowers ``device_put`` so), or a return: on a GPU
  such an operation is host compute or an abort, on a TPU it runs on the host;
* every device copy of a host value stored into a loop's stacked output: a scanned run saving its layers'
  device copies for the backward, which undoes the offload.

Used by the suite for every offload configuration (see [Note: gradient taps] in
:mod:`zinf_jax.engine.staging`), and by users on their own programs.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from zinf_jax.errors import EngineError

__all__ = ["HostComputeReport", "host_compute_report", "check_host_compute"]

_HOST, _COPY = 1, 2  # bits per value: in host memory; a device copy of a host value (or a view of one)
_PASS = {"stablehlo.slice", "stablehlo.dynamic_slice", "stablehlo.reshape", "stablehlo.optimization_barrier",
         "stablehlo.tuple", "stablehlo.get_tuple_element", "func.return", "stablehlo.return", "sdy.return"}
_VIEWS = {"stablehlo.reshape", "stablehlo.convert", "stablehlo.transpose", "stablehlo.broadcast_in_dim",
          "stablehlo.slice", "stablehlo.dynamic_slice", "stablehlo.optimization_barrier",
          "sdy.sharding_constraint", "sdy.reshard", "stablehlo.copy", "stablehlo.reduce_precision"}
_SHARDING = {"sdy.sharding_constraint", "sdy.reshard"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class HostComputeReport:
    """What a lowered program does with host-memory values.

    Attributes:
      violations: one line per offending operation (function, operation, what it reads), in program order.
      moves_to_device: ``annotate_device_placement`` calls to device memory.
      moves_to_host: those to ``pinned_host``.
      host_arguments: the entry function's arguments in host memory.
      host_writes: one line per write of a moved value into a host buffer (a scanned run's gradients
        going out layer by layer), in program order.
      moves_ahead: moves to device memory inside a loop whose result the iteration only hands on to the
        next one (a layer moved in while the one before computes: [Note: moves ahead] in
        :mod:`zinf_jax.engine.staged`).
    """

    violations: tuple[str, ...]
    moves_to_device: int
    moves_to_host: int
    host_arguments: int
    host_writes: tuple[str, ...] = ()
    moves_ahead: int = 0

    @property
    def ok(self) -> bool:
        """No operation computes on a host value and no device copy of one is saved per loop iteration."""
        return not self.violations


def _attr(op: Any, name: str) -> Any:
    try:
        return op.attributes[name]
    except (KeyError, ValueError):
        return None


def _string(attr: Any) -> str:
    return str(attr).strip('"@')


def _placement(op: Any) -> str | None:
    """``device``/``pinned_host`` for an ``annotate_device_placement`` custom call, else None."""
    if op.name != "stablehlo.custom_call" or _string(_attr(op, "call_target_name")) != "annotate_device_placement":
        return None
    attrs = _attr(op, "mhlo.frontend_attributes")
    try:
        return _string(attrs["_xla_buffer_placement"])
    except (KeyError, TypeError, ValueError):
        return None


def _elements(type_: Any) -> int | None:
    """The element count of a ``tensor<AxBxf32>`` type (None if it is not static)."""
    dims = str(type_).removeprefix("tensor<").split(",")[0].split("x")[:-1]
    try:
        n = 1
        for d in dims:
            n *= int(d)
        return n
    except ValueError:
        return None


def _is_reshape(op: Any) -> bool:
    """A ``broadcast_in_dim`` that only adds unit axes: a reshape."""
    return (op.name == "stablehlo.broadcast_in_dim"
            and _elements(op.operands[0].type) == _elements(op.results[0].type) is not None)


def _is_sharding(op: Any) -> bool:
    return op.name in _SHARDING or (op.name == "stablehlo.custom_call"
                                    and _string(_attr(op, "call_target_name")) == "Sharding")


class _Walker:
    def __init__(self, module: Any):
        self.funcs = {}
        for op in module.body.operations:
            if op.operation.name == "func.func":
                self.funcs[_string(op.attributes["sym_name"])] = op.operation
        self.memo: dict[tuple, tuple[int, ...]] = {}
        self.violations: dict[tuple, str] = {}
        self.moves = {"device": 0, "pinned_host": 0}
        self._counted: set[tuple] = set()
        self.host_writes: list[str] = []
        self.ahead: set[tuple] = set()

    def func(self, name: str, arg_bits: tuple[int, ...], in_loop: bool = False) -> tuple[int, ...]:
        key = (name, arg_bits, in_loop)
        if key not in self.memo:
            self.memo[key] = ()  # recursion guard (StableHLO has none, but be safe)
            fn = self.funcs[name]
            block = fn.regions[0].blocks[0]
            bits = {a: b for a, b in zip(block.arguments, arg_bits)}
            self.memo[key] = self.block(name, block, bits, in_loop)
        return self.memo[key]

    def block(self, fname: str, block: Any, bits: dict, in_loop: bool) -> tuple[int, ...]:
        """Walks ``block`` (values' bits in ``bits``); returns the bits of its terminator's operands."""
        out: tuple[int, ...] = ()
        for k, op in enumerate(block.operations):
            op = op.operation
            ins = [bits.get(v, 0) for v in op.operands]
            where = (fname, str(op.location), k, op.name)
            res = self.op(fname, op, ins, in_loop, where)
            for r, b in zip(op.results, res):
                bits[r] = b
            if op.name in ("func.return", "stablehlo.return", "sdy.return"):
                out = tuple(ins)
        return out

    def flag(self, where: tuple, what: str) -> None:
        self.violations.setdefault(where, f"{where[0]}: {where[3]} {what}")

    def op(self, fname: str, op: Any, ins: list[int], in_loop: bool, where: tuple) -> list[int]:
        name, host_in = op.name, any(b & _HOST for b in ins)
        nres = len(op.results)
        place = _placement(op)
        if place is not None:
            if where not in self._counted:
                self._counted.add(where)
                self.moves[place] = self.moves.get(place, 0) + 1
            if place == "pinned_host":
                return [_HOST] * nres
            return [_COPY if host_in or ins[0] & _COPY else 0] * nres
        if name == "stablehlo.optimization_barrier":  # operand i is result i
            return list(ins)
        if name == "func.call":
            return list(self.func(_string(_attr(op, "callee")), tuple(ins), in_loop))
        if name == "stablehlo.while":
            return self.loop(fname, op, ins)
        if name in ("stablehlo.case", "stablehlo.if"):
            res = [0] * nres
            for region in op.regions:
                for blk in region.blocks:
                    for i, b in enumerate(self.block(fname, blk, {}, in_loop)):
                        res[i] |= b
            return res
        if name == "sdy.manual_computation":
            blk = op.regions[0].blocks[0]
            return list(self.block(fname, blk, dict(zip(blk.arguments, ins)), in_loop)) or [0] * nres
        if name == "stablehlo.dynamic_update_slice":
            buf, upd = ins[0], ins[1]
            if host_in and not upd & _HOST:
                self.flag(where, "writes a device value into a host buffer without a move")
            if upd & _COPY and in_loop:
                self.flag(where, "saves a device copy of a host parameter into a stacked loop output "
                                 "(a residual per iteration: the offload undone)")
            if upd & _HOST and where not in self._counted:
                self._counted.add(where)
                self.host_writes.append(f"{where[0]}: {op.operands[1].type} into {op.operands[0].type}")
            return [_HOST if upd & _HOST or buf & _HOST else 0]
        if host_in:
            if _is_sharding(op):
                users = [u.owner.name for r in op.results for u in r.uses]
                if users and all(u == "stablehlo.custom_call" for u in users):
                    return [_HOST] * nres  # device_put's own annotation before its move
            if name not in _PASS and not _is_reshape(op):
                kinds = sorted({str(op.operands[i].type) for i, b in enumerate(ins) if b & _HOST})
                self.flag(where, f"computes on host-memory values {', '.join(kinds)}")
        out = _HOST if host_in else 0
        if any(b & _COPY for b in ins) and (name in _VIEWS or _is_sharding(op)):
            out |= _COPY
        return [out] * nres

    def loop(self, fname: str, op: Any, ins: list[int]) -> list[int]:
        cond, body = op.regions[0].blocks[0], op.regions[1].blocks[0]
        for k, inner in enumerate(body.operations):  # moves whose results this iteration only hands on
            inner = inner.operation
            if _placement(inner) == "device" and all(_only_carried(r) for r in inner.results):
                self.ahead.add((fname, str(op.location), k))
            elif inner.name == "func.call":  # the loop's body function (lax.scan lowers its body to a call)
                callee = _string(_attr(inner, "callee"))
                ops = [o.operation for o in self.funcs[callee].regions[0].blocks[0].operations]
                for r, v in zip(inner.results, ops[-1].operands):
                    mv = _move_behind(v)
                    if mv is not None and _only_carried(r):
                        self.ahead.add((callee, next(i for i, o in enumerate(ops) if o == mv)))
        carried = list(ins)
        for _ in range(len(carried) + 1):
            self.block(fname, cond, dict(zip(cond.arguments, carried)), in_loop=True)
            ret = self.block(fname, body, dict(zip(body.arguments, carried)), in_loop=True)
            new = [a | b for a, b in zip(carried, ret)]
            if new == carried:
                break
            carried = new
        return carried


def _only_carried(value: Any) -> bool:
    """``value`` (a loop body's) reaches the body's return, and nothing else, through views of it."""
    uses = [u.owner for u in value.uses]
    if not uses:
        return False
    for user in uses:
        name = user.operation.name
        if name == "stablehlo.return":
            continue
        if not (name in _VIEWS or _is_sharding(user.operation)) or not all(_only_carried(r) for r in user.results):
            return False
    return True


def _move_behind(value: Any) -> Any:
    """The move to device memory that ``value`` is (or is a view of), else None."""
    owner = value.owner
    if not hasattr(owner, "operation"):  # a block argument
        return None
    op = owner.operation
    if _placement(op) == "device":
        return op
    if (op.name in _VIEWS or _is_sharding(op)) and len(op.operands) >= 1:
        return _move_behind(op.operands[0])
    return None


def _arg_kinds(main: Any) -> list[str | None]:
    attrs = _attr(main, "arg_attrs")
    if attrs is None:
        return [None] * len(main.regions[0].blocks[0].arguments)
    out = []
    for d in attrs:
        try:
            out.append(_string(d["mhlo.memory_kind"]))
        except (KeyError, ValueError):
            out.append(None)
    return out


def host_compute_report(lowered: Any) -> HostComputeReport:
    """Walks ``lowered`` (a ``jax.stages.Lowered``, e.g. ``engine.lower(batch, platforms=("cuda",))``).

    Args:
      lowered: the lowered program; lowered for an accelerator to see its moves (on the CPU backend JAX
        keeps the annotations too, but XLA:CPU ignores them).

    Returns:
      The report; ``report.ok`` when nothing computes on host memory.
    """
    module = lowered.compiler_ir("stablehlo")
    walker = _Walker(module)
    main = walker.funcs.get("main") or next(iter(walker.funcs.values()))
    kinds = _arg_kinds(main)
    bits = tuple(_HOST if k in ("pinned_host", "unpinned_host") else 0 for k in kinds)
    name = _string(main.attributes["sym_name"])
    walker.func(name, bits)
    return HostComputeReport(violations=tuple(walker.violations.values()),
                             moves_to_device=walker.moves.get("device", 0),
                             moves_to_host=walker.moves.get("pinned_host", 0),
                             host_arguments=sum(1 for b in bits if b), host_writes=tuple(walker.host_writes),
                             moves_ahead=len(walker.ahead))


def check_host_compute(lowered: Any, *, limit: int = 20) -> HostComputeReport:
    """:func:`host_compute_report`, raising where the program computes on host memory.

    Raises:
      EngineError: an operation reads a host value other than to move, slice or return it, or a loop
        saves device copies of host values; the message lists the first ``limit`` of them.
    """
    report = host_compute_report(lowered)
    if not report.ok:
        lines: Iterable[str] = report.violations[:limit]
        more = len(report.violations) - limit
        raise EngineError("the program computes on host-memory values (slow or refused on a GPU, host compute "
                          f"on a TPU); {len(report.violations)} operation(s):\n  " + "\n  ".join(lines)
                          + (f"\n  ... and {more} more" if more > 0 else ""))
    return report
