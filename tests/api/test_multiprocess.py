"""A real 2-process jax.distributed job on CPU: each process stores only its own shards, and the
losses equal the single-process run on the same 8 devices."""
import json
from pathlib import Path

import numpy as np
import optax
import optax.contrib
import pytest
from flax import nnx

import zinf_jax as zinf
from helpers.engine_utils import optax_run
from helpers.procs import WORKERS, free_port, job_env, last_json, start
from zinf_jax.models import GPT, GPTConfig, batch_at, corpus, lm_loss

STEPS = 3


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    """One 2-process x 4-device job that trains the compiled engine (cpu tiers), then the streamed one (nvme, one
    directory for both processes) with a whole-tensor optax rule, then a tree-coupled one on cpu tiers:
    ``({tiers: [per-process results]}, its work dir)``. (The streamed engine with zinf's AdamW across processes: the 4-process job below.)"""
    return _job(tmp_path_factory.mktemp("two"), ("cpu", "nvme-lamb", "cpu-prodigy"))


def _job(work, runs):
    for run in runs:
        if run.startswith("nvme"):
            (work / run).mkdir()
    port = str(free_port())
    outs = last_json(start([[str(WORKERS / "mp_worker.py"), str(i), "2", port, str(work), str(STEPS), ",".join(runs)]
                            for i in range(2)], job_env(jax_cache=True)))
    return {tiers: [o[tiers] for o in outs] for tiers in runs}, work


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


def test_two_processes_compiled_match_single_process(two_processes):
    """The compiled engine (params and optimizer in host RAM) as a 2-process job: one program over both."""
    outs = two_processes[0]["cpu"]
    assert [o["mode"] for o in outs] == ["compiled", "compiled"]
    assert outs[0]["losses"] == outs[1]["losses"]
    np.testing.assert_allclose(outs[0]["losses"], _single("cpu"), rtol=1e-5)


def _shares_one_directory(outs, work):
    """Each process of the nvme job keeps its own subdirectory (its host's NVMe) of ``work`` for params and
    optimizer state, with only its own shards in it."""
    assert [o["devices"] for o in outs] == [8, 8] and [o["local"] for o in outs] == [4, 4]
    assert outs[0]["manifests"] == ["optimizer/process_0/MANIFEST.json", "optimizer/process_1/MANIFEST.json",
                                    "params/process_0/MANIFEST.json", "params/process_1/MANIFEST.json"]
    # (fp32 on nvme: the trained params' one copy is the optimizer's master)
    man = json.loads((work / "optimizer" / "process_1" / "MANIFEST.json").read_text())
    sharded = [v["local"] for v in man["keys"].values() if v["spec"]["num_shards"] == 8]
    assert sharded and all(loc == [4, 5, 6, 7] for loc in sharded)  # only its addressable shards
    from zinf_jax.app.inspect import inspect_dir
    text = inspect_dir(work)
    assert "optimizer: 2 processes; every shard of its" in text and "held by exactly one of them" in text


@pytest.mark.slow  # its own 2-process job (~20 s); the 4-process job trains this engine and tier by default
def test_two_processes_match_single_process(tmp_path):
    outs = _job(tmp_path, ("nvme",))[0]["nvme"]
    assert [o["mode"] for o in outs] == ["streamed", "streamed"]
    _shares_one_directory(outs, tmp_path / "nvme")
    assert outs[0]["losses"] == outs[1]["losses"]
    np.testing.assert_allclose(outs[0]["losses"], _single("nvme"), rtol=1e-5)


def test_two_processes_run_a_whole_tensor_rule_as_plain_jit(two_processes):
    """``optax.lamb`` (a trust ratio per tensor) with each process holding half of every sharded parameter: the
    processes gather each parameter's other shards for its update, and train as plain jit + optax on the
    whole batch."""
    outs = two_processes[0]["nvme-lamb"]
    assert [o["mode"] for o in outs] == ["streamed", "streamed"]
    _shares_one_directory(outs, two_processes[1] / "nvme-lamb")
    assert outs[0]["losses"] == outs[1]["losses"]
    cfg = GPTConfig(vocab=256, d_model=32, n_heads=4, n_layers=2, seq=16)
    data = corpus()
    ref, _ = optax_run(GPT(cfg, rngs=nnx.Rngs(0)), optax.lamb(3e-3, eps=1e-4),
                       [batch_at(data, s, 8, cfg.seq) for s in range(STEPS)])
    np.testing.assert_allclose(outs[0]["losses"], ref, rtol=1e-5)


def test_two_processes_run_a_tree_coupled_rule_as_plain_jit(two_processes):
    """``optax.contrib.prodigy`` (a step size estimated over every parameter) with each process holding half of every
    sharded parameter: each process gathers every parameter for the one update over the tree, and the job trains as
    plain jit + optax on the whole batch."""
    outs = two_processes[0]["cpu-prodigy"]
    assert outs[0]["losses"] == outs[1]["losses"]
    cfg = GPTConfig(vocab=256, d_model=32, n_heads=4, n_layers=2, seq=16)
    data = corpus()
    ref, _ = optax_run(GPT(cfg, rngs=nnx.Rngs(0)), optax.contrib.prodigy(3.0, estim_lr0=1e-4),
                       [batch_at(data, s, 8, cfg.seq) for s in range(STEPS)])
    np.testing.assert_allclose(outs[0]["losses"], ref, rtol=1e-5)


@pytest.mark.slow  # its own 2-process job (~25 s)
def test_two_processes_update_nvme_state_on_the_devices_as_one_process_on_the_host(tmp_path):
    """``optimizer_update="device"`` as a 2-process job: each process moves its own shards of the nvme state to its
    devices, one program over both updates them; the losses of the single-process host update (rtol 1e-5)."""
    outs = _job(tmp_path, ("nvme-device",))[0]["nvme-device"]
    assert [o["mode"] for o in outs] == ["compiled", "compiled"] and [o["in_program"] for o in outs] == [1.0, 1.0]
    assert outs[0]["losses"] == outs[1]["losses"]
    assert outs[0]["manifests"] == ["optimizer/process_0/MANIFEST.json", "optimizer/process_1/MANIFEST.json"]
    np.testing.assert_allclose(outs[0]["losses"], _single("cpu"), rtol=1e-5)


def _chunks(root):
    """``{tier key: {shard or chunk: bytes}}`` stored on disk under an nvme directory (any process): the chunk
    files of unpacked keys, and the members of packed keys inside pack files that exist and hold them."""
    out = {}
    for man_path in Path(root).rglob("MANIFEST.json"):
        proc = man_path.parent
        tier = proc.parent.relative_to(root).as_posix()
        man = json.loads(man_path.read_text())
        packs = man.get("packs", {})
        for key, v in man["keys"].items():
            mine = out.setdefault(f"{tier}/{key}", {})
            if "pack" in v:
                pack = packs[v["pack"]]
                size = (proc / "packs" / f"{v['pack']}.s{pack['slot']}").stat().st_size
                for k, i, off, n in pack["members"]:
                    if k == key:
                        assert off + n <= size
                        mine[str(i)] = n
                continue
            chunks = proc / "data" / key / f"s{v['slot']}" / "c"
            for f in chunks.rglob("*"):
                if f.is_file():
                    mine[f.relative_to(chunks).as_posix()] = f.stat().st_size  # <shard>/<chunk...>
    return out


FOUR_STEPS, FOUR_SAVE_AT = 6, 3


@pytest.fixture(scope="module")
def four_processes(tmp_path_factory):
    """A 4-process x 2-device job, each process with its own nvme directory: (per-process results, its dir)."""
    work = tmp_path_factory.mktemp("four")
    port = str(free_port())
    argvs = [[str(WORKERS / "mp4_worker.py"), str(i), "4", port, str(work), str(FOUR_STEPS), str(FOUR_SAVE_AT)]
             for i in range(4)]
    return last_json(start(argvs, job_env(jax_cache=True)), timeout=600), work


def test_four_processes_with_their_own_nvme_match_one_and_restore_on_one(four_processes, tmp_path):
    """4 processes x 2 devices, each with its own nvme directory (separate hosts): 6 steps equal 1 x 8; each
    directory holds a quarter of the sharded state; the 4-process checkpoints restore on 1 x 8 and go on equally."""
    outs, work = four_processes
    steps, save_at = FOUR_STEPS, FOUR_SAVE_AT
    assert [(o["devices"], o["local"], o["mode"]) for o in outs] == [(8, 2, "streamed")] * 4
    assert all(o["losses"] == outs[0]["losses"] for o in outs)

    cfg = GPTConfig(vocab=256, d_model=32, n_heads=4, n_layers=2, seq=16)
    kw = dict(loss_fn=lm_loss, optimizer=zinf.adamw(3e-3, weight_decay=0.1, clip_norm=1.0))
    data = corpus()
    mk = lambda: GPT(cfg, rngs=nnx.Rngs(0))  # noqa: E731

    def conf(sub):
        (tmp_path / sub).mkdir()
        off = zinf.Offload("nvme", path=str(tmp_path / sub))
        return zinf.ZeroConfig(offload_param=off, offload_optimizer=off, persistence_threshold=600)

    ref = zinf.initialize(mk, config=conf("ref"), **kw)
    ref_losses = [ref.train_step(batch_at(data, s, 8, cfg.seq))["loss"] for s in range(steps)]
    ref_params = ref.param_arrays()
    ref.close()
    np.testing.assert_allclose(outs[0]["losses"], ref_losses, rtol=1e-5)
    # each host's disk holds a quarter of the sharded state (every shard once over the four) and its own copy
    # of the persistent parameters' state (under persistence_threshold, replicated); chunk data only
    ref_chunks = _chunks(tmp_path / "ref")
    sharded = {k for k, c in ref_chunks.items() if len(c) > 1}
    total = sum(sum(c.values()) for k, c in ref_chunks.items() if k in sharded)
    persistent = sum(sum(c.values()) for k, c in ref_chunks.items() if k not in sharded)
    assert total > 10 * persistent
    per_host = [_chunks(work / f"host_{i}") for i in range(4)]
    for i, chunks in enumerate(per_host):
        assert set(chunks) == set(ref_chunks)
        mine = sum(sum(c.values()) for k, c in chunks.items() if k in sharded)
        assert mine == total // 4, (i, mine, total)
        assert sum(sum(c.values()) for k, c in chunks.items() if k not in sharded) == persistent
    assert all(len({frozenset(h[k]) for h in per_host}) == 4 for k in sharded)  # disjoint shards per host

    mid = zinf.restore(work / "ckpt" / f"step_{save_at:08d}", mk, config=conf("mid"), **kw)
    assert mid.step == save_at
    going_on = [mid.train_step(batch_at(data, s, 8, cfg.seq))["loss"] for s in range(save_at, steps)]
    mid.close()
    np.testing.assert_allclose(going_on, outs[0]["losses"][save_at:], rtol=1e-6)
    end = zinf.restore(work / "ckpt" / f"step_{steps:08d}", mk, config=conf("end"), **kw)
    got = end.param_arrays()
    end.close()
    for path, r in ref_params.items():
        np.testing.assert_allclose(got[path], r, rtol=1e-5, atol=1e-6, err_msg=path)


@pytest.mark.slow  # ~25 s more; the 1 x 8 restore is in the default suite
def test_a_four_process_checkpoint_restores_on_two_processes(four_processes, tmp_path):
    """The 4-process job's step-3 checkpoint restored by a 2 x 4 job (host-RAM tiers): its next loss is the
    4-process run's fourth."""
    import shutil

    outs, work = four_processes
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copytree(work / "ckpt" / f"step_{FOUR_SAVE_AT:08d}", ckpt / f"step_{FOUR_SAVE_AT:08d}")
    port = str(free_port())
    res = last_json(start([[str(WORKERS / "mp_ckpt_worker.py"), str(i), "2", port, str(ckpt), "restore"]
                           for i in range(2)], job_env()))
    assert [r["step"] for r in res] == [FOUR_SAVE_AT] * 2
    np.testing.assert_allclose([r["loss2"] for r in res], [outs[0]["losses"][FOUR_SAVE_AT]] * 2, rtol=1e-6)
