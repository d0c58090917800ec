"""A model whose shardings live only in its arrays' types (initialisers given ``out_sharding=P(...)``, no
Flax metadata; jax-ml/bonsai's LLaDA style) on an Explicit fsdp x tp mesh: the specs are read from the
abstract arrays of its constructor, composed with the ZeRO partition (ZeRO over fsdp, the model's tp kept),
and both engines train as plain jit + optax on the same mesh."""
from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import zinf_jax as zinf
from helpers.engine_utils import optax_run
from helpers.typed_models import TypedDecoder, typed_loss

TOKENS = [np.random.default_rng(i).integers(0, 64, (8, 17)).astype(np.int32) for i in range(4)]
EPS = 1e-4  # as in test_idioms.py


@pytest.fixture(scope="module")
def typed_reference():
    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"))
    with jax.set_mesh(mesh):  # eager sharding on: each array made split as its initialiser says
        model = TypedDecoder(nnx.Rngs(0))
        assert model.blocks[0].up.kernel[...].sharding.spec == P("fsdp", "tp")
        return optax_run(model, optax.adamw(3e-3, eps=EPS), TOKENS, loss_fn=typed_loss,
                         place=lambda x: x if isinstance(x, jax.Array) else jax.device_put(x, P("fsdp")))


@pytest.mark.parametrize("engine,tier", [("compiled", "cpu"), ("streamed", "nvme")])
def test_initialiser_shardings_compose_with_zero_in_both_engines(typed_reference, engine, tier, tmp_path):
    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"))
    off = zinf.Offload(tier, path=str(tmp_path) if tier == "nvme" else None)
    with jax.set_mesh(mesh):
        eng = zinf.initialize(lambda: TypedDecoder(nnx.Rngs(0)), loss_fn=typed_loss, mesh=mesh,
                              optimizer=zinf.adamw(3e-3, eps=EPS),
                              config=zinf.ZeroConfig(offload_param=off, offload_optimizer=off,
                                                     persistence_threshold=16, engine=engine))
        assert eng.mode == engine and eng.components.model_mesh.explicit == ("fsdp", "tp")
        up, down, table = (eng.layouts[p] for p in ("blocks/0/up/kernel", "blocks/0/down/kernel", "embed/table"))
        assert (up.spec, up.gathered_spec) == (P("fsdp"), P(None, "tp"))  # ZeRO on fsdp, the model's tp kept
        assert down.gathered_spec == P("tp", None) and table.gathered_spec == P(None, "tp")
        losses = [eng.train_step(t)["loss"] for t in TOKENS]
    ref_losses, ref = typed_reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    got = eng.param_arrays()
    for k, v in ref.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-5, err_msg=k)
    eng.close()
