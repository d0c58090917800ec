"""The streaming optimizer driver against optax, on the cpu and nvme tiers.

The reference is always ``optax`` on the full (unsharded) arrays:
``optax.chain(optax.clip_by_global_norm(c), optax.adamw(schedule, mask=...))``.
The driver sees the same parameters split into the shards of
:func:`zinf_jax.plan.partition.plan_partition` on the 8-device test mesh, and the
shards cut into sub-groups (several chunks per shard, a padded last chunk, when
``sub_group_size`` is small).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from zinf_jax.config import LossScaleConfig
from zinf_jax.optim import StreamedAdam, adamw, default_decay_mask, init_loss_scale, update_loss_scale
from zinf_jax.optim.subgroups import PACK_BELOW, sub_groups
from zinf_jax.plan.partition import from_stored, make_mesh, plan_partition, to_stored
from zinf_jax.tiers import CpuTier, NvmeTier
from helpers.engine_utils import nest_paths, unnest_paths

SHAPES = {
    "dense/kernel": (64, 40),  # sharded on dim 0: shards (8, 40), 320 elements
    "dense/bias": (40,),  # sharded: (5,)
    "embed/embedding": (37, 16),  # sharded on dim 1: (37, 2), non-contiguous split
    "head/kernel": (15, 7),  # no dimension divides by 8: flat, padded to 112
    "norm/scale": (12,),  # persistent (one whole shard)
    "temperature": (),  # persistent scalar
}
STEPS = 20
RTOL = 1e-6
CLIP = 1.0
WD = 0.1
SMALL, LARGE = 50, 1 << 20  # 320 -> 7 chunks of 46 (last one padded), 74 -> 2 of 37


def _sched():
    return optax.warmup_cosine_decay_schedule(init_value=0.0, peak_value=1e-2, warmup_steps=5,
                                              decay_steps=STEPS, end_value=1e-3)


def _spec():
    return adamw(_sched(), b1=0.9, b2=0.95, eps=1e-8, weight_decay=WD, clip_norm=CLIP)


def _ref_tx():
    mask = {p: default_decay_mask(p, s) for p, s in SHAPES.items()}
    return optax.chain(optax.clip_by_global_norm(CLIP),
                       optax.adamw(_sched(), b1=0.9, b2=0.95, eps=1e-8, weight_decay=WD, mask=mask))


@pytest.fixture(scope="module")
def layouts():
    structs = {p: jax.ShapeDtypeStruct(s, jnp.float32) for p, s in SHAPES.items()}
    lay = plan_partition(structs, make_mesh(), persistence_threshold=16)
    assert {l.kind for l in lay.values()} == {"sharded", "flat", "persistent"}
    return lay


def _init_params(seed=0):
    rng = np.random.default_rng(seed)
    out = {}
    for p, s in SHAPES.items():  # magnitudes in [0.5, 1.5]: rtol is meaningful
        mag = rng.uniform(0.5, 1.5, size=s).astype(np.float32)
        out[p] = np.where(rng.random(s) < 0.5, -mag, mag).astype(np.float32)
    return out


def _grads(t, seed=1):
    rng = np.random.default_rng(seed * 1000 + t)
    scale = 0.01 if t % 2 else 1.0  # alternately below and above the clipping norm
    return {p: (rng.standard_normal(s) * scale).astype(np.float32) for p, s in SHAPES.items()}


def _split(layout, full):
    stored = to_stored(layout, np.asarray(full, np.float32))
    if layout.dim is None:
        return {0: np.ascontiguousarray(stored)}
    return {i: np.ascontiguousarray(a) for i, a in enumerate(np.split(stored, layout.num_shards, axis=layout.dim))}


def _join(layout, shards):
    if layout.dim is None:
        return from_stored(layout, shards[0])
    return from_stored(layout, np.concatenate([shards[i] for i in range(layout.num_shards)], axis=layout.dim))


def _optax(grads_seq, params, tx=None):
    tx = tx or _ref_tx()
    p = {k: jnp.asarray(v) for k, v in params.items()}
    state = tx.init(p)

    @jax.jit
    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    for g in grads_seq:
        p, state = step(p, state, {k: jnp.asarray(v) for k, v in g.items()})
    return {k: np.asarray(v) for k, v in p.items()}


def _make_tier(kind, path):
    if kind == "nvme-direct":  # every shard on the direct route: zero moments allocated, not written
        return NvmeTier(path, process_index=0, direct_min_bytes=0, pack_below_bytes=0)
    return CpuTier(memory="numpy") if kind == "cpu" else NvmeTier(path, process_index=0)


def _driver(tier, layouts, sgs, params=None, spec=None, **kw):
    """A driver over ``layouts`` with ``params`` written; one sub-group per chunk unless ``pack_below`` is given
    (these shards are all small: packed, the pipeline of sub-groups these tests check would be one pack)."""
    kw.setdefault("pack_below", 0)
    opt = StreamedAdam(_spec() if spec is None else spec, tier, layouts,
                       local_indices=lambda p: list(range(layouts[p].num_shards)), sub_group_size=sgs, **kw)
    opt.declare()
    if params is not None:
        for p, full in params.items():
            for i, shard in _split(layouts[p], full).items():
                opt.init_shard(p, i, shard)
    return opt


class _Writes(dict):
    """Records write_param calls (copies: the driver reuses its buffers)."""

    def __call__(self, path, i, arr):
        assert arr.dtype == np.float32
        self[(path, i)] = np.array(arr)


def _step(opt, layouts, grads, writes, *, scale=1.0):
    shards = {p: _split(layouts[p], g * np.float32(scale)) for p, g in grads.items()}
    return opt.step(lambda p, i: shards[p][i] if p in shards else None, writes)


def _masters(opt, layouts):
    return {p: _join(lay, {i: opt.read_master(p, i) for i in range(lay.num_shards)}) for p, lay in layouts.items()}


def _snapshot(tier):
    return {(k, i): tier.get(k, i).result().tobytes() for k in tier.keys() for i in tier.local_indices(k)}


def _assert_close(got, want):
    for p in SHAPES:
        assert got[p].shape == want[p].shape, p
        np.testing.assert_allclose(got[p], want[p], rtol=RTOL, atol=0, err_msg=p)


@pytest.mark.parametrize("kind,sgs", [("cpu", SMALL), ("cpu", 64), ("cpu", LARGE), ("nvme", SMALL), ("nvme", LARGE),
                                     ("nvme-direct", SMALL)],
                         ids=["cpu-small50", "cpu-small64", "cpu-large", "nvme-small50", "nvme-large", "nvme-zeroed"])
def test_matches_optax(kind, sgs, layouts, tmp_path):
    params = _init_params()
    tier = _make_tier(kind, tmp_path)
    opt = _driver(tier, layouts, sgs, params, buffer_count=3)
    if kind == "nvme-direct":  # the moments' two thirds of init were allocated as zeros
        assert tier.bytes_zeroed == 2 * tier.bytes_written > 0
    if sgs == SMALL:
        assert tier.spec("m/dense/kernel").num_shards == 8 * 7
    sched, writes = _sched(), _Writes()
    for t in range(STEPS):
        g = _grads(t)
        writes.clear()
        met = _step(opt, layouts, g, writes)
        norm = np.sqrt(sum(np.sum(x.astype(np.float64) ** 2) for x in g.values()))
        assert met["skipped"] is False and met["step"] == t + 1 and met["loss_scale"] == 1.0
        assert met["lr"] == pytest.approx(float(sched(t)), rel=1e-6, abs=1e-12)
        assert met["grad_norm"] == pytest.approx(norm, rel=1e-9)
        assert set(writes) == {(p, i) for p, lay in layouts.items() for i in range(lay.num_shards)}
    want = _optax([_grads(t) for t in range(STEPS)], params)
    got = _masters(opt, layouts)
    _assert_close(got, want)
    written = {p: _join(lay, {i: writes[(p, i)] for i in range(lay.num_shards)}) for p, lay in layouts.items()}
    for p in SHAPES:
        np.testing.assert_array_equal(written[p], got[p])
    assert 1 < opt.peak_live_buffers <= 3
    tier.close()


@pytest.mark.parametrize("kind", ["cpu", "nvme"])
def test_nonfinite_step_is_skipped(kind, layouts, tmp_path):
    params = _init_params()
    tier = _make_tier(kind, tmp_path)
    opt = _driver(tier, layouts, SMALL, params)
    writes = _Writes()
    for t in range(5):
        _step(opt, layouts, _grads(t), writes)
    for path, idx, bad in [("dense/kernel", 1, np.nan), ("dense/bias", 3, np.inf)]:
        before, writes = _snapshot(tier), _Writes()
        g = _grads(99)
        stored = to_stored(layouts[path], g[path])  # poison one element of one shard
        flat_index = {"dense/kernel": (idx * 8 + 2, 5), "dense/bias": (idx * 5 + 1,)}[path]
        stored[flat_index] = bad
        g[path] = stored
        met = _step(opt, layouts, g, writes)
        assert met["skipped"] is True and not np.isfinite(met["grad_norm"])
        assert writes == {} and _snapshot(tier) == before
        assert opt.step_count == 5 and met["step"] == 5
    assert opt.skipped == 2
    for t in range(5, 10):
        assert not _step(opt, layouts, _grads(t), writes)["skipped"]
    _assert_close(_masters(opt, layouts), _optax([_grads(t) for t in range(10)], params))
    tier.close()


def test_owner_and_allreduce_in_norm(layouts):
    opt = _driver(CpuTier(memory="numpy"), layouts, SMALL, _init_params(),
                  owner=lambda p, i: p != "dense/kernel" or i % 2 == 0, allreduce=lambda x: 2 * x)
    g = _grads(0)
    local = sum(np.sum(g[p].astype(np.float64) ** 2) for p in SHAPES if p != "dense/kernel")
    kernel_shards = _split(layouts["dense/kernel"], g["dense/kernel"])
    local += sum(np.sum(s.astype(np.float64) ** 2) for i, s in kernel_shards.items() if i % 2 == 0)
    met = _step(opt, layouts, g, _Writes())
    assert met["grad_norm"] == pytest.approx(np.sqrt(2 * local), rel=1e-12)
    g["dense/kernel"][8 + 3, 0] = np.inf  # in shard 1, a replica owned elsewhere: still checked
    writes = _Writes()
    met = _step(opt, layouts, g, writes)
    assert met["skipped"] and writes == {} and opt.skipped == 1 and opt.step_count == 1


def test_missing_grad_is_zero_and_float16_grads(layouts):
    params = _init_params()
    opt = _driver(CpuTier(memory="numpy"), layouts, SMALL, params)
    ref = _driver(CpuTier(memory="numpy"), layouts, SMALL, params)
    seq = []
    for t in range(4):
        g = {p: x.astype(np.float16) for p, x in _grads(t).items() if p != "embed/embedding"}
        shards = {p: _split(layouts[p], x.astype(np.float32)) for p, x in g.items()}
        shards16 = {p: {i: s.astype(np.float16) for i, s in v.items()} for p, v in shards.items()}
        opt.step(lambda p, i: shards16[p][i] if p in shards16 else None, _Writes())
        ref.step(lambda p, i: shards[p][i] if p in shards else None, _Writes())
        seq.append({p: g[p].astype(np.float32) if p in g else np.zeros(SHAPES[p], np.float32) for p in SHAPES})
    got = _masters(opt, layouts)
    for p in SHAPES:
        np.testing.assert_array_equal(got[p], _masters(ref, layouts)[p])  # float16 = float32 of same values
    _assert_close(got, _optax(seq, params))


def test_loss_scale_sequence(layouts):
    cfg = LossScaleConfig(enabled=True, initial_scale_power=3, window=2, hysteresis=2, min_scale=1.0)
    overflow = [False, False, False, True, True, False, False, False, True, False, True, True, True]
    # DeepSpeed's rules by hand: x2 after `window` clean steps since the last overflow; an
    # overflow first spends hysteresis (2 -> 1), then halves; a doubling refills hysteresis.
    expected = [8, 8, 16, 16, 8, 8, 8, 16, 16, 16, 8, 4, 2]
    state, by_rules = init_loss_scale(**dataclasses.asdict(cfg)), []
    for o in overflow:
        state = update_loss_scale(state, o, **dataclasses.asdict(cfg))
        by_rules.append(state.scale)
    assert by_rules == expected
    params = _init_params()
    opt = _driver(CpuTier(memory="numpy"), layouts, SMALL, params, loss_scale=cfg)
    assert opt.loss_scale == 8.0
    scales, clean = [], []
    for t, o in enumerate(overflow):
        g = _grads(t)
        if o:
            g["head/kernel"] = g["head/kernel"].copy()
            g["head/kernel"][3, 2] = np.inf  # a float16 overflow
        else:
            clean.append(g)
        met = _step(opt, layouts, g, _Writes(), scale=opt.loss_scale)  # grads carry the scale
        assert met["skipped"] == o and met["loss_scale"] == opt.loss_scale
        scales.append(opt.loss_scale)
    assert scales == expected
    assert opt.skipped == sum(overflow) and opt.step_count == len(clean)
    _assert_close(_masters(opt, layouts), _optax(clean, params))

    static = _driver(CpuTier(memory="numpy"), layouts, SMALL, params,
                     loss_scale=LossScaleConfig(enabled=True, static_scale=128.0))
    g = _grads(0)
    g["dense/bias"] = np.full_like(g["dense/bias"], np.inf)
    assert _step(static, layouts, g, _Writes(), scale=128.0)["skipped"] and static.loss_scale == 128.0
    met = _step(static, layouts, _grads(0), _Writes(), scale=128.0)
    assert not met["skipped"] and met["grad_norm"] == pytest.approx(
        np.sqrt(sum(np.sum(x.astype(np.float64) ** 2) for x in _grads(0).values())), rel=1e-9)
    _assert_close(_masters(static, layouts), _optax([_grads(0)], params))


def test_buffer_accounting_is_bounded(layouts):
    for bc in (1, 2, 4):
        opt = _driver(CpuTier(memory="numpy"), layouts, 16, _init_params(), buffer_count=bc)
        for t in range(2):
            _step(opt, layouts, _grads(t), _Writes())
        assert opt.peak_live_buffers == bc  # used to the full depth, never beyond
        assert len(opt._sets) == bc
        assert opt.last_stats["sub_groups"] > 50


def test_commit_reopen_restore_continues(layouts, tmp_path):
    cfg = LossScaleConfig(enabled=True, initial_scale_power=4, window=3)
    params = _init_params()

    def run(opt, ts):
        for t in ts:
            g = _grads(t)
            if t == 2:
                g["dense/bias"] = np.full_like(g["dense/bias"], np.nan)
            _step(opt, layouts, g, _Writes(), scale=opt.loss_scale)

    full = _driver(CpuTier(memory="numpy"), layouts, SMALL, params, loss_scale=cfg)
    run(full, range(10))

    (tmp_path / "a").mkdir()
    tier = NvmeTier(tmp_path / "a", process_index=0, update="double_slot")
    opt = _driver(tier, layouts, SMALL, params, loss_scale=cfg)
    run(opt, range(6))
    opt.commit({"engine": {"epoch": 1}})
    run(opt, range(6, 8))  # uncommitted work, lost on reopen
    tier.close()

    tier = NvmeTier(tmp_path / "a", process_index=0, update="double_slot")
    opt = _driver(tier, layouts, SMALL, loss_scale=cfg)
    assert opt.step_count == 0
    opt.restore_state()
    assert tier.metadata()["engine"] == {"epoch": 1}
    assert (opt.step_count, opt.skipped) == (5, 1)
    run(opt, range(6, 10))
    assert (opt.step_count, opt.skipped, opt.loss_scale) == (full.step_count, full.skipped, full.loss_scale)
    got, want = _masters(opt, layouts), _masters(full, layouts)
    for p in SHAPES:
        np.testing.assert_array_equal(got[p], want[p])
    tier.close()


def test_init_shard_rejects_wrong_size(layouts):
    opt = _driver(CpuTier(memory="numpy"), layouts, SMALL)
    with pytest.raises(ValueError):
        opt.init_shard("dense/kernel", 0, np.zeros(7, np.float32))


def test_write_param_future_defers_buffer_reuse(layouts):
    import concurrent.futures as cf
    import time

    opt = _driver(CpuTier(memory="numpy"), layouts, SMALL, _init_params(), buffer_count=2)
    got = {}

    def slow_copy(p, i, a):
        time.sleep(0.002)  # reused too early, the buffer would hold the next sub-group by now
        got[(p, i)] = np.array(a)

    with cf.ThreadPoolExecutor(1) as ex:
        for t in range(2):
            _step(opt, layouts, _grads(t), lambda p, i, a: ex.submit(slow_copy, p, i, a))
    for p, lay in layouts.items():
        for i in range(lay.num_shards):
            np.testing.assert_array_equal(got[(p, i)], opt.read_master(p, i))


def _failing(base):
    """``base`` (a tier class) failing its ``fail_at``-th write: a put, or the cpu tier's arrays handed out to be
    written in place ([Note: updates in place] in zinf_jax/optim/driver.py)."""

    class Failing(base):
        writes, fail_at = 0, 10**9

        def _count(self):
            self.writes += 1
            if self.writes == self.fail_at:
                raise OSError("injected write failure")

        def put(self, key, index, value):
            self._count()
            return super().put(key, index, value)

        def writable(self, items):
            self._count()
            return super().writable(items)

    return Failing


@pytest.mark.parametrize("kind", ["cpu", "nvme"])
def test_io_error_propagates_and_returns_buffers(tmp_path, layouts, kind):
    tier = _failing(CpuTier)(memory="numpy") if kind == "cpu" else _failing(NvmeTier)(tmp_path, process_index=0)
    opt = _driver(tier, layouts, SMALL, _init_params(), buffer_count=3)
    assert opt._in_place == (kind == "cpu")
    tier.fail_at = tier.writes + len(opt._work) // 2  # mid-step
    with pytest.raises(OSError, match="injected"):
        _step(opt, layouts, _grads(0), _Writes())
    assert opt._live == 0 and len(opt._free) == len(opt._sets) <= 3
    assert opt.step_count == 0


def test_sub_groups_are_near_equal():
    """Padding is stored and moved every step: it stays under one element per sub-group."""
    for numel, sgs in [(320, 50), (74, 50), (8_900_000, 8 << 20), (5, 1 << 20), (1, 1), (1 << 24, 1 << 22)]:
        chunk, n = sub_groups(numel, sgs)
        assert chunk <= sgs and n == -(-numel // sgs) and 0 <= n * chunk - numel < n


OPTAX_RULES = {  # element-wise optax transforms the driver runs per sub-group (zinf_jax.optim.optax_rule)
    "sgd_nesterov": lambda: optax.sgd(0.05, momentum=0.9, nesterov=True),
    "lion": lambda: optax.lion(1e-3, weight_decay=0.01),
    "clip_adamw_masked": lambda: optax.chain(
        optax.clip_by_global_norm(CLIP),
        optax.adamw(_sched(), b1=0.9, b2=0.95, weight_decay=WD, mask=lambda t: jax.tree.map(lambda x: x.ndim > 1, t))),
    "rmsprop_adagrad": lambda: optax.chain(optax.scale_by_rms(), optax.scale_by_rss(initial_accumulator_value=0.1),
                                           optax.scale(-1e-2)),
}


@pytest.mark.parametrize("name", sorted(OPTAX_RULES))
def test_optax_rule_matches_optax_with_padded_chunks(tmp_path, layouts, name):
    """Any element-wise optax transform, streamed in sub-groups (several chunks, padded tails) vs the whole tree."""
    params = _init_params()
    grads = [_grads(t) for t in range(10)]
    p = _optax(grads, params, OPTAX_RULES[name]())
    opt = _driver(NvmeTier(tmp_path, process_index=0), layouts, SMALL, params, spec=OPTAX_RULES[name]())
    for g in grads:
        _step(opt, layouts, g, _Writes())
    got = _masters(opt, layouts)
    # The chunk program and the whole-tree program are compiled separately and may round p + u differently
    # (fusion, FMA): up to 2 ulp of the largest parameter magnitude (1.5); a wrong state or chunk mapping
    # errs by the order of a step (>= 1e-3 here).
    atol = 2 * np.finfo(np.float32).eps * 1.5
    for q, ref in p.items():
        np.testing.assert_allclose(got[q], np.asarray(ref), rtol=RTOL, atol=atol, err_msg=q)


def test_tier_grads_keep_small_shards_in_ram_and_write_large_ones(tmp_path):
    # gradients leave host RAM as they are produced, except shards under IN_RAM_BELOW (a file per tiny chunk
    # costs more than it saves); both kinds read back, sum repeats and give the same norm
    from zinf_jax.optim.grads_out import IN_RAM_BELOW, TierGrads
    from zinf_jax.tiers import NvmeTier

    small, large = 1000, IN_RAM_BELOW // 4 + 8  # elements per shard
    geo = {"s": (small, small, 1, 2), "l": (large, large // 2 + 1, 2, 2)}
    tier = NvmeTier(tmp_path, update="scratch")
    tg = TierGrads(tier, geo, {"s": [0, 1], "l": [0, 1]}, lambda p, i: True)
    tg.declare()
    rng = np.random.default_rng(0)
    g = {(p, i): rng.standard_normal(geo[p][0]).astype(np.float32) for p in geo for i in (0, 1)}
    for (p, i), x in g.items():
        tg.add(p, i, x)
    tg.add("s", 1, g[("s", 1)])  # a second contribution: summed
    tg.add("l", 1, g[("l", 1)])
    tg.wait()
    assert tg.nbytes() == 2 * small * 4  # the small shards only
    assert tier.bytes_written >= 2 * large * 4 + 2 * (large // 2 + 1) * 4  # the large ones (and a rewrite)
    want = {k: (2 * x if k[1] == 1 else x) for k, x in g.items()}
    for (p, i), x in want.items():
        np.testing.assert_array_equal(tg.read(p, i)[:geo[p][0]], x)
    assert tg.norm_sq() == pytest.approx(sum(float(np.sum(x.astype(np.float64) ** 2)) for x in want.values()))
    tg.clear()
    assert tg.nbytes() == 0 and not tg.has("s", 0)
    tier.close()


def test_optax_rule_compiles_once_per_distinct_program_and_keeps_path_masks(tmp_path):
    """Alike paths share one compiled chunk program (update and init); a mask that tells two same-shape paths
    apart (by name) still gives each its own update, as optax on the whole tree."""
    shapes = {f"blocks/{i}/w": (16, 8) for i in range(4)}
    structs = {p: jax.ShapeDtypeStruct(s, jnp.float32) for p, s in shapes.items()}
    lays = plan_partition(structs, make_mesh(), persistence_threshold=16)
    tx = lambda: optax.adamw(1e-2, weight_decay=0.5,  # noqa: E731
                             mask=lambda t: jax.tree_util.tree_map_with_path(
                                 lambda path, _: "3" not in [getattr(k, "key", None) for k in path], t))
    rng = np.random.default_rng(0)
    params = {p: rng.uniform(0.5, 1.5, s).astype(np.float32) for p, s in shapes.items()}
    grads = [{p: rng.standard_normal(s).astype(np.float32) for p, s in shapes.items()} for _ in range(3)]
    ref = _optax(grads, params, _nest_tx(tx()))
    opt = _driver(CpuTier(memory="numpy"), lays, LARGE, params, spec=tx())
    for g in grads:
        _step(opt, lays, g, _Writes())
    got = _masters(opt, lays)
    for q in shapes:
        np.testing.assert_allclose(got[q], ref[q], rtol=1e-6, atol=1e-7, err_msg=q)
    assert not np.allclose(got["blocks/3/w"] - got["blocks/0/w"], params["blocks/3/w"] - params["blocks/0/w"])
    distinct = lambda progs: len({id(p) for p in progs.values()})  # noqa: E731
    assert distinct(opt.rule._progs) == 2  # updates: blocks 0-2 alike, block 3 without decay
    assert distinct(opt.rule._inits) == 1  # the state's init: one for all four (its leaves carry no path names)
    assert len(opt.rule._by_key) == 3


def _nest_tx(tx):
    """``tx`` on the flat ``path -> array`` dict of :func:`_optax`, seen nested as the driver shows it."""
    return optax.GradientTransformation(
        lambda p: tx.init(nest_paths(p)),
        lambda g, s, p=None: (lambda u, s2: (unnest_paths(u), s2))(
            *tx.update(nest_paths(g), s, None if p is None else nest_paths(p))))


def test_a_large_pool_is_freed_after_each_step_with_the_same_numbers(layouts, monkeypatch):
    """At or above KEEP_POOL_BELOW the buffers go after each step (host RAM for the next forward); the updates are
    those of a driver that keeps its pool, bitwise."""
    from zinf_jax.optim import driver

    kept = _driver(CpuTier(memory="numpy"), layouts, 16, _init_params(), buffer_count=2)
    for t in range(3):
        _step(kept, layouts, _grads(t), _Writes())
        assert kept.pool_bytes() > 0
    monkeypatch.setattr(driver, "KEEP_POOL_BELOW", 1)
    freed = _driver(CpuTier(memory="numpy"), layouts, 16, _init_params(), buffer_count=2)
    for t in range(3):
        _step(freed, layouts, _grads(t), _Writes())
        assert freed.pool_bytes() == 0 and freed.peak_live_buffers == 2
    for path, a in _masters(kept, layouts).items():
        np.testing.assert_array_equal(_masters(freed, layouts)[path], a, err_msg=path)


class _PackWrites(_Writes):
    """Records write_params calls too: one call per pack, with all its members."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def many(self, items):
        self.calls.append([(p, i) for p, i, _ in items])
        for p, i, arr in items:
            self(p, i, arr)
        return []


@pytest.mark.parametrize("kind,sgs,variant", [("cpu", LARGE, "adamw"), ("nvme", SMALL, "adamw"),
                                              ("nvme", LARGE, "bf16_grad_tier"), ("cpu", SMALL, "optax")])
def test_packs_update_small_shards_together_with_the_same_numbers(kind, sgs, variant, layouts, tmp_path):
    """Whole small shards are read, updated and written as packs (one write_params call each, one kernel call
    per run of equal weight decay): the same master and states bitwise as one sub-group at a time, and optax's
    numbers. SMALL cuts some shards into several chunks (those stay sub-groups beside the packs)."""
    from zinf_jax.optim.subgroups import PACK_BELOW

    spec = OPTAX_RULES["clip_adamw_masked"]() if variant == "optax" else None
    for sub in ("g", "t0", f"t{PACK_BELOW}"):
        (tmp_path / sub).mkdir()
    extra = {"state_dtype": "bfloat16", "grad_tier": NvmeTier(tmp_path / "g", update="scratch")} \
        if variant == "bf16_grad_tier" else {}
    runs = {}
    for pack_below in (0, PACK_BELOW):
        tier = _make_tier(kind, tmp_path / f"t{pack_below}")
        opt = _driver(tier, layouts, sgs, _init_params(), spec=spec, pack_below=pack_below, **extra)
        writes = _PackWrites()
        for t in range(6):
            g = {p: _split(layouts[p], x) for p, x in _grads(t).items()}
            if opt.grads is not None:  # the gradients written to their tier as a backward would
                for p, shards in g.items():
                    for i, x in shards.items():
                        opt.grads.add(p, i, x)
                src = opt.grads
            else:
                src = lambda p, i, g=g: g[p][i]  # noqa: E731
            writes.calls.clear()
            opt.step(src, writes, write_params=writes.many)
            if opt.grads is not None:
                opt.grads.clear()
        states = {(p, i, n): opt.read_state(p, i, n).tobytes() for p, lay in layouts.items()
                  for i in range(lay.num_shards) for n in opt.state_names(p)}
        shards = {(p, i): opt.read_master(p, i) for p, lay in layouts.items() for i in range(lay.num_shards)}
        runs[pack_below] = (opt.packs, writes.calls, states, _masters(opt, layouts), dict(writes), shards)
        tier.close()
    (none, no_calls, want, *_), (packs, calls, got, masters, written, shards) = runs[0], runs[PACK_BELOW]
    assert none == 0 and no_calls == [] and packs >= 1
    assert len(calls) == packs and all(len(c) > 1 for c in calls)  # one call per pack, every member in it
    packed = {m for c in calls for m in c}
    assert len(packed) == sum(len(c) for c in calls)  # each shard in one pack
    if sgs == SMALL:  # the multi-chunk shards stayed sub-groups of their own
        assert not any(p == "dense/kernel" for p, _ in packed)
    assert got == want  # bitwise, every state of every shard
    assert set(written) == set(shards)  # every parameter shard handed out, as it was updated
    for key, arr in written.items():
        np.testing.assert_array_equal(arr.reshape(-1), shards[key].reshape(-1), err_msg=str(key))
    if variant == "adamw":  # against optax itself, as test_matches_optax
        _assert_close(masters, _optax([_grads(t) for t in range(6)], _init_params()))


def test_a_new_order_that_cuts_a_larger_pack_grows_the_buffer_sets(tmp_path):
    """In path order a shard of 40,000 elements and 15 of 65,536 fill one pack (1,023,040 of PACK_ELEMENTS) and
    the 16th stays alone; ordered with the small one last (a next forward's order, as the engine asks after its
    first trace) the 16 large ones make one pack of 1,048,576 elements, larger than any buffer set made for the
    first plan. The step after the new order updates every parameter as optax does (it failed reading the pack
    into the smaller sets: "could not broadcast input array from shape (32768,) into shape (32256,)" on a
    4-block d=512 GPT). On NVMe: a cpu tier's packs are updated in its own arrays, without buffer sets."""
    shapes = {"p00": (40_000,)} | {f"p{k:02d}": (65_536,) for k in range(1, 17)}
    layouts = plan_partition({p: jax.ShapeDtypeStruct(s, jnp.float32) for p, s in shapes.items()}, make_mesh(),
                             persistence_threshold=10**6)
    rng = np.random.default_rng(0)
    params = {p: rng.uniform(0.5, 1.5, s).astype(np.float32) for p, s in shapes.items()}
    grads = {p: rng.standard_normal(s).astype(np.float32) for p, s in shapes.items()}
    spec = adamw(1e-2, weight_decay=0.0, clip_norm=None)
    opt = _driver(NvmeTier(tmp_path, process_index=0), layouts, 1 << 20, params, spec=spec, pack_below=PACK_BELOW)
    before = opt._set_size
    opt.order([*(p for p in shapes if p != "p00"), "p00"])
    assert opt._set_size == 16 * 65_536 > before == 40_000 + 15 * 65_536
    writes = _Writes()
    _step(opt, layouts, grads, writes)
    want = _optax([grads], params, optax.adamw(1e-2, weight_decay=0.0))
    for p in shapes:
        np.testing.assert_allclose(writes[(p, 0)], want[p], rtol=RTOL, err_msg=p)


@pytest.mark.parametrize("name", ["adamw", "lion"])
def test_a_cpu_tier_is_updated_in_its_own_arrays(layouts, name):
    """[Note: updates in place]: with the state in a numpy cpu tier, packs of small shards and the sub-groups of
    the large ones are updated in the tier's arrays: no copy in or out a step (the tier copies nothing and the
    driver holds no buffer of their size), and every master steps as optax's does."""
    spec, tx = (_spec(), _ref_tx()) if name == "adamw" else (OPTAX_RULES[name](), OPTAX_RULES[name]())
    params, grads = _init_params(), [_grads(t) for t in range(6)]
    tier = CpuTier(memory="numpy")
    opt = _driver(tier, layouts, SMALL, params, spec=spec, pack_below=PACK_BELOW)
    assert opt.packs and any(g.n_chunks > 1 for g in opt._groups)  # both kinds of work
    copied, version = tier.copied_bytes, tier.version
    for g in grads:
        _step(opt, layouts, g, _Writes())
    assert tier.copied_bytes == copied and tier.version > version
    assert opt.pool_bytes() < 4096  # no sub-group or pack buffers
    atol = 0 if name == "adamw" else 2 * np.finfo(np.float32).eps * 1.5  # (see the optax-rule test above)
    got, want = _masters(opt, layouts), _optax(grads, params, tx)
    for q, ref in want.items():
        np.testing.assert_allclose(got[q], ref, rtol=RTOL, atol=atol, err_msg=q)
