"""The main job loses nothing and says what it does: flags checked up front, run dirs locked and never
silently reused, stale saves cleaned up, damaged checkpoints skipped, signals honoured, exact resume
after skipped (fp16 overflow) steps, non-finite runs fail.

Fast tests run the job in this process (tiny model, cpu tiers); the subprocess ones are slow
(``pytest -m slow tests/test_cli_safety.py``).
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest

from helpers.procs import job_env
from zinf_jax.app.cli import main
from zinf_jax.distributed import StopAgreement
from zinf_jax.errors import Interrupted
from zinf_jax.app.rundir import RunLock
from zinf_jax.app.train import TrainArgs, train

TINY = ["--d-model", "32", "--n-layers", "2", "--seq", "32", "--batch", "8", "--no-progress"]  # as test_cli
CPU = ["--param-device", "cpu", "--optimizer-device", "cpu"]
# fp16 with a loss scale far too high: the first 6 data steps overflow and are skipped
FP16 = {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}, "compute_dtype": "float16",
        "loss_scale": {"initial_scale_power": 22}, "persistence_threshold": 1024, "gradient_clipping": 1.0}


def _train(run: Path, *extra: str) -> int:
    return main(["train", "--run-dir", str(run), *TINY, *extra])


def _losses(run: Path) -> dict[int, float]:
    """Loss by data position; a step run again after a resume replaces the interrupted run's entry."""
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        out[m["data_step"]] = m["loss"]
    return out


def _files(step_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(step_dir)): p.read_bytes() for p in sorted(step_dir.rglob("*")) if p.is_file()}


def _arrays(step_dir: Path) -> dict[str, bytes]:
    """Every array of a checkpoint as bytes, by group and path."""
    ck = ocp.PyTreeCheckpointer()
    out = {}
    for g in sorted(step_dir.glob("group_*")):
        def walk(t, prefix):
            if isinstance(t, dict):
                for k, v in t.items():
                    walk(v, f"{prefix}/{k}")
            else:
                out[prefix] = np.asarray(t).tobytes()
        walk(ck.restore(g), g.name)
    return out


def _err_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


# --- flags ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, head", [
    (["--seq", "0"], "--seq 0: must be a positive integer"),
    (["--n-heads", "0"], "--n-heads 0: must be a positive integer"),
    (["--batch", "0"], "--batch 0: must be a positive integer"),
    (["--batch", "3"], "--batch 3: must be a positive multiple of 8"),
    (["--batch", "-8"], "--batch -8: must be a positive integer"),
    (["--seq", "5000000"], "--seq 5000000: must be at most"),
    (["--steps", "-1"], "--steps -1: must be a positive integer"),
    (["--lr", "-1"], "--lr -1.0: must be a finite number > 0"),
    (["--lr", "nan"], "--lr nan: must be a finite number > 0"),
    (["--warmup", "-5"], "--warmup -5: must be an integer >= 0"),
    (["--save-every", "-1"], "--save-every -1: must be an integer >= 0"),
    (["--n-heads", "3"], "--n-heads 3: must be a divisor of --d-model 32"),
    (["--param-device", "disk"], "--param-device disk: must be one of none, cpu, nvme"),
    (["--resume", "--overwrite"], "--overwrite: cannot be combined with --resume"),
    (["--num-processes", "4"], "--num-processes 4 --process-id 0: a multi-process job needs --coordinator HOST:PORT"),
    (["--num-processes", "0"], "--num-processes 0: must be a positive integer"),
    (["--coordinator", "localhost:1234", "--num-processes", "4", "--process-id", "4"],
     "--process-id 4: must be less than --num-processes 4 (0 to 3)"),
    (["--coordinator", "nohost"], "--coordinator nohost: must be HOST:PORT"),
    (["--coordinator", "localhost:1234"], "--coordinator localhost:1234: give --num-processes"),
])
def test_every_flag_checked_up_front(tmp_path, capsys, flags, head):
    assert _train(tmp_path / "run", *flags) == 2
    lines = _err_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith(f"zinf-jax train: error: {head}"), lines
    assert not (tmp_path / "run").exists()  # refused before anything is built


def test_estimate_blames_devices(capsys):
    assert main(["estimate", "--layers", "2", "--hidden", "64", "--devices", "0"]) == 2
    assert _err_lines(capsys) == ["zinf-jax estimate: error: --devices 0: must be a positive integer"]


# --- run dirs -----------------------------------------------------------------------------------------

def _plant_tier_state(nvme: Path) -> Path:
    manifest = nvme / "params" / "process_0" / "MANIFEST.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text("{}")
    return manifest


def test_reused_run_dir_refused_then_overwritten(tmp_path, capsys):
    run = tmp_path / "run"
    step2 = run / "ckpt" / "step_00000002"
    assert _train(run, *CPU, "--steps", "2", "--save-every", "0", "--lr", "1e-2") == 0
    files, arrays = _files(step2), _arrays(step2)
    tier_state = _plant_tier_state(run / "nvme")  # as an nvme-tier run leaves it
    capsys.readouterr()
    assert _train(run, *CPU, "--steps", "2", "--save-every", "0", "--lr", "3e-2") == 2  # another run, same dir
    err = _err_lines(capsys)
    assert len(err) == 1 and "already holds a run" in err[0] and "--resume" in err[0] and "--overwrite" in err[0]
    assert "step_00000002" in err[0] and str(run / "nvme" / "params") in err[0], err
    assert _files(step2) == files and tier_state.exists()  # untouched
    assert _train(run, *CPU, "--steps", "2", "--save-every", "0", "--lr", "3e-2", "--overwrite") == 0
    assert "--overwrite: deleted" in capsys.readouterr().err
    assert _arrays(step2) != arrays  # the new run's model, not the first one's
    assert sorted(_losses(run)) == [1, 2] and not tier_state.exists()  # the old run's log and tiers went too


def test_tier_state_alone_refuses(tmp_path, capsys):
    run = tmp_path / "run"
    tier_state = _plant_tier_state(tmp_path / "fast")
    assert _train(run, "--steps", "1", "--nvme-dir", str(tmp_path / "fast")) == 2
    err = _err_lines(capsys)
    assert len(err) == 1 and "--overwrite" in err[0] and str(tmp_path / "fast" / "params") in err[0], err
    assert tier_state.exists()


def test_locked_run_dir_refused_naming_the_holder(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    with RunLock(run):  # another job holds it (flock conflicts between open files, in one process too)
        assert _train(run, "--steps", "1", *CPU) == 2
    err = _err_lines(capsys)
    assert len(err) == 1 and f"in use by pid {os.getpid()}" in err[0], err
    assert not (run / "ckpt").exists() and not (run / "metrics.jsonl").exists()


# --- damaged checkpoints, stale saves ------------------------------------------------------------------

def test_resume_skips_damaged_checkpoints_and_cleans_stale_saves(tmp_path, capsys):
    run, ckpt = tmp_path / "run", tmp_path / "run" / "ckpt"
    assert _train(run, *CPU, "--steps", "5", "--save-every", "1") == 0
    ref_losses, ref_final = _losses(run), _arrays(ckpt / "step_00000005")
    (ckpt / "step_00000005" / "zinf_meta.json").unlink()  # a step dir without metadata
    (ckpt / "step_00000004" / "zinf_meta.json").write_text("")  # empty
    (ckpt / "step_00000003" / "zinf_meta.json").write_bytes(b"\x00garbage{")  # garbage
    shutil.rmtree(ckpt / "step_00000002" / "group_0001")  # a group missing
    (ckpt / ".tmp_step_00000006_deadbeef" / "group_0000").mkdir(parents=True)  # a save killed midway
    capsys.readouterr()
    assert _train(run, *CPU, "--steps", "5", "--save-every", "1", "--resume") == 0
    err = capsys.readouterr().err
    assert "removed 1 unfinished save(s) of an earlier run: .tmp_step_00000006_deadbeef" in err
    for n, why in [(5, "no zinf_meta.json"), (4, "zinf_meta.json"), (3, "zinf_meta.json"), (2, "group_0001")]:
        line = next(x for x in err.splitlines() if f"checkpoint step_{n:08d} is unusable" in x)
        assert why in line and "resuming from step_00000001 instead" in line, line
    assert not list(ckpt.glob(".tmp_*"))
    assert len(list(ckpt.glob(".bad_step_*"))) == 4  # set aside, kept for inspection
    assert _losses(run) == ref_losses  # steps 2..5 again, exactly
    assert _arrays(ckpt / "step_00000005") == ref_final  # and saved again where the damaged ones were


def test_resume_with_only_damaged_checkpoints_names_them(tmp_path, capsys):
    ckpt = tmp_path / "run" / "ckpt"
    (ckpt / "step_00000002").mkdir(parents=True)
    (ckpt / "step_00000001").mkdir()
    (ckpt / "step_00000001" / "zinf_meta.json").write_text("{not json")
    assert _train(tmp_path / "run", *CPU, "--steps", "3", "--resume") == 2
    err = _err_lines(capsys)
    assert len(err) == 1 and "no usable checkpoint" in err[0], err
    assert "step_00000002: no zinf_meta.json" in err[0] and "step_00000001: " in err[0], err
    assert err[0].count("zinf_meta.json") == 2  # missing in one, and the damaged file named
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000001", "step_00000002"]  # nothing moved


# --- signals, skipped steps, non-finite losses --------------------------------------------------------

def _signal_after(log: Path, lines: int, sig: int, done: threading.Event) -> threading.Thread:
    """Sends ``sig`` to this process once ``log`` has ``lines`` lines (not after ``done`` is set)."""
    def watch():
        while not done.is_set():
            if log.exists() and len(log.read_text().splitlines()) >= lines:
                os.kill(os.getpid(), sig)
                return
            time.sleep(0.005)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def test_sigterm_then_resume_is_exact_with_skipped_fp16_steps(tmp_path, capsys):
    cfg = tmp_path / "fp16.json"
    cfg.write_text(json.dumps(FP16))
    args = ["--config", str(cfg), "--steps", "4", "--save-every", "2"]
    ref = tmp_path / "ref"
    assert _train(ref, *args) == 0
    ref_losses = _losses(ref)
    assert len(ref_losses) > 4  # some steps were skipped: 4 optimizer steps took more batches
    run = tmp_path / "run"
    done = threading.Event()
    _signal_after(run / "metrics.jsonl", 3, signal.SIGTERM, done)
    try:
        rc = _train(run, *args)
    finally:
        done.set()
    assert rc == 143
    err = capsys.readouterr().err
    assert "SIGTERM: stopping after the current step" in err and "interrupted by SIGTERM" in err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted"] and summary["data_step"] < len(ref_losses)
    meta = json.loads((Path(summary["checkpoint"]) / "zinf_meta.json").read_text())
    assert meta["user_state"] == {"data_step": summary["data_step"], "optimizer_step": summary["step"]}
    assert _train(run, *args, "--resume") == 0
    assert _losses(run) == ref_losses
    final = "step_00000004"
    assert _arrays(run / "ckpt" / final) == _arrays(ref / "ckpt" / final)
    meta, ref_meta = (json.loads((r / "ckpt" / final / "zinf_meta.json").read_text()) for r in (run, ref))
    assert meta["optimizer"] == ref_meta["optimizer"] and meta["user_state"] == ref_meta["user_state"]


def test_non_finite_loss_fails_the_run(tmp_path, capsys):
    run = tmp_path / "run"
    assert _train(run, *CPU, "--steps", "50", "--lr", "1e30", "--warmup", "0") == 1
    lines = _err_lines(capsys)
    assert lines[-1].startswith("zinf-jax train: error: the final loss is nan"), lines[-1]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["step"] < 50 and summary["steps_run"] < 50  # stopped, not 50 steps of NaN


def test_signal_during_startup_stops_before_anything_is_built(tmp_path):
    stop = StopAgreement(fd=None)
    try:
        os.kill(os.getpid(), signal.SIGHUP)
        assert stop.requested and stop.exit_code == 129
        with pytest.raises(Interrupted, match="SIGHUP during startup: nothing trained, nothing saved") as e:
            train(TrainArgs(run_dir=str(tmp_path / "run"), steps=1, d_model=32, n_layers=2, seq=32, batch=8,
                            progress=False), stop=stop)
    finally:
        stop.restore()
    assert e.value.exit_code == 129
    assert not (tmp_path / "run").exists()


# --- subprocesses (slow) ---------------------------------------------------------------------------------

def _cmd(run: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "zinf_jax.app.cli", "train", "--run-dir", str(run), *TINY, *extra]


ENV = job_env(devices=8)
"""The CLI processes' environment: the tests' compile flags, 8 CPU devices."""


def _wait_for_lines(p: subprocess.Popen, log: Path, lines: int) -> None:
    while p.poll() is None and not (log.exists() and len(log.read_text().splitlines()) >= lines):
        time.sleep(0.05)
    assert p.poll() is None, "the run ended before it could be signalled"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_signal_mid_run_saves_and_exits_with_its_code(tmp_path, sig):
    run = tmp_path / "run"
    p = subprocess.Popen(_cmd(run, "--steps", "1000", "--save-every", "0"), env=ENV, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    _wait_for_lines(p, run / "metrics.jsonl", 2)
    second = subprocess.run(_cmd(run, "--steps", "1000", "--resume"), env=ENV, capture_output=True, text=True)
    assert second.returncode == 2 and f"is in use by pid {p.pid}" in second.stderr, second.stderr  # the lock
    p.send_signal(sig)
    _, err = p.communicate(timeout=300)
    name = signal.Signals(sig).name
    assert p.returncode == 128 + sig, err
    assert f"{name}: stopping after the current step" in err and f"interrupted by {name}:" in err, err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted"] and summary["signal"] == name and 2 <= summary["step"] < 1000
    assert (Path(summary["checkpoint"]) / "zinf_meta.json").exists()
    assert Path(summary["checkpoint"]).name == f"step_{summary['step']:08d}"
    resumed = subprocess.run(_cmd(run, "--steps", str(summary["step"] + 2), "--resume"), env=ENV,
                             capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((run / "summary.json").read_text())["steps_run"] == 2


CRASHES = (-signal.SIGSEGV, -signal.SIGABRT, -signal.SIGBUS, 128 + signal.SIGSEGV, 128 + signal.SIGABRT)


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.5, 1.5, 2.5, 3.5, 5.0, 7.0, 9.0])
def test_ctrl_c_at_any_moment_of_startup_exits_cleanly(tmp_path, delay):
    run = tmp_path / "run"
    p = subprocess.Popen(_cmd(run, "--steps", "1000", "--save-every", "0"), env=ENV, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=300)
    assert p.returncode not in CRASHES and "Segmentation fault" not in err and "Fatal Python error" not in err, err
    assert p.returncode != 0, err  # never swallowed
    assert "Traceback" not in err, err  # zinf_jax imports lazily: the handler is in place within ~0.1 s
    assert p.returncode == 130, err
    lines = [x for x in err.splitlines() if x.strip() and "Warning" not in x and "warnings.warn" not in x
             and not x.startswith("metrics: ")]  # (the report's pointer to the metrics file follows its outcome)
    outcomes = ("zinf-jax train: interrupted by SIGINT during startup", "interrupted by SIGINT:")
    assert lines[-1].startswith(outcomes), lines
    if lines[-1].startswith("zinf-jax train:"):  # nothing trained: nothing saved, no tier state left behind
        assert not list((run / "ckpt").glob("step_*")) and not (run / "nvme" / "params").exists()


def test_a_run_killed_before_its_first_checkpoint_names_one_way_on(tmp_path, capsys):
    """SIGKILL after the first step, before any checkpoint: the tier state is there, no checkpoint. A rerun and a
    --resume both name --overwrite (there is nothing to resume from), and --overwrite trains."""
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "zinf_jax.app.cli", "train", "--run-dir", str(run), *TINY,
                             "--steps", "1000", "--save-every", "1000"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=job_env(jax_cache=True))
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not ((run / "metrics.jsonl").exists()
                                                   and (run / "metrics.jsonl").read_text().strip()):
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    assert not list((run / "ckpt").glob("step_*")) if (run / "ckpt").exists() else True
    assert _train(run, "--steps", "2") == 2
    plain = capsys.readouterr().err
    assert _train(run, "--steps", "2", "--resume") != 0
    resumed = capsys.readouterr().err
    for err in (plain, resumed):
        assert "--overwrite" in err and "first checkpoint" in err, err
    assert "pass --resume" not in plain  # not sent to --resume, which cannot continue it
    assert _train(run, "--steps", "2", "--overwrite") == 0
