"""bf16 Adam moments (ZeroConfig(moments_dtype="bfloat16")) against a reference of exactly those numerics:
optax's adamw (float32 arithmetic) whose moments are rounded to bfloat16 after every update."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zinf_jax as zinf
from helpers.engine_utils import optax_run
from zinf_jax.estimate import estimate_from_sizes
from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss

CFG = GPTConfig(vocab=256, d_model=32, n_heads=4, n_layers=2, seq=16)
LR, EPS, STEPS = 3e-3, 1e-4, 6  # EPS: see test_idioms (an element whose gradient is pure cancellation)
DATA = corpus()


def ctor():
    return GPT(CFG, rngs=nnx.Rngs(0))


def batches(n, start=0):
    return [batch_at(DATA, s, 8, CFG.seq) for s in range(start, start + n)]


def bf16_state(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` with every float32 state leaf rounded to bfloat16 (nearest even) after each update."""
    def rnd(st):
        return jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32) if x.dtype == jnp.float32 else x, st)

    def update(g, st, p=None):
        u, st = tx.update(g, st, p)
        return u, rnd(st)

    return optax.GradientTransformation(tx.init, update)


def config(tmp_path, tier="nvme", **kw):
    tmp_path.mkdir(parents=True, exist_ok=True)
    off = zinf.Offload(tier, path=str(tmp_path) if tier == "nvme" else None)
    return zinf.ZeroConfig(offload_param=off, offload_optimizer=off, persistence_threshold=600, **kw)


@pytest.mark.parametrize("kind,sgs", [("cpu", 50), ("nvme", 50), ("nvme", 1 << 20)])
def test_driver_with_bf16_states_equals_the_rounded_reference(kind, sgs, tmp_path):
    """The same gradients into the driver (several chunks per shard) and into optax with rounded state.

    Step 1 from zero moments is the same float32 arithmetic on both sides (``(1 - b1) * g``), so the
    stored moments must be exactly the reference's rounded to bfloat16, and the parameters its own.
    Later steps: the kernel and XLA may differ by one float32 ulp in a new moment (operation order),
    and where that lands on a bfloat16 rounding boundary the two round one bf16 ulp apart; those
    elements are counted (a handful of ~3,000) and every stored moment stays bfloat16-representable.
    """
    from test_optim_driver import SHAPES, _Writes, _grads, _init_params, _join, _make_tier, _masters, _optax, _split
    from zinf_jax.optim import StreamedAdam, adamw
    from zinf_jax.plan.partition import make_mesh, plan_partition
    layouts = plan_partition({p: jax.ShapeDtypeStruct(s, jnp.float32) for p, s in SHAPES.items()}, make_mesh(),
                             persistence_threshold=16)
    params, grads = _init_params(), [_grads(t) for t in range(10)]
    opt = StreamedAdam(adamw(1e-2, b1=0.9, b2=0.95, weight_decay=0.0, mask=None), _make_tier(kind, tmp_path), layouts,
                       local_indices=lambda p: list(range(layouts[p].num_shards)), sub_group_size=sgs,
                       buffer_count=3, state_dtype="bfloat16")
    opt.declare()
    for p, full in params.items():
        for i, shard in _split(layouts[p], full).items():
            opt.init_shard(p, i, shard)
    tx = optax.adam(1e-2, b1=0.9, b2=0.95)

    def step(g):
        shards = {p: _split(layouts[p], x) for p, x in g.items()}
        opt.step(lambda p, i: shards[p][i], _Writes())

    def stored(name):
        return {p: _join(lay, {i: opt.read_state(p, i, name) for i in range(lay.num_shards)})
                for p, lay in layouts.items()}

    step(grads[0])
    _, st = tx.update({p: jnp.asarray(g) for p, g in grads[0].items()}, tx.init({p: jnp.asarray(v) for p, v in params.items()}))
    for name, ref in (("m", st[0].mu), ("v", st[0].nu)):
        got = stored(name)
        for p in SHAPES:
            assert np.array_equal(got[p], np.asarray(ref[p]).astype(jnp.bfloat16).astype(np.float32)), (name, p)
    np.testing.assert_allclose(_masters(opt, layouts)["dense/kernel"], _optax(grads[:1], params, tx)["dense/kernel"],
                               rtol=1e-6, atol=0)
    for g in grads[1:]:
        step(g)
    got, want = _masters(opt, layouts), _optax(grads, params, bf16_state(tx))
    flips = sum(int(np.sum(~np.isclose(got[p], want[p], rtol=1e-6, atol=0))) for p in SHAPES)
    assert flips <= 0.002 * sum(x.size for x in want.values()), flips
    for name in ("m", "v"):
        for p, x in stored(name).items():
            assert np.array_equal(x, x.astype(jnp.bfloat16).astype(np.float32)), (name, p)
    fp32 = _optax(grads, params, tx)
    assert sum(int(np.sum(~np.isclose(fp32[p], want[p], rtol=1e-6, atol=0))) for p in SHAPES) > 10 * flips + 10


@pytest.fixture(scope="module")
def reference():
    return optax_run(ctor(), bf16_state(optax.adamw(LR, eps=EPS, weight_decay=0.0)), batches(STEPS))


@pytest.mark.parametrize("tier", ["nvme", "cpu"])
def test_bf16_moments_equal_the_rounded_reference(tmp_path, reference, tier):
    eng = zinf.initialize(ctor, config=config(tmp_path, tier, moments_dtype="bfloat16"), loss_fn=lm_loss,
                          optimizer=zinf.adamw(LR, eps=EPS, weight_decay=0.0, mask=None))
    path = next(p for p in eng.optimizer.layouts if eng.layouts[p].dim is not None)
    assert eng.opt_tier.spec(f"m/{path}").dtype == "bfloat16" and eng.opt_tier.spec(f"master/{path}").dtype == "float32"
    losses = [eng.train_step(b)["loss"] for b in batches(STEPS)]
    np.testing.assert_allclose(losses, reference[0], rtol=1e-5)
    got = eng.param_arrays()
    # End to end the gradients come from two programs that sum in another order (~1e-7 relative apart).
    # Where a new moment lies that close to a bfloat16 rounding boundary the two round it one bf16 ulp
    # apart (2^-8 relative). That changes the element's Adam update u = m_hat / (sqrt(v_hat) + eps) by
    # about 2^-8 |u| in that step (and less in the next ones: the difference decays by b1 and is rounded
    # again each step); for t <= 6, b1 = 0.9, b2 = 0.999, Cauchy-Schwarz on the two moment sums bounds
    # |u| by 1.02. The assertion allows one such ulp of the update per step, STEPS * LR * 2^-8 (~7e-5):
    # the scale of bf16 quantization, not a fit to a run (the largest difference seen is 1.3e-5). How
    # many flip: a moment is within 1e-7 relative of a boundary with probability ~1e-7 * 2^8 ~ 3e-5, times
    # 2 moments x 6 steps ~ 4e-4 of the elements (seen: ~12 of ~36,000); 0.2% allows 5x that. The
    # optimizer alone, fed identical gradients, is checked in the test above.
    flips, total = 0, sum(r.size for r in reference[1].values())
    for p, r in reference[1].items():
        np.testing.assert_allclose(got[p], r, rtol=0, atol=STEPS * LR * 2.0 ** -8, err_msg=p)
        flips += int(np.sum(~np.isclose(got[p], r, rtol=1e-5, atol=1e-5)))
    assert flips <= 0.002 * total, (flips, total)
    m = eng.optimizer.read_state(path, eng.optimizer._local[path][0], "m")  # widened exactly from bf16
    assert m.dtype == np.float32 and np.array_equal(m, m.astype(jnp.bfloat16).astype(np.float32))
    eng.close()
    # the rounding is real: fp32 moments give other parameters
    full = optax_run(ctor(), optax.adamw(LR, eps=EPS, weight_decay=0.0), batches(STEPS))[1]
    assert max(float(np.max(np.abs(full[p] - reference[1][p]))) for p in full) > 1e-6


def test_bf16_moments_take_two_thirds_of_the_disk_and_survive_a_checkpoint(tmp_path):
    opt = lambda: zinf.adamw(LR, eps=EPS, weight_decay=0.0, mask=None)  # noqa: E731
    fp32 = zinf.initialize(ctor, config=config(tmp_path / "f"), loss_fn=lm_loss, optimizer=opt())
    bf = zinf.initialize(ctor, config=config(tmp_path / "b", moments_dtype="bfloat16"), loss_fn=lm_loss,
                         optimizer=opt())
    for b in batches(2):
        fp32.train_step(b)
        bf.train_step(b)
    ratio = bf.opt_tier.stored_bytes() / fp32.opt_tier.stored_bytes()
    assert 0.6 < ratio < 0.72, ratio  # master 4 + m 2 + v 2 of 12 B/element (chunk padding aside)
    fp32.close()
    bf.save(tmp_path / "ckpt")
    going_on = [bf.train_step(b)["loss"] for b in batches(3, start=2)]
    bf.close()
    again = zinf.restore(tmp_path / "ckpt", ctor, config=config(tmp_path / "r", moments_dtype="bfloat16"),
                         loss_fn=lm_loss, optimizer=opt())
    assert [again.train_step(b)["loss"] for b in batches(3, start=2)] == going_on  # bitwise
    again.close()


def test_deepspeed_key_and_estimate():
    ds = zinf.ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True,
                                                                                    "bf16_optimizer_states": True}})
    assert ds.moments_dtype == "bfloat16"
    assert zinf.ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 3}}).moments_dtype == "float32"
    with pytest.raises(zinf.ConfigError, match="moments_dtype"):
        zinf.ZeroConfig(moments_dtype="float16")
    kw = dict(params=None, layers=24, hidden=2048, vocab=50257, seq=2048, batch=8, n_devices=8,
              configurations=[("nvme", "nvme")])
    full = estimate_from_sizes(**kw, config=zinf.ZeroConfig(compute_dtype="float32"))[0]
    half = estimate_from_sizes(**kw, config=zinf.ZeroConfig(compute_dtype="float32", moments_dtype="bfloat16"))[0]
    per_param = lambda e: e.nvme_bytes / e.params  # noqa: E731  (one process)
    assert per_param(half) <= 12.05 < 15.9 <= per_param(full) <= 16.1
