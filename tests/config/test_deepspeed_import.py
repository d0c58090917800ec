"""Configs as users have them (issue 46): "auto" filled from the run as the Hugging Face integration fills it,
every spelling DeepSpeed accepts, a misplaced aio, accelerate YAML, DeepSpeed's schedulers, the printed resolution.

The configs here are written for these tests, in the shapes found in the HF Trainer's docs and tests,
accelerate's templates and DeepSpeed's examples.
"""
from __future__ import annotations

import json
import math
import warnings

import pytest

from zinf_jax.config import ConfigError, Offload, ZeroConfig
from zinf_jax.config.ds_keys import KEYS, lookup
from zinf_jax.config.schedule import LRSchedule

RUN = dict(hidden_size=48, lr=2e-3, clip=0.7, weight_decay=0.05, compute_dtype="bfloat16", batch=32,
           gradient_accumulation_steps=2, total_steps=50, warmup_steps=5)

# A ZeRO-3 config with every key the HF integration fills set to "auto".
HF_AUTO = {
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 12},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "none"}, "overlap_comm": True, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                          "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto", "steps_per_print": 100, "wall_clock_breakdown": False,
}


def _quiet(source, **run):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = ZeroConfig.from_deepspeed(source, **run)
    return config, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


# --- "auto" ---------------------------------------------------------------------------------


def test_every_auto_key_is_filled_as_the_hf_integration_fills_it():
    res = ZeroConfig.resolve_deepspeed(HF_AUTO, **RUN)
    c = res.config
    assert c.persistence_threshold == 10 * 48  # stage3_param_persistence_threshold: 10 x hidden
    assert c.gradient_clipping == 0.7 and c.gradient_accumulation_steps == 2
    assert c.compute_dtype == "bfloat16" and not c.loss_scale.enabled  # bf16 "auto" true, fp16 "auto" false
    o = c.optimizer
    assert (o.name, o.lr, o.weight_decay, o.b1, o.b2, o.eps) == ("adamw", 2e-3, 0.05, 0.9, 0.999, 1e-8)
    assert o.schedule == LRSchedule(kind="WarmupDecayLR", warmup_min_lr=0.0, warmup_max_lr=2e-3, warmup_num_steps=5,
                                    total_num_steps=50)
    assert res.batch == 32
    assert res.source("persistence threshold") == '"auto" <- 10 x hidden size (argument hidden_size=48)'
    assert res.source("gradient clipping") == '"auto" <- argument clip=0.7'
    assert res.source("learning rate") == '"auto" <- argument lr=0.002'
    assert "warmup_num_steps \"auto\" <- argument warmup_steps=5" in res.source("lr schedule")
    assert res.source("adam betas").startswith('"auto" <- default (0.9, 0.999)')  # the Trainer's defaults, said
    # the bucket sizes have no counterpart here: named as such, whatever "auto" would make them
    assert "zero_optimization.reduce_bucket_size" in res.no_effect
    assert "zero_optimization.stage3_prefetch_bucket_size" in res.no_effect


def test_betas_and_eps_from_the_run_when_given():
    o = ZeroConfig.resolve_deepspeed(HF_AUTO, **RUN, betas=(0.8, 0.95), eps=1e-6).config.optimizer
    assert (o.b1, o.b2, o.eps) == (0.8, 0.95, 1e-6)


def test_fp16_auto_from_the_run_turns_on_loss_scaling():
    c = ZeroConfig.resolve_deepspeed(HF_AUTO, **{**RUN, "compute_dtype": "float16"}).config
    assert c.compute_dtype == "float16" and c.loss_scale.enabled and c.loss_scale.initial_scale_power == 12


@pytest.mark.parametrize("missing, key, hint", [
    ("hidden_size", "zero_optimization.stage3_param_persistence_threshold", "hidden_size="),
    ("lr", "optimizer.params.lr", "lr="),
    ("clip", "gradient_clipping", "clip="),
    ("weight_decay", "optimizer.params.weight_decay", "weight_decay="),
    ("compute_dtype", "bf16.enabled", "compute_dtype="),
    ("gradient_accumulation_steps", "gradient_accumulation_steps", "gradient_accumulation_steps="),
    ("total_steps", "scheduler.params.total_num_steps", "total_steps="),
    ("warmup_steps", "scheduler.params.warmup_num_steps", "warmup_steps="),
])
def test_an_auto_nothing_fills_is_refused_naming_the_key(missing, key, hint):
    run = {k: v for k, v in RUN.items() if k != missing}
    with pytest.raises(ConfigError) as info:
        ZeroConfig.from_deepspeed(HF_AUTO, **run)
    msg = str(info.value)
    assert msg.startswith(f'{key}: "auto"') and hint in msg, msg


def test_auto_without_a_rule_is_refused():
    ds = {"zero_optimization": {"stage": 3, "sub_group_size": "auto"}}
    with pytest.raises(ConfigError, match=r'^zero_optimization\.sub_group_size: "auto" has no rule.*put a value'):
        ZeroConfig.from_deepspeed(ds, **RUN)


def test_batch_auto_unfilled_is_no_error_in_the_api():
    c, msgs = _quiet({"zero_optimization": {"stage": 3}, "train_batch_size": "auto"})
    assert c == ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 3}})
    assert "train_batch_size" in msgs[0].splitlines()[1]  # what train_step is given: no effect on the config


# --- every spelling DeepSpeed accepts ----------------------------------------------------------


@pytest.mark.parametrize("zero, param, optim", [
    ({"cpu_offload": True}, "none", "cpu"),
    ({"cpu_offload": False}, "none", "none"),
    ({"cpu_offload_param": True}, "cpu", "none"),
    ({"cpu_offload_params": True, "cpu_offload": True}, "cpu", "cpu"),
    ({"cpu_offload_param": True, "cpu_offload": True, "cpu_offload_use_pin_memory": True}, "cpu", "cpu"),
])
def test_deprecated_offload_keys_place_the_state_where_they_say(zero, param, optim):
    c, msgs = _quiet({"zero_optimization": {"stage": 3, **zero}})
    assert (c.offload_param.device, c.offload_optimizer.device) == (param, optim)
    assert c.offload_optimizer.buffer_count == 4  # DeepSpeed's optimizer default, as with the new key
    assert all("not DeepSpeed keys" not in m for m in msgs)
    res = ZeroConfig.resolve_deepspeed({"zero_optimization": {"stage": 3, **zero}})
    assert any("deprecated spelling" in n for n in res.notes)


def test_deprecated_and_new_offload_keys_together_are_refused():
    ds = {"zero_optimization": {"stage": 3, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(ConfigError, match=r"zero_optimization\.cpu_offload, zero_optimization\.offload_optimizer"):
        ZeroConfig.from_deepspeed(ds)


def test_unprefixed_stage3_names_are_read():
    ds = {"zero_optimization": {"stage": 3, "param_persistence_threshold": 777, "max_live_parameters": 1000,
                                "prefetch_bucket_size": 5, "max_reuse_distance": 9,
                                "gather_16bit_weights_on_model_save": True}}
    c, msgs = _quiet(ds)
    assert c.persistence_threshold == 777 and c.max_live_bytes == 4000
    assert msgs[0].splitlines()[1:] == [
        "no counterpart here, no effect on the numbers: zero_optimization.gather_16bit_weights_on_model_save, "
        "zero_optimization.max_reuse_distance, zero_optimization.prefetch_bucket_size"]


def test_old_fp16_save_key_is_known():
    c, msgs = _quiet({"zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True}})
    assert msgs[0].splitlines()[1] == ("no counterpart here, no effect on the numbers: "
                                       "zero_optimization.stage3_gather_fp16_weights_on_model_save")


def test_two_spellings_with_different_values_are_refused():
    ds = {"zero_optimization": {"stage": 3, "param_persistence_threshold": 5, "stage3_param_persistence_threshold": 6}}
    with pytest.raises(ConfigError, match="spellings of one setting"):
        ZeroConfig.from_deepspeed(ds)


def test_bad_value_under_an_old_spelling_names_that_spelling():
    with pytest.raises(ConfigError, match=r"^zero_optimization\.max_live_parameters: expected an integer >= 1"):
        ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 3, "max_live_parameters": -1}})


def test_misplaced_aio_is_read_with_a_note():
    ds = {"zero_optimization": {"stage": 3, "aio": {"block_size": 262144, "queue_depth": 8, "thread_count": 2},
                                "offload_param": {"device": "nvme", "nvme_path": "/tmp/x"}}}
    res = ZeroConfig.resolve_deepspeed(ds)
    assert res.config.aio.block_size == 262144 and res.config.aio.intra_op_parallelism == 2
    assert any(n.startswith("zero_optimization.aio: read as the top-level aio") for n in res.notes)
    assert res.no_effect == ["zero_optimization.aio.queue_depth"]
    with pytest.raises(ConfigError, match=r"^zero_optimization\.aio\.block_size"):
        ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 3, "aio": {"block_size": 10}}})
    both = {**ds, "aio": {"block_size": 4096}}
    with pytest.raises(ConfigError, match="two aio sections"):
        ZeroConfig.from_deepspeed(both)


# --- unused keys, the printed resolution ---------------------------------------------------------


def test_unused_keys_split_into_two_kinds_one_line_each():
    ds = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.4, "pin_memory": True},
                                "zero_quantized_gradients": True, "overlap_comm": True},
          "bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "amsgrad": False}},
          "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.0, "cycle_max_lr": 0.1}},
          "flops_profiler": {"enabled": True}, "tensorboard": {"enabled": True}}
    c, msgs = _quiet(ds)
    assert c.optimizer.schedule is None  # not followed: said
    lines = msgs[0].splitlines()[1:]
    assert len(lines) == 2
    assert lines[0] == ("no counterpart here, no effect on the numbers: flops_profiler, optimizer.params.amsgrad, "
                        "tensorboard, zero_optimization.offload_optimizer.pin_memory, zero_optimization.overlap_comm")
    assert lines[1].startswith("changes training, not supported: ")
    for key in ("bf16.bf16_master_weights_and_grads=true", "scheduler 'OneCycle'",
                "zero_optimization.offload_optimizer.ratio=0.4", "zero_optimization.zero_quantized_gradients=true"):
        assert key in lines[1], key
    assert "cycle_max_lr" not in lines[1]  # the section is named once


def test_printed_resolution_lists_every_setting_with_its_source():
    res = ZeroConfig.resolve_deepspeed(HF_AUTO, **RUN)
    text = str(res)
    for row in ("param tier", "optimizer tier", "compute dtype", "moments dtype", "optimizer", "adam betas",
                "adam eps", "learning rate", "weight decay", "lr schedule", "gradient clipping",
                "gradient accumulation", "batch", "persistence threshold", "max live bytes", "sub group size",
                "loss scaling", "offload activations"):
        line = next(ln for ln in text.splitlines() if ln.strip().startswith(row))
        assert " <- " in line and line.split(" <- ")[1], line
    assert "optimizer tier         cpu" in text and "<- config file zero_optimization.offload_optimizer.device" in text
    assert "max live bytes         unbounded" in text and "default (not in the file: DeepSpeed's default)" in text
    assert "\n  no counterpart here, no effect on the numbers: " in text


def test_explain_prints_the_table(capsys):
    ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 3}}, explain=True)
    assert "settings resolved from (dict):" in capsys.readouterr().out


def test_the_key_table_is_plain_data_with_a_field_and_description_per_key():
    assert len({k.key for k in KEYS}) == len(KEYS)
    for k in KEYS:
        assert k.effect in ("set", "none", "unsupported") and k.about
        assert (k.field is not None) == (k.effect == "set") or k.key == "zero_optimization.stage"
    assert lookup("zero_optimization.cpu_offload_params").key == "zero_optimization.cpu_offload_param"
    assert lookup("tensorboard.output_path").key == "tensorboard"


def test_the_docs_key_reference_is_generated_from_the_importers_table():
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "docs" / "_ext"))
    try:
        import zinf_docs
    finally:
        sys.path.pop(0)
    rows = zinf_docs.deepspeed_rows()
    assert [r[0] for r in rows] == [k.key for k in KEYS]  # every key, in the table's order, nothing else
    by_key = {r[0]: r for r in rows}
    assert by_key["zero_optimization.cpu_offload_param"][1] == "offload_param.device"
    assert "also spelled zero_optimization.cpu_offload_params" in by_key["zero_optimization.cpu_offload_param"][2]
    assert '"auto" becomes: 10 x hidden size' in by_key["zero_optimization.stage3_param_persistence_threshold"][2]
    assert by_key["steps_per_print"][1] == "(no counterpart: no effect on the numbers)"
    assert by_key["optimizer.params.amsgrad"][1] == "(changes training: not supported)"
    md = zinf_docs.deepspeed_md()
    assert md.count("\n") == len(KEYS) + 2 and "`zero_optimization.cpu_offload`" in md


# --- DeepSpeed's schedulers -------------------------------------------------------------------


def _ds_rates(kind, n, **p):
    """The learning rate of updates 1..n under DeepSpeed's engine, written out from its documented formulas:
    the value set at construction for update 1, then the scheduler stepped after each update."""
    w = max(2, p.get("warmup_num_steps", 1000))
    log = p.get("warmup_type", "log") == "log"

    def ramp(i):
        return math.log(i + 1) / math.log(w) if log else i / w

    out = []
    for it in range(-1, n - 1):
        if kind == "WarmupCosineLR":
            lr = p["lr"]
            if it < 0:
                out.append(0.0)
            elif it < w:
                out.append(lr * (p.get("warmup_min_ratio", 0.0) + ramp(it) * (1 - p.get("warmup_min_ratio", 0.0))))
            else:
                prog = min(1.0, (it - w + 1) / max(1, p["total_num_steps"] - w))
                cmin = p.get("cos_min_ratio", 1e-4)
                out.append(lr * max(0.0, cmin + (1 - cmin) * (1 + math.cos(math.pi * prog)) / 2))
            continue
        lo, hi = p.get("warmup_min_lr", 0.0), p["warmup_max_lr"]
        if it < 0:
            out.append(lo)
        elif it < w:
            out.append(lo + (hi - lo) * ramp(it))
        elif kind == "WarmupLR":
            out.append(hi)
        else:
            out.append(lo + (hi - lo) * max(0.0, (p["total_num_steps"] - it) / max(1, p["total_num_steps"] - w)))
    return out


@pytest.mark.parametrize("kind, params", [
    ("WarmupLR", {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 6}),
    ("WarmupLR", {"warmup_max_lr": 0.01, "warmup_num_steps": 4, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"warmup_max_lr": 0.02, "warmup_num_steps": 3, "total_num_steps": 12, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"warmup_num_steps": 4, "total_num_steps": 14, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01}),
])
def test_schedulers_become_the_rates_deepspeed_steps_through(kind, params):
    ds = {"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": 0.03}},
          "scheduler": {"type": kind, "params": params}}
    c, msgs = _quiet(ds)
    sched = c.optimizer.schedule
    want = _ds_rates(kind, 16, lr=0.03, **params)
    assert [sched.lr_at(t) for t in range(16)] == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert [float(sched(t)) for t in range(16)] == pytest.approx(want, rel=1e-6, abs=1e-9)  # as optax evaluates it
    assert c.optimizer.learning_rate() is sched and msgs == []


def test_warmup_lr_without_a_peak_takes_the_optimizers_lr():
    ds = {"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": 0.03}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
    assert ZeroConfig.from_deepspeed(ds).optimizer.schedule.warmup_max_lr == 0.03


def test_scheduler_without_an_optimizer_section_is_said_in_the_api():
    ds = {"zero_optimization": {"stage": 3},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 10}}}
    c, msgs = _quiet(ds)
    assert c.optimizer is None
    assert "changes training, not supported here: scheduler" in msgs[0]
    assert ZeroConfig.resolve_deepspeed(ds).schedule.warmup_max_lr == 0.01


def test_decay_scheduler_needs_total_steps():
    ds = {"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": 0.03}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}}}
    with pytest.raises(ConfigError, match=r"^scheduler\.params\.total_num_steps: required by WarmupDecayLR"):
        ZeroConfig.from_deepspeed(ds)


def test_schedule_round_trips_through_a_dict():
    c = ZeroConfig.resolve_deepspeed(HF_AUTO, **RUN).config
    assert ZeroConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c


# --- accelerate YAML -----------------------------------------------------------------------------

INLINE_YAML = """\
compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  gradient_accumulation_steps: 4
  gradient_clipping: 0.5
  offload_optimizer_device: nvme
  offload_optimizer_nvme_path: {nvme}
  offload_param_device: cpu
  offload_param_nvme_path: none
  zero3_init_flag: true
  zero3_save_16bit_model: true
  zero_stage: 3
distributed_type: DEEPSPEED
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 8
use_cpu: false
"""


def test_accelerate_yaml_with_inline_keys(tmp_path):
    path = tmp_path / "accelerate.yaml"
    path.write_text(INLINE_YAML.format(nvme=tmp_path / "swap"))
    res = ZeroConfig.resolve_deepspeed(path, gradient_accumulation_steps=1)  # the file's 4 wins over the run's
    c = res.config
    assert c.offload_param == Offload("cpu") and c.offload_optimizer == Offload("nvme", path=str(tmp_path / "swap"),
                                                                               buffer_count=4)
    assert (c.gradient_accumulation_steps, c.gradient_clipping, c.compute_dtype) == (4, 0.5, "bfloat16")
    assert "deepspeed_config.zero3_init_flag" in res.no_effect and "num_processes" in res.no_effect
    assert "zero_optimization.stage3_gather_16bit_weights_on_model_save" in res.no_effect
    assert res.file == str(path)
    assert any("offload_optimizer_device -> zero_optimization.offload_optimizer.device" in n for n in res.notes)


def test_accelerate_yaml_inline_accumulation_defaults_to_auto(tmp_path):
    path = tmp_path / "a.yml"
    path.write_text("deepspeed_config:\n  zero_stage: 3\n  offload_optimizer_device: cpu\nmixed_precision: 'no'\n")
    with pytest.raises(ConfigError, match=r'^gradient_accumulation_steps: "auto"'):
        ZeroConfig.from_deepspeed(path)
    c = ZeroConfig.from_deepspeed(path, gradient_accumulation_steps=3)
    assert c.gradient_accumulation_steps == 3 and c.compute_dtype == "float32" and c.gradient_clipping == 0.0


def test_accelerate_yaml_pointing_to_a_json(tmp_path):
    ds = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"},
                                "stage3_param_persistence_threshold": "auto"},
          "bf16": {"enabled": "auto"}, "gradient_clipping": 2.0}
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    path = tmp_path / "acc.yaml"
    path.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n"
                    "  zero3_init_flag: true\nmixed_precision: bf16\n")
    with pytest.raises(ConfigError, match="zero3_init_flag: give it in"):  # accelerate refuses this too
        ZeroConfig.from_deepspeed(path, hidden_size=16)
    path.write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n"
                    "mixed_precision: bf16\n")
    res = ZeroConfig.resolve_deepspeed(path, hidden_size=16)
    c = res.config
    assert c.offload_param.device == "cpu" and c.offload_optimizer.device == "cpu"
    assert (c.compute_dtype, c.persistence_threshold, c.gradient_clipping) == ("bfloat16", 160, 2.0)
    assert c.gradient_accumulation_steps == 1  # accelerate's default beside a file
    assert str(tmp_path / "ds.json") in res.file and "distributed_type" in res.no_effect


def test_accelerate_yaml_without_a_deepspeed_section(tmp_path):
    path = tmp_path / "fsdp.yaml"
    path.write_text("distributed_type: FSDP\nfsdp_config: {}\n")
    with pytest.raises(ConfigError, match="no deepspeed_config section"):
        ZeroConfig.from_deepspeed(path)


# --- the key reference agrees with the importer ------------------------------------------------------

# A value for each key the reference says sets a plain setting, and where the setting lands; the test sets
# each key alone (with what it needs around it) and reads the setting back.
_SAMPLES = {
    "zero_optimization.offload_param.device": ("cpu", "offload_param.device", "cpu"),
    "zero_optimization.offload_optimizer.device": ("cpu", "offload_optimizer.device", "cpu"),
    "zero_optimization.offload_optimizer.buffer_count": (7, "offload_optimizer.buffer_count", 7),
    "zero_optimization.stage3_param_persistence_threshold": (1234, "persistence_threshold", 1234),
    "zero_optimization.stage3_max_live_parameters": (1000, "max_live_bytes", 4000),
    "zero_optimization.sub_group_size": (54321, "sub_group_size", 54321),
    "aio.block_size": (2 << 20, "aio.block_size", 2 << 20),
    "aio.intra_op_parallelism": (3, "aio.intra_op_parallelism", 3),
    "bf16.bf16_optimizer_states": (True, "moments_dtype", "bfloat16"),
    "gradient_clipping": (0.25, "gradient_clipping", 0.25),
    "gradient_accumulation_steps": (3, "gradient_accumulation_steps", 3),
    "activation_checkpointing.cpu_checkpointing": (True, "offload_activations", True),
}


def _dotted(obj, path):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _with_key(key, value):
    d: dict = {"zero_optimization": {"stage": 3}}
    if key.startswith("zero_optimization.offload_optimizer.") and not key.endswith("device"):
        d["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if key == "bf16.bf16_optimizer_states":
        d["bf16"] = {"enabled": True}
    node = d
    *head, last = key.split(".")
    for k in head:
        node = node.setdefault(k, {})
    node[last] = value
    return d


@pytest.mark.parametrize("key", sorted(_SAMPLES))
def test_a_key_the_reference_says_is_read_sets_its_setting(key):
    """The generated DeepSpeed key reference says which setting each key sets; the importer sets exactly that
    (the case of offload_optimizer.buffer_count, once read as DeepSpeed's default whatever the file said)."""
    entry = lookup(key)
    value, field, want = _SAMPLES[key]
    assert entry is not None and entry.effect == "set" and entry.field == field
    config, said = _quiet(_with_key(key, value))
    assert _dotted(config, field) == want
    assert not any(key in s for s in said), said


def test_every_plain_set_key_has_a_sample():
    """Each key the reference maps to a setting of its own is in _SAMPLES (or derived: a dtype, a schedule, the
    optimizer section, the batch, a path, a deprecated spelling)."""
    derived = {"compute_dtype", "schedule", "batch", "offload_param.path", "offload_optimizer.path",
               "offload_param.buffer_count", "optimizer.name", "optimizer.lr", "optimizer.b1", "optimizer.eps",
               "optimizer.weight_decay"}
    for k in KEYS:
        if k.effect == "set" and k.field and k.field not in derived and not k.field.startswith("loss_scale.") and \
                k.key not in ("zero_optimization.cpu_offload", "zero_optimization.cpu_offload_param"):
            assert k.key in _SAMPLES, k.key


def test_explain_and_the_warning_agree_on_the_batch_keys(capsys):
    """With the API (not zinf-jax train), the file's batch keys have no effect: the printed table leaves them out
    and the warning lists them, once."""
    d = {"zero_optimization": {"stage": 3}, "train_batch_size": 16}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ZeroConfig.from_deepspeed(d, explain=True)
    table = capsys.readouterr().out
    assert "train_batch_size" in " ".join(str(w.message) for w in caught)
    assert "16 per step" not in table
