"""engine.train_steps: the optimizer overlapped with the next forward equals sequential train_step bitwise."""
import jax
import numpy as np
import pytest
from flax import nnx

import zinf_jax as zinf
from zinf_jax.engine.adapters import EngineError
from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss

CFG = GPTConfig(vocab=256, d_model=32, n_heads=4, n_layers=2, seq=16, dropout=0.1)  # dropout: RNG state moves
DATA = corpus()


def ctor():
    return GPT(CFG, rngs=nnx.Rngs(0))


def batches(n, start=0):
    return [batch_at(DATA, s, 8, CFG.seq) for s in range(start, start + n)]


def engine(path, tier="nvme", **kw):
    path.mkdir(exist_ok=True)
    off = zinf.Offload(tier, path=str(path) if tier == "nvme" else None)
    config = zinf.ZeroConfig(offload_param=off, offload_optimizer=off, persistence_threshold=600, **kw)
    return zinf.initialize(ctor, config=config, optimizer=zinf.adamw(3e-3, weight_decay=0.1, clip_norm=1.0),
                           loss_fn=lm_loss)


def same_state(a, b):
    pa, pb = a.param_arrays(), b.param_arrays()
    assert pa.keys() == pb.keys()
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)
    for x, y in zip(jax.tree.leaves(a.model_state()), jax.tree.leaves(b.model_state())):
        np.testing.assert_array_equal(np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x),
                                      np.asarray(jax.random.key_data(y) if jax.dtypes.issubdtype(y.dtype, jax.dtypes.prng_key) else y))


KEYS = ("loss", "grad_norm", "skipped", "step", "lr")


def test_overlapped_steps_equal_sequential_bitwise_over_10_steps_on_nvme(tmp_path):
    seq, ovl = engine(tmp_path / "seq"), engine(tmp_path / "ovl")
    want = [{k: m[k] for k in KEYS} for m in map(seq.train_step, batches(10))]
    got = [{k: m[k] for k in KEYS} for m in ovl.train_steps(iter(batches(10)))]
    assert got == want  # floats compared exactly
    assert ovl.step == 10
    same_state(seq, ovl)
    # the optimizer really ran beside the forward: parameters were waited for, not read before their write
    assert ovl.optimizer.last_stats["total_s"] > 0
    seq.close()
    ovl.close()


def test_loop_body_sees_the_yielded_step_and_break_discards_the_drawn_batch(tmp_path):
    seq, ovl = engine(tmp_path / "seq", "cpu"), engine(tmp_path / "ovl", "cpu")  # (the tier plays no part here)
    data = batches(8)
    for b in data[:4]:
        seq.train_step(b)
    drawn = []

    def feed():
        for b in data:
            drawn.append(b)
            yield b

    for m in ovl.train_steps(feed()):
        if m["step"] == 4:
            # batch 5 was drawn and its gradients computed, but the engine is at step 4
            assert len(drawn) == 5
            same_state(seq, ovl)
            np.testing.assert_array_equal(seq.eval_step(data[7]), ovl.eval_step(data[7]))
            with pytest.raises(EngineError, match="inside an engine.train_steps"):
                ovl.train_step(data[4])
            break
    # after the break the drawn batch is gone: training goes on from step 4 exactly
    for b in data[4:6]:
        a, c = seq.train_step(b), ovl.train_step(b)
        assert (a["loss"], a["grad_norm"]) == (c["loss"], c["grad_norm"])
    same_state(seq, ovl)
    seq.close()
    ovl.close()


@pytest.mark.slow  # (suite time; the bitwise 10-step test above runs by default)
def test_save_inside_the_loop_resumes_exactly(tmp_path):
    seq, ovl = engine(tmp_path / "seq"), engine(tmp_path / "ovl")
    data = batches(6)
    want = [seq.train_step(b)["loss"] for b in data]
    for m in ovl.train_steps(data[:4]):
        if m["step"] == 3:
            ovl.save(tmp_path / "ckpt")
    ovl.close()
    (tmp_path / "back").mkdir()
    back = zinf.restore(tmp_path / "ckpt", ctor, config=zinf.ZeroConfig(
        offload_param=zinf.Offload("nvme", path=str(tmp_path / "back")),
        offload_optimizer=zinf.Offload("nvme", path=str(tmp_path / "back")), persistence_threshold=600),
        optimizer=zinf.adamw(3e-3, weight_decay=0.1, clip_norm=1.0), loss_fn=lm_loss)
    assert back.step == 3
    assert [m["loss"] for m in back.train_steps(data[3:])] == want[3:]
    same_state(seq, back)
    seq.close()
    back.close()
