"""The compiled engine's step programs as XLA's own GPU and TPU compilers compile them, on this machine, without a
GPU or a TPU (:mod:`zinf_jax.xla`; the compilers ``scripts/setup_compilers.sh`` installs).

For each model (the bundled GPT with its tied head; a ViT whose class token is broadcast over the batch; a stack of
layers the model scans itself), engine configuration and target (H100, H200, v5e, v6e), the train and eval programs:

* compile, with the XLA options the engine sets, under a time limit;
* with no host compute: no HostOffloader warning, no host-compute instruction in the compiled program;
* move the fewest bytes: what :meth:`Engine.transfer_budget` says (an evaluation exactly; a training step no more,
  nor less than an evaluation; gradients out exactly once, in float32);
* overlap at least 90% of a loop's host-to-device bytes with compute, in the compiled schedule;
* reduce gradients in float32.

The full grid is ``-m accelerators`` (``.ci/run`` runs it); the default suite compiles the GPT's cpu/cpu step for one
GPU and one TPU, and checks that the checks fail on a planted fault.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from helpers.accel_models import CONFIGS, build
from zinf_jax.engine.compiled import GPU_ASYNC_LIMIT
from zinf_jax.xla import TARGETS, available, compile_programs, hlo

MODELS = ("gpt", "vit", "scan")
MISSING = {t.name: available(t) for t in TARGETS}


def _needs(target: str):
    return pytest.mark.skipif(MISSING[target] is not None, reason=f"XLA's compiler for {target}: {MISSING[target]}")


@functools.lru_cache(maxsize=4)
def _engine(model: str, config: str):
    return build(model, config)


def _gradient_reductions(module: hlo.Module) -> list[hlo.Reduction]:
    """The cross-device reductions of the backward (JAX names its operations ``transpose(...)``): a TPU also
    gathers small arrays by summing zeros, which reduces nothing."""
    return [r for r in hlo.reductions(module) if "transpose(" in r.op_name]


def check(eng, batch, target: str, model_casts: bool = False) -> None:
    """``model_casts``: the model computes in bfloat16 itself (its float32 parameters cast in its own code): its
    gradient reductions are left as XLA places them (see :func:`test_a_model_that_casts_itself_reduces_in_its_dtype`)."""
    platform = next(t.platform for t in TARGETS if t.name == target)
    lowered = [(p, eng.lower(batch, program=p, platforms=(platform,))) for p in ("train", "eval")]
    results = {r.label: r for r in compile_programs(lowered, target, options=eng.passes.compiler_options(platform))}
    budgets = {p: eng.transfer_budget(batch, program=p) for p in ("train", "eval")}
    for program, r in results.items():
        where = f"{target} {program}"
        assert r.ok, f"{where}: {r.error}"
        assert not r.warnings, f"{where}: {r.warnings[:3]}"
        s = r.summary
        assert not s["host_compute"], f"{where}: {s['host_compute'][:3]}"
        budget = budgets[program]
        if program == "eval":
            assert s["h2d_bytes"] == budget.h2d_bytes and s["d2h_bytes"] == 0, (where, s, budget)
        else:  # the backward may not need every parameter again (a bias added last)
            assert budgets["eval"].h2d_bytes <= s["h2d_bytes"] <= budget.h2d_bytes, (where, s, budget)
            assert s["d2h_bytes"] == budget.d2h_bytes, (where, s, budget)
        if s["in_loop_h2d_bytes"]:
            assert s["in_loop_h2d_overlapped"] >= 0.9, (where, s)
        bad = [r for r in _gradient_reductions(r.module) if set(r.dtypes) - {"f32"}]
        assert model_casts or not bad, f"{where}: gradients reduced in {bad[:3]}"


@pytest.mark.accelerators
@pytest.mark.parametrize("target", [t.name for t in TARGETS])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("model", MODELS)
def test_every_step_compiles_for_every_accelerator_at_the_byte_minimum_overlapped(model, config, target):
    if MISSING[target]:
        pytest.skip(f"XLA's compiler for {target}: {MISSING[target]}")
    eng, batch = _engine(model, config)
    check(eng, batch, target, model_casts=CONFIGS[config].get("model_dtype") is not None)


@pytest.mark.accelerators  # (~35 s of compiles: in .ci/run's accelerator run, not the default suite)
@pytest.mark.parametrize("target", [pytest.param("h100", marks=_needs("h100")), pytest.param("v5e", marks=_needs("v5e"))])
def test_the_device_update_moves_states_through_the_program_a_window_at_a_time(target):
    """``optimizer_update="device"`` with the state in host RAM: each parameter's states move into device memory and
    back inside the step's program ([Note: states moved in the program]), each once; on a GPU never more in device
    memory at once than the window (``max_in_flight_bytes``) and one parameter's states, and with a window as large
    as the whole state they all move in ahead. XLA:TPU moves every state in at the top of the program either way
    (what this test pins, so a change shows)."""
    platform = next(t.platform for t in TARGETS if t.name == target)
    peaks = {}
    for window in (160_000, 1 << 30):
        eng, batch = build("gpt", "device-update", max_in_flight_bytes=window)
        try:
            (r,) = compile_programs([("train", eng.lower(batch, program="train", platforms=(platform,)))], target,
                                    options=eng.passes.compiler_options(platform))
            assert r.ok and not r.warnings and not r.summary["host_compute"], (r.error, r.warnings[:3])
            opt = eng.optimizer
            states = {p: opt.state_bytes(p) for p in opt.layouts}
            moves = [t for t in hlo.transfers(r.module) if t.computation == r.module.entry]
            assert sum(t.total for t in moves if t.to_device) == sum(states.values())  # every state in once...
            assert sum(t.total for t in moves if not t.to_device) == sum(states.values())  # ...and out once
            peaks[window] = hlo.peak_moved_in(r.module)
        finally:
            eng.close()
    total = sum(states.values())
    if platform == "tpu":  # XLA:TPU starts every move-in at the top of the program, whatever the barriers say
        assert peaks[160_000] == peaks[1 << 30] == total, peaks
        return
    assert peaks[160_000] <= 160_000 + max(states.values()) < total, (peaks, total, max(states.values()))
    assert peaks[1 << 30] > 160_000 + max(states.values()), peaks


@pytest.mark.parametrize("target", [pytest.param("h100", marks=_needs("h100")), pytest.param("v5e", marks=_needs("v5e"))])
def test_the_gpt_step_with_params_and_optimizer_on_the_host_compiles_for_a_gpu_and_a_tpu(target):
    eng, batch = _engine("gpt", "cpu-cpu")
    check(eng, batch, target)


def _host_gradient_program(plant):
    """A stack of layers in host memory, scanned: each layer moved to the device; the loss's gradient moved back
    to host memory, then ``plant`` on it (on a GPU or TPU: compute on a host-memory value)."""
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    host = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "x"), memory_kind="pinned_host")
    dev = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"), memory_kind="device")

    def loss(ws, x):
        def body(h, w):
            w = jax.lax.optimization_barrier(jax.device_put(w, dev))
            return jnp.tanh(h @ jax.lax.with_sharding_constraint(w, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))), None
        return jnp.sum(jax.lax.scan(jax.checkpoint(body), x, ws)[0])

    def step(ws, x):
        return plant(jax.device_put(jax.grad(loss)(ws, x), host))

    args = (jax.ShapeDtypeStruct((4, 128, 128), jnp.float32, sharding=host),
            jax.ShapeDtypeStruct((8, 128), jnp.float32, sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))))
    return {p: jax.jit(step).trace(*args).lower(lowering_platforms=(p,)) for p in ("cuda", "tpu")}


@pytest.mark.parametrize("target", [pytest.param("h100", marks=_needs("h100")), pytest.param("v5e", marks=_needs("v5e"))])
def test_the_compile_checks_fail_on_a_cast_of_a_host_gradient(target):
    platform = "cuda" if target == "h100" else "tpu"
    clean = compile_programs([("clean", _host_gradient_program(lambda g: g)[platform])], target)[0]
    assert clean.clean, (clean.error, clean.warnings[:2], hlo.host_compute(clean.module)[:2])
    planted = compile_programs([("planted", _host_gradient_program(lambda g: g.astype(jnp.bfloat16))[platform])],
                               target)[0]
    assert not planted.clean  # XLA warns, and runs the cast on the host (or refuses the program)
    assert planted.warnings or not planted.ok or hlo.host_compute(planted.module)


@pytest.mark.parametrize("target", [pytest.param("h100", marks=_needs("h100"))])
def test_the_gpu_option_the_engine_sets_changes_the_schedule(target):
    """Without the engine's option XLA's GPU scheduler overlaps two of a layer's moves; with it, every one."""
    eng, batch = _engine("gpt", "cpu-cpu")
    options = eng.passes.compiler_options("cuda")
    assert set(options) == {GPU_ASYNC_LIMIT} and options[GPU_ASYNC_LIMIT] > 2
    lowered = eng.lower(batch, program="eval", platforms=("cuda",))
    default, engine = (compile_programs([("eval", lowered)], target, options=o)[0] for o in ({}, options))
    assert default.ok and engine.ok
    assert default.hlo_text != engine.hlo_text
    assert default.summary["in_loop_h2d_overlapped"] < 0.5 <= 0.9 <= engine.summary["in_loop_h2d_overlapped"]


@pytest.mark.parametrize("target", [pytest.param("h100", marks=_needs("h100"))])
def test_a_model_that_casts_itself_reduces_in_its_dtype(target):
    """The engine reduces gradients in float32 where it casts the parameters (``compute_dtype``); a model that
    computes in bfloat16 itself (float32 parameters cast in its own code) has XLA place the reduction at its own
    products and sums, in bfloat16: the limit docs/guides/accelerators.md states. Here so that a change shows."""
    eng, batch = _engine("vit", "bf16-activations")
    platform = "cuda"
    lowered = [("train", eng.lower(batch, program="train", platforms=(platform,)))]
    r = compile_programs(lowered, target, options=eng.passes.compiler_options(platform))[0]
    assert r.ok
    assert {d for x in _gradient_reductions(r.module) for d in x.dtypes} == {"bf16", "f32"}
    eng2, batch2 = _engine("vit", "bf16")  # the engine's own cast: float32 reductions only
    r2 = compile_programs([("train", eng2.lower(batch2, program="train", platforms=(platform,)))], target,
                          options=eng2.passes.compiler_options(platform))[0]
    assert r2.ok and {d for x in _gradient_reductions(r2.module) for d in x.dtypes} == {"f32"}
