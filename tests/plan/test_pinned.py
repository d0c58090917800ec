"""Pinned host memory planned against the GPU runtime's pinned pool (zinf_jax.plan.pinned): a step over the pool is
refused before anything is built, the pool's variable follows the plan where the runtime has not started, and the
estimator reports the same pinned bytes as the engine plans."""
import jax
import pytest
from flax import nnx

import zinf_jax as zinf
from zinf_jax.engine.host_budget import check_pinned_pool, pinned_of
from zinf_jax.estimate import estimate_from_model
from zinf_jax.models import GPT, GPTConfig
from zinf_jax.plan.partition import local_shard_devices, plan_partition
from zinf_jax.plan.pinned import DEFAULT_POOL_GB, POOL_VARIABLE, PinnedPlan, pool_decision

CFG = GPTConfig(vocab=256, d_model=64, n_heads=4, n_layers=2, seq=16)


def test_a_plan_over_the_pool_is_refused_naming_the_variable_the_bytes_and_the_fix():
    plan = PinnedPlan(items={"params": 50 << 30, "gradients": 30 << 30})
    d = pool_decision(plan, platform="cuda", client_started=True, environ={})
    assert d.action == "refuse"
    assert POOL_VARIABLE in d.message and "80.0 GiB" in d.message and f"{POOL_VARIABLE}={plan.pool_gb}" in d.message
    assert pool_decision(plan, platform="cuda", client_started=True, environ={POOL_VARIABLE: "200"}).action == "ok"
    assert pool_decision(plan, platform="cuda", client_started=True, environ={POOL_VARIABLE: "70"}).action == "refuse"
    assert pool_decision(plan, platform="cpu", client_started=True, environ={}).action == "ok"  # no pool there
    assert pool_decision(plan, platform="tpu", client_started=True, environ={}).action == "ok"


def test_the_pool_setting_follows_the_plan_before_the_runtime_starts():
    plan = PinnedPlan(items={"params": 100 << 30, "gradients": 10 << 30})
    d = pool_decision(plan, platform="gpu", client_started=False, environ={})
    assert d.action == "set" and d.gigabytes == plan.pool_gb and d.gigabytes * 1e9 >= plan.total * 1.25
    small = PinnedPlan(items={"params": 1 << 30})
    assert pool_decision(small, platform="gpu", client_started=False, environ={}).action == "ok"  # default fits
    assert DEFAULT_POOL_GB == 64.0
    # a user's own setting is not overridden: too small is refused even before the runtime starts
    assert pool_decision(plan, platform="gpu", client_started=False, environ={POOL_VARIABLE: "8"}).action == "refuse"


def _plan(param: str, opt: str, update: str = "host"):
    cfg = zinf.ZeroConfig(offload_param=zinf.Offload(param), offload_optimizer=zinf.Offload(opt),
                          persistence_threshold=0, optimizer_update=update)
    mesh = zinf.make_mesh()
    eng = zinf.initialize(lambda: GPT(CFG, rngs=nnx.Rngs(0)), config=cfg, mesh=mesh, loss_fn=lambda m, b: 0.0)
    c = eng.components
    plan = pinned_of(c.layouts, [u.param_paths for u in c.adapter.units], c.trainable,
                     n_idx=len(local_shard_devices(c.mesh, cfg.zero_axes)), where=c.placement,
                     compute_dtype=c.compute_dtype, fused=c.passes.fused is not None, state_bytes=cfg.state_bytes)
    if update == "device":  # the states the program takes and gives in pinned host memory: the tier's, twice
        assert plan.items["optimizer_state"] == 2 * c.opt_tier.stored_bytes() > 0
    eng.close()
    return plan, cfg


def test_the_engine_refuses_a_step_over_the_pool_before_building_and_sets_it_when_it_can(monkeypatch):
    plan, _ = _plan("cpu", "cpu")
    assert plan.items["params"] > 0 and plan.items["gradients"] > 0
    monkeypatch.setenv(POOL_VARIABLE, "0.0001")  # a pool smaller than this small GPT's host-resident step
    with pytest.raises(zinf.ConfigError, match=POOL_VARIABLE):
        check_pinned_pool(plan, "cuda")
    monkeypatch.delenv(POOL_VARIABLE)
    check_pinned_pool(PinnedPlan(items={"params": 100 << 30}), "cuda", client_started=False)
    import os
    assert os.environ[POOL_VARIABLE] == str(PinnedPlan(items={"params": 100 << 30}).pool_gb)


@pytest.mark.parametrize("param, opt, update", [("cpu", "cpu", "host"), ("none", "cpu", "host"),
                                               ("none", "cpu", "device")])
def test_the_estimator_reports_the_pinned_bytes_the_engine_plans(param, opt, update):
    plan, cfg = _plan(param, opt, update)
    est = {(e.param_tier, e.optimizer_tier): e for e in
           estimate_from_model(lambda: GPT(CFG, rngs=nnx.Rngs(0)), config=cfg, batch=8, seq=CFG.seq,
                               mesh=zinf.make_mesh())}[(param, opt)]
    assert est.host_pinned_bytes == plan.total > 0
    assert est.host_pinned_bytes <= est.host_bytes
