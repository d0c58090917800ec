"""Stable Python state reused across steps compiles nothing again: an ``nnx.Rngs`` passed with every
batch (upstream ``examples/mnist``'s way) is placed on the first step as the step leaves it, in both
engines, as under ``nnx.jit``."""
import numpy as np
from flax import nnx

import zinf_jax as zinf
from helpers.idiom_models import LMConfig, NnxSowLM, xent
from test_idioms import ENGINES, CompileLog, nvme, tokens

CFG = LMConfig()


@ENGINES
def test_a_reused_rngs_does_not_compile_the_second_step(tmp_path, engine):
    ctor = lambda: NnxSowLM(CFG, rngs=nnx.Rngs(0, dropout=1))  # noqa: E731
    eng = zinf.initialize(ctor, config=nvme(tmp_path, engine=engine), optimizer=zinf.adamw(1e-3),
                          loss_fn=lambda m, b: xent(m(b[0][:, :-1], rngs=b[1]), b[0][:, 1:]))
    assert eng.mode == engine
    rngs = nnx.Rngs(dropout=3)
    eng.train_step((tokens(0), rngs))
    count = int(rngs.dropout.count[...])
    with CompileLog() as log:
        losses = [eng.train_step((tokens(s), rngs))["loss"] for s in (1, 2)]
    assert log.messages == [], log.messages
    assert int(rngs.dropout.count[...]) > count and np.all(np.isfinite(losses))  # still advancing
    eng.close()
