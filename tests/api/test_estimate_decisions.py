"""The estimator and the engine decide each configuration once, in the same place: every configuration the
estimator reports is one :func:`zinf_jax.initialize` accepts, with the same engine and the same place for the
optimizer's update, and every one it marks refused is refused by ``initialize`` with the same message."""
import itertools

import pytest
from flax import nnx
import jax

import zinf_jax as zinf
from helpers.small_models import TinyLM, TinyLMConfig, lm_loss
from zinf_jax.estimate import estimate_from_model
from zinf_jax.optim.fused import FusedAdam

CFG = TinyLMConfig(n_layers=2, d_model=16, vocab=32, seq=8)
TIERS = ("none", "cpu", "nvme")


def ctor():
    return TinyLM(CFG, rngs=nnx.Rngs(0))


def _config(tmp_path, pt, ot, update, accumulation, engine, dtype):
    off = lambda d: zinf.Offload(d, path=str(tmp_path)) if d == "nvme" else zinf.Offload(d)  # noqa: E731
    return zinf.ZeroConfig(offload_param=off(pt), offload_optimizer=off(ot), optimizer_update=update,
                           gradient_accumulation_steps=accumulation, engine=engine, compute_dtype=dtype,
                           persistence_threshold=64)


def _grid(full: bool):
    cases = itertools.product(TIERS, TIERS, ("host", "device"), (1, 2), ("auto", "streamed"),
                              ("float32", "float16"))
    for pt, ot, update, k, engine, dtype in cases:
        if full or (engine == "auto" and dtype == "float32") or (pt == "none" and ot == "cpu"):
            yield pt, ot, update, k, engine, dtype


def _check(tmp_path, pt, ot, update, k, engine, dtype):
    try:
        cfg = _config(tmp_path, pt, ot, update, k, engine, dtype)
    except zinf.ConfigError:
        return "config"  # refused before either is asked
    (est,) = estimate_from_model(ctor, config=cfg, configurations=[(pt, ot)], loss_fn=lm_loss,
                                 example_batch=jax.ShapeDtypeStruct((8, CFG.seq), "int32"))
    try:
        eng = zinf.initialize(ctor, config=cfg, loss_fn=lm_loss, optimizer=zinf.adamw(1e-3))
    except zinf.ConfigError as e:
        assert est.refusal == str(e), (pt, ot, update, k, engine, dtype)
        return "refused"
    try:
        assert est.refusal is None, (pt, ot, update, k, engine, dtype, est.refusal)
        assert est.engine == eng.mode
        assert est.optimizer_in_program == isinstance(eng.optimizer, FusedAdam), (pt, ot, update, k, engine, dtype)
    finally:
        eng.close()
    return "accepted"


def test_the_estimator_reports_what_initialize_accepts_and_refuses_what_it_refuses(tmp_path):
    """Tiers x optimizer_update x accumulation (the float32 default engine, and every setting with params in device
    memory and the optimizer on cpu): both kinds of outcome occur, and they agree."""
    seen = {_check(tmp_path / str(i), *case) for i, case in enumerate(_grid(full=False))
            if (tmp_path / str(i)).mkdir() is None}
    assert {"accepted", "refused"} <= seen


@pytest.mark.slow
def test_the_estimator_agrees_with_initialize_on_the_whole_grid(tmp_path):
    """The same over tiers x optimizer_update x accumulation x engine x compute dtype."""
    seen = {_check(tmp_path / str(i), *case) for i, case in enumerate(_grid(full=True))
            if (tmp_path / str(i)).mkdir() is None}
    assert {"accepted", "refused"} <= seen


@pytest.mark.parametrize("pt, ot", [("none", "none"), ("cpu", "cpu")])
def test_a_line_search_is_refused_by_the_estimator_where_initialize_refuses_it(tmp_path, pt, ot):
    """optax.lbfgs calls the loss (value_fn): only the step's program runs it; the estimator's refusal is the
    engine's own message (both ask zinf_jax.optim.fused.update_in_program)."""
    import optax

    cfg = _config(tmp_path, pt, ot, "host", 1, "auto", "float32")
    tx = optax.lbfgs()
    (est,) = estimate_from_model(ctor, config=cfg, configurations=[(pt, ot)], loss_fn=lm_loss, optimizer=tx,
                                 example_batch=jax.ShapeDtypeStruct((8, CFG.seq), "int32"))
    if pt == "none":
        assert est.refusal is None and est.optimizer_in_program
        zinf.initialize(ctor, config=cfg, loss_fn=lm_loss, optimizer=tx).close()
        return
    with pytest.raises(zinf.ConfigError) as e:
        zinf.initialize(ctor, config=cfg, loss_fn=lm_loss, optimizer=tx)
    assert est.refusal == str(e.value) and "value_fn" in est.refusal
