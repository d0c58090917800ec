"""SIGKILL the main job at a random point, resume: the run continues exactly as the uninterrupted one.

Slow (several full runs of the main job in subprocesses): ``pytest -m slow tests/test_kill_resume.py``.
"""
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest

from helpers.procs import job_env

STEPS, EVERY = 12, 3
ARGS = ["--d-model", "32", "--n-layers", "2", "--seq", "32", "--batch", "8", "--no-progress",
        "--steps", str(STEPS), "--save-every", str(EVERY)]


def _cmd(run: Path, *extra):
    return [sys.executable, "-m", "zinf_jax.app.cli", "train", "--run-dir", str(run), *ARGS, *extra]


ENV = job_env(devices=8)
"""The CLI processes' environment: the tests' compile flags, 8 CPU devices."""


def _losses(run: Path) -> dict[int, float]:
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        out[m["data_step"]] = m["loss"]  # a re-run step overwrites the killed run's entry
    return out


def _state(step_dir: Path) -> dict:
    ck = ocp.PyTreeCheckpointer()
    return {g.name: ck.restore(g) for g in sorted(step_dir.glob("group_*"))}


@pytest.mark.slow
@pytest.mark.parametrize("update", ["in_place", "double_slot"])
def test_sigkill_then_resume_reproduces_uninterrupted_run(tmp_path, update):
    ref = tmp_path / "ref"
    subprocess.run(_cmd(ref), check=True, env=ENV, capture_output=True)
    ref_losses = _losses(ref)
    ref_state = _state(ref / "ckpt" / f"step_{STEPS:08d}")
    rng = random.Random(0)
    for trial in range(3):
        run = tmp_path / f"killed{trial}"
        p = subprocess.Popen(_cmd(run, "--nvme-update", update), env=ENV, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        while not any((run / "ckpt").glob("step_*/zinf_meta.json")) and p.poll() is None:
            time.sleep(0.2)
        time.sleep(rng.uniform(0.0, 6.0))  # somewhere in the following steps or a save
        p.send_signal(signal.SIGKILL)
        p.wait()
        subprocess.run(_cmd(run, "--resume", "--nvme-update", update), check=True, env=ENV, capture_output=True)
        losses = _losses(run)
        assert losses == ref_losses, trial
        state = _state(run / "ckpt" / f"step_{STEPS:08d}")
        for g, tree in ref_state.items():
            flat_ref = {k: np.asarray(v) for k, v in _flat(tree)}
            flat_got = {k: np.asarray(v) for k, v in _flat(state[g])}
            assert all(flat_got[k].tobytes() == flat_ref[k].tobytes() for k in flat_ref), (trial, g)


def _flat(tree, prefix=()):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat(v, prefix + (k,))
    else:
        yield "/".join(map(str, prefix)), tree


@pytest.mark.slow
def test_sigkill_mid_step_in_place_is_refused_then_resume_is_bitwise(tmp_path):
    """In-place nvme (the default): a kill inside a step leaves a half-updated tier; the next start refuses it,
    ``--resume`` rebuilds it from the checkpoint and ends bitwise where the uninterrupted run ends."""
    from zinf_jax.tiers import NvmeTier, TierDataError

    args = ["--d-model", "128", "--n-layers", "4", "--steps", "30", "--save-every", "5"]
    ref = tmp_path / "ref"
    subprocess.run(_cmd(ref, *args), check=True, env=ENV, capture_output=True)
    run = tmp_path / "killed"
    p = subprocess.Popen(_cmd(run, *args), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    manifest = run / "nvme" / "optimizer" / "process_0" / "MANIFEST.json"
    caught = False
    while p.poll() is None and not caught:  # kill while the optimizer rewrites the tier in place
        try:
            caught = any((run / "ckpt").glob("step_*/zinf_meta.json")) and "in_progress" in json.loads(
                manifest.read_text())
        except (OSError, ValueError):
            pass
        if caught:
            p.send_signal(signal.SIGKILL)
        time.sleep(0.002)
    p.wait()
    assert caught, "the run ended before a step could be caught in progress"
    with pytest.raises(TierDataError, match="half-updated"):
        NvmeTier(manifest.parent.parent)
    again = subprocess.run(_cmd(run, *args), env=ENV, capture_output=True, text=True)
    assert again.returncode != 0 and "half-updated" in again.stderr and "--resume" in again.stderr, again.stderr
    subprocess.run(_cmd(run, *args, "--resume"), check=True, env=ENV, capture_output=True)
    assert _losses(run) == _losses(ref)
    ref_state, state = _state(ref / "ckpt" / "step_00000030"), _state(run / "ckpt" / "step_00000030")
    for g, tree in ref_state.items():
        got = {k: np.asarray(v).tobytes() for k, v in _flat(state[g])}
        assert all(got[k] == np.asarray(v).tobytes() for k, v in _flat(tree)), g
