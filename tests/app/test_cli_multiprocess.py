"""The main job launched as 4 processes of one job (a shell loop's way: the same flags, each its --process-id)."""
import json
import os
import socket

import numpy as np
import pytest

from helpers.procs import WORKERS, finish, free_port, job_env, start

TINY = ["--steps", "4", "--d-model", "32", "--n-layers", "2", "--batch", "16", "--seq", "16", "--save-every", "2",
        "--no-progress"]


def _start(run_dir, n, *flags, runner=None):
    """``zinf-jax train`` as an ``n``-process job (one plain process for ``n == 1``), started.

    ``runner``: ``{process: [script, args...]}`` runs those processes' train arguments through a test worker.
    """
    args = ["train", "--run-dir", str(run_dir), *TINY, *flags]
    if n == 1:
        return start([["-m", "zinf_jax.app.cli", *args]], job_env())
    args += ["--coordinator", f"localhost:{free_port()}", "--num-processes", str(n)]
    runner = runner or {}
    return start([[*runner.get(i, ["-m", "zinf_jax.app.cli"]), *args, "--process-id", str(i)] for i in range(n)],
                 job_env())


def _job(run_dir, n, *flags):
    """The job run to its end (every process exits 0); each process's stderr."""
    return [err for _, err in finish(_start(run_dir, n, *flags), timeout=600)]


@pytest.mark.slow  # ~1 min: two 4-process jobs and two 1-process ones
def test_four_process_cli_job_equals_one_process_and_resumes(tmp_path):
    _job(tmp_path / "one", 1)
    errs = _job(tmp_path / "four", 4)
    one = json.loads((tmp_path / "one" / "summary.json").read_text())
    four = json.loads((tmp_path / "four" / "summary.json").read_text())
    assert four["processes"] == 4 and four["step"] == 4
    np.testing.assert_allclose(four["final_loss"], one["final_loss"], rtol=1e-5)
    # one metrics file and one progress report per job (process 0); the others log under logs/
    assert len((tmp_path / "four" / "metrics.jsonl").read_text().splitlines()) == 4
    assert "done: 4 steps" in errs[0]
    assert sorted(os.listdir(tmp_path / "four" / "logs")) == ["process_1.log", "process_2.log", "process_3.log"]
    assert "done: 4 steps" in (tmp_path / "four" / "logs" / "process_3.log").read_text()
    from zinf_jax.app.inspect import inspect_dir
    assert "4 processes; every shard of its" in inspect_dir(tmp_path / "four" / "nvme" / "optimizer")
    _job(tmp_path / "one", 1, "--resume", "--steps", "6")
    _job(tmp_path / "four", 4, "--resume", "--steps", "6")
    one = json.loads((tmp_path / "one" / "summary.json").read_text())
    four = json.loads((tmp_path / "four" / "summary.json").read_text())
    assert four["step"] == one["step"] == 6
    np.testing.assert_allclose(four["final_loss"], one["final_loss"], rtol=1e-5)


@pytest.mark.slow  # ~1.5 min
def test_a_killed_process_stops_the_others_within_the_peer_timeout_and_resume_continues(tmp_path):
    """SIGKILL one of 4 processes mid-run: the other three exit 75 within --peer-timeout (JAX's heartbeat
    timeout), each with one line naming the lost process (id, host, pid) and the last complete checkpoint;
    all four restarted with --resume end bitwise where the same job uninterrupted does."""
    import signal
    import time

    from zinf_jax.distributed import EXIT_PEER_LOST

    flags = ["--steps", "30", "--save-every", "4", "--peer-timeout", "10"]
    _job(tmp_path / "whole", 4, *flags)
    procs = _start(tmp_path / "four", 4, *flags)
    _wait_for_steps(tmp_path / "four", 10)
    procs[2].send_signal(signal.SIGKILL)
    killed = time.time()
    errs = {}
    for i in (0, 1, 3):
        _, errs[i] = procs[i].communicate(timeout=120)
    took = time.time() - killed
    procs[2].communicate()
    assert [procs[i].returncode for i in (0, 1, 3)] == [EXIT_PEER_LOST] * 3, [e[-1500:] for e in errs.values()]
    assert took <= 10 + 15, took  # the heartbeat timeout, plus the watch's polls and the process exit
    _assert_names_the_loss(errs, tmp_path / "four", 2, f"host {socket.gethostname()}, pid {procs[2].pid}")
    done = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert done["step"] == 30
    _job(tmp_path / "four", 4, *flags, "--resume")
    four = json.loads((tmp_path / "four" / "summary.json").read_text())
    assert four["step"] == 30 and four["steps_run"] < 30
    assert four["final_loss"] == done["final_loss"]  # bitwise: the same job, resumed from its last checkpoint


@pytest.mark.slow  # ~1.5 min
def test_a_process_killed_mid_save_leaves_no_checkpoint_and_resume_continues_bitwise(tmp_path):
    """Process 2 of 4 dies (SIGKILL) in the middle of the step-12 save: the others exit 75 within the bound
    naming it and step 8 as the last complete checkpoint; the half-written save is never taken for a
    checkpoint; --resume on all four removes what is left of it and ends bitwise where an uninterrupted
    4-process job does."""
    import time

    from zinf_jax.distributed import EXIT_PEER_LOST

    flags = ["--steps", "16", "--save-every", "4", "--peer-timeout", "10"]
    _job(tmp_path / "whole", 4, *flags)
    procs = _start(tmp_path / "four", 4, *flags, runner={2: [str(WORKERS / "cli_dies_mid_save.py"), "12"]})
    err = procs[2].communicate(timeout=300)[1]
    died = time.time()
    assert procs[2].returncode == -9, err[-2000:]
    errs = {i: procs[i].communicate(timeout=120)[1] for i in (0, 1, 3)}
    took = time.time() - died
    assert [procs[i].returncode for i in (0, 1, 3)] == [EXIT_PEER_LOST] * 3, [e[-1500:] for e in errs.values()]
    assert took <= 10 + 15, took
    ckpt = tmp_path / "four" / "ckpt"
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000004", "step_00000008"]
    # the half-written save is left as a hidden .tmp_ directory (the watch stopped process 0 first) or already
    # removed (process 0's save saw the lost peer at its next barrier and failed, removing it): never step_00000012
    left = [p.name[:len(".tmp_step_00000012")] for p in ckpt.glob(".tmp_*")]
    assert left in ([], [".tmp_step_00000012"]), left
    _assert_names_the_loss(errs, tmp_path / "four", 2, f"host {socket.gethostname()}, pid {procs[2].pid}")
    errs = _job(tmp_path / "four", 4, *flags, "--resume")
    assert ("removed 1 unfinished save(s) of an earlier run: .tmp_step_00000012" in errs[0]) == bool(left), errs[0]
    four = json.loads((tmp_path / "four" / "summary.json").read_text())
    whole = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert four["step"] == whole["step"] == 16 and four["steps_run"] == 8
    assert four["final_loss"] == whole["final_loss"]  # bitwise: the same job, resumed from step 8


def _assert_names_the_loss(errs, run_dir, lost, where):
    """Each survivor's stderr holds one line naming process ``lost`` (``where``) and the last complete checkpoint."""
    from zinf_jax.checkpoint.format import list_steps

    step, path = list_steps(run_dir / "ckpt")[-1]
    for i, err in errs.items():
        lines = [ln for ln in err.splitlines() if ln.startswith("zinf-jax train: lost ")]
        assert len(lines) == 1, (i, err[-2000:])
        assert f"lost process {lost} ({where}) of the job's 4" in lines[0], lines[0]
        assert f"Last complete checkpoint: {path} (step {step}); restart all 4 processes with --resume" in lines[0]


def _wait_for_steps(run_dir, n, timeout=300):
    """Until the job's metrics file holds ``n`` steps."""
    import time

    metrics, deadline = run_dir / "metrics.jsonl", time.time() + timeout
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < n):
        time.sleep(0.2)
    assert metrics.exists(), "the job never stepped"


@pytest.mark.slow  # ~1.5 min
@pytest.mark.parametrize("sig, own_code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_to_one_process_stops_all_at_one_step_with_one_checkpoint(tmp_path, sig, own_code):
    """SIGTERM (or SIGINT) to process 1 of 4: JAX's preemption service makes all four stop after the same step
    and save it together; all exit 143 (the signalled one 130 for SIGINT); --resume ends bitwise at the loss of
    the same job uninterrupted."""
    import signal

    flags = ["--steps", "30", "--save-every", "0"]
    _job(tmp_path / "whole", 4, *flags)
    procs = _start(tmp_path / "four", 4, *flags)
    _wait_for_steps(tmp_path / "four", 8)
    procs[1].send_signal(getattr(signal, sig))
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [143, own_code, 143, 143], [e[-2000:] for e in errs]
    four = json.loads((tmp_path / "four" / "summary.json").read_text())
    assert four["interrupted"] and 8 <= four["step"] < 30
    steps = sorted(p.name for p in (tmp_path / "four" / "ckpt").iterdir())
    assert steps == [f"step_{four['step']:08d}"]  # one checkpoint, of the step they agreed on, complete
    assert (tmp_path / "four" / "ckpt" / steps[0] / "zinf_meta.json").exists()  # written last: complete
    _job(tmp_path / "four", 4, *flags, "--resume")
    four = json.loads((tmp_path / "four" / "summary.json").read_text())
    whole = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert four["step"] == whole["step"] == 30 and four["steps_run"] < 30
    assert four["final_loss"] == whole["final_loss"]  # bitwise: the same job, resumed from the agreed step

