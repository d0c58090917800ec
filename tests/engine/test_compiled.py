"""The compiled engine (one XLA program per step, params in device or host memory) against plain
jit(value_and_grad) + optax on the unwrapped model, and against the streamed engine across a checkpoint."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zinf_jax as zinf
from helpers.engine_utils import flat, optax_run
from helpers.llm_models import TiedHeadLM, lm_loss as tied_loss
from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss

CFG = GPTConfig(vocab=256, d_model=32, n_heads=4, n_layers=2, seq=16)
DATA = corpus()
LR, STEPS = 3e-3, 8
EPS = 1e-4  # see EPS in test_idioms: an element whose gradient is pure cancellation


def ctor():
    return GPT(CFG, rngs=nnx.Rngs(0))


def batches(n, start=0, batch=8):
    return [batch_at(DATA, s, batch, CFG.seq) for s in range(start, start + n)]


def config(tmp_path, param="cpu", opt="cpu", **kw):
    def off(d, sub):
        if d != "nvme":
            return zinf.Offload(d)
        (tmp_path / sub).mkdir(parents=True, exist_ok=True)
        return zinf.Offload(d, path=str(tmp_path / sub))

    return zinf.ZeroConfig(offload_param=off(param, "p"), offload_optimizer=off(opt, "o"),
                           **{"persistence_threshold": 600, **kw})


def assert_params(got, ref, rtol=1e-5, atol=1e-6):
    assert set(got) == set(ref)
    for path, r in ref.items():
        np.testing.assert_allclose(got[path], r, rtol=rtol, atol=atol, err_msg=path)


@pytest.fixture(scope="module")
def reference():
    return optax_run(ctor(), optax.adamw(LR, eps=EPS, weight_decay=0.0), batches(STEPS))


@pytest.mark.parametrize("param, opt", [("none", "none"), ("none", "cpu"), ("cpu", "cpu"), ("cpu", "nvme")])
def test_compiled_matches_plain_jit(tmp_path, reference, param, opt):
    eng = zinf.initialize(ctor, config=config(tmp_path, param, opt), loss_fn=lm_loss,
                          optimizer=optax.adamw(LR, eps=EPS, weight_decay=0.0))
    assert eng.mode == "compiled"
    if param == "cpu":  # the 2 blocks are one scanned run (as in test_scanned_runs): a loop forward and one backward
        assert eng.lower(batches(1)[0]).as_text().count("stablehlo.while") == 2
    copied = lambda: getattr(eng.store.tier, "copied_bytes", 0) + eng.passes.args.host_copy_bytes  # noqa: E731
    losses, at = [], {}
    for k, b in enumerate(batches(STEPS)):
        at[k] = copied()
        losses.append(eng.train_step(b)["loss"])
    np.testing.assert_allclose(losses, reference[0], rtol=1e-5)
    assert_params(eng.param_arrays(), reference[1])
    if (param, opt) == ("cpu", "cpu"):  # the trained params' host bytes are copied once a step, stack and all
        lays, paths = eng.store.layouts, eng.passes.args.paths
        once = sum(4 * int(np.prod(lays[p].shard_shape)) * len(eng.store.local_indices(p)) for p in paths)
        assert once and [at[k + 1] - at[k] for k in range(2, STEPS - 1)] == [once] * (STEPS - 3)
    eng.close()


def test_bfloat16_compute_with_both_tiers_in_host_ram_reads_the_masters_cast(tmp_path):
    """[Note: shared fp32 master] in bfloat16: the param tier keeps no bfloat16 copy of the trained parameters;
    the step copies the float32 masters out once, cast on the way (one pass over their bfloat16 bytes a step, but
    for a run's 1-D layers, kept float32 for XLA:TPU's slicing: ProgramArgs.stack_dtype), and trains as a plain
    mixed-precision step does: the forward and backward of the masters cast to bfloat16, optax.adamw on the
    float32 masters."""
    tx = optax.adamw(LR, eps=EPS, weight_decay=0.0)
    eng = zinf.initialize(ctor, config=config(tmp_path, "cpu", "cpu", compute_dtype="bfloat16"), loss_fn=lm_loss,
                          optimizer=tx)
    paths = eng.passes.args.paths
    assert eng.store.master_paths == set(eng.store.layouts) and eng.store.tier.stored_bytes() == 0  # all trained
    (w,) = eng.store.fetch([paths[0]])
    assert w.dtype == jnp.bfloat16
    copied = lambda: eng.store.tier.copied_bytes + eng.passes.args.host_copy_bytes  # noqa: E731
    lays = eng.store.layouts
    stacked = {p for stack in eng.passes._slots_of(eng.passes._traced(lm_loss, eng.shard_batch(batches(1)[0]),
                                                                      eng.store.fetch(eng.adapter.glue_paths), True),
                                                   True).stacks for p in stack}
    item = lambda p: jnp.dtype(eng.passes.args.stack_dtype(p) if p in stacked else "bfloat16").itemsize  # noqa: E731
    assert {item(p) for p in paths} == {2, 4}  # the biases and norm scales of the run's layers: float32
    once = sum(item(p) * int(np.prod(lays[p].shard_shape)) * len(eng.store.local_indices(p)) for p in paths)
    losses, at = [], []
    for b in batches(STEPS):
        at.append(copied())
        losses.append(eng.train_step(b)["loss"])
    assert [at[k + 1] - at[k] for k in range(2, STEPS - 1)] == [once] * (STEPS - 3)

    gdef, p0, rest = nnx.split(ctor(), nnx.Param, ...)

    @jax.jit
    def step(p, s, b):
        def f(p):
            return lm_loss(nnx.merge(gdef, jax.tree.map(lambda x: x.astype(jnp.bfloat16), p), rest), b)
        loss, g = jax.value_and_grad(f)(p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    p, st, ref = p0, tx.init(p0), []
    for b in batches(STEPS):
        p, st, loss = step(p, st, jnp.asarray(b))
        ref.append(float(loss))
    # bf16 rounds every product and sum to 8 significant bits (relative 2^-9 each); the engine's and the
    # reference's orders of summation differ (8-device reductions, the recompute), so their losses agree to
    # about 3 significant digits, as in test_engine's bf16 test
    np.testing.assert_allclose(losses, ref, rtol=2e-2)
    got, want, start = eng.param_arrays(), flat(p), flat(p0)
    moved = np.concatenate([(got[k] - start[k]).ravel() for k in want])
    ref_moved = np.concatenate([(want[k] - start[k]).ravel() for k in want])
    # Adam normalises each element's step, so bf16 noise on small gradients moves those elements by up to a
    # step either way; the movement as a whole agrees within 20% (a stale or uncast master: about 100%)
    assert np.linalg.norm(moved - ref_moved) < 0.2 * np.linalg.norm(ref_moved)
    eng.close()


def test_auto_picks_the_engine_by_param_tier(tmp_path):
    assert zinf.ZeroConfig().resolved_engine() == "compiled"
    assert config(tmp_path, "cpu", "nvme").resolved_engine() == "compiled"
    assert config(tmp_path, "nvme", "nvme").resolved_engine() == "streamed"
    assert zinf.ZeroConfig(offload_activations=True).resolved_engine() == "streamed"
    assert zinf.ZeroConfig(engine="streamed").resolved_engine() == "streamed"
    with pytest.raises(zinf.ConfigError, match="compiled engine cannot run with offload_param='nvme'"):
        zinf.ZeroConfig(engine="compiled", offload_param=zinf.Offload("nvme", path=str(tmp_path)))
    with pytest.raises(zinf.ConfigError, match="ZeroConfig.engine: expected one of"):
        zinf.ZeroConfig(engine="eager")
    assert zinf.ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 3}}).engine == "auto"
    with pytest.warns(UserWarning, match="streamed engine have no effect: prefetch_depth=4, track_live_arrays=True"):
        eng = zinf.initialize(ctor, config=config(tmp_path, prefetch_depth=4), loss_fn=lm_loss, track_live_arrays=True)
    eng.close()


def test_lower_gives_the_step_program_and_its_memory(tmp_path):
    eng = zinf.initialize(ctor, config=config(tmp_path), loss_fn=lm_loss)
    b = batches(1)[0]
    lowered = eng.lower(b)
    assert isinstance(lowered, jax.stages.Lowered)
    assert "sdy.sharding_constraint" in lowered.as_text() or "Sharding" in lowered.as_text()
    compiled = lowered.compile()
    text = compiled.as_text()
    # ZeRO-3: gathered inside; the gradients summed over the batch's devices (XLA:CPU combines them into
    # one all-reduce and slices each device's shard)
    assert "all-gather" in text and ("reduce-scatter" in text or "all-reduce" in text)
    mem = compiled.memory_analysis()
    assert mem.temp_size_in_bytes > 0
    assert eng.step == 0  # lowering changes nothing
    m = eng.train_step(b)
    assert m["peak_device_bytes"] > 0
    with pytest.raises(zinf.EngineError, match="engine.mode == 'compiled'"):
        eng.streamed
    eng.close()
    nv = zinf.initialize(ctor, config=config(tmp_path, "nvme", "nvme"), loss_fn=lm_loss)
    assert nv.mode == "streamed"
    with pytest.raises(zinf.EngineError, match="streamed engine runs this model"):
        nv.lower(b)
    nv.close()


def test_clipping_accumulation_and_train_steps(tmp_path):
    """Global-norm clipping (really active), 2 micro-batches, and train_steps equal to train_step bitwise."""
    data = batches(4, batch=16)
    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(LR, eps=EPS))
    ref_losses, ref_params = optax_run(ctor(), tx, data)
    cfg = config(tmp_path, gradient_clipping=0.5, gradient_accumulation_steps=2)
    eng = zinf.initialize(ctor, config=cfg, loss_fn=lm_loss, optimizer=optax.adam(LR, eps=EPS))
    out = [eng.train_step(b) for b in data[:2]] + list(eng.train_steps(data[2:]))
    assert out[0]["grad_norm"] > 0.5
    np.testing.assert_allclose([o["loss"] for o in out], ref_losses, rtol=1e-5)
    assert_params(eng.param_arrays(), ref_params)
    eng.close()
    one = zinf.initialize(ctor, config=cfg, loss_fn=lm_loss, optimizer=optax.adam(LR, eps=EPS))
    assert [one.train_step(b)["loss"] for b in data] == [o["loss"] for o in out]  # bitwise
    one.close()


def test_float16_overflow_is_skipped(tmp_path):
    cfg = config(tmp_path, compute_dtype="float16", loss_scale=zinf.LossScaleConfig(static_scale=2.0 ** 40))
    eng = zinf.initialize(ctor, config=cfg, loss_fn=lm_loss)
    before = eng.param_arrays()
    m = eng.train_step(batches(1)[0])
    assert m["skipped"] and eng.step == 0
    after = eng.param_arrays()
    assert all(after[p].tobytes() == before[p].tobytes() for p in before)
    eng.close()


class LoraLM(nnx.Module):
    def __init__(self, vocab=256, d=32, rank=4, *, rngs):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([nnx.LoRALinear(d, d, lora_rank=rank, rngs=rngs) for _ in range(2)])
        self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for blk in self.blocks:
            x = x + jax.nn.gelu(blk(x))
        return self.head(x)


def test_frozen_params_and_param_loss(tmp_path):
    """LoRA-style: only the adapters trained (as nnx.Optimizer(wrt=LoRAParam)); an L2 term on them."""
    lora = lambda: LoraLM(rngs=nnx.Rngs(0))  # noqa: E731
    l2 = lambda path, w: 1e-2 * jnp.sum(w ** 2) if "lora" in path else 0.0  # noqa: E731
    data = batches(5)
    ref = lora()
    opt = nnx.Optimizer(ref, optax.adam(LR, eps=EPS), wrt=nnx.LoRAParam)

    def total(model, b):
        st = nnx.state(model, nnx.LoRAParam)
        return lm_loss(model, b) + sum(l2("lora", w) for w in jax.tree.leaves(st))

    @nnx.jit
    def step(model, opt, b):
        loss, g = nnx.value_and_grad(total, argnums=nnx.DiffState(0, nnx.LoRAParam))(model, b)
        opt.update(model, g)
        return loss

    ref_losses = [float(step(ref, opt, jnp.asarray(b))) for b in data]
    eng = zinf.initialize(lora, config=config(tmp_path, "cpu", "cpu", persistence_threshold=0), loss_fn=lm_loss,
                          optimizer=optax.adam(LR, eps=EPS), trainable=nnx.LoRAParam, param_loss=l2)
    assert eng.mode == "compiled" and all("lora" in p for p in eng.trainable)
    losses = [eng.train_step(data[0])["loss"]]
    frozen = {p: eng.passes.args._fetched[p][1] for p in eng.passes.unit_paths if p not in eng.trainable}
    losses += [eng.train_step(b)["loss"] for b in data[1:]]
    assert frozen and all(eng.passes.args._fetched[p][1] is a for p, a in frozen.items())  # the base is read once
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_params(flat(eng.params()), flat(nnx.state(ref, nnx.Param)))
    eng.close()


@pytest.mark.parametrize("first, then", [("compiled", "streamed"), ("streamed", "compiled")])
def test_checkpoint_saved_by_one_engine_continues_in_the_other(tmp_path, first, then):
    opt = lambda: optax.adamw(LR, eps=EPS, weight_decay=0.0)  # noqa: E731
    a = zinf.initialize(ctor, config=config(tmp_path / "a", engine=first), loss_fn=lm_loss, optimizer=opt())
    for b in batches(3):
        a.train_step(b)
    a.save(tmp_path / "ckpt")
    going_on = [a.train_step(b)["loss"] for b in batches(3, start=3)]
    a.close()
    b_ = zinf.restore(tmp_path / "ckpt", ctor, config=config(tmp_path / "b", engine=then), loss_fn=lm_loss,
                      optimizer=opt())
    assert b_.mode == then and b_.step == 3
    np.testing.assert_allclose([b_.train_step(b)["loss"] for b in batches(3, start=3)], going_on, rtol=1e-6)
    b_.close()


def test_a_tied_head_read_outside_its_unit_is_a_read_in_the_program(tmp_path):
    """``h @ self.embed.embedding[...].T`` in the top-level call: the table's gradient sums both uses."""
    mk = lambda: TiedHeadLM(nnx.Rngs(0))  # noqa: E731
    toks = [np.asarray(jax.random.randint(jax.random.key(s), (8, 9), 0, 64), np.int32) for s in range(5)]
    tx = lambda: optax.adamw(LR, eps=EPS, weight_decay=0.0)  # noqa: E731
    ref_losses, ref_params = optax_run(mk(), tx(), toks, loss_fn=tied_loss)
    eng = zinf.initialize(mk, config=config(tmp_path, persistence_threshold=0), loss_fn=tied_loss, optimizer=tx())
    assert eng.mode == "compiled"
    np.testing.assert_allclose([eng.train_step(t)["loss"] for t in toks], ref_losses, rtol=1e-5)
    assert_params(eng.param_arrays(), ref_params)
    eng.close()
