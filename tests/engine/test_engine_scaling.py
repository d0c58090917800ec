"""Compilations and device memory do not grow with depth; bad stored params are refused."""
import gc
import logging

import jax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from helpers.engine_utils import build, nnx_adapter
from helpers.small_models import TinyLM, TinyLMConfig, lm_loss
from zinf_jax.engine.activations import PinnedHost
from zinf_jax.engine.store import ParamMismatchError
from zinf_jax.engine.streamed import live_device_bytes

THRESHOLD = 2000  # LayerNorms and the position table stay on device


def _ctor(n_layers, d_model=32):
    cfg = TinyLMConfig(n_layers=n_layers, d_model=d_model, dropout=0.0)
    return cfg, (lambda: TinyLM(cfg, rngs=nnx.Rngs(0)))


def _batch(cfg, mesh, b=8):
    t = jax.random.randint(jax.random.key(3), (b, cfg.seq + 1), 0, cfg.vocab)
    return jax.device_put(t, NamedSharding(mesh, P("fsdp")))


class _CompileLog(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        msg = record.getMessage()
        if "Compiling" in msg or "compiling" in msg:
            self.messages.append(msg)


def _count_compiles(n_layers):
    cfg, ctor = _ctor(n_layers)
    sm = build(nnx_adapter(ctor, THRESHOLD), "device", threshold=THRESHOLD, init="random")
    glue = sm.store.fetch(sm.adapter.glue_paths)
    batch = _batch(cfg, sm.mesh)
    sm.forward_backward(lm_loss, batch, glue, has_aux=False)  # plan + warm the glue ops
    jax.clear_caches()
    handler = _CompileLog()
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        with jax.log_compiles(True):
            sm.forward_backward(lm_loss, batch, glue, has_aux=False)
            sm.forward_backward(lm_loss, batch, glue, has_aux=False)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    return len(handler.messages), len(sm.programs)


def test_compilations_constant_in_depth(no_persistent_cache):
    c2, p2 = _count_compiles(2)
    c8, p8 = _count_compiles(8)
    assert p2 == p8 == 6  # embed fwd/bwd, block fwd/bwd, head (attend) fwd/bwd
    assert c2 > 0 and c2 == c8, (c2, c8)


def _eager_dispatches(n_layers, monkeypatch):
    """Ops dispatched one by one (``apply_primitive``) in one warm forward/backward, and the glue segments."""
    from jax._src import dispatch

    cfg, ctor = _ctor(n_layers)
    sm = build(nnx_adapter(ctor, THRESHOLD), "device", threshold=THRESHOLD, init="random")
    glue = sm.store.fetch(sm.adapter.glue_paths)
    batch = _batch(cfg, sm.mesh)
    sm.forward_backward(lm_loss, batch, glue, has_aux=False)  # trace + compile
    count = [0]
    real = dispatch.apply_primitive

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(dispatch, "apply_primitive", counted)
        sm.forward_backward(lm_loss, batch, glue, has_aux=False)
    segments = next(iter(sm._traces.values())).program.segments
    return count[0], segments, len(sm.plan.calls)


def test_glue_runs_compiled_not_op_by_op(monkeypatch):
    # the embedding add, layer norms and the loss run as jitted segments between unit calls: the ops
    # dispatched one by one are a few per pass (the backward's seed) and at most 2 per unit call (the
    # tape summing the cotangents of a value read twice: the residual stream); eager glue was ~10 per layer
    e2, s2, c2 = _eager_dispatches(2, monkeypatch)
    e6, s6, c6 = _eager_dispatches(6, monkeypatch)
    assert c6 == c2 + 4 and e2 <= 8 and e6 - e2 <= 2 * (c6 - c2), (e2, e6)
    assert s2 == s6 <= 5  # segments: one per stretch of glue, not per op or per layer


@pytest.mark.slow  # ~16 s: two models built and stepped; the default suite keeps the compile-count check
def test_peak_device_memory_flat_in_depth():
    peaks, live, model_bytes = {}, {}, {}
    for n in (4, 8, 16):
        cfg, ctor = _ctor(n, d_model=64)
        sm = build(nnx_adapter(ctor, THRESHOLD), "cpu", threshold=THRESHOLD, depth=1, init="random",
                   activations=PinnedHost(), track_live_arrays=True)
        glue = sm.store.fetch(sm.adapter.glue_paths)
        batch = _batch(cfg, sm.mesh)
        sm.forward_backward(lm_loss, batch, glue, has_aux=False)
        gc.collect()  # arrays of the first step awaiting collection would count in the baseline only
        baseline = live_device_bytes()  # counted as the peak is: each buffer once
        sm.reset_peaks()
        sm.forward_backward(lm_loss, batch, glue, has_aux=False)
        peaks[n] = sm.peak_device_bytes
        live[n] = sm.peak_live_array_bytes - baseline
        model_bytes[n] = sum(u.nbytes for u in sm.units) * 8  # replicated would need this on 8 devices
        sm.prefetcher.close()
    assert max(peaks.values()) <= 1.10 * min(peaks.values()), peaks
    assert max(live.values()) <= 1.10 * max(min(live.values()), 1), live
    assert peaks[16] < 0.25 * model_bytes[16], (peaks, model_bytes)
    # the engine's own accounting covers what JAX reports live beyond the baseline
    assert all(live[n] <= peaks[n] * 1.10 for n in peaks), (live, peaks)


def test_stored_params_of_another_model_are_refused(tmp_path):
    _, small = _ctor(2, d_model=32)
    sm = build(nnx_adapter(small, THRESHOLD), "nvme", threshold=THRESHOLD, path=tmp_path)
    sm.store.tier.close()
    _, wide = _ctor(2, d_model=64)
    with pytest.raises(ParamMismatchError, match="does not match the stored one"):
        build(nnx_adapter(wide, THRESHOLD), "nvme", threshold=THRESHOLD, path=tmp_path)
