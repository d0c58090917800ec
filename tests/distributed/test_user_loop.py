"""``zinf.distributed`` in a user's own training loop: 4 processes x 2 CPU devices, each with its own nvme dir
(``tests/workers/user_loop_worker.py``), not the CLI. A lost process ends the others within the peer timeout
with one line naming it; a signal to one process stops all at one step with one complete checkpoint, and a
restart continues bitwise."""
import json
import signal
import socket
import time

import pytest

from helpers.procs import WORKERS, finish, free_port, job_env, start
from zinf_jax.checkpoint.format import is_complete, list_steps
from zinf_jax.distributed import EXIT_PEER_LOST

N = 4


def _start(work, steps, *, peer_timeout=10, save_every=0):
    port = str(free_port())
    return start([[str(WORKERS / "user_loop_worker.py"), str(i), str(N), port, str(work), str(steps),
                   str(peer_timeout), str(save_every)] for i in range(N)], job_env(jax_cache=True))


def _result(out):
    return json.loads(out.strip().splitlines()[-1])


def _wait_for_step(proc_out, step, procs, timeout=300):
    """Until a process printed ``step`` (reads its stdout line by line; the lines read are returned)."""
    lines, deadline = [], time.time() + timeout
    while time.time() < deadline:
        line = proc_out.readline()
        assert line, f"the process ended before step {step}: {[p.poll() for p in procs]}"
        lines.append(line)
        if line.startswith("{") and json.loads(line).get("step") == step:  # (gloo prints lines of its own)
            return lines
    raise AssertionError(f"no step {step} within {timeout} s")


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The job run to its end without a signal: every process's losses of its 12 steps."""
    work = tmp_path_factory.mktemp("whole")
    outs = [_result(out) for out, _ in finish(_start(work, 12), timeout=600)]
    assert all(o["losses"] == outs[0]["losses"] for o in outs) and len(outs[0]["losses"]) == 12
    return outs[0]["losses"]


@pytest.mark.slow  # ~2-3 min: three 4-process jobs
def test_sigterm_to_one_process_stops_all_at_one_step_and_a_restart_continues_bitwise(tmp_path, whole):
    procs = _start(tmp_path, 12)
    _wait_for_step(procs[0].stdout, 3, procs)
    procs[1].send_signal(signal.SIGTERM)
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [143] * N, [e[-2000:] for _, e in outs]
    results = [_result(out) for out, _ in outs]
    saved = {r["saved"] for r in results}
    assert len(saved) == 1 and None not in saved, saved  # every process saved the same, agreed step
    steps = list_steps(tmp_path / "ckpt")
    assert [str(p) for _, p in steps] == list(saved) and is_complete(steps[0][1])  # one complete checkpoint
    agreed = steps[0][0]
    assert 3 <= agreed < 12 and all(len(r["losses"]) == agreed for r in results)
    assert results[0]["losses"] == whole[:agreed]
    assert "SIGTERM to a process of the job: stopping after this step" in outs[0][1]
    again = [_result(out) for out, _ in finish(_start(tmp_path, 12), timeout=600)]
    assert all(r["start"] == agreed and r["exit"] == 0 for r in again)
    assert again[0]["losses"] == whole[agreed:]  # bitwise: the same job, continued from the agreed step


@pytest.mark.slow  # ~1.5 min: one 4-process job and the peer timeout
def test_sigkill_of_one_process_mid_step_ends_the_others_within_the_peer_timeout_naming_it(tmp_path):
    peer_timeout = 10
    procs = _start(tmp_path, 40, peer_timeout=peer_timeout, save_every=2)
    _wait_for_step(procs[0].stdout, 5, procs)
    procs[2].send_signal(signal.SIGKILL)
    killed = time.time()
    errs, took = {}, {}
    for i in (0, 1, 3):
        errs[i] = procs[i].communicate(timeout=120)[1]
        took[i] = round(time.time() - killed, 1)
    procs[2].communicate()
    print(f"seconds from SIGKILL to each survivor's exit (peer_timeout {peer_timeout}): {took}")
    assert [procs[i].returncode for i in (0, 1, 3)] == [EXIT_PEER_LOST] * 3, [e[-1500:] for e in errs.values()]
    assert max(took.values()) <= peer_timeout + 15, took
    step, path = list_steps(tmp_path / "ckpt")[-1]
    for i, err in errs.items():
        lines = [ln for ln in err.splitlines() if ln.startswith("zinf_jax: lost ")]
        assert len(lines) == 1, (i, err[-2000:])
        assert f"lost process 2 (host {socket.gethostname()}, pid {procs[2].pid}) of the job's 4" in lines[0]
        assert (f"Last complete checkpoint: {path} (step {step}); restart all 4 processes and zinf.restore it "
                "to continue") in lines[0]
