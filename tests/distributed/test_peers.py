"""The peer watch in a real 3-process job (JAX's recoverable mode, a 2 s peer timeout), no training."""
import socket

from helpers.procs import WORKERS, free_port, job_env, start
from zinf_jax.distributed import EXIT_PEER_LOST, last_checkpoint_phrase


def test_peer_watch_stops_the_others_with_one_line_when_a_process_dies(tmp_path):
    """Process 2 exits without a word; 0 and 1 leave with EXIT_PEER_LOST and one line naming process 2 (its host
    and pid) and the last complete checkpoint."""
    (tmp_path / "ckpt" / "step_00000007").mkdir(parents=True)
    (tmp_path / "ckpt" / "step_00000007" / "zinf_meta.json").write_text("{}")  # complete (its meta is written last)
    (tmp_path / "ckpt" / ".tmp_step_00000009_ab").mkdir()  # a save in flight is never the last checkpoint
    port = free_port()
    procs = start([[str(WORKERS / "peer_watch_worker.py"), str(i), str(port), str(tmp_path / "ckpt")]
                   for i in range(3)], job_env())
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [EXIT_PEER_LOST, EXIT_PEER_LOST, 9], [e[-1500:] for _, e in outs]
    for out, err in outs[:2]:
        assert "never stopped" not in out
        lines = [ln for ln in err.splitlines() if ln.startswith("zinf_jax: lost ")]
        assert len(lines) == 1, err[-1500:]
        assert f"lost process 2 (host {socket.gethostname()}, pid {procs[2].pid}) of the job's 3" in lines[0]
        assert (f"Last complete checkpoint: {tmp_path / 'ckpt' / 'step_00000007'} (step 7); restart all 3 "
                "processes and zinf.restore it to continue") in lines[0]


def test_last_checkpoint_phrase(tmp_path):
    assert last_checkpoint_phrase(tmp_path / "none", 4).startswith("none yet under ")
    (tmp_path / "step_00000003").mkdir()
    (tmp_path / "step_00000003" / "zinf_meta.json").write_text("{}")
    (tmp_path / "step_00000005").mkdir()  # no metadata: incomplete
    assert last_checkpoint_phrase(tmp_path, 2, "restart {count} with --resume") == \
        f"{tmp_path / 'step_00000003'} (step 3); restart 2 with --resume"
