"""zinf_jax.estimate against what the engine actually holds, tier by tier.

Each configuration builds a real engine on a tiny GPT whose blocks stream, runs
two train steps (so both NVMe slots of every key are written), and measures:

* device: the engine's own accounting (``engine.streamed.peak_device_bytes``:
  prefetched shards + gathered unit + checkpoints + unit state) plus what it
  leaves out: the fetched persistent params and, with params on ``none``, the
  device tier (committed + uncommitted copies, seen just before its commit);
* host: state held by zinf (not RSS): the grad sink when the optimizer step
  starts, the driver's sub-group buffers, and the cpu tiers' committed +
  uncommitted copies just before their commit (instance wrappers, test only);
* nvme: the sizes of every file under the tier directories.

The process RSS growth is recorded (``record_property``), not asserted.
"""
import dataclasses
import warnings
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zinf_jax as zinf
from helpers.small_models import TinyLM, ConvNet, TinyLMConfig, lm_loss
from zinf_jax.optim.fused import MOVE_IN_AHEAD
from zinf_jax.estimate import (CONFIGURATIONS, RUNTIME_OVERHEAD, Machine, estimate, estimate_from_model,
                               estimate_from_sizes, fits, format_report)

CFG = TinyLMConfig(n_layers=3, d_model=32, vocab=64, seq=16)
THRESHOLD = 512  # LayerNorms, biases and the position table persist; blocks and the embedding stream
WHOLE = 1 << 20  # a persistence threshold over every parameter of the test GPT: all its units whole
BATCH = 8
N_DEVICES = int(os.environ.get("ZINF_ESTIMATE_TEST_DEVICES", "2"))  # few shards: fewer fsynced files per step
REL, SLACK = 0.15, 64 << 10


def ctor(cfg=CFG):
    return lambda: TinyLM(cfg, rngs=nnx.Rngs(0, dropout=1))


def mesh():
    return zinf.make_mesh(devices=jax.devices()[:N_DEVICES])


def zconfig(param="none", opt="cpu", path=None, **kw):
    """The streamed engine's settings: its own device accounting is what the estimate replays."""
    kw.setdefault("persistence_threshold", THRESHOLD)
    return zinf.ZeroConfig(offload_param=zinf.Offload(param, path=path), offload_optimizer=zinf.Offload(opt, path=path),
                           engine="streamed", **kw)


def example(cfg=CFG):
    return jax.ShapeDtypeStruct((BATCH, cfg.seq + 1), np.int32)


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def _arrays_bytes(values) -> int:
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in values)


def _watch_commit(tier, record: dict, name: str) -> None:
    """Records the memory tier's bytes just before each commit (its private table)."""
    commit = tier.commit

    def wrapped(metadata=None):
        tier.wait()
        held = _arrays_bytes(tier._data.values())
        record[name] = max(record.get(name, 0), held)
        return commit(metadata)

    tier.commit = wrapped


def measure(param: str, opt: str, path) -> tuple[dict, dict]:
    """Builds the engine, runs two steps; measured bytes per tier and their parts."""
    r0 = rss()
    engine = zinf.initialize(ctor(), config=zconfig(param, opt, str(path)), mesh=mesh(), loss_fn=lm_loss)
    rec: dict = {}
    for tier, name in ((engine.param_tier, "param_tier"), (engine.opt_tier, "opt_tier")):
        if tier.kind in ("cpu", "device"):
            _watch_commit(tier, rec, name)
    step = engine.optimizer.step

    def watched_step(grad, write_param, **kw):
        rec["grad_sink"] = max(rec.get("grad_sink", 0), engine.streamed.sink.nbytes())
        return step(grad, write_param, **kw)

    engine.optimizer.step = watched_step
    tokens = np.asarray(jax.random.randint(jax.random.key(0), (BATCH, CFG.seq + 1), 0, CFG.vocab))
    try:
        for _ in range(2):
            engine.train_step(tokens)
        glue = sum(s.data.nbytes for a in engine.store.fetch(engine.adapter.glue_paths) for s in a.addressable_shards)
        dev_tier = rec.get("param_tier", 0) if param == "none" else 0
        drv = engine.optimizer
        buffers = sum(a.nbytes for s in drv._sets for a in s.arrays)  # calloc'd _zeros stay untouched: not counted
        buffers += sum(x.nbytes for x in (drv._assembly, drv._scratch) if x is not None)
        host_tiers = sum(rec.get(n, 0) for n, t in (("param_tier", engine.param_tier), ("opt_tier", engine.opt_tier))
                         if t.kind == "cpu")
        parts = {
            "device_stream": engine.streamed.peak_device_bytes, "device_glue": glue,
            "device_tier": dev_tier,
            "grad_sink": rec["grad_sink"], "buffers": buffers, "host_tiers": host_tiers,
            "rss_growth": rss() - r0,
        }
    finally:
        engine.close()
    nvme = sum(os.path.getsize(os.path.join(root, f)) for sub in ("params", "optimizer", "grads")
               for root, _, files in os.walk(path / sub) for f in files)
    device = parts["device_stream"] + glue + dev_tier
    host = parts["grad_sink"] + buffers + host_tiers
    return {"device": device, "host": host, "nvme": nvme}, parts


def close(est: int, true: int) -> bool:
    return abs(est - true) <= SLACK if true == 0 or est == 0 else abs(est - true) <= REL * true


@pytest.fixture(scope="module")
def estimates():
    ests = estimate_from_model(ctor(), config=zconfig(), mesh=mesh(), loss_fn=lm_loss, example_batch=example())
    return {(e.param_tier, e.optimizer_tier): e for e in ests}


@pytest.mark.parametrize("param,opt", [  # the default suite checks two tier pairs; -m slow all six
    c if c in {("none", "cpu"), ("nvme", "nvme")} else pytest.param(*c, marks=pytest.mark.slow)
    for c in CONFIGURATIONS])
def test_estimate_matches_engine(param, opt, estimates, tmp_path, record_property):
    measured, parts = measure(param, opt, tmp_path)
    est = estimates[(param, opt)]
    got = {"device": est.device_bytes_local, "host": est.host_bytes, "nvme": est.nvme_bytes}
    for tier in ("device", "host", "nvme"):
        record_property(f"{tier}_measured", measured[tier])
        record_property(f"{tier}_estimated", got[tier])
    record_property("rss_growth", parts["rss_growth"])
    print(f"\n{param}/{opt}: measured {measured} estimated {got} parts {parts}")
    for tier in ("device", "host", "nvme"):
        assert close(got[tier], measured[tier]), (tier, got[tier], measured[tier], dict(est.breakdown), parts)
    assert (measured["nvme"] == 0) == ("nvme" not in (param, opt)) == (est.nvme_bytes == 0)
    assert est.device_bytes * est.n_devices >= est.device_bytes_local


@pytest.mark.parametrize("settings", [dict(prefetch_depth=0), dict(prefetch_depth=3, max_live_bytes=60_000),
                                      dict(prefetch_depth=1, offload_activations=True),
                                      dict(persistence_threshold=WHOLE)])  # every unit kept for its backward
def test_device_peak_replays_the_prefetcher(settings):
    """The schedule replay gives the engine's own device accounting exactly, whatever the prefetch settings."""
    config = zconfig("cpu", "cpu", **settings)
    engine = zinf.initialize(ctor(), config=config, mesh=mesh(), loss_fn=lm_loss)
    try:
        engine.train_step(np.asarray(jax.random.randint(jax.random.key(1), (BATCH, CFG.seq + 1), 0, CFG.vocab)))
        peak = engine.streamed.peak_device_bytes
    finally:
        engine.close()
    est = estimate_from_model(ctor(), config=config, mesh=mesh(), loss_fn=lm_loss, example_batch=example(),
                              configurations=[("cpu", "cpu")])[0]
    assert est.device_bytes_local - est.breakdown["device.persistent_params"] == peak
    assert ("device.activations" in est.breakdown) != settings.get("offload_activations", False)


def test_sizes_agree_with_model(estimates):
    """The GPT formula (12 h^2 + 13 h per block, tied V x h embedding) on the test GPT's own sizes."""
    params = estimates[("none", "cpu")].params
    sized = estimate_from_sizes(params, CFG.n_layers, CFG.d_model, CFG.vocab, CFG.seq, BATCH, n_devices=N_DEVICES,
                                config=zconfig(), platform="cpu")
    for e in sized:
        m = estimates[(e.param_tier, e.optimizer_tier)]
        assert e.params == m.params
        for a, b in ((e.device_bytes_local, m.device_bytes_local), (e.host_bytes, m.host_bytes)):
            assert abs(a - b) <= REL * b, (e.param_tier, e.optimizer_tier, a, b)
        assert abs(e.nvme_bytes - m.nvme_bytes) <= REL * m.nvme_bytes + SLACK


def test_device_does_not_grow_with_layers_when_activations_are_offloaded():
    def dev(layers, offload):
        cfg = TinyLMConfig(n_layers=layers, d_model=32, vocab=64, seq=16)
        est = estimate_from_model(ctor(cfg), config=zconfig("cpu", "cpu", offload_activations=offload),
                                  mesh=mesh(), loss_fn=lm_loss, example_batch=example(cfg),
                                  configurations=[("cpu", "cpu")])[0]
        return est.device_bytes_local, est.host_bytes

    (d3, h3), (d6, h6) = dev(3, True), dev(6, True)
    assert 0 <= d6 - d3 <= 3 * 12 * N_DEVICES and h6 > h3  # only each block's dropout key + count (12 B a device) grows
    per_block = BATCH * CFG.seq * CFG.d_model * 4  # one float32 checkpoint per block call
    # and each checkpoint on device also holds the block's RNG state at the call (for the exact replay)
    assert 0 <= dev(6, False)[0] - dev(3, False)[0] - (d6 - d3 + 3 * per_block) <= 3 * 12 * N_DEVICES


def test_fits_and_report():
    ests = estimate(None, params=None, layers=4, hidden=256, vocab=1000, seq=128, batch=8, n_devices=8,
                    config=zconfig(), platform="gpu")
    assert [(e.param_tier, e.optimizer_tier) for e in ests] == list(CONFIGURATIONS)
    assert ests[0].compute_dtype == "bfloat16"
    big = Machine(80 << 30, 1 << 40, 1 << 40, 8)
    assert fits(ests, big) == ests
    no_disk = Machine(80 << 30, 1 << 40, 0, 8)
    assert [(e.param_tier, e.optimizer_tier) for e in fits(ests, no_disk)] == [("none", "cpu"), ("cpu", "cpu")]
    assert fits(ests, Machine(1 << 20, 1 << 40, 1 << 40, 8)) == []
    report = format_report(ests, no_disk)
    assert "✓" in report and "✗" in report and "GiB" in report and len(report.splitlines()) == len(ests) + 3
    with pytest.raises(ValueError, match="devices"):
        ests[0].fits(Machine(80 << 30, 1 << 40, 1 << 40, 4))
    with pytest.raises(ValueError, match="configuration"):
        estimate_from_sizes(None, 2, 64, 100, 8, 8, n_devices=8, configurations=[("gpu", "cpu")])
    two = estimate(None, params=None, layers=4, hidden=256, vocab=1000, seq=128, batch=8, n_devices=8,
                   config=dataclasses.replace(zconfig(), nvme_update="double_slot"), platform="gpu")
    # every shard under 1 MiB is packed at a page boundary: what that adds on disk, from the shard sizes
    h = 256
    tensors = [3 * h * h, h * h, 4 * h * h, 4 * h * h, 3 * h, h, 4 * h, h, h, h, h, h] * 4 + [1000 * h, h, h]
    shards = [(-(-t // 8), 8) if t > THRESHOLD else (t, 1) for t in tensors]
    pages = 3 * sum(k * (-(-4 * n // 4096) * 4096 - 4 * n) for n, k in shards)  # master, m, v: 4 B each
    for e, d in zip(ests, two):  # nvme in place: one copy; double slot: two; memory tiers one copy (12 B/param)
        if e.optimizer_tier == "nvme":
            assert 12 * e.params + pages <= e.breakdown["nvme.optimizer_state"] < 12.1 * e.params + pages
            assert 24 * e.params + 2 * pages <= d.breakdown["nvme.optimizer_state"] < 24.1 * e.params + 2 * pages
            # shards of this size (hidden 256: 128 KiB) are gradients kept in host RAM, not written out
            assert "nvme.gradients" not in e.breakdown and "nvme.gradients" not in d.breakdown
            assert e.breakdown["host.grad_sink"] >= 4 * e.params
        else:
            assert 12 * e.params <= e.breakdown["host.optimizer_state"] < 12.01 * e.params
    big = estimate(None, params=None, layers=4, hidden=1024, vocab=1000, seq=128, batch=8, n_devices=8,
                   config=zconfig(), platform="gpu", configurations=[("nvme", "nvme")])[0]
    # 2 MiB shards are written out; under 1 MiB (the h x h projection, the embedding, vectors) kept in RAM
    h = 1024
    tensors = [3 * h * h, h * h, 4 * h * h, 4 * h * h, 3 * h, h, 4 * h, h, h, h, h, h] * 4 + [1000 * h, h, h]
    small = sum(4 * t for t in tensors if 4 * (-(-t // 8) if t > THRESHOLD else t) < 1 << 20)
    assert big.breakdown["host.grad_sink"] >= small
    assert 4 * big.params - small <= big.breakdown["nvme.gradients"] < 4.1 * big.params - small
    # gradients leave host RAM as they are produced: one unit's at most (4 blocks + embedding here), and the small
    assert big.breakdown.get("host.grad_sink", 0) <= 4 * big.params / 4 + small


def test_linen_model():
    x = jax.ShapeDtypeStruct((8, 6, 6, 2), np.float32)
    ests = estimate_from_model(ConvNet(), config=zinf.ZeroConfig(persistence_threshold=50), mesh=zinf.make_mesh(),
                               init_args=(np.zeros(x.shape, x.dtype),), batch=16)
    e = ests[0]
    assert e.params == 5 * 2 * 9 + 5 + 7 * 5 * 9 + 7 + 13 * 7 * 36 + 13 + 3 * 13 + 3
    assert e.breakdown["device.activations"] > 0 and e.host_bytes >= 4 * e.params


def test_runtime_overhead_is_measured():
    """The cpu runtime constant is what a fresh process holds after importing and compiling."""
    code = ("import jax, jax.numpy as jnp, numpy as np, zinf_jax\n"
            "from zinf_jax.optim.kernel import sum_squares\n"
            "jax.jit(lambda a: a * 2)(jnp.ones(8)).block_until_ready(); sum_squares(np.ones(64, np.float32))\n"
            "print(next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmRSS')))\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=True)
    measured = int(out.stdout.split()[-1])
    assert 0.6 * RUNTIME_OVERHEAD["cpu"][1] <= measured <= 1.4 * RUNTIME_OVERHEAD["cpu"][1], measured


def test_estimate_warns_that_kept_activations_are_not_modelled():
    with pytest.warns(UserWarning, match="activation_checkpointing=False"):
        estimate(None, params=None, layers=2, hidden=64, vocab=100, seq=16, batch=8, n_devices=8,
                 config=zinf.ZeroConfig(activation_checkpointing=False), platform="gpu")


@pytest.mark.parametrize("checkpointing,threshold", [(True, THRESHOLD), (False, THRESHOLD), (True, WHOLE)])
def test_step_io_bytes_match_the_tiers(tmp_path, checkpointing, threshold):
    """The disk bytes a step reads and writes (the estimate's I/O bound) against the tiers' own counters
    (``WHOLE``: every unit's params whole, each unit read once a step)."""
    off = zinf.Offload("nvme", path=str(tmp_path))
    config = zinf.ZeroConfig(offload_param=off, offload_optimizer=off, persistence_threshold=threshold,
                             activation_checkpointing=checkpointing)
    engine = zinf.initialize(ctor(), config=config, mesh=mesh(), loss_fn=lm_loss)
    batch = np.asarray(jax.random.randint(jax.random.key(1), (BATCH, CFG.seq + 1), 0, CFG.vocab))
    try:
        engine.train_step(batch)
        tiers = [t for t in (engine.param_tier, engine.opt_tier, engine.grad_tier) if t is not None]
        before = [(t.bytes_read, t.bytes_written) for t in tiers]
        engine.train_step(batch)  # a steady step
        read = sum(t.bytes_read - r for t, (r, _) in zip(tiers, before))
        written = sum(t.bytes_written - w for t, (_, w) in zip(tiers, before))
    finally:
        engine.close()
    est = estimate_from_model(ctor(), config=config, mesh=mesh(), loss_fn=lm_loss, example_batch=example(),
                              configurations=[("nvme", "nvme")])[0]
    assert written == est.step_write_bytes
    assert 0.97 < est.step_read_bytes / read < 1.05, (est.step_read_bytes, read)  # persistent params counted per device
    assert est.io_seconds(2.0) == pytest.approx(est.step_read_bytes / 2e9 + est.step_write_bytes / 2e9)


def test_step_flops_against_xlas_cost_analysis_of_the_plain_step():
    """The estimate's FLOPs (the forward's matrix products, x3 for forward+backward, x4 with activation
    checkpointing) against XLA's own count for plain ``jax.value_and_grad`` of the unwrapped model (which also
    counts the elementwise arithmetic: a few percent here)."""
    cfg = TinyLMConfig(n_layers=2, d_model=128, vocab=256, seq=32)
    gdef, state = nnx.split(ctor(cfg)())
    batch = np.zeros((BATCH, cfg.seq + 1), np.int32)
    step = jax.jit(lambda st: nnx.value_and_grad(lm_loss)(nnx.merge(gdef, st), batch))
    xla = step.lower(state).cost_analysis()["flops"]
    for checkpointing, passes in ((False, 3), (True, 4)):
        config = zinf.ZeroConfig(persistence_threshold=1 << 14, activation_checkpointing=checkpointing)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (kept activations are not modelled)
            est = estimate_from_model(ctor(cfg), config=config, mesh=mesh(), loss_fn=lm_loss, example_batch=example(cfg),
                                      configurations=[("cpu", "cpu")])[0]
        assert 0.95 * xla < est.step_flops * 3 / passes <= xla, (est.step_flops, xla)
    sized = estimate_from_sizes(None, cfg.n_layers, cfg.d_model, cfg.vocab, cfg.seq, BATCH, n_devices=N_DEVICES,
                                platform="cpu", configurations=[("cpu", "cpu")])[0]
    assert 0.9 * xla < sized.step_flops * 3 / 4 < 1.1 * xla  # the GPT formula on the same sizes


def test_matmul_flops_count_nested_programs():
    """Scans count their body ``length`` times, conds their costliest branch; convolutions as XLA counts them
    (unpadded: with padding XLA leaves out the products with the padding's zeros)."""
    from zinf_jax._internal.flops import matmul_flops

    w = jnp.ones((16, 16))

    def scanned(x):
        return jax.lax.scan(lambda c, _: (c @ w, None), x, None, length=5)[0]

    assert matmul_flops(jax.make_jaxpr(scanned)(jnp.ones((4, 16)))) == 5 * 2 * 4 * 16 * 16
    branchy = lambda p, x: jax.lax.cond(p, lambda: x @ w @ w, lambda: x @ w)  # noqa: E731
    assert matmul_flops(jax.make_jaxpr(branchy)(True, jnp.ones((4, 16)))) == 2 * 2 * 4 * 16 * 16
    conv = lambda x, k: jax.lax.conv_general_dilated(x, k, (1, 1), "VALID")  # noqa: E731
    x, k = jnp.ones((2, 3, 8, 8)), jnp.ones((5, 3, 3, 3))
    assert matmul_flops(jax.make_jaxpr(conv)(x, k)) == jax.jit(conv).lower(x, k).cost_analysis()["flops"]


def test_step_seconds_by_phase():
    """Forward+backward: on accelerators the longer of compute and its disk traffic, on a CPU mesh (the same
    cores compute and move the bytes) their sum; optimizer: its reads plus its writes (one disk); nvme tiers
    need the disk's bandwidth."""
    est = estimate_from_sizes(None, 8, 2048, 256, 64, 8, n_devices=2, platform="gpu",
                              configurations=[("nvme", "nvme"), ("cpu", "cpu")])
    disk, mem = est
    t = disk.step_seconds(0.04, 1.5, 2.0)
    assert t["compute"] == pytest.approx(disk.step_flops / (2 * 0.04e12))
    assert t["pass_io"] == pytest.approx(disk.step_pass_read_bytes / 1.5e9 + disk.step_pass_write_bytes / 2e9)
    opt_read, opt_write = (disk.step_read_bytes - disk.step_pass_read_bytes,
                           disk.step_write_bytes - disk.step_pass_write_bytes)
    assert opt_read > 0 and opt_write > 0
    assert t["optimizer_io"] == pytest.approx(opt_read / 1.5e9 + opt_write / 2e9)
    assert t["step"] == pytest.approx(max(t["compute"], t["pass_io"]) + t["optimizer_io"])
    assert disk.step_seconds(1000.0, 1.5, 2.0)["forward_backward"] == pytest.approx(t["pass_io"])  # disk-bound
    (cpu_disk,) = estimate_from_sizes(None, 8, 2048, 256, 64, 8, n_devices=2, platform="cpu",
                                      configurations=[("nvme", "nvme")])
    c = cpu_disk.step_seconds(0.04, 1.5, 2.0)
    assert c["forward_backward"] == pytest.approx(c["compute"] + c["pass_io"]) and c["pass_io"] > 0
    assert mem.step_seconds(0.04) == {"compute": t["compute"], "pass_io": 0.0, "forward_backward": t["compute"],
                                      "optimizer_io": 0.0, "step": t["compute"]}
    with pytest.raises(ValueError, match="read_gbps"):
        disk.step_seconds(0.04)
    with pytest.raises(ValueError, match="device_tflops"):
        mem.step_seconds(0.0)
    report = format_report(est, disk_gbps=1.5, device_tflops=0.04)
    assert "step s" in report and f"{t['compute']:.2f}" in report


def test_device_update_counts_the_state_on_the_devices_and_no_host_buffer_sets():
    """``optimizer_update="device"``: the whole optimizer state is in device memory during the step (the
    device-memory tier's figure for it), and the host holds its read-ahead, not the streamed step's sets (with
    the state in RAM the streamed step updates it in place, with no sets: [Note: updates in place])."""
    pairs = [("none", "cpu"), ("none", "nvme"), ("none", "none")]
    by = {u: {(e.param_tier, e.optimizer_tier): e for e in estimate_from_model(
        ctor(), config=zinf.ZeroConfig(persistence_threshold=THRESHOLD, optimizer_update=u), mesh=mesh(), loss_fn=lm_loss, example_batch=example(),
        configurations=pairs)} for u in ("host", "device")}
    state = by["host"][("none", "none")].breakdown["device.optimizer_state"]
    for pair in pairs[:2]:
        host, dev = by["host"][pair].breakdown, by["device"][pair].breakdown
        assert "device.optimizer_state" not in host and dev["device.optimizer_state"] == state
        assert dev["host.optimizer_buffers"] == min(state, MOVE_IN_AHEAD)
        if pair[1] == "nvme":
            assert dev["host.optimizer_buffers"] < host["host.optimizer_buffers"]
        else:
            assert "host.optimizer_buffers" not in host
    assert by["device"][("none", "none")].breakdown == by["host"][("none", "none")].breakdown


def test_a_whole_tensor_rule_sizes_the_buffer_sets_as_the_driver_allocates_them():
    """``optax.lamb`` updates every parameter whole: the streamed update's buffer sets are as large as the largest
    parameter's local shards (master, mu, nu, gradient), one unit of work a parameter. The estimate and the
    engine's host plan count sets of exactly the bytes the driver allocates."""
    import optax

    tx, cfg = optax.lamb(1e-3), TinyLMConfig(n_layers=1, d_model=32, vocab=64, seq=16)
    est = estimate_from_model(ctor(cfg), config=zconfig(), mesh=mesh(), loss_fn=lm_loss, example_batch=example(cfg),
                              optimizer=tx, configurations=[("none", "cpu")])[0]
    engine = zinf.initialize(ctor(cfg), config=zconfig(), mesh=mesh(), loss_fn=lm_loss, optimizer=tx)
    try:
        one = sum(a.nbytes for a in engine.optimizer._take().arrays)  # the set a step takes (allocated on first use)
        planned = engine.components.host_plan.items["optimizer_buffers"]
    finally:
        engine.close()
    # buffer_count sets at most, each of the driver's size (no shard is cut into sub-groups here: no assembly)
    assert planned == est.host_plan.items["optimizer_buffers"] == min(5, len(engine.layouts)) * one
    assert est.breakdown["host.optimizer_buffers"] == planned


def test_a_stack_scanned_by_the_model_is_estimated_layer_by_layer_as_the_engine_runs_it():
    """A decoder whose blocks are one stack applied by the model's nnx.scan: the estimator counts a call per
    layer (one layer gathered, one layer's shards per prefetched call), giving the streamed engine's own
    device accounting exactly."""
    from helpers.scan_models import ScannedDecoderLM

    def loss(model, toks):
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(model(toks[:, :-1]), toks[:, 1:]))

    make = lambda: ScannedDecoderLM(nnx.Rngs(0), n=8, d=64)  # noqa: E731
    toks = np.asarray(jax.random.randint(jax.random.key(1), (BATCH, 17), 0, 64))
    config = zconfig("cpu", "cpu", persistence_threshold=16)
    engine = zinf.initialize(make, config=config, mesh=mesh(), loss_fn=loss)
    try:
        assert engine.mode == "streamed" and "blocks" in {u.path for u in engine.adapter.units}
        engine.train_step(toks)
        peak = engine.streamed.peak_device_bytes
    finally:
        engine.close()
    est = estimate_from_model(make, config=config, mesh=mesh(), loss_fn=loss, example_batch=toks,
                              configurations=[("cpu", "cpu")])[0]
    assert est.device_bytes_local - est.breakdown.get("device.persistent_params", 0) == peak
    layer = 4 * (64 * 192 + 64 * 64 + 64 * 256 + 256 + 256 * 64 + 64 + 2 * 64)  # a block's parameters, float32
    assert est.breakdown["device.gathered_unit"] == layer * len(mesh().devices.flat)  # one layer, not the 8
