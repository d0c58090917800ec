"""The small gradient shards a step keeps in host RAM are bounded (issue 47): past ``ram_limit`` they go to the
tier like large ones, so a deeper model holds no more; what is read back and the norm are the same."""
import numpy as np
import pytest

from zinf_jax.optim.grads_out import RAM_BYTES, TierGrads, ram_bytes
from zinf_jax.tiers import NvmeTier


def test_small_shards_past_the_bound_go_to_the_tier(tmp_path):
    small, paths = 1000, [f"p{k}" for k in range(6)]
    geo = {p: (small, small, 1, 1) for p in paths}
    tier = NvmeTier(tmp_path, update="scratch")
    tg = TierGrads(tier, geo, {p: [0] for p in paths}, lambda p, i: True, ram_limit=3 * small * 4)
    tg.declare()
    rng = np.random.default_rng(0)
    g = {p: rng.standard_normal(small).astype(np.float32) for p in paths}
    for p in paths:
        tg.add(p, 0, g[p])
    tg.add("p0", 0, g["p0"])  # a repeat of one kept in RAM stays there
    tg.add("p5", 0, g["p5"])  # and of one in the tier is summed there
    tg.wait()
    assert tg.nbytes() == 3 * small * 4  # the bound, not six shards
    assert tier.bytes_written >= 4 * small * 4
    want = {p: 2 * x if p in ("p0", "p5") else x for p, x in g.items()}
    for p, x in want.items():
        np.testing.assert_array_equal(tg.read(p, 0)[:small], x)
    assert tg.norm_sq() == pytest.approx(sum(float(np.sum(x.astype(np.float64) ** 2)) for x in want.values()))
    tg.clear()
    assert tg.nbytes() == 0
    for p in paths[:3]:  # the next step starts with the whole bound again
        tg.add(p, 0, g[p])
    assert tg.nbytes() == 3 * small * 4
    tg.clear()
    tier.close()


def test_plan_figure_is_bounded():
    assert ram_bytes(10) == 10 and ram_bytes(10 * RAM_BYTES) == RAM_BYTES
