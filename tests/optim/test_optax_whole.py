"""Optax transforms that are not element-wise, in the streamed optimizer driver (no model: cheap).

The driver sees parameters split into the shards of :func:`zinf_jax.plan.partition.plan_partition` on the
8-device test mesh and cut into sub-groups (several chunks per shard, padded tails); the reference is the
same transform under ``jax.jit`` on the whole (unsharded) tree, given the same ``value=`` each step. A
transform that couples the elements of one tensor must take the whole-tensor path for exactly the
parameters it couples, and one that couples parameters must update the whole tree at once
(:mod:`zinf_jax.optim.optax_split`): the LARS case (element-wise on vectors, a trust ratio on matrices) is
never cut per chunk, the Prodigy case (a step size estimated over every parameter) never split per
parameter.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest

from zinf_jax.errors import ConfigError, ZinfError
from zinf_jax.optim import StreamedAdam
from zinf_jax.optim import optax_split
from zinf_jax.optim.optax_rule import OptaxRule
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
STEPS = 5


def matrices(t):
    return jax.tree.map(lambda x: x.ndim > 1, t)


def _trust_on_matrices() -> optax.GradientTransformation:
    """Element-wise on vectors (a plain scale), coupled on matrices (divided by the tensor's norm): the shape of
    LARS with a trust-ratio mask, in a few lines."""
    def update(g, state, params=None):
        return jax.tree.map(lambda x: -0.1 * (x / jnp.linalg.norm(x) if x.ndim > 1 else x), g), state
    return optax.GradientTransformation(lambda p: optax.EmptyState(), update)


# name -> (transform, which parameters take the whole-tensor path: "none", "matrices", "all" (each alone) or
# "tree" (all at once)). Hyperparameters large enough that every estimate moves within the run.
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
    "prodigy": (lambda: optax.contrib.prodigy(1.0, estim_lr0=1e-3), "tree"),
    "dadapt_adamw": (lambda: optax.contrib.dadapt_adamw(1.0, estim_lr0=1e-3), "tree"),
    "mechanize": (lambda: optax.contrib.mechanize(optax.adam(1e-2)), "tree"),
    "polyak_sgd": (lambda: optax.polyak_sgd(max_learning_rate=0.5), "tree"),
    "momo": (lambda: optax.contrib.momo(0.5), "tree"),
    "noisy_sgd": (lambda: optax.noisy_sgd(0.05, eta=0.5, key=jax.random.key(3)), "tree"),
    "mid_chain_clip": (lambda: optax.chain(optax.scale_by_adam(), optax.clip_by_global_norm(0.1),
                                           optax.scale(-1e-2)), "tree"),
    "schedule_free_adamw": (lambda: optax.contrib.schedule_free_adamw(0.05, warmup_steps=2), "none"),
    "reduce_on_plateau": (lambda: optax.chain(optax.sgd(0.05), optax.contrib.reduce_on_plateau(
        patience=1, cooldown=0, factor=0.5, accumulation_size=1)), "none"),
}
VALUES = (3.0, 2.5, 2.6, 2.7, 2.8)  # the losses given as value= (a plateau from the second step)


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

    extra = isinstance(tx, optax.GradientTransformationExtraArgs)

    @jax.jit
    def step(p, s, g, value):
        u, s = tx.update(g, s, p, **({"value": value} if extra else {}))
        return optax.apply_updates(p, u), jax.tree.map(rounded, s)

    for g, value in zip(grads, VALUES):
        p, state = step(p, state, nest_paths({k: jnp.asarray(v) for k, v in g.items()}), jnp.float32(value))
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
    base = {p: rng.standard_normal(s) for p, s in SHAPES.items()}  # a steady direction: step-size estimates
    # (Prodigy, D-Adaptation) grow within the run
    grads = [{p: (base[p] + 0.3 * rng.standard_normal(s)).astype(np.float32) for p, s in SHAPES.items()}
             for _ in range(STEPS)]
    return params, grads


def _driver(tier, layouts, tx, params, pack_below=0, sub_group_size=SMALL):
    opt = StreamedAdam(tx, tier, layouts, local_indices=lambda p: list(range(layouts[p].num_shards)),
                       sub_group_size=sub_group_size, pack_below=pack_below)
    opt.declare()
    for p, full in params.items():
        for i, shard in _split(layouts[p], full).items():
            opt.init_shard(p, i, shard)
    return opt


def _train(opt, layouts, grads):
    for g, value in zip(grads, VALUES):
        shards = {p: _split(layouts[p], x) for p, x in g.items()}
        opt.step(lambda p, i: shards[p][i], lambda p, i, arr: None, value=value)
    return {p: _join(lay, {i: opt.read_master(p, i) for i in range(lay.num_shards)}) for p, lay in layouts.items()}


def _want_whole(layouts, which):
    return {"none": set(), "all": set(layouts), "tree": set(layouts),
            "matrices": {p for p in layouts if len(SHAPES[p]) > 1}}[which]


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
        assert (opt.rule.tree is not None) == (which == "tree"), opt.rule.tree
        got = _train(opt, layouts, grads)
    finally:
        tier.close()
    for p, r in ref.items():
        np.testing.assert_allclose(got[p], r, rtol=1e-5, atol=1e-6, err_msg=p)


def _rule(tx, layouts):
    return OptaxRule(tx, layouts, {p: SMALL for p in layouts})


def test_coupled_on_matrices_is_never_cut_per_chunk(layouts):
    """The LARS case: a transform element-wise on vectors but coupled on matrices; the proof on each parameter's
    own shape sends every matrix (sharded on either dimension, flat) whole, and names the reduction."""
    for tx in (RULES["lars"][0](), _trust_on_matrices()):
        rule = _rule(tx, layouts)
        assert rule.tree is None
        for path in layouts:
            assert rule.whole(path) == (len(SHAPES[path]) > 1), path
            assert not rule.whole(path) or "across the elements" in rule.why[path], rule.why[path]


def _reads_the_tree(start: int) -> optax.GradientTransformation:
    """SGD whose step is scaled from ``start`` on by a statistic of the whole gradient tree kept in its state: until
    then the other leaves change nothing (a check that runs it for fewer steps sees an element-wise transform),
    as Prodigy's step-size estimate does not move in its first steps."""
    def init(params):
        return {"count": jnp.zeros((), jnp.int32), "total": jnp.zeros((), jnp.float32)}

    def update(g, state, params=None):
        total = state["total"] + sum(jnp.sum(jnp.abs(x)) for x in jax.tree.leaves(g))
        scale = jnp.where(state["count"] >= start, 1.0 / (1.0 + total), 1.0)
        return (jax.tree.map(lambda x: -0.1 * scale * x, g),
                {"count": state["count"] + 1, "total": total})
    return optax.GradientTransformation(init, update)


def test_a_transform_reading_another_leaf_is_never_split(tmp_path, layouts):
    """The Prodigy case, proven from the data flow rather than seen in a few steps: a transform whose update
    reads a statistic of every parameter's gradient (through its state, used only from step 3 on) updates the
    whole tree at once, and the numbers are optax's on the whole tree; the reason names the parameter it
    reads."""
    tx = _reads_the_tree(start=2)
    rule = _rule(tx, layouts)
    assert rule.tree is not None and "reads the gradient of" in rule.tree, rule.tree
    assert all(rule.whole(p) for p in layouts)
    params, grads = _data()
    ref = _reference(tx, params, grads)
    opt = _driver(CpuTier(memory="numpy"), layouts, tx, params)
    got = _train(opt, layouts, grads)
    for p, r in ref.items():
        np.testing.assert_allclose(got[p], r, rtol=1e-5, atol=1e-6, err_msg=p)
    # the same transform split per parameter would be off from step 3: the statistic of one leaf is not the tree's
    one = {p: np.float32(0) for p in params}
    for g in grads:
        for p in params:
            one[p] += np.abs(g[p]).sum()
    assert not np.allclose(one["dense/bias"], sum(one.values()))


def _flat_state() -> optax.GradientTransformation:
    """Momentum kept as one flat vector over every parameter (a state that is not one part per parameter)."""
    def init(params):
        return jnp.zeros(sum(x.size for x in jax.tree.leaves(params)), jnp.float32)

    def update(g, state, params=None):
        flat = jnp.concatenate([x.reshape(-1) for x in jax.tree.leaves(g)])
        return jax.tree.map(lambda x: -0.1 * x, g), 0.9 * state + flat
    return optax.GradientTransformation(init, update)


def test_refusals_are_config_errors_naming_the_transform_and_the_fix(layouts):
    """A state that is not one part per parameter and something that is not a transform: ConfigErrors (ZinfErrors)
    naming the transform as it was built, the reason and the fix. (A line search that calls the loss, lbfgs, is
    refused where the update is not in the step's program: tests/optim/test_optax_parity.py.)"""
    with pytest.raises(ConfigError) as e:
        _driver(CpuTier(memory="numpy"), layouts, _flat_state(), _data()[0])
    assert isinstance(e.value, ZinfError)
    msg = str(e.value)
    assert "'_flat_state'" in msg and "one part per parameter" in msg and "Fix:" in msg, msg
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
    transform object: the second build reuses the first's proof, with the same verdicts; another transform
    object, however alike, is proved on its own."""
    tx, params = _trust_on_matrices(), _data()[0]
    tiers = [CpuTier(memory="numpy") for _ in range(3)]
    try:
        first = _driver(tiers[0], layouts, tx, params).rule
        proved = len(optax_split._PROOFS)
        second = _driver(tiers[1], layouts, tx, params).rule
        assert len(optax_split._PROOFS) == proved and second.split is first.split
        assert {p for p in layouts if second.whole(p)} == _want_whole(layouts, "matrices")
        _driver(tiers[2], layouts, _trust_on_matrices(), params)
        assert len(optax_split._PROOFS) > proved
    finally:
        for t in tiers:
            t.close()


def test_the_estimates_move_within_the_run():
    """The parity runs above mean something only if what the transforms estimate changes within them: Prodigy's
    and D-Adaptation's step size, reduce_on_plateau's scale (optax on the whole tree, the same data)."""
    params, grads = _data()
    for name, field in (("prodigy", "estim_lr"), ("dadapt_adamw", "estim_lr"), ("reduce_on_plateau", "scale")):
        tx = RULES[name][0]()
        p = nest_paths({k: jnp.asarray(v) for k, v in params.items()})
        state = tx.init(p)
        start = float(optax.tree_utils.tree_get(state, field))
        for g, value in zip(grads, VALUES):
            u, state = tx.update(nest_paths({k: jnp.asarray(v) for k, v in g.items()}), state, p,
                                 value=jnp.float32(value))
            p = optax.apply_updates(p, u)
        assert float(optax.tree_utils.tree_get(state, field)) != start, name


class _RowsTier(CpuTier):
    """A cpu tier whose shards cannot be kept side by side (as where the masters are a scanned stack's rows)."""

    def share_run(self, items):
        return None


@pytest.mark.parametrize("tier", ["cpu", "cpu-rows", "nvme"])
def test_packs_of_small_shards_match_optax(tmp_path, layouts, tier):
    """Small whole shards (every shard of every parameter here, several of one parameter in a pack) updated in packs:
    one program per pack, as one array where the members lie side by side (the tier's runs in host RAM, a buffer
    set from nvme) and run the same element-wise program, else member by member in one program
    ([Note: optax packs]); optax's numbers on the whole tree, a masked weight decay (two programs in one pack)
    and an injected hyperparameter included."""
    txs = [lambda: optax.adamw(3e-2, weight_decay=0.1, mask=matrices),
           lambda: optax.inject_hyperparams(optax.lion)(learning_rate=1e-2)]
    for k, tx in enumerate(txs):
        params, grads = _data()
        ref = _reference(tx(), params, grads)
        (tmp_path / str(k)).mkdir()
        t = {"cpu": lambda: CpuTier(memory="numpy"), "cpu-rows": lambda: _RowsTier(memory="numpy"),
             "nvme": lambda: NvmeTier(tmp_path / str(k), process_index=0)}[tier]()
        opt = _driver(t, layouts, tx(), params, pack_below=1 << 16, sub_group_size=1 << 16)
        try:
            assert opt.packs >= 1 and sum(len(w.members) for w in opt._work if hasattr(w, "offsets")) > 8
            assert opt._in_place == (tier != "nvme")
            got = _train(opt, layouts, grads)
        finally:
            t.close()
        for p, r in ref.items():
            np.testing.assert_allclose(got[p], r, rtol=1e-5, atol=1e-6, err_msg=p)


def test_the_docs_table_is_the_proofs():
    """docs/guides/optimizers.md's table of transforms is generated from the proofs (zinf_jax.optim.optax_table):
    each kind lands where its data flow says."""
    from pathlib import Path

    from zinf_jax.optim.optax_table import rows

    got = {label: split for label, split, _, _ in rows()}
    assert got["contrib.prodigy"].startswith("whole tree") and got["noisy_sgd"].startswith("whole tree")
    assert got["lamb, novograd"].startswith("whole tensor on every parameter")
    assert got["lars (trust ratio on matrices)"].startswith("whole tensor on matrices")
    assert got["contrib.schedule_free_adamw"].startswith("chunk by chunk")
    assert "reads the loss" in got["chain(..., contrib.reduce_on_plateau)"]
    assert got["lbfgs"].startswith("whole tree") and "calls the loss" in got["lbfgs"]
    page = Path(__file__).resolve().parents[2] / "docs" / "guides" / "optimizers.md"
    assert "<!-- zinf:generate optax-table -->" in page.read_text()
