"""The host plan (issue 47): settings lowered in order until the limit is met, the smallest limit that fits,
the engine refusing before anything is written, and the engine and the estimator planning the same items."""
import re

import pytest
from flax import nnx

import zinf_jax as zinf
from zinf_jax._internal.native_memory import TRIM_SLACK
from zinf_jax.estimate import estimate_from_model
from zinf_jax.models import GPT, GPTConfig, lm_loss
from zinf_jax.plan.host_memory import MIN_MARGIN, MIN_TRIM_SLACK, HostSizes, margin, plan_host

MiB = 1 << 20
SIZES = HostSizes(unit_held=(10 * MiB, 40 * MiB), unit_gathered=(80 * MiB, 320 * MiB), params_on_nvme=True,
                  device_is_host=True, buffer_set=20 * MiB, sets=8, assembly=0, optimizer_on_nvme=True,
                  grad_ram=MiB, grad_unit=5 * MiB, resident_tiers=0)


def _plan(limit=None, depth=2, count=4):
    return plan_host(SIZES, runtime=400 * MiB, prefetch_depth=depth, buffer_count=count, limit=limit)


def test_without_a_limit_the_settings_are_kept_and_with_one_lowered_in_order_until_it_fits():
    free = _plan()
    assert (free.prefetch_depth, free.buffer_count, free.trim_slack, free.max_live_bytes) == (2, 4, TRIM_SLACK, None)
    assert free.fits and free.total == sum(free.items.values())
    # the items at depth 2, 4 sets: staging 120, device 320 + 120, buffers 80 (+ their writes 80), grads 6; a limit
    # also keeps its margin free (under 4 GiB: MIN_MARGIN)
    assert "margin" not in free.items and margin(1 << 30) == MIN_MARGIN and margin(8 << 30) == 512 * MiB
    assert free.items["device_grads"] == 320 * MiB  # on a CPU mesh: the largest unit's gradient, gathered
    roomy = _plan(limit=free.total - TRIM_SLACK + 2 * MIN_TRIM_SLACK + 200 * MiB + MIN_MARGIN)
    assert roomy.items["margin"] == MIN_MARGIN
    assert (roomy.prefetch_depth, roomy.buffer_count) == (2, 4) and MIN_TRIM_SLACK < roomy.trim_slack < TRIM_SLACK
    assert roomy.fits and roomy.headroom >= roomy.trim_slack  # half the spare is the step's
    depth_cut = _plan(limit=free.total - TRIM_SLACK + MIN_TRIM_SLACK + MIN_MARGIN - 1)  # a window less: depth 1
    assert (depth_cut.prefetch_depth, depth_cut.buffer_count) == (1, 4) and depth_cut.fits
    assert depth_cut.max_live_bytes == 2 * 40 * MiB  # the prefetcher's bound: the planned window
    both = _plan(limit=depth_cut.minimum + 40 * MiB)  # depth 0, then sets cut
    assert both.prefetch_depth == 0 and 1 <= both.buffer_count < 4 and both.fits
    at_least = _plan(limit=both.minimum)
    assert at_least.fits and (at_least.prefetch_depth, at_least.buffer_count) == (0, 1)
    assert at_least.total == at_least.minimum
    short = _plan(limit=both.minimum - 1)
    assert not short.fits and [x.split()[0] for x in short.lowering[:2]] == ["runtime", "device_params"]  # largest first


def _gpt():
    cfg = GPTConfig(d_model=64, n_heads=4, n_layers=2, seq=16)
    return cfg, lambda: GPT(cfg, rngs=nnx.Rngs(0))


def _config(path, **kw):
    off = zinf.Offload("nvme", path=str(path))
    return zinf.ZeroConfig(offload_param=off, offload_optimizer=off, compute_dtype="float32", **kw)


def test_a_limit_below_the_plan_is_refused_before_anything_is_written_naming_the_smallest_that_fits(tmp_path):
    _, ctor = _gpt()
    with pytest.raises(zinf.ConfigError, match="host_memory_limit") as e:
        zinf.initialize(ctor, config=_config(tmp_path, host_memory_limit="2MiB"), loss_fn=lm_loss,
                        optimizer=zinf.adamw(1e-3))
    assert list(tmp_path.iterdir()) == []
    assert "JAX, XLA, Python" in str(e.value) and "What would lower it" in str(e.value)
    smallest = int(re.search(r"host_memory_limit=(\d+) or more fits", str(e.value)).group(1))
    eng = zinf.initialize(ctor, config=_config(tmp_path, host_memory_limit=smallest + 256 * MiB), loss_fn=lm_loss,
                          optimizer=zinf.adamw(1e-3))
    try:  # what the plan picked is what the engine runs
        plan, passes = eng.components.host_plan, eng.components.passes
        assert plan.fits and passes.prefetcher.depth == plan.prefetch_depth
        assert passes.prefetcher.max_live_bytes == plan.max_live_bytes
        assert passes._trimmer.slack == plan.trim_slack < TRIM_SLACK
        assert eng.components.optimizer.buffer_count == plan.buffer_count
    finally:
        eng.close()


def test_the_engine_and_the_estimator_plan_the_same_buffers(tmp_path):
    cfg, ctor = _gpt()
    config = _config(tmp_path, host_memory_limit="8GiB")
    est = estimate_from_model(ctor, config=config, loss_fn=lm_loss, batch=8, seq=cfg.seq,
                              configurations=[("nvme", "nvme")])[0].host_plan
    eng = zinf.initialize(ctor, config=config, loss_fn=lm_loss, optimizer=zinf.adamw(1e-3))
    try:
        got = eng.components.host_plan
    finally:
        eng.close()
    same = [k for k in got.items if k not in ("runtime", "trim_slack")]  # measured vs assumed; the slack follows
    assert {k: got.items[k] for k in same} == {k: est.items[k] for k in same}
    assert (got.prefetch_depth, got.buffer_count) == (est.prefetch_depth, est.buffer_count)


def test_the_host_plan_does_not_grow_with_depth():
    # the items a deeper model of the same width holds the same: the gradient shards kept in RAM are bounded
    # (grads_out.RAM_BYTES); only the step's saved activations grow, one unit input a layer
    from zinf_jax.estimate import estimate_from_sizes

    nvme = zinf.Offload("nvme", path="/unused")
    config = zinf.ZeroConfig(offload_param=nvme, offload_optimizer=nvme, compute_dtype="float32",
                             host_memory_limit="4GiB")

    def est(layers):
        return estimate_from_sizes(None, layers, 1024, 256, 16, 8, n_devices=8, heads=16, config=config,
                                   platform="cpu", configurations=[("nvme", "nvme")])[0]

    small, large = est(32), est(128)
    assert large.host_plan.total == small.host_plan.total
    assert large.step_host_bytes - small.step_host_bytes == 96 * 8 * 16 * 1024 * 4  # 96 more unit inputs
