"""End to end: zinf training equals a plain jit + optax loop; checkpoints resume exactly."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zinf_jax as zinf
from helpers.engine_utils import optax_run
from zinf_jax.engine.adapters import leaf_paths as _leaf_paths
from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss
from zinf_jax.plan.units import path_str

CFG = GPTConfig(vocab=256, d_model=32, n_heads=4, n_layers=2, seq=16)
LR, WD, CLIP = 3e-3, 0.1, 1.0
DATA = corpus()


def ctor():
    return GPT(CFG, rngs=nnx.Rngs(0))


def batches(n, start=0):
    return [batch_at(DATA, s, 8, CFG.seq) for s in range(start, start + n)]


def config(tmp_path, param="nvme", opt="nvme", **kw):
    off = lambda d: zinf.Offload(d, path=str(tmp_path) if d == "nvme" else None)  # noqa: E731
    return zinf.ZeroConfig(offload_param=off(param), offload_optimizer=off(opt), persistence_threshold=600, **kw)


def engine(tmp_path, **kw):
    return zinf.initialize(ctor, config=config(tmp_path, **kw), optimizer=zinf.adamw(LR, weight_decay=WD, clip_norm=CLIP),
                           loss_fn=lm_loss)


def flat_params(state):
    return {path_str(p): np.asarray(v) for p, v in zip(_leaf_paths(state), jax.tree.leaves(state))}


def reference_run(steps):
    tx = optax.chain(optax.clip_by_global_norm(CLIP),
                     optax.adamw(LR, weight_decay=WD, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)))
    return optax_run(ctor(), tx, batches(steps))


def test_15_steps_match_jit_optax_on_nvme(tmp_path):
    ref_losses, ref_params = reference_run(15)
    eng = engine(tmp_path)
    losses = [eng.train_step(b)["loss"] for b in batches(15)]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    got = flat_params(eng.params())
    for path, r in ref_params.items():
        np.testing.assert_allclose(got[path], r, rtol=1e-5, atol=1e-6, err_msg=path)
    assert ref_losses[-1] < ref_losses[0] - 0.5  # it really trains
    eng.close()


@pytest.mark.parametrize("tier", [pytest.param("none", marks=pytest.mark.slow), "nvme"])  # (suite time)
def test_exact_resume_bitwise(tmp_path, tier):
    k, n = 3, 3
    eng = engine(tmp_path / "a", param=tier, opt="cpu" if tier == "none" else tier) if tier != "nvme" else None
    if eng is None:
        (tmp_path / "a").mkdir()
        eng = engine(tmp_path / "a", param=tier, opt=tier)
    for b in batches(k):
        eng.train_step(b)
    eng.save(tmp_path / "ckpt", user_state={"data_step": k})
    cont = [eng.train_step(b)["loss"] for b in batches(n, k)]
    cont_params = flat_params(eng.params())
    eng.close()

    (tmp_path / "b").mkdir()
    again = zinf.restore(tmp_path / "ckpt", ctor, config=config(tmp_path / "b", param=tier,
                         opt="cpu" if tier == "none" else tier),
                         optimizer=zinf.adamw(LR, weight_decay=WD, clip_norm=CLIP), loss_fn=lm_loss)
    assert again.step == k and again.user_state == {"data_step": k}
    redo = [again.train_step(b)["loss"] for b in batches(n, k)]
    assert redo == cont
    redo_params = flat_params(again.params())
    assert all(redo_params[p].tobytes() == cont_params[p].tobytes() for p in cont_params)
    again.close()


def test_exact_resume_bitwise_with_both_tiers_in_host_ram_in_bfloat16(tmp_path):
    """Both tiers in host RAM, bfloat16 compute: the trained parameters are the float32 masters cast as the step
    copies them out ([Note: shared fp32 master]); a restored engine reads the restored masters and continues
    bit for bit."""
    k, n, kw = 3, 3, {"param": "cpu", "opt": "cpu", "compute_dtype": "bfloat16"}
    eng = engine(tmp_path, **kw)
    assert eng.mode == "compiled" and eng.store.master_paths
    for b in batches(k):
        eng.train_step(b)
    eng.save(tmp_path / "ckpt")
    cont = [eng.train_step(b)["loss"] for b in batches(n, k)]
    cont_params = flat_params(eng.params())
    eng.close()
    again = zinf.restore(tmp_path / "ckpt", ctor, config=config(tmp_path, **kw),
                         optimizer=zinf.adamw(LR, weight_decay=WD, clip_norm=CLIP), loss_fn=lm_loss)
    assert again.step == k
    assert [again.train_step(b)["loss"] for b in batches(n, k)] == cont
    redo_params = flat_params(again.params())
    assert all(redo_params[p].tobytes() == cont_params[p].tobytes() for p in cont_params)
    again.close()


def test_resharded_restore_8_to_4_devices_nvme_to_cpu(tmp_path):
    eng = engine(tmp_path)
    for b in batches(2):
        eng.train_step(b)
    saved = flat_params(eng.params())
    eng.save(tmp_path / "ckpt")
    eng.close()
    mesh4 = zinf.make_mesh(devices=jax.devices()[:4])
    small = zinf.restore(tmp_path / "ckpt", ctor, config=config(tmp_path, param="cpu", opt="cpu"), mesh=mesh4,
                         optimizer=zinf.adamw(LR, weight_decay=WD, clip_norm=CLIP), loss_fn=lm_loss)
    assert small.mesh.shape["fsdp"] == 4
    got = flat_params(small.params())
    assert all(got[p].tobytes() == saved[p].tobytes() for p in saved)
    small.train_step(batches(1, 2)[0])  # and it trains on the smaller mesh
    small.close()


def test_checkpoint_of_another_model_and_missing_checkpoint(tmp_path, monkeypatch):
    eng = engine(tmp_path, param="cpu", opt="cpu")
    monkeypatch.chdir(tmp_path)
    eng.save("ckpt")  # a relative directory, as the main job uses by default
    eng.close()
    other = GPTConfig(vocab=256, d_model=64, n_heads=4, n_layers=2, seq=16)
    with pytest.raises(zinf.CheckpointError, match="another model"):
        zinf.restore(tmp_path / "ckpt", lambda: GPT(other, rngs=nnx.Rngs(0)), config=config(tmp_path, "cpu", "cpu"),
                     loss_fn=lm_loss)
    with pytest.raises(zinf.CheckpointError, match="no zinf_jax checkpoint"):
        zinf.restore(tmp_path / "nothing", ctor, config=config(tmp_path, "cpu", "cpu"), loss_fn=lm_loss)


def test_nan_gradient_skips_step(tmp_path):
    eng = engine(tmp_path, param="cpu", opt="cpu")
    eng.train_step(batches(1)[0])
    before = flat_params(eng.params())
    nan_loss = lambda model, b: lm_loss(model, b) * jnp.nan  # noqa: E731
    eng.loss_fn = nan_loss
    m = eng.train_step(batches(1, 1)[0])
    assert m["skipped"] and eng.step == 1
    after = flat_params(eng.params())
    assert all(after[p].tobytes() == before[p].tobytes() for p in before)
    eng.close()


def test_offloaded_activation_checkpoints_give_the_same_losses(tmp_path):
    """zinf_jax.models.GPT feeds an uncommitted jnp.arange to its position unit: parking must keep it usable.
    Both runs against plain jit + optax (not bit for bit against each other: the two programs are fused
    differently, and XLA:CPU below its top optimisation level may round a fused sum differently)."""
    ref_losses, _ = reference_run(2)
    for offload in (False, True):
        eng = engine(tmp_path, param="none", opt="cpu", offload_activations=offload)
        np.testing.assert_allclose([eng.train_step(b)["loss"] for b in batches(2)], ref_losses, rtol=1e-5,
                                   err_msg=f"offload_activations={offload}")
        eng.close()


def test_double_slot_equals_in_place_bitwise_and_resumes(tmp_path):
    """The nvme update modes differ only in what a crash leaves: the numbers are the same, bit for bit
    (so the optax-parity test above covers both); a double-slot run resumes bitwise too."""
    runs = {}
    for mode in ("in_place", "double_slot"):
        (tmp_path / mode).mkdir()
        eng = engine(tmp_path / mode, nvme_update=mode)
        losses = [eng.train_step(b)["loss"] for b in batches(4)]
        if mode == "double_slot":
            eng.save(tmp_path / "ckpt")
        losses += [eng.train_step(b)["loss"] for b in batches(2, 4)]
        runs[mode] = losses, flat_params(eng.params())
        disk = sum(f.stat().st_size for f in (tmp_path / mode / "optimizer").rglob("*") if f.is_file())
        runs[mode] += (disk,)
        eng.close()
    (a_loss, a_par, a_disk), (b_loss, b_par, b_disk) = runs["in_place"], runs["double_slot"]
    assert a_loss == b_loss and all(a_par[p].tobytes() == b_par[p].tobytes() for p in a_par)
    assert 1.9 * a_disk < b_disk < 2.1 * a_disk  # one copy of master/m/v vs two
    (tmp_path / "r").mkdir()
    again = zinf.restore(tmp_path / "ckpt", ctor, config=config(tmp_path / "r", nvme_update="double_slot"),
                         optimizer=zinf.adamw(LR, weight_decay=WD, clip_norm=CLIP), loss_fn=lm_loss)
    assert [again.train_step(b)["loss"] for b in batches(2, 4)] == b_loss[4:]
    got = flat_params(again.params())
    assert all(got[p].tobytes() == b_par[p].tobytes() for p in b_par)
    again.close()


def test_without_activation_checkpointing_matches_jit_optax_and_fetches_once(tmp_path):
    # ZeroConfig(activation_checkpointing=False): the forward keeps what the backward needs (never the
    # gathered parameters): no recompute and no second fetch per step, same training as plain JAX
    ref_losses, ref_params = reference_run(5)
    eng = engine(tmp_path, activation_checkpointing=False)
    losses = []
    for b in batches(5):
        before = eng.streamed.prefetcher.fetches
        losses.append(eng.train_step(b)["loss"])
        assert eng.streamed.prefetcher.fetches - before == len(eng.streamed.plan.calls)  # forward only
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    got = flat_params(eng.params())
    for path, r in ref_params.items():
        np.testing.assert_allclose(got[path], r, rtol=1e-5, atol=1e-6, err_msg=path)
    eng.close()


def test_param_loss_without_activation_checkpointing(tmp_path):
    # the per-unit penalty's gradient flows through the kept forward exactly as through the recompute
    l2 = lambda path, w: 1e-2 * jnp.sum(w ** 2) if path.endswith("kernel") else 0.0  # noqa: E731
    runs = []
    for ck in (True, False):
        eng = zinf.initialize(ctor, config=config(tmp_path / str(ck), "none", "cpu", activation_checkpointing=ck),
                              optimizer=zinf.adamw(LR, weight_decay=WD), loss_fn=lm_loss, param_loss=l2)
        runs.append(([eng.train_step(b)["loss"] for b in batches(3)], eng.param_arrays()))
        eng.close()
    np.testing.assert_allclose(runs[0][0], runs[1][0], rtol=1e-6)
    for k in runs[0][1]:
        np.testing.assert_allclose(runs[0][1][k], runs[1][1][k], rtol=1e-5, atol=1e-7, err_msg=k)
