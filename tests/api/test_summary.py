"""What the engine says it decided: the build summary (``engine.describe()``, logged at build), the compile
message, and the progress line a user's own loop prints (``zinf.format_step``)."""
import logging

import pytest
from flax import nnx

import zinf_jax as zinf
from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss

CFG = GPTConfig(vocab=256, d_model=32, n_heads=2, n_layers=2, seq=16, dropout=0.0)


def _engine(**config):
    return zinf.initialize(lambda: GPT(CFG, rngs=nnx.Rngs(0)), config=zinf.ZeroConfig(**config),
                           optimizer=zinf.adamw(1e-3), loss_fn=lm_loss)


def test_a_small_model_with_the_default_threshold_is_said_to_be_sharded_nowhere(caplog):
    """Every parameter of a small model is under the default ``persistence_threshold``: the summary says nothing is
    sharded and how to change it, at build (a WARNING, shown without any logging set up) and in ``describe()``;
    with a lower threshold it says what is sharded instead."""
    with caplog.at_level(logging.INFO, logger="zinf_jax"):
        eng = _engine()
    try:
        text = eng.describe()
        assert "sharded over fsdp: 0 parameters" in text
        assert "note: nothing is sharded" in text and "persistence_threshold=" in text
        notes = [r for r in caplog.records if r.levelno == logging.WARNING and "nothing is sharded" in r.getMessage()]
        assert len(notes) == 1, caplog.text
        summary = [r for r in caplog.records if r.levelno == logging.INFO and "zinf_jax engine:" in r.getMessage()]
        assert len(summary) == 1 and "units, each gathered" in summary[0].getMessage()
    finally:
        eng.close()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="zinf_jax"):
        eng = _engine(persistence_threshold=256)
    try:
        text = eng.describe()
        assert "nothing is sharded" not in text and "nothing is sharded" not in caplog.text
        sharded = sum(1 for l in eng.layouts.values() if l.kind != "persistent")
        assert sharded > 0 and f"sharded over fsdp: {sharded} parameters" in text
        assert f"units, each gathered for its call and released after: {len(eng.adapter.units)} (" in text
    finally:
        eng.close()


@pytest.mark.parametrize("engine", ["compiled", "streamed"])
def test_the_first_step_says_it_compiles_and_the_step_line_reads_the_metrics(caplog, engine):
    """The first step logs that it compiles (the compiled engine: per program, with its time), later steps do not;
    ``format_step`` prints the step's loss, rate and bytes from its metrics."""
    eng = _engine(persistence_threshold=256, engine=engine)
    data = corpus()
    try:
        with caplog.at_level(logging.INFO, logger="zinf_jax"):
            m = eng.train_step(batch_at(data, 0, 8, CFG.seq, 0))
        said = [r.getMessage() for r in caplog.records if "compil" in r.getMessage()]
        if engine == "compiled":
            assert any(s.startswith("compiling the train") for s in said) and any(" in " in s for s in said), said
        else:
            assert said == ["the first step traces and compiles each unit's programs; later steps reuse them"]
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="zinf_jax"):
            m = eng.train_step(batch_at(data, 1, 8, CFG.seq, 0))
        assert not [r for r in caplog.records if "compil" in r.getMessage()]
        line = zinf.format_step(m, total=10)
        assert line.startswith(f"step 2/10 loss {m['loss']:.4f} ") and "tok/s" in line and " dev " in line
        assert "optimizer " in line
    finally:
        eng.close()
