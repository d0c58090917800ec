"""Optax transforms that are not element-wise, in the streamed optimizer driver (no model: cheap).

The driver sees parameters split into the shards of :func:`zinf_jax.plan.partition.plan_partition` on the
8-device test mesh and cut into sub-groups (several chunks per shard, padded tails); the reference is the
same transform under ``jax.jit`` on the whole (unsharded) tree. A transform that couples the elements of
one tensor must take the whole-tensor path for exactly the parameters it couples
(:mod:`zinf_jax.optim.optax_probe`): the LARS case (element-wise on vectors, a trust ratio on matrices)
is never cut per chunk.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest

from zinf_jax.errors import ConfigError, ZinfError
from zinf_jax.optim import StreamedAdam
from zinf_jax.optim.optax_probe import Cut, classify
from zinf_jax.plan.partition import from_stored, make_mesh, plan_partition, to_stored
from zinf_jax.tiers import CpuTier, NvmeTier
from helpers.engine_utils import nest_paths, unnest_paths

SHAPES = {
    "dense/kernel": (64, 40),  # sharded on dim 0
    "dense/bias": (40,),  # sharded
    "embed/embedding": (37, 16),  # sharded on dim 1: a non-contiguous split
    "head/kernel": (15, 7),  # flat, padded
    "norm/scale": (12,),  # persistent (one whole shard)
}
SMALL = 50  # dense/kernel's 320-element shards in 7 chunks, the last one padded
STEPS = 4


def matrices(t):
    return jax.tree.map(lambda x: x.ndim > 1, t)


def _trust_on_matrices() -> optax.GradientTransformation:
    """Element-wise on vectors (a plain scale), coupled on matrices (divided by the tensor's norm): the shape of
    LARS with a trust-ratio mask, in a few lines."""
    def update(g, state, params=None):
        return jax.tree.map(lambda x: -0.1 * (x / jnp.linalg.norm(x) if x.ndim > 1 else x), g), state
    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


# name -> (transform, which parameters take the whole-tensor path: "none", "matrices" or "all")
RULES = {
    "sgd": (lambda: optax.sgd(0.05), "none"),  # stateless: one program text for every shape
    "lars": (lambda: optax.lars(0.1, trust_ratio_mask=matrices, weight_decay_mask=matrices), "matrices"),
    "trust_on_matrices": (_trust_on_matrices, "matrices"),
    "lamb": (lambda: optax.lamb(3e-3, eps=1e-4), "all"),
    "adafactor": (lambda: optax.adafactor(3e-2, min_dim_size_to_factor=8), "all"),
    "muon": (lambda: optax.contrib.muon(3e-3, eps=1e-4), "all"),
    "multi_transform": (lambda: optax.multi_transform(
        {"sgd": optax.sgd(0.05), "lamb": optax.lamb(3e-3, eps=1e-4)},
        lambda t: jax.tree.map(lambda x: "lamb" if x.ndim > 1 else "sgd", t)), "matrices"),
}


@pytest.fixture(scope="module")
def layouts():
    structs = {p: jax.ShapeDtypeStruct(s, jnp.float32) for p, s in SHAPES.items()}
    return plan_partition(structs, make_mesh(), persistence_threshold=16)


def _reference(tx, params, grads, state_dtype=None):
    """optax on the whole tree; with ``state_dtype``, its float states rounded to it after every update (as a
    tier storing them in that dtype holds them)."""
    p = nest_paths({k: jnp.asarray(v) for k, v in params.items()})
    state = tx.init(p)

    def rounded(x):
        if state_dtype is None or not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return x.astype(state_dtype).astype(x.dtype)

    @jax.jit
    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), jax.tree.map(rounded, s)

    for g in grads:
        p, state = step(p, state, nest_paths({k: jnp.asarray(v) for k, v in g.items()}))
    return {k: np.asarray(v) for k, v in unnest_paths(p).items()}


def _split(layout, full):
    stored = to_stored(layout, np.asarray(full, np.float32))
    if layout.dim is None:
        return {0: np.ascontiguousarray(stored)}
    return {i: np.ascontiguousarray(s) for i, s in enumerate(np.split(stored, layout.num_shards, axis=layout.dim))}


def _join(layout, shards):
    if layout.dim is None:
        return from_stored(layout, shards[0])
    return from_stored(layout, np.concatenate([shards[i] for i in range(layout.num_shards)], axis=layout.dim))


def _data():
    rng = np.random.default_rng(0)
    params = {p: (rng.uniform(0.5, 1.5, s) * rng.choice([-1.0, 1.0], s)).astype(np.float32) for p, s in SHAPES.items()}
    grads = [{p: rng.standard_normal(s).astype(np.float32) for p, s in SHAPES.items()} for _ in range(STEPS)]
    return params, grads


def _driver(tier, layouts, tx, params):
    opt = StreamedAdam(tx, tier, layouts, local_indices=lambda p: list(range(layouts[p].num_shards)),
                       sub_group_size=SMALL, pack_below=0)
    opt.declare()
    for p, full in params.items():
        for i, shard in _split(layouts[p], full).items():
            opt.init_shard(p, i, shard)
    return opt


def _train(opt, layouts, grads):
    for g in grads:
        shards = {p: _split(layouts[p], x) for p, x in g.items()}
        opt.step(lambda p, i: shards[p][i], lambda p, i, arr: None)
    return {p: _join(lay, {i: opt.read_master(p, i) for i in range(lay.num_shards)}) for p, lay in layouts.items()}


def _want_whole(layouts, which):
    return {"none": set(), "all": set(layouts), "matrices": {p for p in layouts if len(SHAPES[p]) > 1}}[which]


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in ("lamb", "muon") else n
                                  for n in sorted(RULES)])
def test_optax_transform_matches_optax_on_the_whole_tree(tmp_path, layouts, name):
    """Each transform, streamed through the driver (whole tensors where it couples them, chunks elsewhere), gives
    optax's numbers on the whole tree; the whole-tensor path is taken by exactly the coupled parameters."""
    tx, which = RULES[name]
    params, grads = _data()
    ref = _reference(tx(), params, grads)
    tier = NvmeTier(tmp_path, process_index=0) if name in ("adafactor", "lars") else CpuTier(memory="numpy")
    opt = _driver(tier, layouts, tx(), params)
    try:
        assert {p for p in layouts if opt.rule.whole(p)} == _want_whole(layouts, which)
        got = _train(opt, layouts, grads)
    finally:
        tier.close()
    for p, r in ref.items():
        np.testing.assert_allclose(got[p], r, rtol=1e-5, atol=1e-6, err_msg=p)


def test_coupled_on_matrices_is_never_cut_per_chunk(layouts):
    """The LARS case: a transform element-wise on vectors but coupled on matrices passes a vector probe; the
    proof on each parameter's own shape and cut sends every matrix (sharded on either dimension, flat) whole."""
    for tx in (RULES["lars"][0](), _trust_on_matrices()):
        for path, lay in layouts.items():
            keys = tuple(path.split("/"))
            verdict = classify(tx, keys, Cut.of(lay, SMALL), None)
            assert verdict.elementwise == (len(SHAPES[path]) == 1), (path, verdict)
            assert verdict.elementwise or "couples" in verdict.why or "changes" in verdict.why


def test_refusals_are_config_errors_naming_the_fix(layouts):
    """A global-norm clip in the middle of a chain couples parameters: a ConfigError (a ZinfError) naming the
    transform, the reason and the fix."""
    tx = optax.chain(optax.scale_by_adam(), optax.clip_by_global_norm(0.1), optax.scale(-1e-2))
    with pytest.raises(ConfigError) as e:
        _driver(CpuTier(memory="numpy"), layouts, tx, _data()[0])
    assert isinstance(e.value, ZinfError)
    msg = str(e.value)
    assert "optax transform" in msg and "depends on the others" in msg and "Fix:" in msg
    with pytest.raises(ConfigError, match="GradientTransformation"):
        _driver(CpuTier(memory="numpy"), layouts, object(), _data()[0])


def test_bf16_state_storage_on_the_whole_path(tmp_path, layouts):
    """States stored as bfloat16 (ZeroConfig.moments_dtype) on the whole-tensor path: read widened to float32,
    updated, stored rounded: optax's numbers with its float states rounded to bfloat16 after every update."""
    tx, _ = RULES["lars"]
    params, grads = _data()
    ref = _reference(tx(), params, grads, state_dtype=jnp.bfloat16)
    unrounded = _reference(tx(), params, grads)
    tier = NvmeTier(tmp_path, process_index=0)
    opt = StreamedAdam(tx(), tier, layouts, local_indices=lambda p: list(range(layouts[p].num_shards)),
                       sub_group_size=SMALL, pack_below=0, state_dtype="bfloat16")
    opt.declare()
    for p, full in params.items():
        for i, shard in _split(layouts[p], full).items():
            opt.init_shard(p, i, shard)
    try:
        assert opt.rule.whole("dense/kernel") and not opt.rule.whole("dense/bias")
        got = _train(opt, layouts, grads)
    finally:
        tier.close()
    for p, r in ref.items():
        np.testing.assert_allclose(got[p], r, rtol=1e-5, atol=1e-6, err_msg=p)
        assert not np.array_equal(got[p], params[p]), p
    # the rounding shows: float32 state would be told apart at this tolerance
    assert any(not np.allclose(got[p], unrounded[p], rtol=1e-5, atol=1e-6) for p in ref)


def test_a_transform_is_proved_once_for_every_rule_built_from_it(layouts):
    """``estimate_from_model`` and then ``initialize`` (or ``restore``) build a rule each from the user's one
    transform object: the second build reuses the first's proofs, with the same verdicts; another transform
    object, however alike, is proved on its own."""
    from zinf_jax.optim import optax_probe

    tx, params = _trust_on_matrices(), _data()[0]
    tiers = [CpuTier(memory="numpy") for _ in range(3)]
    try:
        first = _driver(tiers[0], layouts, tx, params).rule
        proved = len(optax_probe._VERDICTS)
        second = _driver(tiers[1], layouts, tx, params).rule
        assert len(optax_probe._VERDICTS) == proved
        assert [second.whole(p) for p in layouts] == [first.whole(p) for p in layouts]
        assert {p for p in layouts if second.whole(p)} == _want_whole(layouts, "matrices")
        _driver(tiers[2], layouts, _trust_on_matrices(), params)
        assert len(optax_probe._VERDICTS) > proved
    finally:
        for t in tiers:
            t.close()
