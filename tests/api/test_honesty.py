"""Config honesty and API misuse (issue 11): every setting used or refused, misuse refused before any change."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zinf_jax as zinf
from test_workflows import batches, config, ctor, flat, optax_run
from flax import nnx

from zinf_jax.models import GPT, GPTConfig, lm_loss
from zinf_jax.tiers import DeviceTier


def cpu_config(**kw):
    return zinf.ZeroConfig(persistence_threshold=600, **kw)


@pytest.mark.parametrize("kind", [pytest.param("zinf", marks=pytest.mark.slow),
                                  pytest.param("optax", marks=pytest.mark.slow)])  # default: test_workflows clip+adamw
def test_gradient_clipping_applies_to_any_optimizer(kind):
    data = batches(3)
    # eps 1e-4: see OPTAX in test_workflows (an element whose gradient is pure cancellation)
    opt = zinf.adam(3e-3, eps=1e-4) if kind == "zinf" else optax.adam(3e-3, eps=1e-4)
    eng = zinf.initialize(ctor, config=cpu_config(gradient_clipping=0.5), optimizer=opt, loss_fn=lm_loss)
    assert eng.optimizer.rule.clip_norm == 0.5
    out = [eng.train_step(b) for b in data]
    assert out[0]["grad_norm"] > 0.5  # clipping really active
    ref_losses, ref_params = optax_run(ctor(), optax.chain(optax.clip_by_global_norm(0.5), optax.adam(3e-3, eps=1e-4)),
                                      data)
    np.testing.assert_allclose([o["loss"] for o in out], ref_losses, rtol=1e-5)
    got = flat(eng.params())
    for path, r in ref_params.items():
        np.testing.assert_allclose(got[path], r, rtol=1e-5, atol=1e-6, err_msg=path)
    eng.close()


def test_conflicting_settings_are_refused():
    with pytest.raises(zinf.ConfigError, match="gradient_clipping: the config clips at 0.5 but the optimizer clips at 1.0"):
        zinf.initialize(ctor, config=cpu_config(gradient_clipping=0.5), optimizer=zinf.adam(1e-3, clip_norm=1.0),
                        loss_fn=lm_loss)
    ds = zinf.ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 3},
                                         "optimizer": {"type": "AdamW", "params": {"lr": 0.02}}})
    with pytest.raises(zinf.ConfigError, match="both initialize\\(optimizer=...\\) and ZeroConfig.optimizer"):
        zinf.initialize(ctor, config=ds, optimizer=zinf.adam(1e-3), loss_fn=lm_loss)
    eng = zinf.initialize(ctor, config=ds, loss_fn=lm_loss)  # the DeepSpeed optimizer section is used
    assert eng.train_step(batches(1)[0])["lr"] == pytest.approx(0.02)
    eng.close()


def test_float16_compute_scales_the_loss_by_default():
    eng = zinf.initialize(ctor, config=cpu_config(compute_dtype="float16"), loss_fn=lm_loss)
    assert eng.optimizer.loss_scale == 2.0 ** 16  # DeepSpeed's dynamic default
    eng.close()
    off = cpu_config(compute_dtype="float16", loss_scale=zinf.LossScaleConfig(enabled=False))
    eng = zinf.initialize(ctor, config=off, loss_fn=lm_loss)
    assert eng.optimizer.loss_scale == 1.0  # explicitly off is honoured
    eng.close()


def test_offload_optimizer_none_keeps_the_state_in_device_memory():
    """The state in device memory (the update in the step's program) or on the host (the fused CPU kernel): both
    train as plain jit + optax.adamw with zinf.adamw(1e-3)'s defaults. (Not bit for bit against each other: the
    two updates are different programs, whose fused multiply-adds depend on the CPU's instruction set.)"""
    data = batches(3)
    decay = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)  # noqa: E731 - zinf.adamw's default mask
    ref_losses, ref_params = optax_run(ctor(), optax.adamw(1e-3, weight_decay=1e-4, mask=decay), data)
    for dev in ("none", "cpu"):
        eng = zinf.initialize(ctor, config=cpu_config(offload_optimizer=zinf.Offload(dev)), loss_fn=lm_loss)
        np.testing.assert_allclose([eng.train_step(b)["loss"] for b in data], ref_losses, rtol=1e-5, err_msg=dev)
        got = eng.param_arrays()
        for k, v in ref_params.items():
            np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-6, err_msg=f"{dev} {k}")
        if dev == "none":
            assert isinstance(eng.opt_tier, DeviceTier)
        eng.close()


def test_misuse_fails_before_any_state_changes(tmp_path):
    eng = zinf.initialize(ctor, config=config(tmp_path / "a"), loss_fn=lm_loss)
    b = batches(1)[0]
    with pytest.raises(zinf.EngineError, match="cannot run under jax.jit"):
        jax.jit(eng.train_step)(jnp.asarray(b))
    per_example = lambda model, batch: jnp.mean(model(batch[:, :-1]), axis=(1, 2))  # noqa: E731
    bad = zinf.initialize(ctor, config=config(tmp_path / "b"), loss_fn=per_example)
    with pytest.raises(zinf.EngineError, match=r"scalar loss, got shape \(8,\)"):
        bad.train_step(b)
    assert bad.step == 0
    bad.close()
    raw_key = jax.random.fold_in(jax.random.PRNGKey(0), 3)  # an old-style uint32[2] key in the batch
    with pytest.raises(ValueError, match=r"batch leaf \[1\] of shape \(2,\).*jax.random.wrap_key_data"):
        eng.train_step((b, raw_key))
    with pytest.raises(ValueError, match=r"\(7, 17\).*7 does not divide by 8"):
        eng.train_step(b[:7])
    assert eng.step == 0
    first = eng.train_step(b)["loss"]
    fresh = zinf.initialize(ctor, config=config(tmp_path / "c"), loss_fn=lm_loss)
    assert fresh.train_step(b)["loss"] == first  # the refused calls changed nothing
    fresh.close()
    eng.close()
    eng.close()  # idempotent
    for call in (lambda: eng.train_step(b), lambda: eng.save(tmp_path / "ck"), eng.params, eng.model_state):
        with pytest.raises(zinf.EngineError, match="after engine.close"):
            call()
    assert not (tmp_path / "ck").exists()


def test_settings_without_effect_are_warned():
    cfg = cpu_config(offload_param=zinf.Offload("cpu", buffer_count=3))  # the optimizer's buffer sets only
    assert cfg.inert_settings() == ["offload_param.buffer_count=3"]
    with pytest.warns(UserWarning, match="no effect: offload_param.buffer_count=3"):
        zinf.initialize(ctor, config=cfg, loss_fn=lm_loss).close()
    assert zinf.ZeroConfig().inert_settings() == []


def _chunk_files(tier_dir, key):
    return sorted(p for p in (tier_dir / "process_0" / "data" / key / "s0" / "c").rglob("*") if p.is_file())


def test_aio_block_size_and_threads_shape_the_nvme_io(tmp_path):
    """aio.block_size cuts shards into chunk files of that size and bounds the files small shards are packed in;
    aio.thread_count sizes the I/O pools."""
    def run(path, aio):
        path.mkdir()
        cfg = zinf.ZeroConfig.from_deepspeed({
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 600,
                                  "offload_param": {"device": "nvme", "nvme_path": str(path)},
                                  "offload_optimizer": {"device": "nvme", "nvme_path": str(path)}},
            **({"aio": aio} if aio else {})})
        mk = lambda: GPT(GPTConfig(vocab=8192, d_model=256, n_heads=4, n_layers=1, seq=16), rngs=nnx.Rngs(0))  # noqa: E731
        eng = zinf.initialize(mk, config=cfg, optimizer=zinf.adamw(1e-3), loss_fn=lm_loss)
        eng.train_step(batches(1)[0])
        pools = [(t._arrays._io._readers._max_workers, len(t._arrays._io._readers._threads),
                  t._arrays._io._writers._max_workers)
                 for t in (eng.param_tier, eng.opt_tier, eng.grad_tier)]
        eng.close()
        return pools

    key = "master/embed/embedding"  # 8192 x 256 fp32 over 8 devices: 1 MiB shards, not packed
    small = run(tmp_path / "a", {"block_size": 256 << 10, "thread_count": 2})
    default = run(tmp_path / "b", None)
    got, base = _chunk_files(tmp_path / "a" / "optimizer", key), _chunk_files(tmp_path / "b" / "optimizer", key)
    assert len(base) == 8 and len(got) == 8 * 4  # one file per shard by default; 256 KiB pieces: 4 per shard
    assert {f.stat().st_size for f in got} == {256 << 10}
    packs = [sorted((d / "optimizer" / "process_0" / "packs").iterdir()) for d in (tmp_path / "a", tmp_path / "b")]
    # the small shards: one pack file by default; with 256 KiB blocks, files of <= 256 KiB (or one larger key each)
    assert len(packs[1]) == 1 and len(packs[0]) > 3
    assert all(r == w == 2 and live <= 2 for r, live, w in small)
    assert all(r == w == 4 for r, _, w in default)
