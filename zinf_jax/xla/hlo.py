"""Reads an XLA program as an accelerator's compiler left it: its transfers, their overlap, host compute, reductions.

The input is the text of a compiled, scheduled HLO module (what :mod:`zinf_jax.xla.deviceless` gets back
from XLA's GPU or TPU compiler). In such a module the order of a computation's instructions is the
schedule, a memory space of ``S(5)`` marks a host-memory buffer, and a move between host and device
memory is an asynchronous pair: ``copy-start``/``copy-done``, or on a loop's stacked buffer an
asynchronous slice (``dynamic-slice-start``/``-done``; on a GPU a ``fusion-start`` of a dynamic slice)
or update (``dynamic-update-slice-start``/``-done``). This module finds those pairs and answers, per step:

* how many bytes move host -> device and device -> host per device (a loop body's moves counted
  once per iteration, from the trip count XLA records on the loop);
* which moves have compute scheduled between their start and their done (*overlapped*), and which
  of a loop's moves are handed on to the next iteration (*ahead*: [Note: moves ahead] in
  :mod:`zinf_jax.engine.staged`);
* which instructions XLA turned into host compute (``_xla_compute_type="host"`` on a GPU, a
  ``HostExecute`` call on a TPU): device work on host-memory values;
* the element types of the cross-device reductions (all-reduce, reduce-scatter);
* the shapes all-gathers produce (an expert stack split over an expert axis never appears whole);
* the most bytes moved into device memory and not yet moved back, over the top-level schedule (states a
  program moves in, updates and moves out: [Note: states moved in the program]).

Pure text processing: no JAX, no device.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Iterator

__all__ = ["Instruction", "Module", "Transfer", "Reduction", "parse", "transfers", "host_compute", "reductions",
           "gathered_shapes", "peak_moved_in"]

_HOST_SPACE = "S(5)"
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_ARRAY = re.compile(r"\b(" + "|".join(sorted(_BYTES, key=len, reverse=True)) + r")\[([\d,]*)\](\{[^}]*\})?")
_HEADER = re.compile(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
_NOT_COMPUTE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id",
                "replica-id", "opt-barrier", "copy", "add-dependency", "domain"}
"""Bookkeeping instructions: neither compute nor a move."""
_COLLECTIVE = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
               "collective-broadcast", "ragged-all-to-all")


@dataclasses.dataclass(frozen=True)
class Array:
    """One array type of an instruction's shape: element type, dims, and whether it lives in host memory."""

    dtype: str
    dims: tuple[int, ...]
    host: bool

    @property
    def nbytes(self) -> int:
        n = _BYTES[self.dtype]
        for d in self.dims:
            n *= d
        return n


def _arrays(text: str) -> list[Array]:
    out = []
    for dtype, dims, layout in _ARRAY.findall(text):
        out.append(Array(dtype, tuple(int(d) for d in dims.split(",") if d), _HOST_SPACE in (layout or "")))
    return out


def _split_top(text: str) -> list[str]:
    """The comma-separated elements of a tuple shape's outer level (``(a, (b, c), d)`` -> ``a``, ``(b, c)``, ``d``)."""
    text = text.strip()
    if not text.startswith("("):
        return [text]
    body, depth, start, parts = text[1:-1], 0, 0, []
    for i, ch in enumerate(body):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    parts.append(body[start:])
    return [p.strip() for p in parts if p.strip() and not p.strip().startswith("/*")]


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One instruction of a computation, in schedule order.

    Attributes:
      name: its name (without ``%``).
      shape: its result type as written.
      opcode: the HLO opcode (``fusion-start``, ``copy-done``, ``while``, ...).
      operands: the names of its operands.
      attrs: the rest of the line (``calls=``, ``backend_config=``, ``metadata=``...).
      args: the text between its parentheses (a constant's value).
    """

    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str
    args: str = ""

    def attr(self, key: str) -> str | None:
        m = re.search(r"\b" + re.escape(key) + r"=(%?[\w.\-]+)", self.attrs)
        return m.group(1).lstrip("%") if m else None

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.attrs)
        return m.group(1) if m else ""


def _operands_and_attrs(rest: str) -> tuple[tuple[str, ...], str, str]:
    depth, i = 1, 0
    for i, ch in enumerate(rest):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                break
    return tuple(re.findall(r"%([\w.\-]+)", rest[:i])), rest[i + 1:], rest[:i]


@dataclasses.dataclass
class Module:
    """A parsed HLO module: computations by name, each a list of instructions in schedule order."""

    computations: dict[str, list[Instruction]]
    entry: str

    def instructions(self) -> Iterator[tuple[str, Instruction]]:
        for comp, insts in self.computations.items():
            for inst in insts:
                yield comp, inst

    def multiplicity(self) -> dict[str, int]:
        """How many times each computation runs per execution of the entry: a while body once per iteration
        (its ``known_trip_count``), a called computation or branch once per call. Computations only reached as
        a fusion's or a reduction's inner function count 0 (they are kernels, not schedules)."""
        count: dict[str, int] = {self.entry: 1}
        order = [self.entry]
        for comp in order:
            for inst in self.computations.get(comp, []):
                callees: list[tuple[str, int]] = []
                if inst.opcode == "while":
                    trips = self.trip_count(comp, inst)
                    callees += [(inst.attr("body") or "", trips), (inst.attr("condition") or "", trips + 1)]
                elif inst.opcode in ("call", "conditional", "async-start"):
                    for key in ("to_apply", "calls"):
                        if inst.attr(key):
                            callees.append((inst.attr(key) or "", 1))
                    m = re.search(r"branch_computations=\{([^}]*)\}", inst.attrs)
                    if m:
                        callees += [(b.strip().lstrip("%"), 1) for b in m.group(1).split(",")]
                for callee, k in callees:
                    if callee in self.computations:
                        count[callee] = count.get(callee, 0) + count[comp] * k
                        if callee not in order:
                            order.append(callee)
        return count


    def find(self, comp: str, name: str) -> Instruction | None:
        for inst in self.computations.get(comp, []):
            if inst.name == name:
                return inst
        return None

    def _constant(self, comp: str, name: str) -> int | None:
        """The integer a value is, following copies and bitcasts back to a ``constant``."""
        inst = self.find(comp, name)
        while inst is not None and inst.opcode in ("copy", "bitcast", "reshape") and inst.operands:
            inst = self.find(comp, inst.operands[0])
        if inst is None or inst.opcode != "constant":
            return None
        m = re.fullmatch(r"\s*(-?\d+)\s*", inst.args)
        return int(m.group(1)) if m else None

    def trip_count(self, comp: str, loop: Instruction) -> int:
        """A while loop's iteration count: the ``known_trip_count`` XLA records (GPU), else read off the loop:
        an induction variable from a constant, stepped by a constant, compared with a constant (TPU)."""
        m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', loop.attrs)
        if m:
            return int(m.group(1))
        cond, body = loop.attr("condition"), loop.attr("body")
        croot = (self.computations.get(cond or "") or [None])[-1]
        broot = (self.computations.get(body or "") or [None])[-1]
        init = self.find(comp, loop.operands[0]) if loop.operands else None
        if croot is None or broot is None or init is None or croot.opcode != "compare" or init.opcode != "tuple":
            return 1
        direction = re.search(r"direction=(\w+)", croot.attrs)
        idx, limit = None, None
        for a, b in (croot.operands, croot.operands[::-1]):
            g = self.find(cond or "", a)
            if g is not None and g.opcode == "get-tuple-element":
                idx, limit = g.attr("index"), self._constant(cond or "", b)
                flip = a != croot.operands[0]
                break
        if idx is None or limit is None or direction is None:
            return 1
        i = int(idx)
        start = self._constant(comp, init.operands[i]) if i < len(init.operands) else None
        step = None
        nxt = self.find(body or "", broot.operands[i]) if i < len(broot.operands) else None
        while nxt is not None and nxt.opcode in ("copy", "bitcast"):
            nxt = self.find(body or "", nxt.operands[0])
        if nxt is not None and nxt.opcode == "add":
            for o in nxt.operands:
                c = self._constant(body or "", o)
                if c is not None:
                    step = c
        if start is None or not step:
            return 1
        d = direction.group(1)
        if flip:
            d = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}.get(d, d)
        span = {"LT": limit - start, "LE": limit - start + 1, "GT": start - limit, "GE": start - limit + 1}.get(d)
        if span is None:
            return 1
        return max(0, -(-span // abs(step)))


def parse(text: str) -> Module:
    """Parses the text of an HLO module (``HloModule.to_string()``)."""
    comps: dict[str, list[Instruction]] = {}
    entry, cur = "", None
    for line in text.splitlines():
        if not line.startswith(" "):
            m = _HEADER.match(line)
            if m:
                cur = m.group(2)
                comps[cur] = []
                if m.group(1):
                    entry = cur
                continue
            if line.startswith("}"):
                cur = None
            continue
        if cur is None:
            continue
        m = _INSTR.match(line)
        if m:
            operands, attrs, args = _operands_and_attrs(m.group(5))
            comps[cur].append(Instruction(m.group(2), m.group(3), m.group(4), operands, attrs, args))
    return Module(comps, entry or next(iter(comps), ""))


@dataclasses.dataclass(frozen=True)
class Transfer:
    """A move between host and device memory in the schedule.

    Attributes:
      computation: the computation it is scheduled in.
      name: its start instruction (or the instruction, for a synchronous move).
      to_device: host -> device (else device -> host).
      nbytes: bytes moved per device per execution of its computation.
      runs: executions per step (its computation's multiplicity).
      overlapped: compute instructions are scheduled between its start and its done.
      ahead: in a loop body, the moved value is only handed on to the next iteration.
      asynchronous: a start/done pair (a synchronous copy never overlaps).
    """

    computation: str
    name: str
    to_device: bool
    nbytes: int
    runs: int
    overlapped: bool
    ahead: bool
    asynchronous: bool

    @property
    def total(self) -> int:
        """Bytes per device per step."""
        return self.nbytes * self.runs


def _start_parts(inst: Instruction) -> tuple[list[Array], list[Array]]:
    """``(inputs, outputs)`` of an asynchronous start: ``copy-start`` is ``(dst, src, ctx)``, the others
    ``((operands...), result, ctx)``."""
    parts = _split_top(inst.shape)
    if inst.opcode == "copy-start":
        return _arrays(parts[1]), _arrays(parts[0])
    if len(parts) >= 2:
        return _arrays(parts[0]), _arrays(parts[1])
    return [], _arrays(inst.shape)


def _done_of(insts: list[Instruction], k: int) -> int | None:
    name = insts[k].name
    for j in range(k + 1, len(insts)):
        if insts[j].opcode.endswith("-done") and name in insts[j].operands:
            return j
    return None


def _is_compute(inst: Instruction) -> bool:
    if inst.opcode in _NOT_COMPUTE or inst.opcode.endswith("-start") or inst.opcode.endswith("-done"):
        return False
    return not inst.opcode.startswith(_COLLECTIVE)


def _only_to_root(insts: list[Instruction], name: str) -> bool:
    """``name``'s value reaches the computation's root tuple, and nothing else, through copies and bitcasts."""
    users = [i for i in insts if name in i.operands]
    if not users:
        return False
    for u in users:
        if u is insts[-1] and u.opcode == "tuple":
            continue
        if u.opcode not in ("bitcast", "copy", "reshape") or not _only_to_root(insts, u.name):
            return False
    return True


def transfers(module: Module) -> list[Transfer]:
    """Every move between host and device memory in ``module``, in schedule order per computation."""
    runs = module.multiplicity()
    out = []
    for comp, insts in module.computations.items():
        if runs.get(comp, 0) == 0:
            continue
        for k, inst in enumerate(insts):
            if inst.opcode.endswith("-start") and not inst.opcode.startswith(_COLLECTIVE):
                ins, outs = _start_parts(inst)
                moved = _moved(inst, ins, outs)
                if moved is None:
                    continue
                to_device, nbytes = moved
                done = _done_of(insts, k)
                between = insts[k + 1:done] if done is not None else []
                out.append(Transfer(comp, inst.name, to_device, nbytes, runs[comp],
                                    any(_is_compute(i) for i in between),
                                    done is not None and _only_to_root(insts, insts[done].name), True))
            elif inst.opcode == "copy":
                src = _arrays(_operand_shape(insts, inst.operands[0]) if inst.operands else "")
                dst = _arrays(inst.shape)
                if src and dst and src[0].host != dst[0].host:
                    out.append(Transfer(comp, inst.name, src[0].host, dst[0].nbytes, runs[comp], False, False, False))
    return out


def _operand_shape(insts: list[Instruction], name: str) -> str:
    for i in insts:
        if i.name == name:
            return i.shape
    return ""


def _moved(inst: Instruction, ins: list[Array], outs: list[Array]) -> tuple[bool, int] | None:
    """``(to_device, bytes)`` of an asynchronous start that moves data between memories, else None."""
    if not outs:
        return None
    result = outs[0]
    if "update-slice" in inst.name or "update-slice" in inst.opcode:  # writes ins[1] into the buffer ins[0]
        if len(ins) >= 2 and ins[0].host and not ins[1].host:
            return False, ins[1].nbytes
        if len(ins) >= 2 and not ins[0].host and ins[1].host:
            return True, ins[1].nbytes
        return None
    if ins and ins[0].host and not result.host:
        return True, result.nbytes
    if ins and not ins[0].host and result.host:
        return False, result.nbytes
    return None


def host_compute(module: Module) -> list[str]:
    """Instructions XLA runs on the host: ``_xla_compute_type="host"`` (GPU) or ``HostExecute`` calls (TPU)."""
    out = []
    for comp, inst in module.instructions():
        if '_xla_compute_type="host"' in inst.attrs or "HostExecute" in inst.attrs \
                or 'async_execution_thread="host"' in inst.attrs:
            out.append(f"{comp}: {inst.name} = {inst.opcode} ({inst.op_name or 'no op_name'})")
    return out


@dataclasses.dataclass(frozen=True)
class Reduction:
    """A cross-device reduction (all-reduce or reduce-scatter) of the partitioned program.

    Attributes:
      computation: where it is.
      name: the instruction.
      dtypes: the element types it reduces.
      op_name: the JAX operation it came from (``metadata``).
    """

    computation: str
    name: str
    dtypes: tuple[str, ...]
    op_name: str


def reductions(module: Module) -> list[Reduction]:
    """Every all-reduce and reduce-scatter (synchronous or started), with the types it reduces."""
    out = []
    for comp, inst in module.instructions():
        if inst.opcode in ("all-reduce", "all-reduce-start", "reduce-scatter", "reduce-scatter-start"):
            types = tuple(sorted({a.dtype for a in _arrays(inst.shape)}))
            out.append(Reduction(comp, inst.name, types, inst.op_name))
        elif inst.opcode == "fusion-start" and ("all-reduce" in inst.name or "reduce-scatter" in inst.name):
            types = tuple(sorted({a.dtype for a in _start_parts(inst)[1]}))
            out.append(Reduction(comp, inst.name, types, inst.op_name))
    return out


def gathered_shapes(module: Module) -> list[tuple[int, ...]]:
    """The dims of every array an all-gather (synchronous or started) produces, one entry per array."""
    out = []
    for _, inst in module.instructions():
        if inst.opcode == "all-gather":
            out += [a.dims for a in _arrays(inst.shape)]
        elif inst.opcode == "all-gather-start":
            parts = _split_top(inst.shape)
            out += [a.dims for a in _arrays(parts[-1])]
    return out


def peak_moved_in(module: Module) -> int:
    """The most bytes per device, over the entry computation's schedule, moved host -> device (counted from each
    move's start) and not yet answered by as many bytes moved device -> host (counted at each move's done): what a
    program that moves values in, updates them and moves the new values out holds in device memory at once."""
    insts = module.computations[module.entry]
    starts: dict[str, tuple[bool, int]] = {}
    held = peak = 0
    for inst in insts:
        if inst.opcode.endswith("-start") and not inst.opcode.startswith(_COLLECTIVE):
            moved = _moved(inst, *_start_parts(inst))
            if moved is not None:
                starts[inst.name] = moved
                held += moved[1] if moved[0] else 0
                peak = max(peak, held)
        elif inst.opcode.endswith("-done") and inst.operands and inst.operands[0] in starts:
            to_device, nbytes = starts[inst.operands[0]]
            held -= 0 if to_device else nbytes
    return peak


def summary(module: Module) -> dict:
    """The figures a report carries, as plain data (bytes per device per step; shares of bytes)."""
    ts = transfers(module)
    in_loop = [t for t in ts if t.to_device and t.computation != module.entry]
    loop_bytes = sum(t.total for t in in_loop)
    return {
        "h2d_bytes": sum(t.total for t in ts if t.to_device),
        "d2h_bytes": sum(t.total for t in ts if not t.to_device),
        "h2d_moves": sum(t.runs for t in ts if t.to_device),
        "d2h_moves": sum(t.runs for t in ts if not t.to_device),
        "in_loop_h2d_bytes": loop_bytes,
        "in_loop_h2d_overlapped": (sum(t.total for t in in_loop if t.overlapped) / loop_bytes) if loop_bytes else 1.0,
        "in_loop_h2d_ahead": (sum(t.total for t in in_loop if t.ahead) / loop_bytes) if loop_bytes else 1.0,
        "host_compute": host_compute(module),
        "reduction_dtypes": sorted({d for r in reductions(module) for d in r.dtypes}),
    }


def dumps(module: Module) -> str:
    """:func:`summary` as indented JSON."""
    return json.dumps(summary(module), indent=1)
