"""Offload read as a GPU or a TPU runs it: the compiled engine's programs lowered for cuda and tpu from
the CPU mesh (where moves between memory kinds are no-ops) and walked by zinf.check_host_compute.

Each offload configuration's train and eval programs: nothing computes on a host-memory value, no
device copy of a host parameter is a scan residual, each host gradient leaves as the last operation.
The demo GPT ties its head to its embedding (a parameter read twice) and its 4 blocks are one scanned
run. And the checks themselves fail on planted faults.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import zinf_jax as zinf
from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss

CFG = GPTConfig(vocab=128, d_model=32, n_heads=4, n_layers=4, seq=16)
PLATFORMS = ("cuda", "tpu")


def _engine(param, opt, devices, **kw):
    cfg = zinf.ZeroConfig(offload_param=zinf.Offload(param), offload_optimizer=zinf.Offload(opt),
                          persistence_threshold=0, **kw)
    mesh = zinf.make_mesh(devices=jax.devices()[:devices])
    return zinf.initialize(lambda: GPT(CFG, rngs=nnx.Rngs(0)), config=cfg, loss_fn=lm_loss, mesh=mesh,
                           optimizer=zinf.adamw(1e-3))


@pytest.mark.parametrize("param, opt, devices, kw", [
    ("cpu", "cpu", 8, {}),
    ("cpu", "none", 8, {}),
    ("none", "cpu", 8, {}),
    ("cpu", "cpu", 8, {"activation_checkpointing": False}),
    ("cpu", "cpu", 1, {}),
    ("cpu", "cpu", 8, {"compute_dtype": "bfloat16"}),
], ids=["cpu-cpu", "cpu-none", "none-cpu", "no-remat", "1-device", "bf16"])
def test_offload_programs_compute_nothing_on_host_memory(param, opt, devices, kw):
    eng = _engine(param, opt, devices, **kw)
    assert eng.mode == "compiled"
    batch = batch_at(corpus(), 0, 8, CFG.seq)
    for platform in PLATFORMS:
        for program in ("train", "eval"):
            report = zinf.check_host_compute(eng.lower(batch, program=program, platforms=(platform,)))
            where = f"{platform} {program}"
            if param == "cpu":  # the unit params go in as host arguments, each read moved to the device
                assert report.host_arguments > 0 and report.moves_to_device >= 2, where
            if program == "train" and opt == "cpu":
                # gradients go out to host memory: the scanned run's layer by layer into its host stack,
                # the tied embedding (read twice: its two cotangents summed in device memory) once
                assert report.moves_to_host >= 2 and report.host_writes, where
            if program == "eval" or opt == "none":
                assert not report.host_writes, where
            # the scanned run moves each of a block's parameters in one iteration ahead, in the forward and in
            # the backward, with or without remat ([Note: moves ahead]); the backward drops the few its
            # gradients do not read (a bias added last)
            per_block = sum(p.startswith("blocks/0/") for p in eng.store.layouts)
            if param == "none":
                assert report.moves_ahead == 0, where
            elif program == "eval":
                assert report.moves_ahead == per_block, where
            else:
                assert per_block + per_block // 2 < report.moves_ahead <= 2 * per_block, where
    eng.close()


def _host_program(plant, remat=True):
    """A layer stack on the host, scanned: each layer moved to the device, applied (recomputed in the
    backward with ``remat``); its loss's gradient with respect to the host stack moved to host memory,
    then ``plant`` on it."""
    host, dev = (jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=k) for k in ("pinned_host", "device"))

    def loss(ws, x):
        def body(h, w):
            return jnp.tanh(h @ jax.device_put(w, dev)), None
        body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable) if remat else body
        return jnp.sum(jax.lax.scan(body, x, ws)[0])

    def step(ws, x):
        return plant(jax.device_put(jax.grad(loss)(ws, x), host))

    args = (jax.ShapeDtypeStruct((4, 8, 8), jnp.float32, sharding=host),
            jax.ShapeDtypeStruct((2, 8), jnp.float32, sharding=dev))
    return jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",))


def test_the_check_fails_on_compute_on_a_host_gradient():
    report = zinf.check_host_compute(_host_program(lambda g: g))  # moves and slices only: clean
    assert report.host_arguments == 1 and report.moves_to_device >= 1 and report.moves_to_host >= 1
    assert report.moves_ahead == 0  # each layer moved in the iteration that uses it
    planted = _host_program(lambda g: g.astype(jnp.bfloat16))  # a cast of the host-memory gradient
    with pytest.raises(zinf.EngineError, match="computes on host-memory values"):
        zinf.check_host_compute(planted)
    assert any("convert" in v for v in zinf.host_compute_report(planted).violations)


def test_a_move_handed_on_to_the_next_iteration_counts_as_ahead():
    host, dev = (jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=k) for k in ("pinned_host", "device"))

    def f(ws, x):
        def body(carry, k):
            h, w = carry
            nxt = jax.device_put(jax.lax.dynamic_index_in_dim(ws, jnp.minimum(k + 1, 3), keepdims=False), dev)
            return (jnp.tanh(h @ w), nxt), None
        return jnp.sum(jax.lax.scan(body, (x, jax.device_put(ws[0], dev)), jnp.arange(4))[0][0])

    args = (jax.ShapeDtypeStruct((4, 8, 8), jnp.float32, sharding=host),
            jax.ShapeDtypeStruct((2, 8), jnp.float32, sharding=dev))
    report = zinf.check_host_compute(jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)))
    assert report.moves_ahead == 1 and report.moves_to_device == 2


def test_the_check_fails_on_device_copies_of_host_layers_saved_by_a_scan():
    # differentiated without rematerialisation, the scan saves each layer's device copy for its backward
    report = zinf.host_compute_report(_host_program(lambda g: g, remat=False))
    assert any("residual" in v for v in report.violations), report.violations


def test_old_style_read_is_flagged_on_the_engine_path():
    """The engine's own path with the read the engine had before its gradient taps (differentiated with
    respect to the host shards themselves): the tied embedding's two cotangents are summed in host memory."""
    from zinf_jax.engine import staging

    mesh = zinf.make_mesh()
    lay = zinf.plan_partition({"w": jax.ShapeDtypeStruct((64, 32), jnp.float32)}, mesh, 0)["w"]
    host = NamedSharding(mesh, lay.spec, memory_kind="pinned_host")

    def loss(w, x):  # read twice, as a tied head is
        a, b = staging.read(lay, w, mesh, jnp.float32, True), staging.read(lay, w, mesh, jnp.float32, True)
        return jnp.sum((x @ a.T) @ b)

    arg = jax.ShapeDtypeStruct(lay.stored_shape, jnp.float32, sharding=host)
    x = jax.ShapeDtypeStruct((8, 32), jnp.float32, sharding=NamedSharding(mesh, P()))
    lowered = jax.jit(jax.grad(loss)).trace(arg, x).lower(lowering_platforms=("cuda",))
    report = zinf.host_compute_report(lowered)
    assert any("add" in v for v in report.violations), report.violations

    def tapped(w, x):  # the engine's read: differentiated by a device tap, moved out at the end
        def f(t):
            fn = staging.staged_read(lay, mesh, "float32", True, "device")
            return jnp.sum((x @ fn(t, w).T) @ fn(t, w))
        g = jax.grad(f)(staging.tap(lay.stored_shape, lay.spec, mesh, "device"))
        return jax.device_put(g, host)

    assert zinf.check_host_compute(jax.jit(tapped).trace(arg, x).lower(lowering_platforms=("cuda",))).ok
    np.testing.assert_allclose(  # and it is the same gradient (run on the CPU mesh)
        jax.jit(tapped)(jnp.ones(lay.stored_shape), jnp.ones((8, 32))),
        jax.jit(jax.grad(loss))(jnp.ones(lay.stored_shape), jnp.ones((8, 32))), rtol=1e-6)


def test_gpu_compile_options_follow_the_moves_and_xla_flags_win(monkeypatch):
    """The one XLA option the engine sets for a GPU (tests/xla shows it changes the compiled schedule): as many
    asynchronous moves at once as a loop iteration makes, where that is more than XLA's default of 2."""
    from zinf_jax.engine.compiled import GPU_ASYNC_LIMIT, compiler_options

    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert compiler_options("cpu", 24) == {} and compiler_options("tpu", 24) == {}
    assert compiler_options("gpu", 2) == {} and compiler_options("cuda", 24) == {GPU_ASYNC_LIMIT: 24}
    monkeypatch.setenv("XLA_FLAGS", f"--{GPU_ASYNC_LIMIT}=4")
    assert compiler_options("cuda", 24) == {}
    eng = _engine("cpu", "cpu", 8)  # a block's 12 parameters moved in, and their 12 gradients out
    assert eng.passes.compiler_options("cuda") == {} and eng.passes.compiler_options("cpu") == {}
    monkeypatch.delenv("XLA_FLAGS")
    per_block = sum(p.startswith("blocks/0/") for p in eng.store.layouts)
    assert eng.passes.compiler_options("cuda") == {GPU_ASYNC_LIMIT: 2 * per_block}
    eng.close()


def _bench_device(tmp_path, *flags, timeout=600):
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "bench_device.py"
    proc = subprocess.run([sys.executable, str(script), "--small", "--out", str(tmp_path), *flags],
                          capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    return proc, json.loads((tmp_path / "summary.json").read_text())


def test_bench_device_keeps_the_summary_when_a_runner_hangs(tmp_path):
    proc, summary = _bench_device(tmp_path, "--runners", "transfers", "--runner-timeout", "0.2", timeout=120)
    assert proc.returncode == 1 and summary["runners"] == {"transfers": "timeout after 0s"}
    assert "=== transfers: timeout" in (tmp_path / "log.txt").read_text()


@pytest.mark.slow
def test_bench_device_small_runs_and_checks_losses_against_plain_jax(tmp_path):
    proc, summary = _bench_device(tmp_path, "--runners", "transfers,plain,compiled,compiled_device")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert set(summary["runners"].values()) == {"ok"}
    assert all(c["ok"] for c in summary["loss_check"].values()) and len(summary["loss_check"]) == 2
    assert summary["offload_program_ratio"] > 0 and (tmp_path / "trace_compiled.json.gz").stat().st_size > 0
    assert summary["transfers"]["pinned_to_device_in_program_gbps"] > 0
