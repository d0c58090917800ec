"""The optimizer as a plain optax user handles it between steps: hyperparameters set, the state read (issue 58).

References are plain ``jax.jit`` + optax on the unwrapped model, doing what optax users do in their loops:
``opt_state.hyperparams['learning_rate'] = x`` before step 3, ``schedule_free_eval_params(opt_state,
params)`` at the end. The engine does the same through :meth:`Engine.set_hyperparams` and
:meth:`Engine.optimizer_state`, in every placement of the optimizer state.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest
from flax import nnx

import zinf_jax as zinf
from helpers.engine_utils import assert_params_close, flat, placement_config as config
from zinf_jax.errors import ConfigError
from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss

CFG = GPTConfig(vocab=256, d_model=32, n_heads=4, n_layers=2, seq=16)
DATA = corpus()
STEPS = 5
BATCHES = [batch_at(DATA, s, 8, CFG.seq) for s in range(STEPS)]
PLACEMENTS = ("nvme", "cpu", "none", "cpu-device")
CHEAP = ("cpu", "none")


def ctor():
    return GPT(CFG, rngs=nnx.Rngs(0))


def injected():
    return optax.inject_hyperparams(optax.adamw)(learning_rate=3e-3, eps=1e-4, weight_decay=0.1)


def reference(tx, *, new_lr=None, at=2):
    """Plain jit + optax; with ``new_lr``, ``opt_state.hyperparams['learning_rate']`` set before step ``at + 1``.
    The losses, the final params (flat) and the final optimizer state."""
    gdef, params, rest = nnx.split(ctor(), nnx.Param, ...)
    state = tx.init(params)

    @jax.jit
    def step(params, state, b):
        loss, g = jax.value_and_grad(lambda p: lm_loss(nnx.merge(gdef, p, rest), b))(params)
        u, state = tx.update(g, state, params)
        return optax.apply_updates(params, u), state, loss

    losses = []
    for s, b in enumerate(BATCHES):
        if new_lr is not None and s == at:
            state.hyperparams["learning_rate"] = jnp.asarray(new_lr, state.hyperparams["learning_rate"].dtype)
        params, state, loss = step(params, state, b)
        losses.append(float(loss))
    return losses, flat(nnx.state(nnx.merge(gdef, params, rest), nnx.Param)), params, state


@pytest.fixture(scope="module")
def changed_lr():
    return reference(injected(), new_lr=1e-3)


@pytest.mark.parametrize("where", [pytest.param(w, marks=() if w in CHEAP else pytest.mark.slow) for w in PLACEMENTS])
def test_learning_rate_set_between_steps_takes_effect_at_the_next(tmp_path, changed_lr, where):
    """``engine.set_hyperparams(learning_rate=...)`` before step 3: optax's numbers with the same change (losses and
    params rtol 1e-5), and ``engine.hyperparams`` reads it back."""
    ref_losses, ref_params, _, _ = changed_lr
    eng = zinf.initialize(ctor, config=config(tmp_path, where), optimizer=injected(), loss_fn=lm_loss)
    try:
        assert eng.hyperparams["learning_rate"] == pytest.approx(3e-3)
        losses = []
        for s, b in enumerate(BATCHES):
            if s == 2:
                eng.set_hyperparams(learning_rate=1e-3)
                assert eng.hyperparams["learning_rate"] == pytest.approx(1e-3)
            losses.append(eng.train_step(b)["loss"])
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        assert_params_close(flat(eng.params()), ref_params)
    finally:
        eng.close()


def test_hyperparams_refused_clearly(tmp_path):
    """A name the transform does not inject, one that follows a schedule, and zinf's own Adam (no optax state):
    ConfigErrors naming the fix."""
    sched = optax.inject_hyperparams(optax.adam)(learning_rate=optax.linear_schedule(1e-3, 0.0, 10), b1=0.9)
    eng = zinf.initialize(ctor, config=config(tmp_path, "cpu"), optimizer=sched, loss_fn=lm_loss)
    try:
        with pytest.raises(ConfigError, match="no injected hyperparameter 'lr'.*learning_rate"):
            eng.set_hyperparams(lr=1e-4)
        with pytest.raises(ConfigError, match="follows a schedule"):
            eng.set_hyperparams(learning_rate=1e-4)
        eng.set_hyperparams(b1=0.8)
        assert eng.hyperparams["b1"] == pytest.approx(0.8)
    finally:
        eng.close()
    eng = zinf.initialize(ctor, config=config(tmp_path / "b", "cpu"), optimizer=zinf.adamw(1e-3), loss_fn=lm_loss)
    try:
        with pytest.raises(ConfigError, match="zinf's own Adam.*inject_hyperparams"):
            eng.set_hyperparams(learning_rate=1e-4)
        with pytest.raises(ConfigError, match="zinf's own Adam"):
            eng.optimizer_state()
    finally:
        eng.close()


def test_restore_with_a_changed_hyperparameter_applies_it_and_says_so(tmp_path, changed_lr):
    """Saved after 2 steps at 3e-3, restored with ``inject_hyperparams(adamw)(learning_rate=1e-3)``: the new value is
    applied (a warning names both values), and the run goes on as optax's with the rate changed before step 3; a
    value set with ``set_hyperparams`` before the save is what the checkpoint holds."""
    ref_losses, ref_params, _, _ = changed_lr
    eng = zinf.initialize(ctor, config=config(tmp_path / "a", "nvme"), optimizer=injected(), loss_fn=lm_loss)
    try:
        for b in BATCHES[:2]:
            eng.train_step(b)
        eng.set_hyperparams(weight_decay=0.1)  # the same value: nothing to say about it at restore
        eng.save(tmp_path / "ckpt")
    finally:
        eng.close()
    new = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3, eps=1e-4, weight_decay=0.1)
    with pytest.warns(UserWarning, match=r"learning_rate=0\.001.*checkpoint: 0\.003") as rec:
        again = zinf.restore(tmp_path / "ckpt", ctor, config=config(tmp_path / "b", "nvme"), optimizer=new,
                             loss_fn=lm_loss)
    assert not any("weight_decay" in str(w.message) for w in rec)
    try:
        assert again.hyperparams["learning_rate"] == pytest.approx(1e-3)
        losses = [again.train_step(b)["loss"] for b in BATCHES[2:]]
        np.testing.assert_allclose(losses, ref_losses[2:], rtol=1e-5)
        assert_params_close(flat(again.params()), ref_params)
    finally:
        again.close()


@pytest.mark.parametrize("where", [pytest.param(w, marks=() if w == "cpu" else pytest.mark.slow) for w in PLACEMENTS])
def test_schedule_free_eval_params_from_the_optimizer_state(tmp_path, where):
    """``optax.contrib.schedule_free_eval_params(engine.optimizer_state(), engine.params())`` equals optax's on its
    own state and params; the state's leaves equal optax's (same structure, rtol 1e-5); one parameter's state reads
    alone (``path=``)."""
    tx = lambda: optax.contrib.schedule_free_adamw(3e-3, warmup_steps=2, eps=1e-4)  # noqa: E731
    _, _, ref_params, ref_state = reference(tx())
    want = flat(optax.contrib.schedule_free_eval_params(ref_state, ref_params))
    eng = zinf.initialize(ctor, config=config(tmp_path, where), optimizer=tx(), loss_fn=lm_loss)
    try:
        for b in BATCHES:
            eng.train_step(b)
        state = eng.optimizer_state()
        assert _keys(state) == _keys(ref_state)  # (the Param metadata of the model's structure aside)
        for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)):
            np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-5, atol=1e-7)
        got = flat(optax.contrib.schedule_free_eval_params(state, eng.params()))
        assert_params_close(got, want)
        path = next(iter(eng.layouts))
        one = eng.optimizer_state(path)
        assert jax.tree.structure(one) == jax.tree.structure(
            tx().init(_nest(path, np.zeros(eng.layouts[path].shape, np.float32))))
        np.testing.assert_array_equal(jax.tree.leaves(one.z)[0], jax.tree.leaves(_at(state.z, path))[0])
    finally:
        eng.close()


def _nest(path, x):
    tree = x
    for k in reversed(path.split("/")):
        tree = {k: tree}
    return tree


def _at(tree, path):
    for k in path.split("/"):
        tree = tree[k] if k in tree else tree[int(k)]
    return tree


def _keys(tree):
    return [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
