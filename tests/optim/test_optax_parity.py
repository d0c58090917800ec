"""Every optax optimizer a JAX user brings, end to end against plain ``jax.jit`` + optax (issue 44).

Each transform trains a small GPT (kernels sharded over 8 CPU devices) for 4 steps through zinf_jax
in five placements (params and optimizer on nvme; both on cpu; both in device memory; params in device
memory with the optimizer state on cpu or on nvme, updated on the device) and is held
to the same transform under plain ``jax.jit`` on the unwrapped model: losses rtol 1e-5, params rtol
1e-5. Element-wise transforms run chunk by chunk, the others whole tensor by tensor
(:mod:`zinf_jax.optim.optax_rule`); which parameters took the whole path is checked too, so a
coupled transform cannot slip through per chunk (the LARS case).

The whole matrix is ``slow`` (each run compiles a model and its optimizer programs); the default run
keeps the LARS case and a stateless transform, and ``tests/optim/test_optax_whole.py`` holds the cheap
driver-level checks of every whole-tensor path.
"""
import jax
import numpy as np
import optax
import optax.contrib
import pytest
from flax import nnx

import zinf_jax as zinf
from helpers.engine_utils import assert_params_close, flat, optax_run, placement_config as config
from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss

CFG = GPTConfig(vocab=256, d_model=32, n_heads=4, n_layers=2, seq=16)
DATA = corpus()
STEPS = 5


def ctor():
    return GPT(CFG, rngs=nnx.Rngs(0))


def matrices(t):
    return jax.tree.map(lambda x: x.ndim > 1, t)


# name -> (the transform, which parameters must take the whole-tensor path: "none", "matrices" or "all").
# Adam-like normalisers get eps 1e-4 (as in tests/api/test_workflows.py): with 1e-8 an element whose gradient is
# pure cancellation takes lr-sized steps of rounding noise, and the streamed backward rounds gradients
# differently from the whole-model jit.
OPTIMIZERS = {
    "sgd": (lambda: optax.sgd(0.05), "none"),
    "sgd_momentum": (lambda: optax.sgd(0.05, momentum=0.9), "none"),
    "adamw": (lambda: optax.adamw(3e-3, weight_decay=0.1, eps=1e-4), "none"),
    "lion": (lambda: optax.lion(1e-3, weight_decay=0.01), "none"),
    "lamb": (lambda: optax.lamb(3e-3, eps=1e-4), "all"),
    "lars": (lambda: optax.lars(0.1, trust_ratio_mask=matrices, weight_decay_mask=matrices), "matrices"),
    "novograd": (lambda: optax.novograd(3e-3, eps=1e-4), "all"),
    "adafactor": (lambda: optax.adafactor(3e-2, min_dim_size_to_factor=8), "all"),  # RMS clip: per tensor
    "sm3": (lambda: optax.chain(optax.scale_by_sm3(eps=1e-4), optax.scale(-0.1)), "matrices"),  # optax.sm3, eps 1e-4
    "muon": (lambda: optax.contrib.muon(3e-3, eps=1e-4), "all"),  # its ns_coeffs leaf: a per-tensor state
    "clip_adamw": (lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(3e-3, eps=1e-4)), "none"),
    "multi_transform": (lambda: optax.multi_transform(
        {"adam": optax.adam(3e-3, eps=1e-4), "lamb": optax.lamb(3e-3, eps=1e-4)},
        lambda t: jax.tree.map(lambda x: "lamb" if x.ndim > 1 else "adam", t)), "matrices"),
    "multi_steps": (lambda: optax.MultiSteps(optax.adam(3e-3, eps=1e-4), every_k_schedule=2), "none"),
    "inject_hyperparams": (lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=3e-3, eps=1e-4), "none"),
    # one parameter's update reads the others' (a step size estimated over the tree, the loss against the whole
    # gradient's norm, a key split over the leaves): the whole tree in one update (zinf_jax.optim.optax_split)
    "prodigy": (lambda: optax.contrib.prodigy(3.0, estim_lr0=1e-4), "tree"),  # its estimate moves from step 3
    "dadapt_adamw": (lambda: optax.contrib.dadapt_adamw(1.0, estim_lr0=1e-3), "tree"),
    "mechanize": (lambda: optax.contrib.mechanize(optax.adam(3e-3, eps=1e-4)), "tree"),
    "polyak_sgd": (lambda: optax.polyak_sgd(max_learning_rate=0.5, f_min=4.0), "tree"),
    "momo": (lambda: optax.contrib.momo(0.3), "tree"),
    "noisy_sgd": (lambda: optax.noisy_sgd(0.05, eta=1e-3, key=jax.random.key(3)), "tree"),
    # element-wise, reading the loss or differences of parameter-sized numbers
    "schedule_free_adamw": (lambda: optax.contrib.schedule_free_adamw(3e-3, warmup_steps=2, eps=1e-4), "none"),
    "reduce_on_plateau": (lambda: optax.chain(optax.adam(3e-3, eps=1e-4), optax.contrib.reduce_on_plateau(
        patience=0, cooldown=0, factor=0.5, rtol=0.5)), "none"),
}

# "<tier>-device": params in device memory, the optimizer state on <tier>, updated in the step's program
# (optimizer_update="device")
PLACEMENTS = ("nvme", "cpu", "none", "cpu-device", "nvme-device")
CHEAP = {("lars", "cpu"), ("sgd", "none"), ("prodigy", "cpu"), ("polyak_sgd", "none"), ("noisy_sgd", "nvme"),
         ("schedule_free_adamw", "cpu-device")}  # the LARS and Prodigy cases, the loss, a key, a stateless
# transform, schedule-free; the rest: -m slow


@pytest.fixture(scope="module")
def references():
    """The plain jit + optax run of each transform (computed once per transform)."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = optax_run(ctor(), OPTIMIZERS[name][0](), [batch_at(DATA, s, 8, CFG.seq)
                                                                    for s in range(STEPS)])
        return cache[name]
    return get


@pytest.mark.parametrize("name, where", [
    pytest.param(n, w, id=f"{n}-{w}", marks=() if (n, w) in CHEAP else pytest.mark.slow)
    for n in OPTIMIZERS for w in PLACEMENTS])
def test_optax_matches_plain_jit(tmp_path, references, name, where):
    tx, whole = OPTIMIZERS[name]
    ref_losses, ref_params = references(name)
    eng = zinf.initialize(ctor, config=config(tmp_path, where), optimizer=tx(), loss_fn=lm_loss)
    try:
        metrics = [eng.train_step(batch_at(DATA, s, 8, CFG.seq)) for s in range(STEPS)]
        losses = [m["loss"] for m in metrics]
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        got = flat(eng.params())
        assert set(got) == set(ref_params)
        assert_params_close(got, ref_params)
        rule = eng.optimizer.rule
        coupled = {p for p in eng.layouts if rule.whole(p)}
        assert (rule.tree is not None) == (whole == "tree"), rule.tree
        want = {"none": set(), "all": set(eng.layouts), "tree": set(eng.layouts),
                "matrices": {p for p, lay in eng.layouts.items() if len(lay.shape) > 1}}[whole]
        assert coupled == want
        if where in ("none", "cpu-device", "nvme-device"):  # the transform ran inside the step's one XLA program
            # (zinf_jax.optim.fused_optax)
            assert eng.optimizer.last_stats.get("in_program") == 1.0
    finally:
        eng.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adafactor", "muon"])
def test_checkpoint_mid_run_restores_on_another_mesh(tmp_path, name):
    """A whole-tensor transform (its factored or per-tensor state kept with the optimizer's metadata) saved on nvme
    after 2 steps and restored on a 4-device mesh takes the same next 2 steps as the run that went on."""
    tx = OPTIMIZERS[name][0]
    batches = [batch_at(DATA, s, 8, CFG.seq) for s in range(STEPS)]
    eng = zinf.initialize(ctor, config=config(tmp_path / "a", "nvme"), optimizer=tx(), loss_fn=lm_loss)
    try:
        for b in batches[:2]:
            eng.train_step(b)
        eng.save(tmp_path / "ckpt")
        cont = [eng.train_step(b)["loss"] for b in batches[2:]]
        cont_params = flat(eng.params())
    finally:
        eng.close()
    mesh4 = zinf.make_mesh(devices=jax.devices()[:4])
    again = zinf.restore(tmp_path / "ckpt", ctor, config=config(tmp_path / "b", "nvme"), mesh=mesh4, optimizer=tx(),
                         loss_fn=lm_loss)
    try:
        assert again.mesh.shape["fsdp"] == 4
        redo = [again.train_step(b)["loss"] for b in batches[2:]]
        np.testing.assert_allclose(redo, cont, rtol=1e-5)
        got = flat(again.params())
        assert_params_close(got, cont_params)
    finally:
        again.close()


@pytest.mark.slow
@pytest.mark.parametrize("name, where", [("lamb", "cpu"), ("multi_transform", "nvme"), ("adafactor", "none"),
                                         ("muon", "nvme-device")])
def test_train_steps_overlapped_matches_plain_jit(tmp_path, references, name, where):
    """``train_steps`` (each step's optimizer overlapped with the next forward, parameters handed out as they are
    written) with whole-tensor rules: the numbers of plain jit + optax."""
    ref_losses, ref_params = references(name)
    eng = zinf.initialize(ctor, config=config(tmp_path, where), optimizer=OPTIMIZERS[name][0](), loss_fn=lm_loss)
    try:
        losses = [m["loss"] for m in eng.train_steps(batch_at(DATA, s, 8, CFG.seq) for s in range(STEPS))]
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        assert_params_close(flat(eng.params()), ref_params)
    finally:
        eng.close()


@pytest.fixture(scope="module")
def lbfgs_reference():
    return optax_run(ctor(), optax.lbfgs(), [batch_at(DATA, s, 8, CFG.seq) for s in range(STEPS)], line_search=True)


@pytest.mark.parametrize("where", ["nvme", "cpu"])
def test_lbfgs_is_refused_where_the_update_is_not_in_the_step_program(tmp_path, where):
    """optax.lbfgs's zoom line search calls the loss at trial points (``value_fn``): where the update runs on the
    host it is refused up front, naming the transform, the reason and the fix."""
    with pytest.raises(zinf.ConfigError) as e:
        zinf.initialize(ctor, config=config(tmp_path, where), optimizer=optax.lbfgs(), loss_fn=lm_loss)
    msg = str(e.value)
    assert "scale_by_lbfgs" in msg and "value_fn" in msg and "line search" in msg and "offload_param='none'" in msg


@pytest.mark.parametrize("where", [pytest.param(w, marks=() if w == "none" else pytest.mark.slow)
                                   for w in ("none", "cpu-device", "nvme-device")])
def test_lbfgs_runs_where_the_step_program_has_the_loss(tmp_path, lbfgs_reference, where):
    """With params in device memory and the update in the step's program (state in device memory, or moved there:
    optimizer_update="device") optax.lbfgs trains as plain jit + optax given ``value_fn`` ([Note: a line search]
    in zinf_jax.engine.compiled)."""
    ref_losses, ref_params = lbfgs_reference
    eng = zinf.initialize(ctor, config=config(tmp_path, where), optimizer=optax.lbfgs(), loss_fn=lm_loss)
    try:
        losses = [eng.train_step(batch_at(DATA, s, 8, CFG.seq))["loss"] for s in range(STEPS)]
        assert eng.optimizer.last_stats.get("in_program") == 1.0
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        assert ref_losses[-1] < ref_losses[0] - 1.0  # the line search's steps, not a stalled run
        assert_params_close(flat(eng.params()), ref_params)
    finally:
        eng.close()
