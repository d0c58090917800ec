"""The user's mesh as the model's own code sees it: Explicit axes, tensor-parallel specs, the batch.

``jax.make_mesh`` gives Explicit axes by default, and public model code written for them shards its
own arrays: ``jax.sharding.reshard``, ``.at[...].get(out_sharding=...)``, ``nnx.Linear(...)(x,
out_sharding=...)``, parameters with ``out_sharding`` metadata (Flax eager sharding). Such code only
traces with that mesh set and its inputs typed with their shardings.

The engine's own programs (gathers, reduce-scatters, host offload, the fused optimizer) place
arrays by sharding constraints on an Auto view of the same devices
(:func:`~zinf_jax.plan.partition.auto_axes`). The two meet in *regions* (see [Note: model regions]):
the model's code — a unit's method, a glue segment between unit calls — is traced with the user's mesh
as the context mesh and, with Explicit axes, inside ``jax.sharding.explicit_axes`` with each input typed
as the model expects it; the engine's code runs around it on the Auto view, with no context mesh.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Sequence

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from zinf_jax.plan.partition import auto_axes, batch_spec, no_mesh

__all__ = ["ModelMesh"]

# [Note: model regions]
# A model written for Explicit axes needs, while it traces, the mesh set with those axes Explicit and
# every input typed with its sharding; the engine's programs need the Auto view (sharding constraints,
# memory kinds, optimization barriers: Explicit axes turn with_sharding_constraint into an assert).
# So the loss is traced once under the user's mesh with typed inputs (the glue parameters with their
# gathered specs, the model state replicated, the batch split over the batch axes); each unit call is
# recorded with its inputs' specs (engine.glue.Recorder), and a unit's outputs are typed by an
# abstract evaluation of the unit under the same mesh. At run time every piece of the model's code
# (a glue segment, a unit's method) is one region: jax.sharding.explicit_axes with the specs recorded
# for its inputs, with the Auto view as the context mesh inside the region only (explicit_axes needs one;
# the engine's own host work must not run under a mesh). A unit's parameters enter gathered to their ParamLayout.gathered spec (the model's own
# tensor-parallel spec without the zero axes); their gradients leave the region and are constrained
# back to the stored spec (a reduce-scatter over the zero axes).


@dataclasses.dataclass(frozen=True)
class ModelMesh:
    """The engine's mesh and how the model's own code sees it.

    Attributes:
      mesh: the mesh the engine runs on (Auto axes: the user's mesh's devices and names).
      explicit: the axes of the user's mesh of type Explicit (``jax.make_mesh``'s default); the
        model's code runs with them Explicit. Empty: the model's code runs as the engine's does.
      model_axes: the axes the model splits its gathered parameters over (tensor parallelism): the
        batch is replicated over them (:func:`~zinf_jax.plan.partition.model_axes_of`).
    """

    mesh: Mesh
    explicit: tuple[str, ...] = ()
    model_axes: tuple[str, ...] = ()

    @staticmethod
    def of(user_mesh: Mesh, model_axes: Sequence[str] = (), own_shardings: bool = False) -> ModelMesh:
        """The model's view of ``user_mesh``, the engine running on its Auto view.

        Args:
          user_mesh: the mesh the user gave (any axis types).
          model_axes: see :attr:`model_axes`.
          own_shardings: the model is written for sharding-in-types: its parameters carry their own
            shardings (Flax NNX ``out_sharding`` metadata, which Flax's eager sharding applies on an
            Explicit mesh). Only then does its code run with the mesh's Explicit axes, as it would under
            ``nnx.jit`` on that mesh; other models run on the Auto view, where code that never names a
            sharding needs none (on Explicit axes a lookup ``table[tokens]`` of a batch split over
            devices is ambiguous and refused).
        """
        types = getattr(user_mesh, "axis_types", None) or ()
        explicit = tuple(n for n, t in zip(user_mesh.axis_names, types) if t == AxisType.Explicit)
        return ModelMesh(auto_axes(user_mesh), explicit if own_shardings else (), tuple(model_axes))

    @property
    def user_mesh(self) -> Mesh:
        """The mesh the model's code traces under: the engine's, with the :attr:`explicit` axes Explicit."""
        types = tuple(AxisType.Explicit if n in self.explicit else AxisType.Auto for n in self.mesh.axis_names)
        return Mesh(self.mesh.devices, self.mesh.axis_names, axis_types=types)

    def batch_spec(self, ndim: int) -> P:
        """The sharding of a batch leaf with ``ndim`` dimensions (leading axis split over the batch axes)."""
        return batch_spec(self.mesh, ndim, self.model_axes) if ndim else P()

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The context of the engine's passes: no context mesh (one the caller set is cleared: the engine's
        programs place every array by explicit shardings, its host work uses single devices); the model's
        code gets its mesh back inside each region (:meth:`region`)."""
        with no_mesh():
            yield

    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        """The context in which the model's code is traced abstractly (the loss, the constructor): the user's
        mesh, its Explicit axes (if any) set; usable inside a trace as outside (an abstract mesh)."""
        with jax.sharding.use_abstract_mesh(self.code_mesh.abstract_mesh):
            yield

    @property
    def code_mesh(self) -> Mesh:
        """The mesh the model's own code sees: the user's, with its Explicit axes, when the code names shardings;
        else the engine's. Abstract while the code is traced (:meth:`tracing`), set (``jax.set_mesh``) while
        traced code is evaluated eagerly (the constructor's scalar chain of RNG keys and counts)."""
        return self.user_mesh if self.explicit else self.mesh

    def typed(self, x: Any, spec: P) -> Any:
        """An abstract value of ``x``'s shape and dtype, typed with ``spec`` when the model has Explicit axes."""
        if not self.explicit:
            return jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.typeof(x).dtype)
        return jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.typeof(x).dtype,
                                    sharding=NamedSharding(self.user_mesh, spec))

    def region(self, fn: Callable, in_specs: Any) -> Callable:
        """``fn`` as the model's code runs: traced with the user's mesh as the context mesh (so its constraints
        by bare ``PartitionSpec`` s apply: ``with_sharding_constraint``, Linen's ``nn.with_logical_constraint``)
        and, with Explicit axes, inside ``jax.sharding.explicit_axes`` with its inputs typed ``in_specs`` (a
        pytree of specs matching its arguments). See [Note: model regions]."""
        abstract = self.mesh.abstract_mesh

        def run(*args: Any) -> Any:
            with jax.sharding.use_abstract_mesh(abstract):
                if not self.explicit:
                    return fn(*args)
                return jax.sharding.explicit_axes(fn, axes=self.explicit, in_sharding=in_specs)(*args)

        return run


def spec_of(x: Any) -> P:
    """The sharding spec a value or an abstract value (an aval) was typed with (``P()`` without one)."""
    aval = x if isinstance(x, jax.core.ShapedArray) else jax.typeof(x)
    sharding = getattr(aval, "sharding", None)
    spec = getattr(sharding, "spec", None)
    return P() if spec is None else P(*spec)
