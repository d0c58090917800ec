"""Runs of alike unit calls in the compiled engine: one lax.scan per run (see [Note: scanned runs]),
exact against plain jit + optax, and device memory and program size flat in depth."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zinf_jax as zinf
from helpers.engine_utils import optax_run
from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss

LR, EPS = 3e-3, 1e-4  # EPS: see test_idioms


class SkipBlock(nnx.Module):
    def __init__(self, d: int, rngs: nnx.Rngs):
        self.ln = nnx.LayerNorm(d, rngs=rngs)
        self.lin = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x, skip):
        return x + 0.5 * jnp.tanh(self.lin(self.ln(x))) + 0.1 * skip


class SkipStack(nnx.Module):
    """Six alike blocks: the first two read the previous output twice; from the third on, each also reads
    the first block's output (a skip across the run: the run breaks there, then that skip is the same
    value in every call); every block's output is read by the loss (stacked outputs of a run)."""

    def __init__(self, rngs: nnx.Rngs, vocab: int = 64, d: int = 32, layers: int = 6):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([SkipBlock(d, rngs) for _ in range(layers)])
        self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        x = y0 = self.blocks[0](x, x)
        x = self.blocks[1](x, x)
        hidden = [y0, x]
        for b in self.blocks[2:]:
            x = b(x, y0)
            hidden.append(x)
        return self.head(x), hidden


def skip_loss(model, tokens):
    logits, hidden = model(tokens[:, :-1])
    xent = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))
    return xent + 0.01 * sum(jnp.mean(h ** 2) for h in hidden)


def cpu_config(**kw):
    return zinf.ZeroConfig(offload_param=zinf.Offload("cpu"), offload_optimizer=zinf.Offload("cpu"),
                           persistence_threshold=0, **kw)


def test_a_skip_across_the_run_splits_it_and_every_output_read_after_leaves_stacked():
    mk = lambda: SkipStack(nnx.Rngs(0))  # noqa: E731
    toks = [np.asarray(jax.random.randint(jax.random.key(s), (8, 9), 0, 64), np.int32) for s in range(6)]
    tx = lambda: optax.adamw(LR, eps=EPS, weight_decay=0.0)  # noqa: E731
    ref_losses, ref_params = optax_run(mk(), tx(), toks, loss_fn=skip_loss)
    eng = zinf.initialize(mk, config=cpu_config(), loss_fn=skip_loss, optimizer=tx())
    assert eng.mode == "compiled"
    # blocks 0-1 (both inputs carried) and blocks 2-5 (the skip invariant): two scans, forward and backward
    assert eng.lower(toks[0]).as_text().count("stablehlo.while") == 4
    np.testing.assert_allclose([eng.train_step(t)["loss"] for t in toks], ref_losses, rtol=1e-5)
    got = eng.param_arrays()
    for path, r in ref_params.items():
        np.testing.assert_allclose(got[path], r, rtol=1e-5, atol=1e-6, err_msg=path)
    eng.close()


def _gpt_program(layers: int):
    cfg = GPTConfig(vocab=256, d_model=64, n_heads=4, n_layers=layers, seq=16)
    eng = zinf.initialize(lambda: GPT(cfg, rngs=nnx.Rngs(0)), config=cpu_config(), loss_fn=lm_loss,
                          optimizer=optax.adamw(LR))
    compiled = eng.lower(batch_at(corpus(), 0, 8, cfg.seq)).compile()
    eng.close()
    return compiled


def test_device_memory_and_program_size_do_not_grow_with_depth():
    """Params on the cpu tier: the step's device temp bytes at 2 and 8 layers within 15%, and the blocks'
    matmuls compiled once (the unrolled program held every layer's gathered weights: 4x the temp)."""
    small, deep = _gpt_program(2), _gpt_program(8)
    t2, t8 = small.memory_analysis().temp_size_in_bytes, deep.memory_analysis().temp_size_in_bytes
    assert t8 <= 1.15 * t2, (t2, t8)
    dots = lambda c: len(re.findall(r" dot\(", c.as_text()))  # noqa: E731
    assert dots(deep) == dots(small) > 0


# slow (suite time): test_compiled_matches_plain_jit trains the 2-block scanned run on both tiers in the default suite
@pytest.mark.slow
@pytest.mark.parametrize("param", ["none", "cpu"])
def test_a_scanned_gpt_trains_like_plain_jit_on_both_memory_tiers(param):
    cfg = GPTConfig(vocab=256, d_model=32, n_heads=4, n_layers=4, seq=16)
    mk = lambda: GPT(cfg, rngs=nnx.Rngs(0))  # noqa: E731
    data = [batch_at(corpus(), s, 8, cfg.seq) for s in range(6)]
    tx = lambda: optax.adamw(LR, eps=EPS, weight_decay=0.0)  # noqa: E731
    ref_losses, ref_params = optax_run(mk(), tx(), data)
    eng = zinf.initialize(mk, config=zinf.ZeroConfig(offload_param=zinf.Offload(param),
                                                    offload_optimizer=zinf.Offload("cpu"), persistence_threshold=600),
                          loss_fn=lm_loss, optimizer=tx())
    assert eng.lower(data[0]).as_text().count("stablehlo.while") == 2  # the blocks' scan, forward and backward
    np.testing.assert_allclose([eng.train_step(b)["loss"] for b in data], ref_losses, rtol=1e-5)
    got = eng.param_arrays()
    for path, r in ref_params.items():
        np.testing.assert_allclose(got[path], r, rtol=1e-5, atol=1e-6, err_msg=path)
    ev = eng.eval_step(data[0])
    eng.close()
    assert np.isfinite(float(ev["loss"] if isinstance(ev, dict) else ev))
