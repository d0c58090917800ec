"""The one module that touches ``jax._src``: JAX internals the engine needs, behind public names.

The engine cuts a traced loss into compiled segments and re-runs parts of a traced
constructor, which needs a few jaxpr utilities JAX does not export. Everything
with a public home is taken from there (``jax.extend.core``, ``jax.core``); only
the rest reaches into ``jax._src``, here and nowhere else (a layering test in
the suite enforces it).

Checked against JAX 0.6 - 0.10.2 (``pyproject.toml``: ``jax>=0.6``). If a JAX
release moves one of the private names below, this is the file to change:

==========================  ====================================  =====================
name                        from                                  used by
==========================  ====================================  =====================
``ClosedJaxpr``, ``Jaxpr``  ``jax.extend.core`` (public)          ``engine/glue``
``Var``, ``DropVar``,       ``jax.extend.core`` (public)          ``engine/glue``
``Literal``, ``DebugInfo``
``jaxpr_as_fun``            ``jax.extend.core`` (public)          ``engine/glue``
``ShapedArray``,            ``jax.core`` (public)                 ``engine/glue``,
``eval_jaxpr``                                                    ``engine/adapters``
``join_effects``            ``jax._src.core`` (private)           ``engine/glue``
``convert_constvars_jaxpr`` ``jax._src.interpreters.partial_eval``  ``engine/adapters``
``dce_jaxpr``               ``jax._src.interpreters.partial_eval``  ``engine/adapters``
``current_trace``           ``jax._src.core`` (private)           ``engine/glue``
``jaxprs_in_params``        ``jax._src.core`` (private)           ``engine/unroll``
``scan_p``                  ``jax._src.lax.control_flow`` (private)  ``engine/unroll``
``bind_params``             ``jax._src.core`` (private)           ``engine/unroll``
``discharge_refs``          ``jax._src.state.discharge``          ``engine/adapters``
``distributed_client``      ``jax._src.distributed.global_state``  ``distributed/``
``preemption_sync_manager`` ``jax._src.distributed.global_state``  ``distributed/stop``
``lowered_program``         ``Lowered._lowering`` (private attrs)  ``xla/deviceless``
``compile_deviceless``      ``jax._src.interpreters.pxla``,       ``xla/worker``
                            ``jax._src.interpreters.mlir``
==========================  ====================================  =====================
"""
from __future__ import annotations

import inspect

from jax._src import core as _core  # private: join_effects has no public home (JAX 0.10.2)
from jax._src import distributed as _distributed  # private: the job's client (orbax reaches it the same way)
from jax._src.lax.control_flow import loops as _loops  # private: the scan primitive (JAX 0.10.2)
from jax._src.interpreters import partial_eval as _pe  # private: jaxpr rewriting (JAX 0.10.2)
from jax._src.state import discharge as _discharge  # private: Ref-free jaxprs (JAX 0.10.2)
from jax._src.interpreters import mlir as _mlir  # private: StableHLO bytecode and contexts (JAX 0.10.2)
from jax._src.interpreters import pxla as _pxla  # private: a program's XLA compile options (JAX 0.10.2)
from jax.core import ShapedArray, eval_jaxpr
from jax.extend.core import ClosedJaxpr, DebugInfo, DropVar, Jaxpr, Literal, Primitive, Var, jaxpr_as_fun

__all__ = ["ClosedJaxpr", "DebugInfo", "DropVar", "Jaxpr", "Literal", "Primitive", "Var", "jaxpr_as_fun",
           "ShapedArray", "eval_jaxpr", "join_effects", "convert_constvars_jaxpr", "dce_jaxpr", "discharge_refs",
           "distributed_client", "preemption_sync_manager", "current_trace", "jaxprs_in_params", "scan_p",
           "bind_params", "lowered_program", "compile_deviceless"]

join_effects = _core.join_effects
"""The union of effect sets (of a segment's equations)."""
convert_constvars_jaxpr = _pe.convert_constvars_jaxpr
"""A jaxpr whose constants become its leading inputs."""
dce_jaxpr = _pe.dce_jaxpr
"""Dead-code elimination: ``(jaxpr, used_outputs) -> (smaller jaxpr, used_inputs)``."""
current_trace = _core.unsafe_get_current_trace
"""The trace values are being built in now: the loss's own, or that of a transform's body inside it (a scan)."""
jaxprs_in_params = _core.jaxprs_in_params
"""The jaxprs an equation's parameters hold (a scan's body, a ``jit``'s or ``checkpoint``'s inner jaxpr)."""
scan_p = _loops.scan_p
"""``jax.lax.scan``'s primitive: its parameters ``jaxpr``, ``num_consts``, ``num_carry``, ``length``, ``reverse``."""


def bind_params(eqn) -> dict:
    """The keyword arguments that bind ``eqn``'s primitive again (as ``jax.core.eval_jaxpr`` does)."""
    got = eqn.primitive.get_bind_params(eqn.params)
    return got[1] if isinstance(got, tuple) else got  # JAX < 0.8: (subfuns, params)


def discharge_refs(closed: ClosedJaxpr) -> ClosedJaxpr:
    """The same computation without mutable array references: each ``Ref`` the jaxpr creates, reads and
    writes becomes the plain values it holds (the state discharge JAX applies before lowering)."""
    if "closed_jaxpr" in inspect.signature(_discharge.discharge_state).parameters:
        return _discharge.discharge_state(closed)
    jaxpr, consts = _discharge.discharge_state(closed.jaxpr, closed.consts)  # JAX < 0.8: (jaxpr, consts)
    return ClosedJaxpr(jaxpr, consts)


def distributed_client():
    """The ``jax.distributed`` client of this process (``None`` outside a multi-process job).

    Its ``get_live_nodes`` and key-value store are the coordination service's own; JAX exports no
    public accessor (orbax's ``multihost`` module reads the same ``global_state.client``).
    """
    return _distributed.global_state.client


def preemption_sync_manager():
    """This process's JAX preemption sync manager (``None`` outside a job, or with the service off).

    ``multihost_utils.reached_preemption_sync_point`` answers False without a job and raises a bare
    ``RuntimeError`` without the manager; checking first gives a clearer error.
    """
    return _distributed.global_state.preemption_sync_manager


def lowered_program(lowered) -> dict:
    """What compiling ``lowered`` (a ``jax.stages.Lowered``) elsewhere needs, as plain data: its StableHLO as
    bytecode, its device count, and the compile settings JAX derives from its shardings.

    ``Lowered.compile()`` compiles for the backend the program was lowered on; a program lowered on the CPU
    mesh for ``cuda`` or ``tpu`` (``lowering_platforms``) is compiled on another client by
    :func:`compile_deviceless`, in another process.
    """
    low = lowered._lowering  # MeshComputation (JAX 0.10.2)
    args = low.compile_args
    allow_in, allow_out = _pxla.get_prop_to_input_output(args["in_shardings"], args["out_shardings"],
                                                         len(args["ordered_effects"]))
    return {"bytecode": _mlir.module_to_bytecode(low.stablehlo()), "devices": len(low._device_list),
            "tuple_args": bool(args["tuple_args"]), "allow_in": list(allow_in), "allow_out": list(allow_out)}


def compile_deviceless(program: dict, devices: list, options: dict):
    """Compiles a :func:`lowered_program` on the compile-only client of ``devices`` (a topology's).

    Returns:
      The compiled executable (``hlo_modules()``, ``get_compiled_memory_stats()``).
    """
    import numpy as np
    from jax._src.lib import xla_client as xc

    with _mlir.make_ir_context():
        module = _mlir.ir.Module.parse(program["bytecode"])
        dev = np.array(devices[: program["devices"]], dtype=object)
        client = dev[0].client
        opts = _pxla.create_compile_options(module, program["tuple_args"], tuple(program["allow_in"]),
                                            tuple(program["allow_out"]), client, dev, dict(options))
        return client.compile(module, executable_devices=xc.DeviceList(tuple(dev)), compile_options=opts)
