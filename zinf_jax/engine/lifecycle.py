"""An engine's life cycle: one named state, and the check every public call makes first.

[Note: engine life cycle]
``READY`` after ``initialize``/``restore``: the tiers are open (and their directory locks held), any
call may run. ``LOOPING`` while an ``engine.train_steps`` generator runs: it holds the next
batch's gradients in the sink, so ``train_step`` and a second ``train_steps`` are refused (``save``,
``params`` and ``eval_step`` in the loop body see the step just yielded). ``CLOSED`` after
``close()``: the tiers are released; every call but ``close`` is an :class:`EngineError`. Every
public method checks first (:meth:`LifeCycle.check`), before any state changes.
"""
from __future__ import annotations

import enum
from typing import Any

import jax
from flax import nnx

from zinf_jax.engine.streamed import JIT_MESSAGE
from zinf_jax.errors import EngineError

__all__ = ["Phase", "LifeCycle"]


class Phase(enum.Enum):
    """Where an engine is in its life (see [Note: engine life cycle])."""

    READY = "ready"
    """Tiers open, no ``train_steps`` loop running: every call may run."""
    LOOPING = "looping"
    """A ``train_steps`` loop holds the next batch's gradients: ``train_step`` and another loop wait."""
    CLOSED = "closed"
    """Tiers and locks released: nothing but ``close`` may run."""


class LifeCycle:
    """The :class:`Phase` of one engine, and the refusals it implies."""

    def __init__(self) -> None:
        self.phase = Phase.READY

    @property
    def closed(self) -> bool:
        """Whether the engine is closed."""
        return self.phase is Phase.CLOSED

    def check(self, what: str, batch: Any = None) -> None:
        """Refuses ``engine.<what>()`` after :meth:`close` or under an outer transformation, before anything changes.

        Raises:
          EngineError: the engine is closed, or ``batch`` holds a tracer (an outer ``jax.jit``/``grad``).
        """
        if self.phase is Phase.CLOSED:
            raise EngineError(f"engine.{what}() after engine.close(): its tiers (and their locks) are released; "
                              "build a new engine (zinf.restore(...) from a checkpoint)")
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(batch, is_leaf=nnx.graph.is_graph_node)):
            raise EngineError(JIT_MESSAGE)

    @property
    def looping(self) -> bool:
        """Whether a ``train_steps`` loop is running."""
        return self.phase is Phase.LOOPING

    def enter_loop(self) -> None:
        """A ``train_steps`` loop starts (a closed engine stays closed: the loop's first check refuses it)."""
        if self.phase is Phase.READY:
            self.phase = Phase.LOOPING

    def leave_loop(self) -> None:
        """Ends a ``train_steps`` loop (unless the engine was closed inside it)."""
        if self.phase is Phase.LOOPING:
            self.phase = Phase.READY

    def close(self) -> bool:
        """Marks the engine closed; False if it already was."""
        if self.phase is Phase.CLOSED:
            return False
        self.phase = Phase.CLOSED
        return True
