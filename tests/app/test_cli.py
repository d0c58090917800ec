"""The main job and the command line: trains, saves, resumes; bad input gives one clear error."""
import json
import os

import pytest

from zinf_jax.app.cli import main
from zinf_jax.checkpoint.format import OWNER
from helpers.tmpfs import mounted

TINY = ["--d-model", "32", "--n-layers", "2", "--seq", "32", "--batch", "8", "--no-progress"]


def _run(tmp_path, *extra):
    return main(["train", "--run-dir", str(tmp_path / "run"), *TINY, *extra])


def _losses(tmp_path):
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        return [json.loads(line)["loss"] for line in f]


def test_main_job_trains_saves_and_resumes(tmp_path, capsys):
    assert _run(tmp_path, "--steps", "20", "--save-every", "10", "--lr", "1e-2") == 0
    err = capsys.readouterr().err
    assert "done: 20 steps" in err
    losses = _losses(tmp_path)
    assert len(losses) == 20
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, (losses[0], losses[-5:])  # clearly falls
    ckpts = sorted(p.name for p in (tmp_path / "run" / "ckpt").iterdir() if p.name != OWNER)
    assert ckpts == ["step_00000010", "step_00000020"]
    assert (tmp_path / "run" / "nvme" / "params" / "process_0" / "MANIFEST.json").exists()
    assert _run(tmp_path, "--steps", "23", "--lr", "1e-2", "--resume") == 0
    assert len(_losses(tmp_path)) == 23
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["step"] == 23 and summary["steps_run"] == 3
    assert main(["inspect", str(tmp_path / "run" / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert "step 23" in out and "blocks/0/up/kernel" in out
    assert main(["inspect", str(tmp_path / "run" / "nvme")]) == 0
    assert "generation" in capsys.readouterr().out


@pytest.mark.parametrize(
    "content, message",
    [
        ({"prefetch_depht": 2}, "unknown config key"),
        ({"offload_param": {"device": "disk"}}, "offload_param"),
    ],
)
def test_bad_zinf_config(tmp_path, capsys, content, message):
    cfg = tmp_path / "zinf.json"
    cfg.write_text(json.dumps(content))
    assert _run(tmp_path, "--steps", "1", "--config", str(cfg)) == 2
    err = capsys.readouterr().err
    assert "error" in err and message in err


def test_deepspeed_stage2_refused(tmp_path, capsys):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    assert _run(tmp_path, "--steps", "1", "--deepspeed-config", str(ds)) == 2
    assert "stage" in capsys.readouterr().err


def test_deepspeed_optimizer_section_is_used(tmp_path, capsys):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                                    "offload_optimizer": {"device": "cpu"}},
                              "optimizer": {"type": "AdamW", "params": {"lr": 0.02}}}))
    assert _run(tmp_path, "--steps", "2", "--deepspeed-config", str(ds)) == 0
    err = capsys.readouterr().err
    assert "learning rate          0.02" in err and "lr schedule            constant" in err
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        assert [json.loads(line)["lr"] for line in f] == pytest.approx([0.02, 0.02])


def test_resume_without_checkpoint(tmp_path, capsys):
    assert _run(tmp_path, "--steps", "1", "--resume") == 2
    assert "no zinf_jax checkpoint" in capsys.readouterr().err


def _tmpfs(path, opts):
    """A tmpfs at ``path``; it must unmount cleanly after (busy: the run left tier files open)."""
    return mounted(path, opts, must_release=True)


def test_read_only_and_full_nvme_path(tmp_path, capsys):
    with _tmpfs(tmp_path / "ro", "size=1m,ro") as ro:
        assert _run(tmp_path, "--steps", "1", "--nvme-dir", str(ro)) == 2
        assert "not writable" in capsys.readouterr().err
    # a good run, then a full disk: the error is clear and the saved checkpoint stays intact
    assert _run(tmp_path, "--steps", "2", "--param-device", "cpu", "--optimizer-device", "cpu") == 0
    ckpt = tmp_path / "run" / "ckpt" / "step_00000002"
    before = sorted((p.relative_to(ckpt), p.stat().st_size) for p in ckpt.rglob("*") if p.is_file())
    with _tmpfs(tmp_path / "full", "size=64k") as full:
        assert _run(tmp_path, "--steps", "4", "--nvme-dir", str(full), "--resume") == 2
        assert "disk full" in capsys.readouterr().err
    after = sorted((p.relative_to(ckpt), p.stat().st_size) for p in ckpt.rglob("*") if p.is_file())
    assert before == after and os.path.exists(ckpt / "zinf_meta.json")


def test_profile_writes_a_trace_with_the_engine_regions(tmp_path, capsys):
    # the engine's named regions land in a TensorBoard/Perfetto trace of steps 2-4
    assert _run(tmp_path, "--steps", "4", "--profile", str(tmp_path / "trace")) == 0
    traces = list((tmp_path / "trace").rglob("*.xplane.pb"))
    assert len(traces) == 1, traces
    blob = traces[0].read_bytes()
    for region in (b"zinf/fetch", b"zinf/unit_forward", b"zinf/unit_backward", b"zinf/grads_out", b"zinf/glue",
                   b"zinf/optimizer_read", b"zinf/optimizer_update", b"zinf/optimizer_write", b"zinf/commit"):
        assert region in blob, region
    capsys.readouterr()
    assert _run(tmp_path / "other", "--steps", "1", "--profile", str(tmp_path / "trace2")) == 0
    assert not (tmp_path / "trace2").exists()  # the run ended before the traced steps: said, not silent
    err = capsys.readouterr().err
    assert "--profile" in err and "no trace written" in err
