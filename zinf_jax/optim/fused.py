"""Adam(W), or any optax transform, inside the compiled step, for optimizer state kept in device memory.

With ``offload_optimizer="none"`` the fp32 master and the moments live in device memory (the
device tier). Streaming them through the host each step (read a sub-group, update it on the CPU,
put it back) costs a device-to-host and a host-to-device copy of every state, and a transfer per
sub-group. Where the compiled engine runs the step with the params in device memory too, the update
instead joins the step's program (:class:`~zinf_jax.engine.compiled.CompiledModel` calls
:meth:`FusedAdam.update` inside its trace): the gradients never leave the devices, the global norm
is a reduction in the program, and the new params and states come out of it, one program per step.

:class:`FusedAdam` *is* the streamed optimizer of the same tier (its subclass): the tier stays the
one place the state lives, in the driver's layout (one flat chunk per shard), so checkpoints,
restores, ``params()`` and a step the program cannot take (e.g. before the first compiled step)
read and write it exactly as before. The program takes each state as one global flat array, shard
``i`` being the tier's chunk ``i`` (built without a copy from the tier's arrays and kept while the
tier holds what the last step wrote: an identity check per shard), and its outputs' shards are put
back as the tier's new arrays.

The arithmetic is the fused kernel's (:func:`~zinf_jax.optim.adam.adam_math`, the bias corrections
and learning rate computed on the host as for the kernel); the global norm is summed in float32 in
the program (the host sums in float64), so a clipped step can differ from the streamed one in the
last bits of the multiplier. A non-finite gradient skips the step (every state and param unchanged)
as in the streamed step. With an optax transform the program runs the transform instead
(:mod:`~zinf_jax.optim.fused_optax`).

With ``optimizer_update="device"`` the tier is a host or nvme one. A cpu tier holds the states in pinned host
memory: its arrays are the program's inputs as they are, it takes the program's outputs as its new arrays,
and inside the program each parameter's states move into device memory and back, a bounded window at a time
([Note: states moved in the program] in :mod:`~zinf_jax.optim.state_moves`). An nvme tier's states (the
state that does not fit host RAM) are read into host buffers a bounded read-ahead at a time
(:meth:`FusedAdam._move_in`) and put on the devices as the program's inputs, and :meth:`FusedAdam.adopt`
writes the outputs back to it before the step commits. Nothing is kept on the devices between steps. In a
multi-process job each process moves only its own shards: the global arrays are built from them
(:meth:`FusedAdam._global_flat`).
"""
from __future__ import annotations

import collections
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zinf_jax.config import ConfigError, ZeroConfig
from zinf_jax.optim.adam import AdamSpec, adam_math, bias_correction
from zinf_jax.optim.choose import loss_scaling
from zinf_jax.optim.driver import StreamedOptimizer
from zinf_jax.optim.fused_optax import from_flat, optax_update, small_leaves, to_flat
from zinf_jax.optim.kernel import AdamCoefficients
from zinf_jax.optim.optax_rule import as_transform, describe
from zinf_jax.optim.optax_split import calls_loss
from zinf_jax.optim.scaling import update_loss_scale
from zinf_jax.optim.state_moves import Resident, StateMoves
from zinf_jax.plan.partition import local_positions
from zinf_jax.tiers.base import np_dtype

__all__ = ["FusedAdam", "fused_refusal", "update_in_program", "to_flat", "from_flat", "MOVE_IN_AHEAD"]

MOVE_IN_AHEAD = 256 << 20
"""Host bytes of optimizer state read ahead of their put to the devices (``optimizer_update="device"``)."""


def fused_refusal(spec: Any, *, compiled: bool, param_tier: str, opt_tier: str, accumulation: int,
                  loss_scaling: bool, grad_tier: bool, largest_shard: int, sub_group_size: int,
                  update_on_device: bool = False) -> str | None:
    """Why the update cannot run inside the compiled step (``None``: it can).

    Args:
      update_on_device: ``optimizer_update="device"``: state on a host tier moves in for the step.
    """
    if not compiled:
        return "the streamed engine runs the step"
    if param_tier != "none" or (opt_tier != "none" and not update_on_device):
        need = ("params must be in device memory" if update_on_device
                else "both must be in device memory, or optimizer_update='device'")
        return f"params on {param_tier!r} and optimizer on {opt_tier!r} ({need})"
    import optax

    if not isinstance(spec, (AdamSpec, optax.GradientTransformation)):
        return f"the optimizer {type(spec).__name__} (not zinf's Adam or an optax GradientTransformation)"
    if accumulation != 1:
        return "gradient accumulation"
    if loss_scaling:
        return "fp16 loss scaling"
    if grad_tier:
        return "a gradient tier"
    if largest_shard > sub_group_size:
        return f"sub_group_size {sub_group_size} cuts a shard of {largest_shard} elements"
    return None


def update_in_program(spec: Any, config: ZeroConfig, where: Any, *, compute_dtype: str, largest_shard: int) -> bool:
    """Whether the compiled step runs the optimizer's update (:func:`fused_refusal` is ``None``): the one place the
    engine (``build``) and the estimator ask.

    Args:
      spec: the optimizer (zinf's Adam or an optax transform).
      config: the engine's settings (``optimizer_update``, accumulation, ``sub_group_size``, loss scaling).
      where: the engine's :class:`~zinf_jax.plan.placement.Placement`.
      compute_dtype: the resolved compute dtype (float16 turns loss scaling on).
      largest_shard: elements of the largest parameter shard.

    Raises:
      ConfigError: ``optimizer_update="device"`` with the optimizer on a host tier, and the update cannot run in
        the step's program; or the optimizer calls the loss (a line search) and the update cannot run there (the
        message says why and how to fix it).
    """
    on_device = config.optimizer_update == "device"
    why = fused_refusal(
        spec, compiled=where.engine == "compiled", param_tier=where.params.device, opt_tier=where.optimizer.device,
        accumulation=config.gradient_accumulation_steps, loss_scaling=loss_scaling(config, compute_dtype) is not None,
        grad_tier=where.grads is not None, largest_shard=largest_shard, sub_group_size=config.sub_group_size,
        update_on_device=on_device)
    if why is not None and (name := _line_search(spec)) is not None:
        detail = (f"the optax transform {name!r} calls the loss in its line search (value_fn), "
                  "and only the compiled step with params and optimizer state in device memory runs its update in the "
                  f"program that has the loss (here: {why}). Fix: offload_param='none', offload_optimizer='none' and "
                  "engine='compiled' (or 'auto'), or a transform without a line search")
        raise ConfigError(f"optimizer: {detail}", field="optimizer", detail=detail)
    if why is not None and on_device and where.optimizer.device != "none":
        detail = (f"the update cannot run in the step's program with {why}. Fix: change that, or "
                  "optimizer_update='host' (the streamed CPU update)")
        raise ConfigError(f"ZeroConfig.optimizer_update='device': {detail}", field="optimizer_update", detail=detail)
    return why is None


def _line_search(spec: Any) -> str | None:
    """The name of an optax transform that calls the loss (a line search: :func:`calls_loss`), else ``None``."""
    import optax

    if isinstance(spec, optax.GradientTransformation) and calls_loss(tx := as_transform(spec)):
        return describe(tx)
    return None


class FusedAdam(StreamedOptimizer):
    """The streamed optimizer of a device tier whose Adam step can also run inside the compiled step.

    Args:
      mesh: the device mesh.
      *args, **kwargs: as :class:`~zinf_jax.optim.driver.StreamedOptimizer` (an
        :class:`~zinf_jax.optim.adam.AdamSpec`, a device tier, no grad tier).

    Raises:
      ValueError: a shard is cut into several sub-groups (``sub_group_size`` below a shard's size).
    """

    def __init__(self, *args: Any, mesh: Mesh, window: int = 1 << 30, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if any(n != 1 for n in self._nch.values()):
            raise ValueError("FusedAdam needs one sub-group per shard (raise sub_group_size)")
        self.mesh = mesh
        self.window = window
        """Bytes per device of states moved into device memory ahead of their update (a host tier's)."""
        self._cache: dict[str, tuple[tuple[int, ...], jax.Array]] = {}  # state key -> (tier objects' ids, array)
        self._pending: dict[str, Any] | None = None  # the metrics of a step the program applied
        self._adopted = -1  # the tier's version after the last adopt
        self._resident = self.tier.kind == "device"  # else the state moves in for each step and back out
        self._in_program = self.tier.kind == "cpu" and self.tier.memory == "pinned_host"  # ... inside the program
        self._held = self._resident or self._in_program  # the program takes the tier's arrays as they are
        self._kind = "pinned_host" if self._in_program else "device"  # the memory the program takes the states in
        self._optax = not isinstance(self.spec, AdamSpec)  # See zinf_jax.optim.fused_optax
        self._small: dict[str, tuple[tuple[int, ...], list[jax.Array]]] = {}  # path -> (host leaves' ids, on device)
        self._new_small: dict[str, list[jax.Array]] = {}  # the last program's small leaves, until applied

    @property
    def calls_loss(self) -> bool:
        """The update calls the loss (an optax line search's ``value_fn``): the program passes it."""
        return self._optax and self.rule.calls_loss

    # --- the state as the program takes it -------------------------------------------
    def _flat_sharding(self, path: str, kind: str | None = None) -> NamedSharding:
        lay = self.layouts[path]
        return NamedSharding(self.mesh, P() if lay.dim is None else P(lay.axes), memory_kind=kind)

    def moves(self) -> Resident | StateMoves:
        """The moves of the states in a program (traced: one per program)."""
        if not self._in_program:
            return Resident()
        return StateMoves(self.window, lambda p: self._flat_sharding(p, "device"),
                          lambda p: self._flat_sharding(p, "pinned_host"))

    def state_bytes(self, path: str) -> int:
        """Bytes per device of ``path``'s states the program moves (its master and the rule's tier states)."""
        return sum(self._numel[path] * np.dtype(np_dtype(self.tier.spec(f"{name}/{path}").dtype)).itemsize
                   for name in self._names[path])

    def moved_bytes(self, paths: Sequence[str]) -> int:
        """Bytes per device the program moves each way for the states of ``paths`` (0 but for a cpu tier's)."""
        return sum(self.state_bytes(p) for p in paths) if self._in_program else 0

    def states(self, paths: Sequence[str]) -> list[list[jax.Array]]:
        """Per path, its master and the rule's states as global flat arrays (see module doc)."""
        if not self._held:
            return [row + (self._small_on_device(path) if self._optax else []) for path, row in self._move_in(paths)]
        if self.tier.version == self._adopted:  # nothing else wrote the tier since the last step's states
            return [[self._cache[f"{name}/{path}"][1] for name in self._names[path]]
                    + (self._small_on_device(path) if self._optax else []) for path in paths]
        out = []
        for path in paths:
            row = []
            for name in self._names[path]:
                key = f"{name}/{path}"
                objs = [self.tier.current(key, i) for i in self._local[path]]
                hit = self._cache.get(key)
                if hit is None or hit[0] != tuple(map(id, objs)):
                    hit = self._cache[key] = (tuple(map(id, objs)), self._assemble(path, objs))
                row.append(hit[1])
            out.append(row + self._small_on_device(path) if self._optax else row)
        return out

    def _move_in(self, paths: Sequence[str]) -> Iterator[tuple[str, list[jax.Array]]]:
        """Each path's states read from a host or nvme tier and put on the devices (``optimizer_update="device"``).

        Reads run ahead of the puts by up to :data:`MOVE_IN_AHEAD` bytes, each state read into one host buffer
        (shard ``i`` at ``i * numel``) that its put copies from and that is dropped once the put is done.
        """
        pending: collections.deque = collections.deque()
        ahead = 0

        def issue(path: str) -> None:
            nonlocal ahead
            reads = []
            for name in self._names[path]:
                spec = self.tier.spec(f"{name}/{path}")
                n = spec.shard_shape[0]
                host = np.empty(len(self._local[path]) * n, np_dtype(spec.dtype))
                futs = self.tier.get_many([(f"{name}/{path}", i, host[k * n:(k + 1) * n])
                                           for k, i in enumerate(self._local[path])])
                reads.append((host, futs))
                ahead += host.nbytes
            pending.append((path, reads))

        todo = collections.deque(paths)
        while todo or pending:
            while todo and (not pending or ahead < MOVE_IN_AHEAD):
                issue(todo.popleft())
            path, reads = pending.popleft()
            row = []
            for host, futs in reads:
                for f in futs:
                    f.result()
                arr = self._global_flat(path, np.split(host, len(self._local[path])), self._kind)
                row.append(jax.block_until_ready(arr))
                ahead -= host.nbytes
            yield path, row

    def _small_on_device(self, path: str) -> list[jax.Array]:
        """``path``'s scalar and other-shaped optax state leaves, replicated (uploaded when the rule's changed)."""
        host = small_leaves(self.rule, path)
        hit = self._small.get(path)
        if hit is None or hit[0] != tuple(map(id, host)):
            rep = NamedSharding(self.mesh, P())
            hit = self._small[path] = (tuple(map(id, host)), [jax.device_put(np.asarray(x), rep) for x in host])
        return hit[1]

    def _assemble(self, path: str, shards: Sequence[Any]) -> jax.Array:
        """The global flat array of a state from this process's shards of it (``shards``: in the order of its
        local indices; a copy: only when the tier was written else)."""
        return self._global_flat(path, [np.asarray(s).reshape(-1) for s in shards], self._kind)

    def _global_flat(self, path: str, local: Sequence[np.ndarray], kind: str = "device") -> jax.Array:
        """The global flat array (shard ``i`` at ``i * numel``) whose addressable parts are this process's shards
        ``local`` (flat, in the order of its local indices): each device gets the shard it holds."""
        numel, lay = self._numel[path], self.layouts[path]
        by_index = dict(zip(self._local[path], local))

        def part(idx: tuple) -> np.ndarray:
            start = idx[0].start or 0
            return by_index[start // numel] if lay.dim is not None else by_index[0]

        return jax.make_array_from_callback((lay.num_shards * numel,), self._flat_sharding(path, kind), part)

    def adopt(self, paths: Sequence[str], states: Sequence[Sequence[jax.Array]]) -> None:
        """Makes the program's new states the tier's shards (no copy), and remembers them as the next step's inputs
        (a host or nvme tier: writes them back to it, each shard copied out of device memory, and keeps nothing on
        the devices; the step's commit waits for the writes)."""
        if not self._held:
            for path, row in zip(paths, states):
                pos = local_positions(self.layouts[path], self.mesh, row[0])
                n = len(self._names[path])
                self.tier.put_many([(f"{name}/{path}", i, np.asarray(arr.addressable_data(pos[i])))
                                    for name, arr in zip(self._names[path], row[:n]) for i in self._local[path]])
                if self._optax:
                    self._new_small[path] = list(row[n:])
            return
        items = []
        for path, row in zip(paths, states):
            pos = local_positions(self.layouts[path], self.mesh, row[0])  # flat shard i: the layout's shard i
            for name, arr in zip(self._names[path], row):
                objs = [arr.addressable_data(pos[i]) for i in self._local[path]]
                items += [(f"{name}/{path}", i, x) for i, x in zip(self._local[path], objs)]
                self._cache[f"{name}/{path}"] = (tuple(map(id, objs)), arr)
            if self._optax:
                self._new_small[path] = list(row[len(self._names[path]):])
        self.tier.put_arrays(items)
        self._adopted = self.tier.version

    # --- the step's arithmetic, traced inside the compiled program -------------------------
    def scalars(self) -> tuple[np.float32, ...]:
        """This step's learning rate and bias corrections, as the kernel computes them (program arguments; an
        optax transform: a placeholder learning rate, its schedule is in its state)."""
        if self._optax:
            return (np.float32(0),)
        sp, t = self.spec, self._count + 1
        return np.float32(self.rule.lr_at(self._count)), bias_correction(sp.b1, t), bias_correction(sp.b2, t)

    def update(self, paths: Sequence[str], grads: Sequence[jax.Array], states: Sequence[Sequence[jax.Array]],
               scalars: Sequence[jax.Array], value: jax.Array | None = None, value_fn: Any = None
               ) -> tuple[list[jax.Array], list[list[jax.Array]], jax.Array, jax.Array]:
        """One step inside the program: stored-form float32 gradients in; new stored-form float32 masters, new
        flat states, the global norm and whether it was finite out (not finite: everything as it was).
        ``value``: the step's loss (an optax transform's ``value=``); ``value_fn``: the loss as a function of
        ``{path: param}`` (a line search's, when :attr:`calls_loss`)."""
        moves = self.moves()
        if self._optax:
            return optax_update(self.rule, self.layouts, paths, grads, states,
                                {p: len(self._names[p]) for p in paths}, value, value_fn, moves,
                                {p: self.state_bytes(p) for p in paths})
        sp = self.spec
        lr, bc1, bc2 = scalars
        flat_g = [to_flat(self.layouts[p], g.astype(jnp.float32)) for p, g in zip(paths, grads)]
        norm = jnp.sqrt(sum((jnp.sum(g * g) for g in flat_g), jnp.float32(0)))
        finite = jnp.isfinite(norm)
        mult = jnp.float32(1)
        if sp.clip_norm is not None:
            mult = jnp.where(norm < sp.clip_norm, jnp.float32(1), jnp.float32(sp.clip_norm) / norm)
        mult = jnp.where(finite, mult, jnp.float32(0))
        f = np.float32
        masters, new_states = [], []
        for path, g, row in zip(paths, flat_g, states):
            lay = self.layouts[path]
            c = AdamCoefficients(grad_scale=mult, b1=f(sp.b1), one_minus_b1=f(1.0 - sp.b1), b2=f(sp.b2),
                                 one_minus_b2=f(1.0 - sp.b2), bias_correction1=bc1, bias_correction2=bc2,
                                 eps=f(sp.eps), eps_root=f(sp.eps_root),
                                 weight_decay=f(sp.decay_for(path, lay.shape)), neg_lr=-lr)
            master, m, v = moves.into(path, row, self.state_bytes(path))
            p2, m2, v2 = adam_math(master, m.astype(jnp.float32), v.astype(jnp.float32), g, c)
            row2 = [jnp.where(finite, p2, master), jnp.where(finite, m2.astype(m.dtype), m),
                    jnp.where(finite, v2.astype(v.dtype), v)]
            row2 = [jax.lax.with_sharding_constraint(x, self._flat_sharding(path)) for x in row2]
            new_states.append(moves.out(path, row2))
            masters.append(from_flat(lay, row2[0]))
        return masters, new_states, norm, finite

    def applied(self, norm: float, finite: bool, lr: float, seconds: float) -> None:
        """Records a step the program took (counters now; :meth:`step` reports it)."""
        on_device, self._new_small = self._new_small, {}
        if self._optax:  # the rule's small leaves as the program left them (kept if the step is applied)
            for path, new in jax.device_get(on_device).items():
                n = len(self.rule._scalars.get(path, []))
                self.rule._pending[path] = [np.asarray(x) for x in new[:n]]
                if path in self.rule._odd:
                    self.rule._pending_odd[path] = [np.asarray(x) for x in new[n:]]
        self._scaler = update_loss_scale(self._scaler, not finite, **self._ls)
        if finite:
            self._count += 1
        self._skipped += not finite
        self.rule.end_step(applied=finite)
        for path, arrays in (on_device.items() if finite else ()):  # the next step's inputs as they are
            self._small[path] = (tuple(map(id, small_leaves(self.rule, path))), arrays)
        self.last_stats = {"in_program": 1.0, "total_s": seconds}
        self._pending = {"grad_norm": float(norm), "skipped": not finite, "loss_scale": self.loss_scale,
                         "step": self._count, "lr": None if self._optax else float(lr)}

    def step(self, grad: Callable, write_param: Callable, on_written: Callable[[str], None] | None = None,
             write_params: Callable | None = None, value: float | None = None) -> dict:
        """The step the program applied (its metrics), or else a streamed step (see the base class)."""
        if self._pending is not None:
            out, self._pending = self._pending, None
            return out
        return super().step(grad, write_param, on_written=on_written, write_params=write_params, value=value)
