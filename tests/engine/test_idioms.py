"""Real-model idioms, each trained with zinf (params and optimizer on the nvme tier) against
jit(value_and_grad) + optax.adamw on the unwrapped model: same init, same data, same random bits."""
import functools
import logging
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx, traverse_util

import zinf_jax as zinf
from helpers.idiom_models import (LinenBNMlp, LinenEncDec, LinenLM, LinenResNet, LinenRnnSeq, LMConfig, NnxCNN,
                                  NnxRootTable, NnxSowLM, NnxWhisperLike, sow_penalty, xent)
from zinf_jax.engine.adapters import leaf_paths
from zinf_jax.plan.units import path_str

LR, WD, STEPS = 3e-3, 0.01, 4
# Adam's eps. Adam divides each element's step by that element's own gradient scale, so an element
# whose gradient is pure cancellation (~1e-7 against ~1e-2 typical, e.g. a hidden unit that is nearly
# dead for the whole batch) takes a step of ~lr set by rounding noise: two correct programs that sum
# in another order (one XLA fusion vs unit programs) then differ there by ~lr/10 (seen: 1 element of
# 2048, gradients 8.7e-8 vs 9.5e-8). With eps 1e-4 every step is a smooth function of the gradient;
# the gradients themselves are compared directly in test_sow_model_gradients_match.
EPS = 1e-4
CFG = LMConfig()


class CompileLog(logging.Handler):
    """Counts JAX's "Compiling ..." log lines while active."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        if record.getMessage().startswith("Compiling"):
            self.messages.append(record.getMessage())

    def count(self, name):
        return sum(f"Compiling {name} " in m for m in self.messages)

    def __enter__(self):
        self._logger, self._ctx = logging.getLogger("jax"), jax.log_compiles(True)
        self._level = self._logger.level
        self._logger.addHandler(self)
        self._logger.setLevel(logging.DEBUG)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)


def nvme(tmp_path, threshold=64, engine="streamed"):
    """Params and optimizer on nvme (the streamed engine); ``engine="compiled"``: both in host RAM instead,
    where the compiled engine runs (one program per step)."""
    if engine == "compiled":
        cpu = zinf.Offload("cpu")
        return zinf.ZeroConfig(offload_param=cpu, offload_optimizer=cpu, persistence_threshold=threshold,
                               engine="compiled")
    tmp_path.mkdir(parents=True, exist_ok=True)
    off = zinf.Offload("nvme", path=str(tmp_path))
    return zinf.ZeroConfig(offload_param=off, offload_optimizer=off, persistence_threshold=threshold)


ENGINES = pytest.mark.parametrize("engine", ["streamed", "compiled"])
# the Linen LM and ResNet on the streamed engine: -m slow (Linen units stream in test_engine's convnet)
COMPILED_BY_DEFAULT = pytest.mark.parametrize("engine", [pytest.param("streamed", marks=pytest.mark.slow), "compiled"])


def tokens(step, batch=8, seq=9):
    return np.asarray(jax.random.randint(jax.random.key(1000 + step), (batch, seq), 0, CFG.vocab), np.int32)


def images(step, batch=8):
    x = np.asarray(jax.random.normal(jax.random.key(2000 + step), (batch, 8, 8, 1)), np.float32)
    y = np.asarray(jax.random.randint(jax.random.key(3000 + step), (batch,), 0, 10), np.int32)
    return x, y


def flat_linen(params):
    return {path_str(p): np.asarray(v) for p, v in traverse_util.flatten_dict(nn.unbox(params)).items()}


def flat_nnx(state):
    host = lambda v: np.asarray(jax.random.key_data(v) if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key) else v)  # noqa: E731
    return {path_str(p): host(v) for p, v in zip(leaf_paths(state), jax.tree.leaves(state))}


def assert_params(got, ref):
    assert set(got) == set(ref)
    for path, r in ref.items():
        np.testing.assert_allclose(got[path], r, rtol=1e-5, atol=1e-5, err_msg=path)


def linen_reference(module, init_args, init_kwargs, loss_fn, batches, *, collections=(), param_loss=None):
    """Plain Linen + optax: ``loss_fn`` gets the same callable model as zinf gives it."""
    init = jax.jit(functools.partial(module.init, **init_kwargs))  # jitted: eagerly, an XLA program per op
    variables = init(jax.random.key(0), *init_args)
    params = nn.unbox(variables["params"])
    state = {c: variables[c] for c in collections}
    tx = optax.adamw(LR, eps=EPS, weight_decay=WD)
    opt = tx.init(params)

    def total(p, state, batch):
        kept = dict(state)

        def model(*args, rngs=None, mutable=False, **kw):
            res = module.apply({"params": p, **kept}, *args, rngs=rngs, mutable=mutable, **kw)
            if mutable is not False:
                kept.update({c: v for c, v in res[1].items() if c in kept})
            return res

        loss = loss_fn(model, batch)
        if param_loss is not None:
            loss = loss + sum(param_loss(path_str(k), v) for k, v in traverse_util.flatten_dict(p).items())
        return loss, kept

    @jax.jit
    def step(p, opt, state, batch):
        (loss, state), g = jax.value_and_grad(total, has_aux=True)(p, state, batch)
        upd, opt = tx.update(g, opt, p)
        return optax.apply_updates(p, upd), opt, state, loss

    losses = []
    for b in batches:
        params, opt, state, loss = step(params, opt, state, b)
        losses.append(float(loss))
    return losses, params, state


@COMPILED_BY_DEFAULT
def test_linen_lm_boxed_params_setup_units_mask_kwarg_and_dropout(tmp_path, engine):
    """with_logical_partitioning boxes, setup()-built embedding/layers as units, decoder_mask= (an array
    keyword argument), a Python flag, dropout from apply(rngs=...): losses and params equal plain Linen."""
    module, tok0 = LinenLM(CFG), jnp.zeros((8, 8), jnp.int32)

    def loss_fn(model, batch):
        toks, key = batch
        return xent(model(toks[:, :-1], rngs={"dropout": key}), toks[:, 1:])

    batches = [(tokens(s), jax.random.key(s)) for s in range(STEPS)]
    ref_losses, ref_params, _ = linen_reference(module, (tok0,), {"deterministic": True}, loss_fn, batches)
    eng = zinf.initialize(module, init_args=(tok0,), init_kwargs={"deterministic": True},
                          config=nvme(tmp_path, engine=engine),
                          optimizer=zinf.adamw(LR, eps=EPS, weight_decay=WD, mask=None), loss_fn=loss_fn)
    assert {u.path for u in eng.adapter.units} == {"embed", "layers_0", "layers_1"}
    losses = [eng.train_step(b)["loss"] for b in batches]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_params(eng.param_arrays(), flat_linen(ref_params))
    # the boxes come back: Flax's own partitioning helpers work on engine.params()
    params = eng.params()
    assert isinstance(params["embed"]["embedding"], nn.LogicallyPartitioned)
    assert nn.get_partition_spec(params)["embed"]["embedding"] == jax.sharding.PartitionSpec("vocab", "embed")
    # dropout really is on: the same batch with another key gives another loss
    assert eng.eval_step((batches[0][0], jax.random.key(7))) != eng.eval_step((batches[0][0], jax.random.key(8)))
    eng.close()


def test_logical_axis_rules_choose_the_sharded_dimension(tmp_path):
    module, tok0 = LinenLM(CFG), jnp.zeros((8, 8), jnp.int32)
    kernel = "layers_0/LinenMlp_0/Dense_0/kernel"  # (emb 32, mlp 64), logical ("embed", "mlp")
    loss_fn = lambda model, toks: xent(model(toks[:, :-1], deterministic=True), toks[:, 1:])  # noqa: E731
    cfg = zinf.ZeroConfig(persistence_threshold=64)
    plain = zinf.initialize(module, init_args=(tok0,), config=cfg, loss_fn=loss_fn)
    assert plain.layouts[kernel].dim == 1  # the largest dimension by default
    plain.close()
    with nn.logical_axis_rules((("embed", "fsdp"), ("mlp", None))):
        ruled = zinf.initialize(module, init_args=(tok0,), config=cfg, loss_fn=loss_fn)
    assert ruled.layouts[kernel].dim == 0
    ruled.train_step(tokens(0))
    ruled.close()


def test_linen_child_holding_a_shared_setup_module_is_skipped_with_a_warning(tmp_path):
    """A child module that calls an embedding owned by its parent cannot run alone: never picked as a unit."""
    module, tok0 = LinenEncDec(CFG), jnp.zeros((8, 8), jnp.int32)
    loss_fn = lambda model, toks: xent(model(toks[:, :-1]), toks[:, 1:])  # noqa: E731
    batches = [tokens(s) for s in range(STEPS)]
    ref_losses, ref_params, _ = linen_reference(module, (tok0,), {}, loss_fn, batches)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eng = zinf.initialize(module, init_args=(tok0,), config=nvme(tmp_path), loss_fn=loss_fn,
                              optimizer=zinf.adamw(LR, eps=EPS, weight_decay=WD, mask=None),
                              unit_policy=zinf.UnitPolicy(patterns=("decoder",)))
    assert sum("'decoder' cannot run as a unit" in str(w.message) for w in caught) == 1
    assert {"decoder/layers_0", "decoder/layers_1", "shared"} <= {u.path for u in eng.adapter.units}
    np.testing.assert_allclose([eng.train_step(b)["loss"] for b in batches], ref_losses, rtol=1e-5)
    assert_params(eng.param_arrays(), flat_linen(ref_params))
    eng.close()


@COMPILED_BY_DEFAULT
def test_linen_resnet_batch_stats_and_l2_penalty(tmp_path, engine):
    """BatchNorm batch_stats through apply(mutable=['batch_stats']), an L2 term over the kernels
    (param_loss), running averages kept, saved, restored and used by eval_step."""
    module, x0 = LinenResNet(), jnp.zeros((8, 8, 8, 1))
    l2 = lambda path, w: 5e-3 * jnp.sum(w ** 2) if w.ndim > 1 else 0.0  # noqa: E731

    def loss_fn(model, batch):
        x, y = batch
        logits, _ = model(x, train=True, mutable=["batch_stats"])
        return xent(logits, y)

    batches = [images(s) for s in range(STEPS)]
    ref_losses, ref_params, ref_state = linen_reference(module, (x0,), {"train": False}, loss_fn, batches,
                                                        collections=("batch_stats",), param_loss=l2)
    eng = zinf.initialize(module, init_args=(x0,), init_kwargs={"train": False}, config=nvme(tmp_path / "t", 100, engine),
                          optimizer=zinf.adamw(LR, eps=EPS, weight_decay=WD, mask=None), loss_fn=loss_fn, param_loss=l2)
    assert {"LinenResBlock_0", "LinenResBlock_1"} <= {u.path for u in eng.adapter.units}
    losses = [eng.train_step(b)["loss"] for b in batches]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_params(eng.param_arrays(), flat_linen(ref_params))
    got = traverse_util.flatten_dict(eng.model_state()["batch_stats"])
    want = traverse_util.flatten_dict(ref_state["batch_stats"])
    assert set(got) == set(want)
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-6, err_msg=str(k))

    def eval_loss(model, batch):
        return xent(model(batch[0], train=False), batch[1])

    ref_eval = eval_loss(lambda *a, **k: module.apply({"params": ref_params, **ref_state}, *a, **k), images(9))
    np.testing.assert_allclose(eng.eval_step(images(9), loss_fn=eval_loss), ref_eval, rtol=1e-5)
    eng.save(tmp_path / "ckpt")
    eng.close()
    again = zinf.restore(tmp_path / "ckpt", module, init_args=(x0,), init_kwargs={"train": False},
                         config=nvme(tmp_path / "r", 100), loss_fn=loss_fn, param_loss=l2,
                         optimizer=zinf.adamw(LR, eps=EPS, weight_decay=WD, mask=None))
    np.testing.assert_allclose(again.eval_step(images(9), loss_fn=eval_loss), ref_eval, rtol=1e-5)
    again.close()


@pytest.mark.parametrize("init_train, engine", [(False, "compiled"), (True, "streamed"),
                                                pytest.param(True, "compiled", marks=pytest.mark.slow),
                                                pytest.param(False, "streamed", marks=pytest.mark.slow)])
def test_linen_batchnorm_and_dropout_follow_the_call(tmp_path, init_train, engine):
    """``nn.BatchNorm(use_running_average=not train)`` and ``nn.Dropout(deterministic=not train)`` as units of their
    own, initialised in either mode: training steps normalise with the batch's statistics and update the running
    averages, evaluation uses them, as plain Flax does (losses, params, batch stats rtol 1e-5). A unit runs in the mode
    of the call that reaches it, never the one it was initialised in."""
    module, x0 = LinenBNMlp(), jnp.zeros((8, 8, 8, 1))

    def loss_fn(model, batch):
        x, y, key = batch
        logits, _ = model(x, train=True, mutable=["batch_stats"], rngs={"dropout": key})
        return xent(logits, y)

    def eval_loss(model, batch):
        return xent(model(batch[0], train=False), batch[1])

    batches = [(*images(s), jax.random.key(7 + s)) for s in range(STEPS)]
    ref_losses, ref_params, ref_state = linen_reference(module, (x0,), {"train": init_train}, loss_fn, batches,
                                                        collections=("batch_stats",))
    eng = zinf.initialize(module, init_args=(x0,), init_kwargs={"train": init_train},
                          config=nvme(tmp_path, 16, engine), optimizer=zinf.adamw(LR, eps=EPS, weight_decay=WD,
                                                                                  mask=None), loss_fn=loss_fn)
    try:
        assert {"BatchNorm_0", "BatchNorm_1", "Dense_0"} <= {u.path for u in eng.adapter.units}
        losses = [eng.train_step(b)["loss"] for b in batches]
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        assert_params(eng.param_arrays(), flat_linen(ref_params))
        got = traverse_util.flatten_dict(eng.model_state()["batch_stats"])
        for k, v in traverse_util.flatten_dict(ref_state["batch_stats"]).items():
            np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-6, err_msg=str(k))
        ref_eval = eval_loss(lambda *a, **k: module.apply({"params": ref_params, **ref_state}, *a, **k), images(9))
        np.testing.assert_allclose(eng.eval_step(images(9), loss_fn=eval_loss), ref_eval, rtol=1e-5)
    finally:
        eng.close()


def nnx_reference(ctor, loss_fn, batches, wrt=nnx.Param):
    model = ctor()
    opt = nnx.Optimizer(model, optax.adamw(LR, eps=EPS, weight_decay=WD), wrt=wrt)

    @nnx.jit
    def step(model, opt, batch):
        loss, g = nnx.value_and_grad(loss_fn)(model, batch)
        opt.update(model, g)
        return loss

    losses = [float(step(model, opt, b)) for b in batches]
    return losses, model


@ENGINES
def test_nnx_cnn_batchnorm_in_units_and_glue_with_dropout(tmp_path, engine):
    """NNX BatchNorm + Dropout inside units and in the glue (BatchStat updated in place), a static
    attribute read through a unit proxy; the running averages drive eval_step."""
    ctor = lambda: NnxCNN(rngs=nnx.Rngs(0, dropout=1))  # noqa: E731

    def loss_fn(model, batch):
        x, y = batch
        assert model.head.in_features == 8  # a static attribute of a streamed unit
        return xent(model(x), y)

    batches = [images(s) for s in range(STEPS)]
    ref_losses, ref_model = nnx_reference(ctor, loss_fn, batches)
    eng = zinf.initialize(ctor, config=nvme(tmp_path, engine=engine),
                          optimizer=zinf.adamw(LR, eps=EPS, weight_decay=WD, mask=None), loss_fn=loss_fn)
    assert eng.mode == engine
    assert {"blocks/0", "blocks/1", "head"} <= {u.path for u in eng.adapter.units}
    assert "stem_bn/scale" in eng.adapter.glue_paths
    losses = [eng.train_step(b)["loss"] for b in batches]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_params(eng.param_arrays(), flat_nnx(nnx.state(ref_model, nnx.Param)))
    got, want = flat_nnx(eng.model_state()), flat_nnx(nnx.state(ref_model, nnx.BatchStat))
    for path, v in want.items():
        np.testing.assert_allclose(got[path], v, rtol=1e-5, atol=1e-6, err_msg=path)
    ref_model.eval()
    ref_eval = float(xent(ref_model(images(9)[0]), images(9)[1]))
    np.testing.assert_allclose(eng.eval_step(images(9), loss_fn=lambda m, b: xent(m(b[0]), b[1])), ref_eval, rtol=1e-5)
    eng.close()


def test_nnx_unit_attribute_errors_are_actionable(tmp_path):
    ctor = lambda: NnxCNN(rngs=nnx.Rngs(0, dropout=1))  # noqa: E731
    cases = {  # (a parameter read outside its unit's call is fetched instead: tests/engine/test_param_reads.py)
        "child": (lambda m: m.blocks[0].conv, "submodule of the streamed unit 'blocks/0'"),
        "missing": (lambda m: m.head.no_such_thing, "has no attribute 'no_such_thing'"),
    }
    eng = zinf.initialize(ctor, config=zinf.ZeroConfig(persistence_threshold=64), loss_fn=lambda m, b: 0.0)
    for name, (read, msg) in cases.items():
        with pytest.raises((zinf.EngineError, AttributeError), match=msg):
            eng.eval_step(images(0), loss_fn=lambda m, b, read=read: read(m))
    read = eng.eval_step(images(0), loss_fn=lambda m, b: m.head.kernel[...])
    np.testing.assert_array_equal(np.asarray(read), eng.param_arrays()["head/kernel"])
    eng.close()


@pytest.mark.parametrize("rngs_passed, engine", [pytest.param(False, "streamed", marks=pytest.mark.slow),
                                                 (True, "streamed"), (True, "compiled")],
                         ids=["held_rngs", "fresh_rngs_each_step", "fresh_rngs_each_step_compiled"])
def test_nnx_sow_and_shared_rngs(tmp_path, rngs_passed, engine, no_persistent_cache):
    """Blocks sow intermediates that the loss pops (an auxiliary term, differentiated through the sown
    values); one nnx.Rngs is shared by the model and all blocks, or a fresh one is passed every step.
    10 steps compile each unit program once."""
    ctor = lambda: NnxSowLM(CFG, rngs=nnx.Rngs(0, dropout=1))  # noqa: E731
    steps = 10 if rngs_passed else STEPS

    def loss_fn(model, batch):
        toks, rngs = batch
        logits = model(toks[:, :-1], rngs=rngs)
        return xent(logits, toks[:, 1:]) + 1e-2 * sow_penalty(model)

    make = lambda s: (tokens(s), nnx.Rngs(dropout=50 + s) if rngs_passed else None)  # noqa: E731
    ref_losses, ref_model = nnx_reference(ctor, loss_fn, [make(s) for s in range(steps)])
    eng = zinf.initialize(ctor, config=nvme(tmp_path, engine=engine),
                          optimizer=zinf.adamw(LR, eps=EPS, weight_decay=WD, mask=None), loss_fn=loss_fn)
    losses = [eng.train_step(make(0))["loss"]]
    with CompileLog() as log:  # the later steps (new keys, new counters) compile nothing
        losses += [eng.train_step(make(s))["loss"] for s in range(1, steps)]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_params(eng.param_arrays(), flat_nnx(nnx.state(ref_model, nnx.Param)))
    assert log.messages == [] and (engine == "compiled" or len(eng.streamed.programs) > 0)
    # the shared RNG counter advanced exactly as in the unwrapped model (and nothing sown was kept)
    want = flat_nnx(nnx.state(ref_model, nnx.RngState))
    got = flat_nnx(eng.model_state())
    count = "blocks/0/rngs/dropout/count"
    assert got[count] == want[count] and (rngs_passed or got[count] > 0)
    assert not any("attn_out" in p for p in got)
    eng.close()


def test_passed_rngs_advance_like_nnx(tmp_path):
    """An nnx.Rngs in the batch is state: its counter advances as under nnx.jit."""
    ctor = lambda: NnxSowLM(CFG, rngs=nnx.Rngs(0, dropout=1))  # noqa: E731
    eng = zinf.initialize(ctor, config=zinf.ZeroConfig(persistence_threshold=64),
                          loss_fn=lambda m, b: xent(m(b[0][:, :-1], rngs=b[1]), b[0][:, 1:]))
    mine, ref = nnx.Rngs(dropout=3), nnx.Rngs(dropout=3)
    eng.train_step((tokens(0), mine))
    model = ctor()
    nnx.jit(lambda m, t, r: m(t, rngs=r))(model, jnp.asarray(tokens(0))[:, :-1], ref)
    assert int(mine.dropout.count[...]) == int(ref.dropout.count[...]) > 0
    eng.close()


@pytest.mark.slow  # sow is trained end to end by test_nnx_sow_and_shared_rngs
def test_sow_model_gradients_match(tmp_path):
    """The gradients themselves (shared Rngs, dropout, sown auxiliary term) against nnx.value_and_grad."""
    from helpers.engine_utils import build, nnx_adapter, streamed_grads
    from jax.sharding import NamedSharding, PartitionSpec as P

    ctor = lambda: NnxSowLM(CFG, rngs=nnx.Rngs(0, dropout=1))  # noqa: E731

    def loss_fn(model, toks):
        return xent(model(toks[:, :-1]), toks[:, 1:]) + 1e-2 * sow_penalty(model)

    toks = jnp.asarray(tokens(0))
    ref_loss, g = nnx.jit(nnx.value_and_grad(loss_fn))(ctor(), toks)
    ref = flat_nnx(nnx.state(g, nnx.Param))
    sm = build(nnx_adapter(ctor, 64), "nvme", threshold=64, path=tmp_path)
    loss, _, g_glue = sm.forward_backward(loss_fn, jax.device_put(toks, NamedSharding(sm.mesh, P("fsdp"))),
                                          sm.store.fetch(sm.adapter.glue_paths), has_aux=False)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    got = streamed_grads(sm, g_glue)
    for path, r in ref.items():
        np.testing.assert_allclose(got[path], r, rtol=1e-5, atol=1e-5 * np.abs(r).max(), err_msg=path)
    sm.prefetcher.close()
    sm.store.tier.close()


def test_eval_step_returns_what_its_loss_returns():
    """An evaluation loss returning a scalar works after training with has_aux=True (and vice versa)."""
    ctor = lambda: NnxCNN(rngs=nnx.Rngs(0, dropout=1))  # noqa: E731
    eng = zinf.initialize(ctor, config=zinf.ZeroConfig(persistence_threshold=64), has_aux=True,
                          loss_fn=lambda m, b: (xent(m(b[0]), b[1]), {"n": b[1].shape[0]}))
    eng.train_step(images(0))
    assert np.ndim(eng.eval_step(images(1), loss_fn=lambda m, b: xent(m(b[0]), b[1]))) == 0
    loss, aux = eng.eval_step(images(1))
    assert aux == {"n": 8}
    eng.close()


@pytest.mark.parametrize("engine", ["compiled", "streamed"])
@pytest.mark.parametrize("name", ["root table", "stem beside the blocks"])
def test_nnx_parameters_outside_every_unit_belong_to_the_root(tmp_path, name, engine):
    """A large parameter in no unit (a DiT's table on the model itself; a Whisper encoder's stem beside its unit
    blocks) belongs to the root, as in FSDP2: sharded in its tier, gathered for the step. Losses and params equal
    plain nnx.jit + optax (compiled: cpu tiers; streamed: nvme)."""
    ctor, root = {"root table": (lambda: NnxRootTable(rngs=nnx.Rngs(0)), ["pos_embed"]),
                  "stem beside the blocks": (lambda: NnxWhisperLike(rngs=nnx.Rngs(0)),
                                             ["encoder/conv1/kernel", "encoder/conv2/kernel"])}[name]

    def loss_fn(model, batch):
        return xent(model(batch[0]), batch[1])

    batches = [images(s) for s in range(STEPS)]
    ref_losses, ref_model = nnx_reference(ctor, loss_fn, batches)
    eng = zinf.initialize(ctor, config=nvme(tmp_path, 256, engine),
                          optimizer=zinf.adamw(LR, eps=EPS, weight_decay=WD, mask=None), loss_fn=loss_fn)
    try:
        for p in root:
            assert p in eng.adapter.glue_paths and eng.layouts[p].kind != "persistent", p
        assert "outside every unit" in eng.describe()
        losses = [eng.train_step(b)["loss"] for b in batches]
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        assert_params(eng.param_arrays(), flat_nnx(nnx.state(ref_model, nnx.Param)))
    finally:
        eng.close()


@pytest.mark.parametrize("engine", ["compiled", "streamed"])
def test_linen_rnn_cells_run_under_their_scan(tmp_path, engine):
    """``nn.RNN`` runs its cell through a lifted scan: the cell is never a unit alone (no warning); the module
    that runs the scan holds the cell as a unit, and a cell on the root belongs to the root. Equal to plain Linen."""
    module, x0 = LinenRnnSeq(), jnp.zeros((8, 8, 8, 1))

    def loss_fn(model, batch):
        return xent(model(batch[0]), batch[1])

    batches = [images(s) for s in range(STEPS)]
    ref_losses, ref_params, _ = linen_reference(module, (x0,), {}, loss_fn, batches)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "cannot run as a unit" warning for a lifted cell
        eng = zinf.initialize(module, init_args=(x0,), config=nvme(tmp_path, 256, engine),
                              optimizer=zinf.adamw(LR, eps=EPS, weight_decay=WD, mask=None), loss_fn=loss_fn)
    try:
        units = {u.path for u in eng.adapter.units}
        assert "LinenRnnEncoder_0" in units and not any("Cell" in u for u in units), units
        assert "GRUCell_0/hn/kernel" in eng.adapter.glue_paths
        losses = [eng.train_step(b)["loss"] for b in batches]
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        assert_params(eng.param_arrays(), flat_linen(ref_params))
    finally:
        eng.close()
