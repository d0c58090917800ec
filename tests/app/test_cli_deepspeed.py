"""``zinf-jax train --deepspeed-config`` on configs as users have them (issue 46): the run uses the resolved
settings (the engine's tiers, clipping and learning-rate schedule are checked, not only that it ran), the
flags given explicitly override the file, a flag that cannot apply is refused, and the resolution is printed."""
import json

import pytest

import zinf_jax.app.train as train_mod
from zinf_jax.app.cli import main
from zinf_jax.config.schedule import LRSchedule

TINY = ["--d-model", "32", "--n-layers", "2", "--seq", "32", "--no-progress", "--save-every", "0"]


@pytest.fixture
def batches(monkeypatch):
    """The batch sizes the runs feed (rows per step)."""
    sizes = []
    real = train_mod.batch_at

    def batch_at(*a, **kw):
        out = real(*a, **kw)
        sizes.append(len(out))
        return out

    monkeypatch.setattr(train_mod, "batch_at", batch_at)
    return sizes


@pytest.fixture
def engines(monkeypatch):
    """The engines the runs build (to read their tiers, clipping and schedule)."""
    built = []

    def initialize(*a, **kw):
        eng = real(*a, **kw)
        built.append((eng, kw["config"]))
        return eng

    real = train_mod.initialize
    monkeypatch.setattr(train_mod, "initialize", initialize)
    return built


def _run(tmp_path, cfg, *extra, name="run"):
    return main(["train", "--run-dir", str(tmp_path / name), *TINY, "--deepspeed-config", str(cfg), *extra])


def _metrics(tmp_path, name="run"):
    with open(tmp_path / name / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def _write(path, data):
    path.write_text(json.dumps(data))
    return path


HF_SHAPE = {  # the HF docs' ZeRO-3 shape: "auto" everywhere, old offload keys, unprefixed stage3_ names
    "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto",
                                                      "warmup_type": "linear"}},
    "zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_params": True,
                          "param_persistence_threshold": "auto", "stage3_prefetch_bucket_size": "auto",
                          "reduce_bucket_size": "auto", "stage3_gather_fp16_weights_on_model_save": True,
                          "zero_quantized_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto", "steps_per_print": 10,
}


def test_hf_shape_trains_with_auto_filled_from_the_flags(tmp_path, capsys, engines, batches):
    cfg = _write(tmp_path / "ds.json", HF_SHAPE)
    assert _run(tmp_path, cfg, "--steps", "3", "--batch", "8", "--lr", "0.01", "--warmup", "2") == 0
    (eng, config), = engines
    assert (eng.param_tier.kind, eng.opt_tier.kind) == ("cpu", "cpu")  # cpu_offload(_params): not device memory
    spec = eng.optimizer.spec
    assert spec.clip_norm == 1.0  # gradient_clipping "auto" <- --clip's default, as the HF Trainer's max_grad_norm
    assert spec.learning_rate == LRSchedule(kind="WarmupDecayLR", warmup_min_lr=0.0, warmup_max_lr=0.01,
                                            warmup_num_steps=2, total_num_steps=3, warmup_type="linear")
    assert config.persistence_threshold == 320 and config.compute_dtype == "float32"
    assert batches == [8, 8, 8]  # train_batch_size "auto" <- --batch
    # DeepSpeed's engine: update 1 at warmup_min_lr, then the scheduler's iterations 0, 1...
    assert [m["lr"] for m in _metrics(tmp_path)] == pytest.approx([0.0, 0.0, 0.005])
    err = capsys.readouterr().err
    assert "settings resolved from" in err
    assert 'gradient clipping      1  ' in err and '"auto" <- --clip 1.0 (the flag\'s default)' in err
    assert '"auto" <- 10 x hidden size (--d-model 32)' in err
    assert "param tier             cpu" in err and "cpu_offload_params (DeepSpeed's other spelling" in err
    table = err[err.index("settings resolved from"):].splitlines()[1:]
    table = table[:next(i for i, ln in enumerate(table) if not ln.startswith("  "))]
    rows = [ln for ln in table if " <- " in ln]
    names = {ln[2:25].strip() for ln in rows}
    for name in ("param tier", "optimizer tier", "compute dtype", "moments dtype", "optimizer", "learning rate",
                 "weight decay", "lr schedule", "gradient clipping", "gradient accumulation", "batch",
                 "persistence threshold", "loss scaling", "seed", "engine", "nvme update", "optimizer update"):
        assert name in names, name
    assert all(ln.split(" <- ", 1)[1].strip() for ln in rows)  # every setting has its source
    unused = [ln.strip() for ln in table if " <- " not in ln]
    kinds = [ln.split(":")[0] for ln in unused if not ln.startswith("note:")]
    assert kinds == ["no counterpart here, no effect on the numbers", "changes training, not supported"]  # one line each
    assert unused[0].startswith("no counterpart here, no effect on the numbers: steps_per_print, "
                                "zero_optimization.reduce_bucket_size")
    assert unused[1] == ("changes training, not supported: zero_optimization.zero_quantized_gradients=true "
                         "(quantized gradient reduction)")


def test_accelerate_yaml_inline_trains_with_its_settings(tmp_path, capsys, engines):
    cfg = tmp_path / "accelerate.yaml"
    cfg.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\nnum_processes: 8\n"
                   "mixed_precision: 'no'\ndeepspeed_config:\n  zero_stage: 3\n  offload_optimizer_device: cpu\n"
                   "  offload_param_device: none\n  gradient_clipping: 0.5\n  gradient_accumulation_steps: 2\n"
                   "  zero3_init_flag: true\n")
    assert _run(tmp_path, cfg, "--steps", "2", "--batch", "16", "--lr", "0.02", "--warmup", "1") == 0
    (eng, config), = engines
    assert (eng.param_tier.kind, eng.opt_tier.kind) == ("device", "cpu")
    assert eng.optimizer.spec.clip_norm == 0.5 and config.gradient_accumulation_steps == 2
    # no optimizer or scheduler in the file: the CLI's AdamW, warmup then cosine decay
    assert [m["lr"] for m in _metrics(tmp_path)] == pytest.approx([0.0, 0.02])
    err = capsys.readouterr().err
    assert "deepspeed_config.zero3_init_flag" in err and "gradient clipping      0.5" in err


def test_accelerate_yaml_pointing_to_json_with_a_constant_lr(tmp_path, capsys, engines, batches):
    _write(tmp_path / "ds.json", {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                                        "offload_optimizer": {"device": "cpu"},
                                                        "stage3_param_persistence_threshold": 100},
                                  "optimizer": {"type": "AdamW", "params": {"lr": 0.02}},
                                  "train_batch_size": 32, "gradient_accumulation_steps": 2})
    cfg = tmp_path / "acc.yaml"
    cfg.write_text(f"distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: {tmp_path / 'ds.json'}\n")
    assert _run(tmp_path, cfg, "--steps", "2") == 0
    (eng, config), = engines
    assert (eng.param_tier.kind, eng.opt_tier.kind) == ("cpu", "cpu")
    assert eng.optimizer.spec.clip_norm is None  # absent: DeepSpeed's default, no clipping
    assert [m["lr"] for m in _metrics(tmp_path)] == pytest.approx([0.02, 0.02])  # DeepSpeed: no scheduler
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps_run"] == 2
    err = capsys.readouterr().err
    assert "batch                  32 per step" in err  # the file's batch, not --batch's default 16
    assert batches == [32, 32]


def test_flags_given_override_the_file(tmp_path, capsys, engines, batches):
    cfg = _write(tmp_path / "ds.json", {
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"},
                              "stage3_param_persistence_threshold": 100000},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.5, "weight_decay": 0.3}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100, "warmup_type": "linear"}},
        "gradient_clipping": 3.0, "train_batch_size": 8})
    assert _run(tmp_path, cfg, "--steps", "2", "--param-device", "none", "--optimizer-device", "nvme",
                "--nvme-dir", str(tmp_path / "swap"), "--clip", "0.25", "--lr", "0.01", "--weight-decay", "0.0",
                "--warmup", "2", "--persistence-threshold", "64", "--moments-dtype", "bfloat16", "--seed", "3",
                "--gradient-accumulation-steps", "2", "--batch", "16", "--engine", "streamed",
                "--nvme-update", "double_slot") == 0
    (eng, config), = engines
    assert (eng.param_tier.kind, eng.opt_tier.kind, eng.mode) == ("device", "nvme", "streamed")
    # the threshold places the parameters: with the file's 100000 every one of this model would stay whole
    kinds = {lay.kind for lay in eng.layouts.values()}
    assert "persistent" in kinds and kinds - {"persistent"}
    assert all(lay.kind == "persistent" for lay in eng.layouts.values() if lay.size <= 64)
    assert eng.optimizer.state_dtype == "bfloat16"  # the moments as stored
    assert (eng.config.gradient_accumulation_steps, eng.config.nvme_update) == (2, "double_slot")
    assert batches == [16, 16]  # --batch over the file's train_batch_size 8
    assert config.offload_optimizer.path == str(tmp_path / "swap") and (tmp_path / "swap").is_dir()
    spec = eng.optimizer.spec
    assert spec.clip_norm == 0.25 and spec.weight_decay == 0.0
    assert spec.learning_rate == LRSchedule(kind="WarmupLR", warmup_max_lr=0.01, warmup_num_steps=2,
                                            warmup_type="linear")
    assert (config.persistence_threshold, config.moments_dtype, config.seed) == (64, "bfloat16", 3)
    assert config.gradient_accumulation_steps == 2
    assert [m["lr"] for m in _metrics(tmp_path)] == pytest.approx([0.0, 0.0])  # warmup_min_lr 0, iterations -1, 0
    err = capsys.readouterr().err
    for row in ("param tier             none  ", "optimizer tier         nvme at", "gradient clipping      0.25",
                "persistence threshold  64", "moments dtype          bfloat16", "seed                   3",
                "batch                  16 per step", "nvme update            double_slot"):
        assert row in err, row
    assert err.count("(flag)") >= 10


def test_seed_clip_and_dtype_flags_change_the_run(tmp_path, engines):
    cfg = _write(tmp_path / "ds.json", {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                                              "offload_optimizer": {"device": "cpu"}},
                                        "optimizer": {"type": "AdamW", "params": {"lr": 0.05}},
                                        "bf16": {"enabled": True}, "gradient_clipping": 0.0})
    assert _run(tmp_path, cfg, "--steps", "2", "--batch", "8", name="a") == 0
    assert _run(tmp_path, cfg, "--steps", "2", "--batch", "8", "--seed", "1", "--clip", "0.01",
                "--compute-dtype", "float32", name="b") == 0
    a, b = _metrics(tmp_path, "a"), _metrics(tmp_path, "b")
    assert a[0]["loss"] != b[0]["loss"]  # another initialisation
    (ea, _), (eb, _) = engines
    assert ea.optimizer.spec.clip_norm is None and eb.optimizer.spec.clip_norm == 0.01
    assert (ea.compute_dtype, eb.compute_dtype) == ("bfloat16", "float32")  # the file's bf16, then the flag's


def test_optimizer_update_device_moves_the_files_nvme_state_to_the_devices_for_the_update(tmp_path, capsys, engines):
    """A DeepSpeed file that keeps the optimizer on nvme, and ``--optimizer-update device``: the state stays on
    nvme between steps and the step's program updates it."""
    (tmp_path / "swap").mkdir()
    cfg = _write(tmp_path / "ds.json", {
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "swap")}},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}, "train_batch_size": 8})
    assert _run(tmp_path, cfg, "--steps", "2", "--optimizer-update", "device") == 0
    (dev, config), = engines
    assert config.optimizer_update == "device" and dev.opt_tier.kind == "nvme" and dev.mode == "compiled"
    assert dev.optimizer.last_stats.get("in_program") == 1.0  # (its numbers: tests/optim/test_optax_parity.py)
    assert "optimizer update       device" in capsys.readouterr().err


@pytest.mark.parametrize("ds, flags, message", [
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}, ["--nvme-dir", "SWAP"],
     "--nvme-dir SWAP: no tier is on nvme (params on none, optimizer on cpu"),
    ({"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}, ["--warmup", "5"],
     "--warmup 5: DS has an optimizer section and no scheduler"),
    ({"zero_optimization": {"stage": 3}}, ["--nvme-update", "double_slot"], "--nvme-update double_slot: no tier"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}},
     ["--optimizer-update", "device"], "optimizer_update='device': the update cannot run in the step's program with "
     "params on 'cpu' and optimizer on 'cpu' (params must be in device memory)"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "SWAP"}}}, [],
     "DS: zero_optimization.offload_param.nvme_path 'SWAP' does not exist; create it, set "
     "zero_optimization.offload_param.nvme_path to a directory on a local disk, or give --nvme-dir DIR"),
    ({"zero_optimization": {"stage": 3, "sub_group_size": "auto"}}, [],
     "error: zero_optimization.sub_group_size: \"auto\" has no rule"),
    ({"zero_optimization": {"stage": 3}, "train_batch_size": 16, "train_micro_batch_size_per_gpu": 4}, [],
     "train_batch_size 16 is not train_micro_batch_size_per_gpu 4 x 8 devices x 1 accumulation steps"),
])
def test_a_flag_that_cannot_apply_is_refused(tmp_path, capsys, ds, flags, message):
    ds = json.loads(json.dumps(ds).replace("SWAP", str(tmp_path / "swap")))
    cfg = _write(tmp_path / "ds.json", ds)
    flags = [str(tmp_path / "swap") if f == "SWAP" else f for f in flags]
    assert _run(tmp_path, cfg, "--steps", "1", *flags) == 2
    err = capsys.readouterr().err.replace(str(tmp_path / "swap"), "SWAP").replace(str(cfg), "DS")
    assert message in err, err


def test_a_zinf_config_keeps_its_own_seed_engine_and_nvme_update_unless_a_flag_is_given(tmp_path):
    from zinf_jax.app.settings import resolve
    from zinf_jax.app.train import TrainArgs

    cfg = tmp_path / "zinf.json"
    cfg.write_text(json.dumps({"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "nvme",
                                                                                         "path": str(tmp_path)},
                               "seed": 7, "engine": "streamed", "nvme_update": "double_slot", "gradient_clipping": 2.0}))
    args = TrainArgs(config=str(cfg), run_dir=str(tmp_path / "run"))
    _, config, res = resolve(args, frozenset({"config", "run_dir"}))
    assert res is None
    assert (config.seed, config.engine, config.nvme_update, config.gradient_clipping) == (7, "streamed", "double_slot",
                                                                                           2.0)
    _, config, _ = resolve(TrainArgs(config=str(cfg), run_dir=str(tmp_path / "run"), seed=0, clip=0.5,
                                     param_device="none", nvme_dir=str(tmp_path / "swap")),
                           frozenset({"config", "run_dir", "seed", "clip", "param_device", "nvme_dir"}))
    assert (config.seed, config.gradient_clipping, config.offload_param.device) == (0, 0.5, "none")
    assert config.offload_optimizer.path == str(tmp_path / "swap") and config.engine == "streamed"
    gone = str(tmp_path / "gone")
    cfg.write_text(json.dumps({"offload_optimizer": {"device": "nvme", "path": gone}}))
    with pytest.raises(ValueError, match=f"offload_optimizer.path '{gone}' does not exist.*or give --nvme-dir DIR"):
        resolve(args, frozenset({"config", "run_dir"}))
