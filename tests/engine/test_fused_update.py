"""The optimizer step inside the compiled step (params and optimizer in device memory, zinf's Adam(W)):
against plain jit(value_and_grad) + optax, against the host-side streamed update of the same state, through
a skipped step and across checkpoints into and out of the other engines."""
import gc

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zinf_jax as zinf
from helpers.engine_utils import optax_run
from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss
from zinf_jax.optim.fused import FusedAdam, fused_refusal

CFG = GPTConfig(vocab=256, d_model=32, n_heads=4, n_layers=2, seq=16)
DATA = corpus()
LR, STEPS, CLIP = 3e-3, 8, 0.5
EPS = 1e-4  # see EPS in test_idioms: an element whose gradient is pure cancellation


def ctor():
    return GPT(CFG, rngs=nnx.Rngs(0))


def batches(n, start=0, batch=8):
    return [batch_at(DATA, s, batch, CFG.seq) for s in range(start, start + n)]


def adamw():
    return zinf.adamw(LR, eps=EPS, weight_decay=0.1)


def config(param="none", opt="none", **kw):
    # 600: the blocks' matrices sharded over the 8 devices, the norms and biases persistent (both kinds)
    return zinf.ZeroConfig(offload_param=zinf.Offload(param), offload_optimizer=zinf.Offload(opt),
                           **{"engine": "compiled", "gradient_clipping": CLIP, "persistence_threshold": 600, **kw})


@pytest.fixture(scope="module")
def fused_run():
    """The fused engine after STEPS steps: (engine, metrics)."""
    eng = zinf.initialize(ctor, config=config(), loss_fn=lm_loss, optimizer=adamw())
    ms = [eng.train_step(b) for b in batches(STEPS)]
    yield eng, ms
    eng.close()


def test_the_update_in_the_program_matches_optax(fused_run):
    eng, ms = fused_run
    assert isinstance(eng.optimizer, FusedAdam)
    assert all(m["time_split"]["optimizer_in_program"] == 1.0 for m in ms)
    assert any(eng.layouts[p].dim is not None for p in eng.trainable)  # sharded and persistent both
    assert any(eng.layouts[p].dim is None for p in eng.trainable)
    decay = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # noqa: E731 - zinf.adamw's default mask
    tx = optax.chain(optax.clip_by_global_norm(CLIP), optax.adamw(LR, eps=EPS, weight_decay=0.1, mask=decay))
    ref_losses, ref = optax_run(ctor(), tx, batches(STEPS))
    assert ms[0]["grad_norm"] > CLIP  # clipping is active
    np.testing.assert_allclose([m["loss"] for m in ms], ref_losses, rtol=1e-5)
    got = eng.param_arrays()
    for k, v in ref.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
    assert eng.step == STEPS
    lowered = eng.lower(batches(1)[0])  # the program train_step runs: master, m and v of every trained param in
    states = lowered.args_info[0][6]
    assert len(states) == len(eng.trainable) and all(len(row) == 3 for row in states)


@pytest.mark.parametrize("moments", ["float32", "bfloat16"])
def test_the_update_in_the_program_equals_the_host_update_of_the_same_state(fused_run, moments):
    """Against the streamed CPU Adam over the same tiers' numbers (the optimizer on the host): the same kernel
    arithmetic, up to the float32-vs-float64 norm and the host kernel's fused multiply-adds."""
    if moments == "float32":
        eng, ms = fused_run
    else:
        eng = zinf.initialize(ctor, config=config(moments_dtype=moments), loss_fn=lm_loss, optimizer=adamw())
        ms = [eng.train_step(b) for b in batches(STEPS)]
    host = zinf.initialize(ctor, config=config(opt="cpu", moments_dtype=moments), loss_fn=lm_loss, optimizer=adamw())
    assert not isinstance(host.optimizer, FusedAdam)
    hs = [host.train_step(b) for b in batches(STEPS)]
    np.testing.assert_allclose([m["loss"] for m in ms], [m["loss"] for m in hs], rtol=1e-6)
    np.testing.assert_allclose([m["grad_norm"] for m in ms], [m["grad_norm"] for m in hs], rtol=1e-5)
    a, b = eng.param_arrays(), host.param_arrays()
    flips, total = 0, sum(x.size for x in b.values())
    for k in a:
        if moments == "float32":
            np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, err_msg=k)
        else:  # the two updates' ~1e-7 differences round a moment near a bf16 boundary one ulp apart: the bound
            # and the share of such elements are test_bf16_moments.py's (one ulp of the update a step, <= 0.2%)
            np.testing.assert_allclose(a[k], b[k], rtol=0, atol=STEPS * LR * 2.0 ** -8, err_msg=k)
            flips += int(np.sum(~np.isclose(a[k], b[k], rtol=1e-5, atol=1e-6)))
    assert flips <= 0.002 * total, (flips, total)
    for p in eng.trainable:  # the moments in the tier as they are stored (bf16: rounded to nearest even)
        i = eng.components.store.local_indices(p)[-1]
        v, w = eng.optimizer.read_state(p, i, "v"), host.optimizer.read_state(p, i, "v")
        if moments == "float32":
            np.testing.assert_allclose(v, w, rtol=1e-5, atol=1e-12, err_msg=p)
        else:
            assert np.array_equal(v, v.astype(jnp.bfloat16).astype(np.float32))  # stored as bf16
            assert np.sum(~np.isclose(v, w, rtol=2.0 ** -7, atol=1e-12)) <= max(1, 0.002 * v.size), p
    host.close()
    if moments != "float32":
        eng.close()


def test_state_on_nvme_updated_on_the_device_is_the_device_memory_run_bitwise(fused_run, tmp_path):
    """``optimizer_update="device"``: master, m and v live on nvme, move in for each step's program and go back.
    The same program arithmetic as state kept in device memory, so the same numbers bit for bit; between steps
    no state is on the devices; a checkpoint of it continues under the host update (its CPU kernel: rtol 1e-6)."""
    eng, ms = fused_run
    (tmp_path / "t").mkdir()
    embed = next(p for p in eng.trainable if "embed" in p)  # its flat state is a 1-D array of its size
    size = int(np.prod(eng.layouts[embed].shape))

    def flat_states():
        gc.collect()  # what earlier tests' engines left in reference cycles
        return {id(x) for x in jax.live_arrays() if x.ndim == 1 and x.size == size}

    resident = flat_states()  # the device-memory run's (fused_run's) own, and what other tests keep alive

    def cfg(update):
        return zinf.ZeroConfig(offload_optimizer=zinf.Offload("nvme", path=str(tmp_path / "t")),
                               optimizer_update=update, engine="compiled", gradient_clipping=CLIP,
                               persistence_threshold=600)

    dev = zinf.initialize(ctor, config=cfg("device"), loss_fn=lm_loss, optimizer=adamw())
    assert isinstance(dev.optimizer, FusedAdam) and dev.grad_tier is None  # the gradients never leave the devices
    got = []
    for k, b in enumerate(batches(STEPS)):
        got.append(dev.train_step(b))
        if k == STEPS // 2 - 1:
            dev.save(tmp_path / "ckpt")
    assert all(m["time_split"]["optimizer_in_program"] == 1.0 for m in got)
    assert [m["loss"] for m in got] == [m["loss"] for m in ms]
    a, b = dev.param_arrays(), eng.param_arrays()
    assert all(a[k].tobytes() == b[k].tobytes() for k in b)
    assert flat_states() <= resident  # none of the nvme run's state stays on the devices
    first = dev.optimizer.read_state(embed, 0, "v")  # what the tier holds is the device-memory run's state
    np.testing.assert_array_equal(first, eng.optimizer.read_state(embed, 0, "v"))
    dev.close()
    host = zinf.restore(tmp_path / "ckpt", ctor, config=cfg("host"), loss_fn=lm_loss, optimizer=adamw())
    assert not isinstance(host.optimizer, FusedAdam) and host.step == STEPS // 2
    np.testing.assert_allclose([host.train_step(b)["loss"] for b in batches(STEPS // 2, start=STEPS // 2)],
                               [m["loss"] for m in ms[STEPS // 2:]], rtol=1e-6)
    host.close()


@pytest.mark.parametrize("window", [1, 1 << 30])
def test_state_in_host_ram_moves_through_the_program_bitwise(fused_run, window):
    """``optimizer_update="device"`` with the state on the cpu tier: the tier holds it in pinned host memory, the
    program moves each parameter's states in and back out ([Note: states moved in the program]), one parameter at a
    time (a window of 1 byte) or all ahead: the device-memory run's numbers bit for bit, and the tier's arrays are
    the program's outputs, in pinned host memory."""
    eng, ms = fused_run
    cfg = zinf.ZeroConfig(offload_optimizer=zinf.Offload("cpu"), optimizer_update="device", engine="compiled",
                          gradient_clipping=CLIP, persistence_threshold=600, max_in_flight_bytes=window)
    dev = zinf.initialize(ctor, config=cfg, loss_fn=lm_loss, optimizer=adamw())
    try:
        assert isinstance(dev.optimizer, FusedAdam) and dev.optimizer.window == window
        got = [dev.train_step(b) for b in batches(STEPS)]
        assert [m["loss"] for m in got] == [m["loss"] for m in ms]
        a, b = dev.param_arrays(), eng.param_arrays()
        assert all(a[k].tobytes() == b[k].tobytes() for k in b)
        path = next(iter(dev.trainable))
        held = dev.opt_tier.current(f"v/{path}", dev.optimizer._local[path][0])
        assert held.sharding.memory_kind == "pinned_host"
    finally:
        dev.close()


def test_device_update_refuses_what_its_program_cannot_take(tmp_path):
    """Params offloaded, accumulation: a ConfigError naming the setting, before the nvme tier is written."""
    nvme = zinf.Offload("nvme", path=str(tmp_path))
    for kw, reason in [(dict(offload_param=zinf.Offload("cpu")), "params must be in device memory"),
                       (dict(gradient_accumulation_steps=2), "accumulation")]:
        with pytest.raises(zinf.ConfigError, match=reason) as e:
            zinf.initialize(ctor, config=zinf.ZeroConfig(offload_optimizer=nvme, optimizer_update="device", **kw),
                            loss_fn=lm_loss, optimizer=adamw())
        assert e.value.field == "optimizer_update" and "optimizer_update='host'" in str(e.value)
        assert not list(tmp_path.iterdir())


def test_train_steps_equal_train_step_bitwise(fused_run):
    eng, ms = fused_run
    other = zinf.initialize(ctor, config=config(), loss_fn=lm_loss, optimizer=adamw())
    out = list(other.train_steps(batches(STEPS)))
    assert [m["loss"] for m in out] == [m["loss"] for m in ms]
    a, b = eng.param_arrays(), other.param_arrays()
    assert all(a[k].tobytes() == b[k].tobytes() for k in a)
    other.close()


def test_a_non_finite_gradient_skips_the_step_in_the_program():
    """A batch whose loss is NaN: nothing changes (params, moments, step count), the next step trains on."""
    def loss(model, tokens):
        return lm_loss(model, tokens) * jnp.where(tokens[0, 0] == 255, jnp.nan, 1.0)

    eng = zinf.initialize(ctor, config=config(), loss_fn=loss, optimizer=adamw())
    good = batches(2)
    eng.train_step(good[0])
    before = eng.param_arrays()
    v_before = {p: eng.optimizer.read_state(p, 0, "v") for p in eng.trainable}
    bad = good[1].copy()
    bad[0, 0] = 255
    m = eng.train_step(bad)
    assert m["skipped"] and eng.step == 1 and eng.optimizer.skipped == 1
    after = eng.param_arrays()
    assert all(after[p].tobytes() == before[p].tobytes() for p in before)
    assert all(eng.optimizer.read_state(p, 0, "v").tobytes() == v.tobytes() for p, v in v_before.items())
    m = eng.train_step(good[1])
    assert not m["skipped"] and eng.step == 2 and np.isfinite(m["loss"])
    eng.close()


def test_a_fused_checkpoint_continues_in_the_streamed_engine_and_back(tmp_path):
    """Saved by the fused engine after 3 steps, restored in the streamed engine (its host update over the same
    device tiers): the next 3 steps as the fused engine's own (rtol 1e-6); and saved there, restored fused again."""
    then = dict(engine="streamed")
    a = zinf.initialize(ctor, config=config(), loss_fn=lm_loss, optimizer=adamw())
    for b in batches(3):
        a.train_step(b)
    a.save(tmp_path / "ckpt")
    going_on = [a.train_step(b)["loss"] for b in batches(3, start=3)]
    a.close()
    b_ = zinf.restore(tmp_path / "ckpt", ctor, config=config(**then), loss_fn=lm_loss, optimizer=adamw())
    assert b_.step == 3
    np.testing.assert_allclose([b_.train_step(b)["loss"] for b in batches(3, start=3)], going_on, rtol=1e-6)
    b_.save(tmp_path / "ckpt2")
    further = [b_.train_step(b)["loss"] for b in batches(2, start=6)]
    b_.close()
    c = zinf.restore(tmp_path / "ckpt2", ctor, config=config(), loss_fn=lm_loss, optimizer=adamw())
    assert isinstance(c.optimizer, FusedAdam) and c.step == 6
    np.testing.assert_allclose([c.train_step(b)["loss"] for b in batches(2, start=6)], further, rtol=1e-6)
    c.close()


def test_what_keeps_the_update_on_the_host():
    """Accumulation, fp16 loss scaling, other tiers, the streamed engine, a cut shard: the
    streamed update, as before (each is trained that way by the engine's other tests). An optax transform runs in
    the program too (tests/optim/test_optax_parity.py)."""
    base = dict(compiled=True, param_tier="none", opt_tier="none", accumulation=1, loss_scaling=False,
                grad_tier=False, largest_shard=100, sub_group_size=1000)
    assert fused_refusal(adamw(), **base) is None
    for change, reason in [(dict(accumulation=2), "accumulation"), (dict(loss_scaling=True), "loss scaling"),
                           (dict(opt_tier="cpu"), "device memory"), (dict(compiled=False), "streamed"),
                           (dict(grad_tier=True), "gradient tier"), (dict(sub_group_size=10), "cuts a shard")]:
        assert reason in fused_refusal(adamw(), **{**base, **change}), change
    assert fused_refusal(optax.adamw(LR), **base) is None
    eng = zinf.initialize(ctor, config=config(gradient_accumulation_steps=2), loss_fn=lm_loss, optimizer=adamw())
    assert not isinstance(eng.optimizer, FusedAdam)
    eng.close()
