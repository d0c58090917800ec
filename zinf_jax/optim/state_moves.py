"""Optimizer states moved between host and device memory inside the step's program, a bounded window at a time.

[Note: states moved in the program]
With ``optimizer_update="device"`` and the state on the cpu tier (held in pinned host memory), the
compiled step's program takes each parameter's states (its float32 master, its moments or an optax
transform's states) as arguments in pinned host memory, moves them into device memory, updates them
there and moves the new states back, parameter by parameter, in the program: XLA issues each move as an
asynchronous copy and schedules it against the step's other work, and the new states leave the program
in host memory, where the tier takes them as they are. Nothing is moved outside the program, and
nothing serialises the step on a host copy.

Left alone, XLA would start every move-in at the top of the program and hold every parameter's states
in device memory at once. So a parameter's states are moved in only once enough earlier updates are
done: the move-in of parameter k depends (an optimization barrier) on the new states of the latest
parameter j whose later states, j+1..k, already exceed the window (``limit`` bytes per device,
``ZeroConfig.max_in_flight_bytes``), moved back to host memory (which frees their device buffers). At
most the window's bytes plus one parameter's are in device memory at once, as XLA's GPU compiler schedules
the program with its default of two asynchronous moves in flight (the engine raises that limit only for a
loop's parameter moves, which this configuration has none of): measured on the H100 schedule of a GPT with
1.2 MB of state per device, a window of 160 kB holds at most 203 kB, and XLA issues the moves back to back
with 3-15% of their bytes overlapping compute (windows of 50-400 kB; a limit of 32 overlaps 53% but lets the
moves back out lag: 470 kB held). XLA:TPU hoists every move-in of an argument to the top of the program
whatever the barriers say, so there the whole state is in device memory during the update. A transform that updates the whole tree at once needs every state in
device memory together: there the window cannot apply, and every state is moved in before the update.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

__all__ = ["StateMoves", "Resident"]


class Resident:
    """States already in device memory (the device tier): nothing to move."""

    def into(self, path: str, arrays: Sequence[Any], nbytes: int) -> list[Any]:
        return list(arrays)

    def out(self, path: str, arrays: Sequence[Any]) -> list[Any]:
        return list(arrays)


class StateMoves:
    """The moves of one program's states (traced; see [Note: states moved in the program]).

    Args:
      limit: the window, in bytes per device of states moved in ahead of their update.
      device: a path's states' sharding in device memory.
      host: the same in pinned host memory.
    """

    def __init__(self, limit: int, device: Callable[[str], Any], host: Callable[[str], Any]):
        self.limit, self.device, self.host = limit, device, host
        self._moved: list[int] = []  # bytes per device of each parameter's states moved in so far, in order
        self._new: list[Any] = []  # each updated parameter's new states moved back (pinned host memory), in order

    def _after(self) -> Any | None:
        """The moved-back states the next move-in waits for: those of the latest update with more than ``limit``
        bytes of states moved in after it (``None``: none such, or not updated yet)."""
        total = 0
        for j in range(len(self._moved) - 1, -1, -1):
            total += self._moved[j]
            if total > self.limit and j - 1 >= 0:
                return self._new[j - 1] if j - 1 < len(self._new) else None
        return None

    def into(self, path: str, arrays: Sequence[Any], nbytes: int) -> list[Any]:
        """``path``'s states (pinned host memory) in device memory, moved once the window allows.

        Args:
          nbytes: their bytes per device.
        """
        self._moved.append(nbytes)
        wait = self._after()
        arrays = list(arrays)
        if wait is not None:
            arrays, _ = jax.lax.optimization_barrier((arrays, wait))
        return [jax.device_put(x, self.device(path)) for x in arrays]

    def out(self, path: str, arrays: Sequence[Any]) -> list[Any]:
        """``path``'s new states (device memory) moved to pinned host memory; once moved, they open the window."""
        moved = [jax.device_put(x, self.host(path)) for x in arrays]
        self._new.append(moved)
        return moved
