"""Experts that stay split over an expert axis: a top-k MoE LM (stacked experts declaring ``("expert", None,
None)``) on a (fsdp=2, expert=4) mesh of 8 CPU devices trains as plain jit + optax on the same mesh and
shardings (plain GSPMD) in both engines, cpu and nvme tiers, and through a checkpoint; the stacks are
stored split over both axes, gathered over fsdp only (the compiled program has no all-gather that makes
a stack whole), and device memory grows with E / 4, not with E. See [Note: experts stay sharded]."""
from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import zinf_jax as zinf
from helpers.engine_utils import optax_run
from helpers.moe_models import MoELM, moe_loss
from zinf_jax.xla import hlo

TOKENS = [np.random.default_rng(i).integers(0, 64, (8, 17)).astype(np.int32) for i in range(4)]
STACKS = ("blocks/0/w_in", "blocks/0/w_out", "blocks/1/w_in", "blocks/1/w_out")


def mesh():
    return jax.make_mesh((2, 4), ("fsdp", "expert"), axis_types=(AxisType.Auto,) * 2)


def config(engine, tiers, tmp_path=None):
    """``tiers``: ``"cpu"``, ``"nvme"``, or ``"<params>/<optimizer>"``."""
    params, _, opt = tiers.partition("/")
    off = [zinf.Offload(t, path=str(tmp_path) if t == "nvme" else None) for t in (params, opt or params)]
    return zinf.ZeroConfig(offload_param=off[0], offload_optimizer=off[1], persistence_threshold=16, engine=engine)


def build(engine, tiers, tmp_path=None, **model):
    return zinf.initialize(lambda: MoELM(nnx.Rngs(0), **model), loss_fn=moe_loss, mesh=mesh(),
                           optimizer=zinf.adamw(3e-3), config=config(engine, tiers, tmp_path))


@pytest.fixture(scope="module")
def reference():
    """Plain jit + optax, the stacks split over the expert axis as declared (and over fsdp, as zinf stores
    them), the batch over both axes."""
    m = mesh()

    def place(x):
        if not isinstance(x, jax.Array):
            return jax.device_put(x, NamedSharding(m, P(("fsdp", "expert"))))
        return jax.device_put(x, NamedSharding(m, P(("expert", "fsdp")) if x.ndim == 3 else P()))

    with jax.set_mesh(m):
        return optax_run(MoELM(nnx.Rngs(0)), optax.adamw(3e-3), TOKENS, loss_fn=moe_loss, place=place)


def assert_matches(reference, losses, got):
    ref_losses, ref = reference
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for k, v in ref.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-5, err_msg=k)


@pytest.mark.parametrize("engine,tiers", [("compiled", "cpu"), ("streamed", "nvme"), ("compiled", "cpu/nvme")])
def test_moe_trains_like_plain_gspmd(reference, engine, tiers, tmp_path):
    eng = build(engine, tiers, tmp_path)
    try:
        for p in STACKS:
            lay = eng.layouts[p]
            assert (lay.spec, lay.gathered_spec) == (P(("expert", "fsdp")), P("expert", None, None)), p
            assert lay.shard_shape[0] == 1  # one of the 8 experts per device
        assert eng.layouts["head/kernel"].gathered_spec == P()  # a plain parameter is gathered whole
        assert eng.components.model_mesh.batch_spec(2) == P(("fsdp", "expert"), None)  # tokens over both axes
        losses = [eng.train_step(t)["loss"] for t in TOKENS]
        assert_matches(reference, losses, eng.param_arrays())
    finally:
        eng.close()


def test_moe_restores_from_a_checkpoint_and_trains_on(reference, tmp_path):
    (tmp_path / "a").mkdir()
    eng = build("streamed", "nvme", tmp_path / "a")
    try:
        losses = [eng.train_step(t)["loss"] for t in TOKENS[:2]]
        eng.save(tmp_path / "ckpt")
    finally:
        eng.close()
    eng = zinf.restore(tmp_path / "ckpt", lambda: MoELM(nnx.Rngs(0)), loss_fn=moe_loss, mesh=mesh(),
                       optimizer=zinf.adamw(3e-3), config=config("compiled", "cpu"))
    try:
        losses += [eng.train_step(t)["loss"] for t in TOKENS[2:]]
        assert_matches(reference, losses, eng.param_arrays())
    finally:
        eng.close()


def test_no_all_gather_makes_a_stack_whole():
    eng = build("compiled", "cpu")
    try:
        shapes = hlo.gathered_shapes(hlo.parse(eng.lower(TOKENS[0]).compile().as_text()))
    finally:
        eng.close()
    whole = {(8, 32, 64), (8, 64, 32), (2, 8, 32, 64), (2, 8, 64, 32)}  # a stack, or the two layers' stacks
    assert not whole & set(shapes), sorted(set(shapes))
    assert {(2, 32, 64), (2, 64, 32)} <= set(shapes)  # gathered over fsdp: this expert group's 2 experts


def _memory(split: bool, experts: int) -> tuple[int, int]:
    """(compiled program's temp bytes per device, streamed engine's peak device bytes) after a step."""
    out = []
    for engine in ("compiled", "streamed"):
        eng = build(engine, "cpu", experts=experts, d=64, f=256, split=split)
        try:
            m = eng.train_step(TOKENS[0][:, :9])
            out.append(eng.lower(TOKENS[0][:, :9]).compile().memory_analysis().temp_size_in_bytes
                       if engine == "compiled" else m["peak_device_bytes"])
        finally:
            eng.close()
    return out[0], out[1]


def test_device_memory_grows_with_the_experts_per_device():
    """From E = 8 to E = 32 the device memory of split stacks grows by (E / 4) of the experts' bytes, under
    half what stacks gathered whole (the same model, no expert axis declared) add."""
    kept = [_memory(True, e) for e in (8, 32)]
    whole = [_memory(False, e) for e in (8, 32)]
    for i, what in enumerate(("compiled temp bytes", "streamed peak device bytes")):
        grew_kept, grew_whole = kept[1][i] - kept[0][i], whole[1][i] - whole[0][i]
        assert 0 < grew_kept < 0.5 * grew_whole, (what, kept, whole)


def test_estimator_names_stacks_gathered_whole_and_counts_split_ones():
    """Without an expert axis the estimator says what gathering every expert costs; with one it says nothing
    and counts a device's share of each stack (the unit's gathered bytes shrink)."""
    from zinf_jax.estimate import estimate_from_model, format_report

    def run(m):
        return estimate_from_model(lambda: MoELM(nnx.Rngs(0), d=64, f=256), mesh=m, loss_fn=moe_loss,
                                   example_batch=TOKENS[0], config=zinf.ZeroConfig(persistence_threshold=16))

    flat = run(jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,)))
    split = run(mesh())
    lines = flat[0].experts_whole
    assert len(lines) == 4 and "blocks/0/w_in (8, 64, 256): all 8 experts" in lines[0], lines
    assert "one expert 65,536 B" in lines[0] and "'expert'" in lines[0]  # 64 x 256 x 4 B
    assert "experts: blocks/0/w_in" in format_report(flat)
    assert split[0].experts_whole == ()
    assert split[0].device_bytes < flat[0].device_bytes


def test_a_stack_that_does_not_divide_is_gathered_whole_with_a_warning():
    """4 experts over the 8 shards of a (fsdp=2, expert=4) mesh cannot be split expert-major: the stack is an
    ordinary parameter, gathered whole, and the partition says so (and the estimator counts what it costs)."""
    import warnings

    from zinf_jax.plan.partition import experts_gathered_whole, plan_partition

    params = {"blocks/0/w_in": jax.ShapeDtypeStruct((4, 32, 64), np.float32)}  # 4 experts of 32 x 64
    hints = {"blocks/0/w_in": ("expert", None, None)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lays = plan_partition(params, mesh(), 16, hints)
    lay = lays["blocks/0/w_in"]
    assert lay.gathered_spec == P() and lay.spec != P(("expert", "fsdp"))
    assert any("does not divide by the 8 shards" in str(w.message) and "blocks/0/w_in" in str(w.message)
               for w in caught), [str(w.message) for w in caught]
    assert experts_gathered_whole(lays, hints) and "all 4 experts" in experts_gathered_whole(lays, hints)[0]
