"""The CLI explains itself and its output reads well: help for every flag, plain progress in logs, plots, TensorBoard."""
from __future__ import annotations

import argparse
import io
import json
import struct

import numpy as np
import pytest

from zinf_jax.app.cli import EXAMPLES, main, make_parser
from zinf_jax.app.progress import Progress
from zinf_jax.app.train import TrainArgs, train

TINY = dict(d_model=32, n_layers=2, seq=32, batch=8)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_option_of_every_subcommand_has_help():
    parser = make_parser()
    subs = _subparsers(parser)
    assert set(subs) == {"train", "estimate", "inspect", "plot"}
    for name, sub in subs.items():
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help and len(action.help) > 10, f"zinf-jax {name} {action.option_strings or action.dest}"
    train_help = " ".join(subs["train"].format_help().split())  # whatever the terminal width
    assert "--nvme-update MODE" in train_help and "in_place or double_slot" in train_help
    assert "default: nvme" in train_help and "default: 150" in train_help  # defaults shown
    top = parser.format_help()
    assert all(f"zinf-jax {c}" in top for c in subs) and EXAMPLES.splitlines()[0] in top  # an example per command


def test_progress_is_a_live_line_on_a_terminal_and_plain_lines_otherwise():
    m = {"loss": 1.0, "tokens_per_s": 10.0, "peak_device_bytes": 1 << 20, "bytes_host": 0, "bytes_nvme": 2 << 20}
    live = io.StringIO()
    bar = Progress(5, 0, live, True, every=2, live=True)
    for s in range(1, 6):
        bar.update(s, m)
    bar.close()
    assert live.getvalue().count("\r") == 5 and live.getvalue().endswith("\n")
    assert "dev 1.0MiB" in live.getvalue()


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One short main-job run under a pipe (a StringIO is no TTY), with TensorBoard scalars."""
    root = tmp_path_factory.mktemp("run")
    out = io.StringIO()
    summary = train(TrainArgs(**TINY, steps=12, log_every=5, save_every=0, run_dir=str(root / "run"),
                              tensorboard=str(root / "tb")), out=out)
    return root, out.getvalue(), summary


def test_piped_progress_has_no_carriage_return_and_one_line_per_n_steps(tiny_run):
    _, text, summary = tiny_run
    assert summary["step"] == 12
    assert "\r" not in text
    steps = [line.split()[1] for line in text.splitlines() if line.startswith("step ")]
    assert steps == ["5/12", "10/12", "12/12"]  # every 5 steps, and the last
    assert "zinf-jax plot" in text  # the main job says where its metrics are and how to draw them


def test_plot_writes_a_png_of_the_run(tiny_run, capsys):
    root, _, _ = tiny_run
    assert main(["plot", str(root / "run")]) == 0
    png = root / "run" / "metrics.png"
    assert str(png) in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    import matplotlib.image

    image = matplotlib.image.imread(png)
    assert image.shape[0] > 500 and image.shape[1] > 500 and float(np.std(image)) > 0.01  # not blank
    assert main(["plot", str(root / "nowhere")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def _events(path) -> list:
    from tensorboardX.proto import event_pb2

    data, out, pos = path.read_bytes(), [], 0
    while pos < len(data):  # TFRecord: length, crc, payload, crc
        (n,) = struct.unpack("<Q", data[pos:pos + 8])
        ev = event_pb2.Event()
        ev.ParseFromString(data[pos + 12:pos + 12 + n])
        out.append(ev)
        pos += 12 + n + 4
    return out


def test_tensorboard_gets_the_same_scalars_as_the_jsonl(tiny_run):
    root, _, _ = tiny_run
    files = list((root / "tb").glob("events.out.tfevents.*"))
    assert len(files) == 1
    scalars: dict[str, dict[int, float]] = {}
    for ev in _events(files[0]):
        for v in ev.summary.value:
            scalars.setdefault(v.tag, {})[ev.step] = v.simple_value
    rows = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sorted(scalars["loss"]) == [r["step"] for r in rows] == list(range(1, 13))
    np.testing.assert_allclose([scalars["loss"][r["step"]] for r in rows], [r["loss"] for r in rows], rtol=1e-6)
    numeric = {k for r in rows for k, v in r.items() if isinstance(v, (int, float))}
    assert numeric <= set(scalars), numeric - set(scalars)


def test_tensorboard_without_a_writer_package_is_refused_up_front(monkeypatch, tmp_path, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("tensorboardX", "torch") else real(name, *a))
    assert main(["train", "--run-dir", str(tmp_path / "r"), "--tensorboard", str(tmp_path / "tb")]) == 2
    assert "pip install 'zinf-jax[tensorboard]'" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()  # refused before anything is made


def test_estimate_counts_host_and_nvme_per_process(capsys):
    args = ["estimate", "--layers", "8", "--hidden", "1024", "--devices", "8", "--json"]
    assert main(args) == 0
    one = {(e["param_tier"], e["optimizer_tier"]): e for e in json.loads(capsys.readouterr().out)}
    assert main([*args, "--processes", "4"]) == 0
    four = {(e["param_tier"], e["optimizer_tier"]): e for e in json.loads(capsys.readouterr().out)}
    both = four[("nvme", "nvme")]
    assert both["n_processes"] == 4 and both["n_devices"] == 2  # devices of one process
    ratio = both["nvme_bytes"] / one[("nvme", "nvme")]["nvme_bytes"]
    assert 0.24 < ratio < 0.27, ratio  # each host's disk holds its quarter of the state (+ its key metadata)
    assert main([*args, "--processes", "3"]) == 2
    assert "--processes 3: must divide --devices 8" in capsys.readouterr().err


def test_estimate_predicts_the_step_from_the_disk_and_the_device_rate(capsys):
    """``--device-tflops`` with ``--disk-gbps``: each configuration's predicted step seconds (with 4 processes each
    one computes its quarter of the batch on its own devices); without a disk bandwidth the nvme rows say so."""
    args = ["estimate", "--layers", "8", "--hidden", "1024", "--devices", "8", "--device-tflops", "100"]
    assert main([*args, "--disk-gbps", "3", "--json"]) == 0
    rows = {(e["param_tier"], e["optimizer_tier"]): e for e in json.loads(capsys.readouterr().out)}
    assert main([*args, "--disk-gbps", "3", "--json", "--processes", "4"]) == 0
    four = {(e["param_tier"], e["optimizer_tier"]): e for e in json.loads(capsys.readouterr().out)}
    one, other = rows[("nvme", "nvme")]["step_seconds"], four[("nvme", "nvme")]["step_seconds"]
    assert one["compute"] == pytest.approx(other["compute"])  # a quarter of the work on a quarter of the devices
    assert one["step"] == pytest.approx(max(one["compute"], one["pass_io"]) + one["optimizer_io"])
    assert rows[("none", "cpu")]["step_seconds"]["step"] == pytest.approx(one["compute"])
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "step s" in out and "needs --disk-gbps" in out
    assert main([*args[:-1], "0"]) == 2
    assert "--device-tflops 0.0: must be a finite number > 0" in capsys.readouterr().err
