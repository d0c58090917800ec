"""A real 2-process jax.distributed job on CPU: each process stores only its own shards, and the
losses equal the single-process run on the same 8 devices."""
import json
import os
import socket
import subprocess
import sys

import numpy as np
from flax import nnx

import zinf_jax as zinf
from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss

HERE = os.path.dirname(__file__)
STEPS = 3


def _port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run_two(tmp_path, tiers):
    port = str(_port())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    (tmp_path / "nvme").mkdir()
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "..", "workers", "mp_worker.py"), str(i), "2", port,
                               str(tmp_path / "nvme"), str(STEPS), tiers], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=env, text=True) for i in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=400)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def _single(tiers):
    cfg = GPTConfig(vocab=256, d_model=32, n_heads=4, n_layers=2, seq=16)
    eng = zinf.initialize(lambda: GPT(cfg, rngs=nnx.Rngs(0)), loss_fn=lm_loss,
                          config=zinf.ZeroConfig(offload_param=zinf.Offload("cpu"), persistence_threshold=600,
                                                 engine="compiled" if tiers == "cpu" else "streamed"),
                          optimizer=zinf.adamw(3e-3, weight_decay=0.1, clip_norm=1.0))
    data = corpus()
    single = [eng.train_step(batch_at(data, s, 8, cfg.seq))["loss"] for s in range(STEPS)]
    eng.close()
    return single


def test_two_processes_compiled_match_single_process(tmp_path):
    """The compiled engine (params and optimizer in host RAM) as a 2-process job: one program over both."""
    outs = _run_two(tmp_path, "cpu")
    assert [o["mode"] for o in outs] == ["compiled", "compiled"]
    assert outs[0]["losses"] == outs[1]["losses"]
    np.testing.assert_allclose(outs[0]["losses"], _single("cpu"), rtol=1e-5)


def test_two_processes_match_single_process(tmp_path):
    outs = _run_two(tmp_path, "nvme")
    assert [o["mode"] for o in outs] == ["streamed", "streamed"]
    assert [o["devices"] for o in outs] == [8, 8] and [o["local"] for o in outs] == [4, 4]
    # each process keeps its own directory (its host's NVMe) for params and optimizer state
    assert outs[0]["manifests"] == ["optimizer/process_0/MANIFEST.json", "optimizer/process_1/MANIFEST.json",
                                    "params/process_0/MANIFEST.json", "params/process_1/MANIFEST.json"]
    # (fp32 on nvme: the trained params' one copy is the optimizer's master)
    man = json.loads((tmp_path / "nvme" / "optimizer" / "process_1" / "MANIFEST.json").read_text())
    sharded = [v["local"] for v in man["keys"].values() if v["spec"]["num_shards"] == 8]
    assert sharded and all(loc == [4, 5, 6, 7] for loc in sharded)  # only its addressable shards
    assert outs[0]["losses"] == outs[1]["losses"]
    np.testing.assert_allclose(outs[0]["losses"], _single("nvme"), rtol=1e-5)
