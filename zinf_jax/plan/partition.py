"""Device mesh and the ZeRO-3 partition rule.

Every parameter is split over the *zero axes* of the mesh (:func:`zero_axes_of`:
by default every axis but ``data`` and ``tensor``; with :func:`make_mesh`, the
``fsdp`` axis), and replicated over the others. The shard count is the product
of the zero axes' sizes:

* ``sharded``: along the largest dimension whose size divides by the shard count;
* ``flat``: no dimension divides, so the parameter is flattened and zero-padded
  to a multiple of the shard count (restored exactly by :func:`from_stored`);
* ``persistent``: at or under the persistence threshold (in elements), it stays
  whole on every device, like DeepSpeed's persistent parameters.

A model may shard its own parameters for tensor parallelism (Flax ``out_sharding`` metadata,
Linen ``nn.with_partitioning`` boxes): ZeRO composes with that spec. The stored shards are split over
the zero axes only; inside the model's code a gathered parameter has the model's own spec without the
zero axes (:attr:`ParamLayout.gathered`), e.g. ``P("fsdp", "tp")`` stored over ``fsdp``, gathered to
``P(None, "tp")``. A batch's leading dimension is split over every axis but the model's own
(``tensor``, ``tp``, and any other axis its parameters are split over besides the zero axes:
:func:`batch_axes_of`). The decision per parameter is plain data (:class:`ParamLayout`), printable as a
table with :func:`format_table`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import warnings
from typing import Any, Collection, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from zinf_jax.config import ConfigError
from zinf_jax.errors import EngineError

__all__ = [
    "owns_shard",
    "auto_axes",
    "no_mesh",
    "FSDP",
    "ParamLayout",
    "make_mesh",
    "zero_axes_of",
    "batch_axes_of",
    "batch_spec",
    "model_axes_of",
    "experts_gathered_whole",
    "EXPERT_AXES",
    "plan_partition",
    "to_stored",
    "from_stored",
    "shard_index_of",
    "local_shard_devices",
    "assemble",
    "assemble_many",
    "stacked_layout",
    "layer_layout",
    "split_local",
    "local_positions",
    "format_table",
]

FSDP = "fsdp"
"""Name of the mesh axis of :func:`make_mesh` that carries ZeRO-3 partitioning."""

REPLICA_AXES = ("data", "tensor", "tp")
"""Axes that replicate parameters (not zero axes by default): data parallelism, and the tensor-parallel
axes of :func:`make_mesh` (``tensor``) and of public model code (``tp``)."""

MODEL_AXES = ("tensor", "tp")
"""Axes that replicate the batch too (every other axis splits it, but those the model splits its
parameters over: see :func:`batch_axes_of`)."""

EXPERT_AXES = ("expert", "experts", "exp")
"""Names of expert-parallel mesh axes (as public MoE code names them). An expert axis among the zero axes
comes first in the shard order, and a parameter whose own spec splits a dimension over it (a stack of
experts) keeps that split when gathered: see [Note: experts stay sharded]."""


def make_mesh(
    fsdp: int | None = None,
    *,
    data: int = 1,
    tensor: int = 1,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """Builds a mesh with an ``fsdp`` axis and optional ``data``/``tensor`` axes.

    Args:
      fsdp: size of the ZeRO-3 axis; default: all devices not used by the others.
      data: size of a pure data-parallel axis (parameters replicated across it).
      tensor: size of a ``tensor`` axis (parameters replicated across it here).
      devices: devices to use (default: ``jax.devices()``, all processes).

    Returns:
      A mesh with Auto axis types, axes ordered ``data, fsdp, tensor`` (the
      ``data`` and ``tensor`` axes only when larger than one).

    Raises:
      ValueError: the sizes do not multiply to the device count.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if fsdp is None:
        if n % (data * tensor):
            raise ValueError(f"{n} devices do not divide into data={data} x tensor={tensor}")
        fsdp = n // (data * tensor)
    if data * fsdp * tensor != n:
        raise ValueError(
            f"mesh data={data} x fsdp={fsdp} x tensor={tensor} = {data * fsdp * tensor} "
            f"does not match the {n} devices; pass sizes whose product is {n}"
        )
    names, sizes = [], []
    for name, size in (("data", data), (FSDP, fsdp), ("tensor", tensor)):
        if size > 1 or name == FSDP:
            names.append(name)
            sizes.append(size)
    arr = np.asarray(devices, dtype=object).reshape(sizes)
    return Mesh(arr, tuple(names), axis_types=tuple(AxisType.Auto for _ in names))


def auto_axes(mesh: Mesh) -> Mesh:
    """``mesh`` with every axis of type ``Auto`` (the same devices, names and shape).

    ``jax.make_mesh`` gives Explicit axes by default, which type every array with its sharding; the
    engine's programs place parameters and batches by sharding constraints and let GSPMD
    propagate, as on Auto axes, so the engine runs on this view of the user's mesh.
    """
    types = getattr(mesh, "axis_types", None)
    if types is None or all(t == AxisType.Auto for t in types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=tuple(AxisType.Auto for _ in mesh.axis_names))


def no_mesh() -> Any:
    """A context with no current JAX mesh, for the engine's own programs.

    A user may have set a mesh with ``jax.set_mesh`` (Explicit axes, as ``jax.make_mesh`` gives); the
    engine's programs place their arrays by explicit shardings on its Auto view of that mesh
    (:func:`auto_axes`) and its host optimizer on single devices, so they must not trace under the
    user's mesh. Nothing on JAX versions without ``set_mesh``.
    """
    setter = getattr(jax, "set_mesh", None)
    return setter(None) if setter is not None else contextlib.nullcontext()


def zero_axes_of(mesh: Mesh, zero_axes: Sequence[str] | None = None) -> tuple[str, ...]:
    """The mesh axes ZeRO-3 shards parameters over, in the order given.

    Args:
      mesh: the mesh.
      zero_axes: axis names (``ZeroConfig.zero_axes``); ``None``: every axis
        not named ``data``, ``tensor`` or ``tp`` (every axis if there is no other).

    Returns:
      The axis names, expert axes (:data:`EXPERT_AXES`) first, the others in the order given; shard
      indices run over them in row-major order.

    Raises:
      ConfigError: a name is not an axis of the mesh, or is given twice.
    """
    names = tuple(mesh.axis_names)
    if zero_axes is None:
        axes = tuple(a for a in names if a not in REPLICA_AXES) or names
    else:
        axes = tuple(zero_axes)
        bad = [a for a in axes if a not in names]
        if bad or len(set(axes)) != len(axes):
            what = f"{', '.join(map(repr, bad))} not an axis of the mesh" if bad else "an axis named twice"
            detail = f"{what}; the mesh's axes are {names}, got {axes}"
            raise ConfigError(f"ZeroConfig.zero_axes: {detail}", field="zero_axes", detail=detail)
    return tuple(sorted(axes, key=lambda a: a not in EXPERT_AXES))  # See [Note: experts stay sharded]


def batch_axes_of(mesh: Mesh, model_axes: Collection[str] = ()) -> tuple[str, ...]:
    """The mesh axes a batch's leading dimension is split over, in mesh order.

    Every axis but ``tensor``, ``tp`` and ``model_axes`` (the axes the model splits its own
    parameters over besides the zero axes: :func:`model_axes_of`): tensor parallelism replicates
    the batch over its axes.
    """
    return tuple(a for a in mesh.axis_names if a not in MODEL_AXES and a not in model_axes)


def _axes_entry(axes: tuple[str, ...]) -> str | tuple[str, ...] | None:
    """A PartitionSpec entry for ``axes``: one name alone, several as a tuple, none as ``None``."""
    return axes[0] if len(axes) == 1 else (axes or None)


def batch_spec(mesh: Mesh, ndim: int = 1, model_axes: Collection[str] = ()) -> P:
    """PartitionSpec that splits a batch's leading dimension over :func:`batch_axes_of`."""
    return P(_axes_entry(batch_axes_of(mesh, model_axes)), *([None] * (ndim - 1)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParamLayout:
    """How one parameter is partitioned and stored.

    Attributes:
      path: ``/``-joined path of the parameter in the model's state.
      shape: the parameter's own shape.
      dtype: its dtype name.
      kind: ``"sharded"``, ``"flat"`` (padded and flattened) or ``"persistent"``.
      dim: the sharded dimension of the stored array (``None`` when persistent).
      num_shards: shard count (the product of the zero axes' sizes; 1 when persistent).
      axes: the mesh axes the sharded dimension is split over (:func:`zero_axes_of`).
      gathered: the PartitionSpec entries of the gathered parameter inside the model's code: the
        model's own spec without the zero axes (its tensor parallelism), but for the expert axes a stack
        of experts keeps (see [Note: experts stay sharded]); ``()``: replicated.
      gathered_split: how many pieces the gathered parameter is split into (the product of the sizes of
        the axes in ``gathered``): a device holds ``size / gathered_split`` of its elements.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    kind: str
    dim: int | None
    num_shards: int
    axes: tuple[str, ...] = (FSDP,)
    gathered: tuple[str | tuple[str, ...] | None, ...] = ()
    gathered_split: int = 1

    @property
    def size(self) -> int:
        """Number of elements of the parameter."""
        return math.prod(self.shape)

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """Shape of the stored array (padded 1-D for ``flat``)."""
        if self.kind == "flat":
            return (-(-self.size // self.num_shards) * self.num_shards,)
        return self.shape

    @property
    def shard_shape(self) -> tuple[int, ...]:
        """Shape of one shard of the stored array."""
        s = list(self.stored_shape)
        if self.dim is not None:
            s[self.dim] //= self.num_shards
        return tuple(s)

    @property
    def spec(self) -> P:
        """PartitionSpec of the stored array."""
        if self.dim is None:
            return P()
        return P(*([None] * self.dim), _axes_entry(self.axes))

    @property
    def gathered_spec(self) -> P:
        """PartitionSpec of the gathered parameter in the model's code (see :attr:`gathered`)."""
        return P(*self.gathered)

    def bytes_per_device(self, dtype: Any = None) -> int:
        """Bytes of one shard in ``dtype`` (default: the parameter's own)."""
        item = jnp.dtype(dtype or self.dtype).itemsize
        return math.prod(self.shard_shape) * item

    def gathered_bytes_per_device(self, dtype: Any = None) -> int:
        """Bytes of the gathered parameter on one device in ``dtype`` (default: the parameter's own)."""
        return self.size // self.gathered_split * jnp.dtype(dtype or self.dtype).itemsize


Hint = int | tuple[str | tuple[str, ...] | None, ...]
"""A layout hint: the dimension to shard first, or the mesh axes of each dimension (a PartitionSpec)."""


def _names(entry: Any) -> tuple[str, ...]:
    """The axis names of one PartitionSpec entry (``None``, a name, or a tuple of names)."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def _gathered(hint: Hint | None, mesh: Mesh, axes: tuple[str, ...], ndim: int) -> tuple:
    """The model's own spec (a hint naming mesh axes per dimension) without ``axes`` (the zero axes a gather
    spans) and the axes the mesh lacks; ``()`` when nothing is left (replicated)."""
    if hint is None or isinstance(hint, int) or len(hint) != ndim:
        return ()
    out = []
    for entry in hint:
        kept = tuple(a for a in _names(entry) if a in mesh.axis_names and a not in axes)
        out.append(kept[0] if len(kept) == 1 else (kept or None))
    return tuple(out) if any(e is not None for e in out) else ()


def _expert_dim(hint: Hint | None, shape: tuple[int, ...], axes: tuple[str, ...], mesh: Mesh,
                path: str) -> tuple[int, tuple[str, ...]] | None:
    """The dimension of a stack of experts and the expert axes it keeps (see [Note: experts stay sharded]):
    the dimension the model's own spec splits over the leading expert axes of ``axes``, when it divides by
    the shard count; ``None`` for any other parameter. A stack that does not divide is gathered whole, with a
    warning naming the sizes."""
    experts = tuple(a for a in axes if a in EXPERT_AXES)
    if not experts or hint is None or isinstance(hint, int) or len(hint) != len(shape):
        return None
    for d, entry in enumerate(hint):
        named = tuple(a for a in _names(entry) if a in experts)
        if not named:
            continue
        if named != axes[:len(named)]:
            return None
        n = math.prod(mesh.shape[a] for a in axes)
        if shape[d] % n:
            warnings.warn(
                f"zinf_jax: {path} {shape} splits dimension {d} over the expert axes {named}, but {shape[d]} does not "
                f"divide by the {n} shards of the zero axes {axes}: every device gathers all {shape[d]} experts per "
                f"call. Make dimension {d} a multiple of {n} to keep the experts split.", stacklevel=3)
            return None
        return d, named
    return None


def experts_gathered_whole(layouts: Mapping[str, ParamLayout], hints: Mapping[str, Hint] | None,
                           compute_dtype: Any = None) -> list[str]:
    """What gathering a stack of experts whole costs, one line per stack: a parameter whose own spec splits
    a dimension over an expert axis (:data:`EXPERT_AXES`) that its gathered spec does not keep (the mesh
    lacks the axis, the axis is not a zero axis, or the stack does not divide by the shard count)."""
    out = []
    for path, lay in layouts.items():
        hint = (hints or {}).get(path)
        if hint is None or isinstance(hint, int) or len(hint) != len(lay.shape):
            continue
        kept = {a for e in lay.gathered for a in _names(e)}
        dims = [d for d, e in enumerate(hint) if any(a in EXPERT_AXES and a not in kept for a in _names(e))]
        if not dims:
            continue
        n, whole = lay.shape[dims[0]], lay.gathered_bytes_per_device(compute_dtype)
        out.append(f"{path} {lay.shape}: all {n} experts gathered on every device per call ({whole:,} B per device; "
                   f"one expert {whole // n:,} B); a mesh axis named {_names(hint[dims[0]])[0]!r} among the zero axes, "
                   f"with dimension {dims[0]} a multiple of the shard count, keeps them split")
    return out


def model_axes_of(layouts: Iterable[ParamLayout], mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes the model splits its gathered parameters over besides the zero axes (its tensor
    parallelism), in mesh order, with ``tensor`` and ``tp`` when the mesh has them: the batch is replicated
    over these. (An expert axis is a zero axis: the batch is split over it.)"""
    layouts = list(layouts)
    zero = {a for lay in layouts for a in lay.axes}
    used = {a for lay in layouts for e in lay.gathered for a in _names(e) if a not in zero} | set(MODEL_AXES)
    return tuple(a for a in mesh.axis_names if a in used)


def _hint_dim(hint: Hint | None, axes: tuple[str, ...]) -> int | None:
    """The dimension a hint asks to shard first: itself, or the first one mapped to one of ``axes``."""
    if hint is None or isinstance(hint, int):
        return hint
    for i, ax in enumerate(hint):
        if any(a in axes for a in ((ax,) if isinstance(ax, str) else ax or ())):
            return i
    return None


def plan_partition(
    params: Mapping[str, Any],
    mesh: Mesh,
    persistence_threshold: int,
    hints: Mapping[str, Hint] | None = None,
    zero_axes: Sequence[str] | None = None,
    persistent: Collection[str] = (),
) -> dict[str, ParamLayout]:
    """Decides the layout of every parameter.

    Args:
      params: flat mapping of path to anything with ``.shape`` and ``.dtype``
        (arrays or ``jax.ShapeDtypeStruct``).
      mesh: the mesh.
      persistence_threshold: parameters with at most this many elements stay
        whole on every device.
      hints: path to the dimension to shard first, or to the mesh axes of each
        dimension (the model's own partitioning annotations: the first
        dimension mapped to a zero axis is sharded first, when it divides by the
        shard count; the axes that are not zero axes are the gathered
        parameter's spec, :attr:`ParamLayout.gathered`).
      zero_axes: the axes to shard over (see :func:`zero_axes_of`); the shard
        count is the product of their sizes.
      persistent: paths kept whole on every device whatever their size
        (``ZeroConfig.persistent_params``, see :func:`~zinf_jax.plan.units.persistent_paths`).

    Returns:
      Path to :class:`ParamLayout`, in the input's order.

    Raises:
      ConfigError: ``zero_axes`` names an axis the mesh does not have.
    """
    axes = zero_axes_of(mesh, zero_axes)
    n = math.prod(mesh.shape[a] for a in axes)
    out = {}
    for path, leaf in params.items():
        shape = tuple(int(d) for d in leaf.shape)
        dtype = jnp.dtype(leaf.dtype).name
        size = math.prod(shape)
        hint = (hints or {}).get(path)
        kept: tuple[str, ...] = ()
        if size <= persistence_threshold or path in persistent:
            kind, dim = "persistent", None
        elif (experts := _expert_dim(hint, shape, axes, mesh, path)) is not None:
            (dim, kept), kind = experts, "sharded"
        else:
            dims = sorted(range(len(shape)), key=lambda d: (-shape[d], d))
            first = _hint_dim(hint, axes)
            if first is not None and 0 <= first < len(shape):
                dims.insert(0, dims.pop(dims.index(first)))
            dim = next((d for d in dims if shape[d] % n == 0), None)
            kind = "sharded" if dim is not None else "flat"
            dim = 0 if dim is None else dim
        gathered = _gathered(hint, mesh, tuple(a for a in axes if a not in kept), len(shape))
        out[path] = ParamLayout(
            path=path, shape=shape, dtype=dtype, kind=kind, dim=dim, num_shards=1 if dim is None else n, axes=axes,
            gathered=gathered, gathered_split=math.prod(mesh.shape[a] for e in gathered for a in _names(e)),
        )
    return out


# [Note: experts stay sharded]
# A mixture-of-experts layer stacks its experts in one parameter, (E, D, F), and public MoE code splits
# the stack over an expert axis of the mesh (P("expert", None, None)), routing tokens to the devices
# that hold their experts. ZeRO gathering such a stack over every zero axis would put all E experts on
# every device for every call. An expert axis (EXPERT_AXES) among the zero axes therefore comes first in
# the shard order, and a stack whose own spec splits a dimension over it is stored split along that
# dimension over all zero axes, expert axes major: on a (fsdp=2, expert=4) mesh, block e*2+f of the 8
# lives on the device at (fsdp=f, expert=e). Gathering over the other zero axes alone (fsdp) then leaves
# the device at expert=e holding blocks 2e and 2e+1 — exactly its slice of P("expert", None, None), the
# spec the model's code expects (ParamLayout.gathered keeps the expert axes). The all-gather spans the
# fsdp groups only, the reduce-scatter of the gradient likewise, the tiers hold and move one device's
# experts, and the batch is split over the expert axis as over any zero axis. Every other parameter is
# split over the same shards in the same order (any order serves a parameter gathered whole), so shard
# index i is one device's block for every parameter, and a checkpoint reads back on any order.


def to_stored(layout: ParamLayout, value: Any) -> Any:
    """Turns a parameter into its stored form (pads and flattens ``flat`` ones)."""
    if layout.kind != "flat":
        return value
    xp = np if isinstance(value, np.ndarray) else jnp
    flat = xp.reshape(value, (-1,))
    return xp.pad(flat, (0, layout.stored_shape[0] - layout.size))


def from_stored(layout: ParamLayout, stored: Any) -> Any:
    """Inverse of :func:`to_stored`: drops the padding and restores the shape."""
    if layout.kind != "flat":
        return stored
    return stored[: layout.size].reshape(layout.shape)


def shard_index_of(mesh: Mesh, device: jax.Device, zero_axes: Sequence[str] | None = None) -> int:
    """The device's shard index: its row-major coordinate over the zero axes.

    Args:
      mesh: the mesh.
      device: a device of the mesh.
      zero_axes: as for :func:`zero_axes_of`.

    Raises:
      ValueError: the device is not in the mesh.
    """
    pos = np.argwhere(mesh.devices == device)
    if pos.size == 0:
        raise ValueError(f"{device} is not in the mesh")
    axes = zero_axes_of(mesh, zero_axes)
    coords = [int(pos[0][mesh.axis_names.index(a)]) for a in axes]
    return int(np.ravel_multi_index(coords, [mesh.shape[a] for a in axes])) if axes else 0


def owns_shard(mesh: Mesh, layout: ParamLayout, index: int, zero_axes: Sequence[str] | None = None) -> bool:
    """Whether this process writes shard ``index`` of a parameter (once per job, wherever it is replicated).

    A sharded parameter's shard is written by the lowest process holding a device of that shard
    index; a persistent one (``layout.dim is None``, whole on every device) by process 0.
    """
    if layout.dim is None:
        return jax.process_index() == 0
    return _writers(mesh, zero_axes_of(mesh, zero_axes))[index] == jax.process_index()


@functools.lru_cache(maxsize=64)
def _writers(mesh: Mesh, axes: tuple[str, ...]) -> dict[int, int]:
    """Shard index to the lowest process holding a device of it (asked per shard per step: worked out once)."""
    out: dict[int, int] = {}
    for d in mesh.devices.flat:
        i = shard_index_of(mesh, d, axes)
        out[i] = min(out.get(i, d.process_index), d.process_index)
    return out


def local_shard_devices(mesh: Mesh, zero_axes: Sequence[str] | None = None) -> dict[int, list[jax.Device]]:
    """Shard index to this process's devices that hold that shard (its replicas, in mesh order).

    Args:
      mesh: the mesh.
      zero_axes: as for :func:`zero_axes_of`.
    """
    axes = zero_axes_of(mesh, zero_axes)
    out: dict[int, list[jax.Device]] = {}
    for d in mesh.devices.flat:
        if d.process_index == jax.process_index():
            out.setdefault(shard_index_of(mesh, d, axes), []).append(d)
    return dict(sorted(out.items()))


def assemble(layout: ParamLayout, mesh: Mesh, shards: Mapping[int, Any], dtype: Any = None) -> jax.Array:
    """Builds the global sharded array of a stored parameter from local shards.

    Args:
      layout: the parameter's layout.
      mesh: the mesh.
      shards: shard index to a host array or jax.Array, for every local index
        (index 0 alone for persistent parameters).
      dtype: cast to this dtype on the way (default: keep).

    Returns:
      A jax.Array with ``NamedSharding(mesh, layout.spec)`` in device memory.
    """
    return assemble_many([layout], mesh, [shards], dtype)[0]


def stacked_layout(layout: ParamLayout, n: int) -> ParamLayout:
    """The layout of ``n`` stored arrays of ``layout`` stacked along a new first axis (sharded as each one is)."""
    return dataclasses.replace(layout, shape=(n, *layout.stored_shape),
                               kind="persistent" if layout.dim is None else "sharded",
                               dim=None if layout.dim is None else layout.dim + 1)


def layer_layout(layout: ParamLayout, n: int) -> ParamLayout:
    """The layout of one of the ``n`` layers of a stacked parameter (a leading layer axis): ``layout`` without
    that axis, split as the stack is (see [Note: layers of a stack] in :mod:`zinf_jax.engine.streamed`).

    Raises:
      EngineError: the stack is split along its layer axis (or flattened to be split), so a layer is not
        spread over the devices; the message says how to keep it whole.
    """
    gathered = tuple(layout.gathered[1:]) if layout.gathered else ()
    gathered = gathered if any(e is not None for e in gathered) else ()
    if layout.kind == "persistent":
        return dataclasses.replace(layout, shape=layout.shape[1:], gathered=gathered)
    if layout.kind == "sharded" and layout.dim >= 1:
        return dataclasses.replace(layout, shape=layout.shape[1:], dim=layout.dim - 1, gathered=gathered)
    how = "split along its layers" if layout.kind == "sharded" else "flattened to be split"
    raise EngineError(
        f"zinf_jax: {layout.path} {layout.shape} is a stack of {n} layers applied one layer per iteration of the "
        f"model's scan, but it is {how} ({layout.num_shards} shards): no other axis divides by "
        f"{layout.num_shards}. Keep it whole on every device (ZeroConfig(persistent_params=({layout.path!r},)) or "
        f"a persistence_threshold of at least {math.prod(layout.shape)}), or make the module holding the scan the "
        "unit (UnitPolicy(patterns=(...,)))")


def assemble_many(layouts: Sequence[ParamLayout], mesh: Mesh, shards: Sequence[Mapping[int, Any]],
                  dtype: Any = None, memory_kind: str | None = None) -> list[jax.Array]:
    """:func:`assemble` of several parameters with one batched host-to-device copy (a unit's fetch).

    ``memory_kind``: the memory the arrays go to (default: each device's default memory). Shards that
    already are arrays there (the device tier's; the cpu tier's with ``"pinned_host"``) are used as
    they are: no copy, and none of ``device_put``'s per-array cost; a persistent parameter (one
    process) is put to every device in one call.
    """
    one_process = jax.process_count() == 1
    whole: dict[int, jax.Array] = {}  # persistent parameters: one put to every device (one process)
    w_srcs, w_targets, w_slots = [], [], []
    placed: list[Any] = []
    srcs, targets, slots = [], [], []
    for k, (lay, sh) in enumerate(zip(layouts, shards)):
        if lay.dim is None and one_process:
            src = sh[0] if dtype is None or sh[0].dtype == dtype else sh[0].astype(dtype)
            if _in_cpu_device_memory(src):  # See [Note: broadcast from host memory]
                src = np.asarray(src)
            w_slots.append(k)
            w_srcs.append(src)
            w_targets.append(NamedSharding(mesh, lay.spec, memory_kind=memory_kind))
            continue
        for idx, dev in _placements(mesh, lay.axes, lay.dim is None):
            src = sh[idx]
            if dtype is not None and src.dtype != dtype:
                src = src.astype(dtype)
            kind = memory_kind or dev.default_memory().kind
            if isinstance(src, jax.Array) and src.sharding.memory_kind == kind and src.devices() == {dev}:
                placed.append(src)
                continue
            slots.append(len(placed))
            placed.append(None)
            srcs.append(src)
            targets.append(jax.sharding.SingleDeviceSharding(dev, memory_kind=kind))
    for k, arr in zip(slots, jax.device_put(srcs, targets) if srcs else []):
        placed[k] = arr
    whole.update(zip(w_slots, jax.device_put(w_srcs, w_targets) if w_srcs else []))
    it = iter(placed)
    out = []
    for k, lay in enumerate(layouts):
        if k in whole:
            out.append(whole[k])
            continue
        n = len(_placements(mesh, lay.axes, lay.dim is None))
        out.append(jax.make_array_from_single_device_arrays(
            lay.stored_shape, NamedSharding(mesh, lay.spec, memory_kind=memory_kind),
            [next(it) for _ in range(n)]))
    return out


# [Note: broadcast from host memory]
# A persistent parameter is put to every device from its one stored shard. Where a device's memory is
# host memory (the CPU backend), a device array reads as numpy without a copy, and a put of that
# (XLA-aligned) host buffer to the CPU devices lets all of them alias it: one buffer for the 8 devices
# of a CPU mesh instead of 7 copies made device to device (measured: 0.8 vs 4.5 ms for the d=128
# GPT's 22 persistent stacks). Immutable arrays make the sharing safe; on an accelerator the put
# stays device to device.


def _in_cpu_device_memory(x: Any) -> bool:
    """``x`` is a jax.Array in a CPU device's own (default) memory."""
    if not isinstance(x, jax.Array) or x.sharding.memory_kind not in (None, "device"):
        return False
    return all(d.platform == "cpu" for d in x.devices())


@functools.lru_cache(maxsize=64)
def _placements(mesh: Mesh, axes: tuple[str, ...], persistent: bool) -> tuple[tuple[int, jax.Device], ...]:
    """(shard index, device) of every addressable device, in the order sharded arrays list them."""
    pairs = [(0 if persistent else idx, d) for idx, devs in local_shard_devices(mesh, axes).items() for d in devs]
    order = {d: i for i, d in enumerate(mesh.devices.flat)}
    return tuple(sorted(pairs, key=lambda p: order[p[1]]))


def split_local(layout: ParamLayout, mesh: Mesh, array: jax.Array) -> dict[int, jax.Array]:
    """The inverse of :func:`assemble`: one single-device array per local shard index.

    Takes each shard as ``array.addressable_data(k)`` at the positions :func:`local_positions` keeps
    per sharding: building ``array.addressable_shards`` (a ``Shard`` object per device) cost ~3 ms a
    unit on the streamed backward's path, every unit of every step.
    """
    return {idx: array.addressable_data(k) for idx, k in local_positions(layout, mesh, array).items()}


def local_positions(layout: ParamLayout, mesh: Mesh, array: jax.Array) -> dict[int, int]:
    """For each local shard index, the position ``k`` of one device holding it in ``array.addressable_data(k)``.

    The same for every array of one sharding, so it is worked out once per sharding (kept here);
    a caller that splits many arrays then takes each shard as ``array.addressable_data(k)`` (no
    ``Shard`` object per device, as ``array.addressable_shards`` builds), as :func:`split_local` does.
    """
    key = (mesh, layout.axes, layout.dim is None, array.sharding)
    hit = _POSITIONS.get(key)
    if hit is None:
        index = _index_of_device(mesh, layout.axes)
        out: dict[int, int] = {}
        for k, s in enumerate(array.addressable_shards):
            out.setdefault(0 if layout.dim is None else index[s.device], k)
        hit = _POSITIONS[key] = dict(sorted(out.items()))
    return hit


_POSITIONS: dict[tuple, dict[int, int]] = {}  # see local_positions


@functools.lru_cache(maxsize=64)
def _index_of_device(mesh: Mesh, axes: tuple[str, ...]) -> dict[jax.Device, int]:
    return {d: idx for idx, devs in local_shard_devices(mesh, axes).items() for d in devs}


def format_table(layouts: Iterable[ParamLayout], dtype: Any = None) -> str:
    """A readable table: path, shape, kind, spec (and the gathered spec, where the model has its own), bytes per device."""
    layouts = list(layouts)
    tp = any(lay.gathered for lay in layouts)
    head = ("path", "shape", "kind", "spec", *(("gathered",) if tp else ()), "bytes/device")
    rows = [head]
    total = 0
    for lay in layouts:
        b = lay.bytes_per_device(dtype)
        total += b
        extra = (str(tuple(lay.gathered)) if lay.gathered else "replicated",) if tp else ()
        rows.append((lay.path, str(lay.shape), lay.kind, str(tuple(lay.spec)), *extra, f"{b:,}"))
    rows.append(("total", *([""] * (len(head) - 2)), f"{total:,}"))
    last = len(head) - 1
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i < last else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.insert(len(lines) - 1, "-" * len(lines[0]))
    return "\n".join(lines)
