"""Tests of zinf_jax.config: validation, DeepSpeed JSON import, dict round trip.

The DeepSpeed configs under tests/data are DeepSpeed's own documented examples:
  ds_offload_cpu.json    docs/_tutorials/zero.md, "Offloading to CPU and NVMe with ZeRO-Infinity"
  ds_infinity_nvme.json  docs/_pages/config-json.md blocks: optimizer (Adam), fp16,
                         offload_param / offload_optimizer to NVMe, aio
  ds_zero3_auto.json     the ZeRO-3 example of the Hugging Face DeepSpeed integration ("auto" values)
  ds_zero2.json          docs/_tutorials/zero.md, the ZeRO stage 2 example
"""
from __future__ import annotations

import copy
import dataclasses
import json
import pathlib
import warnings

import pytest

from zinf_jax.config import (AioConfig, ConfigError, LossScaleConfig, Offload, OptimizerConfig,
                             ZeroConfig)

DATA = pathlib.Path(__file__).parent / "data"


def _load(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def _from_deepspeed(source) -> tuple[ZeroConfig, list[str]]:
    """Parses ``source``; returns the config and the texts of the warnings raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = ZeroConfig.from_deepspeed(source)
    return config, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def _from_deepspeed_run(source, **run) -> tuple[ZeroConfig, list[str]]:
    """Parses ``source`` with the run's values; returns the config and the texts of the warnings raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = ZeroConfig.from_deepspeed(source, **run)
    return config, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def _set(d: dict, dotted: str, value) -> dict:
    """Returns a deep copy of ``d`` with the value at the dotted key replaced."""
    d = copy.deepcopy(d)
    *parents, last = dotted.split(".")
    node = d
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    return d


# --- dataclasses ------------------------------------------------------------------------------


def test_defaults():
    c = ZeroConfig()
    assert c.offload_param == Offload("none")
    assert c.offload_optimizer == Offload("cpu")
    assert (c.prefetch_depth, c.max_live_bytes, c.nvme_update) == (2, None, "in_place")
    assert (c.persistence_threshold, c.sub_group_size, c.max_in_flight_bytes) == (100_000, 10**9, 1 << 30)
    assert c.aio == AioConfig() and c.loss_scale == LossScaleConfig() and c.optimizer is None
    o = Offload()
    assert (o.device, o.path, o.buffer_count, o.direct_io) == ("none", None, 5, False)
    assert (c.aio.block_size, c.aio.intra_op_parallelism) == (None, None)  # the nvme tier's own defaults


def test_offload_device_is_the_only_positional_field():
    o = Offload("nvme", path="/local_nvme")
    assert (o.device, o.path) == ("nvme", "/local_nvme")
    assert Offload(device="cpu").device == "cpu"
    with pytest.raises(TypeError):
        Offload("nvme", "/local_nvme")  # path is keyword-only
    with pytest.raises(TypeError):
        ZeroConfig(Offload("cpu"))  # ZeroConfig is keyword-only


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ZeroConfig().prefetch_depth = 3  # type: ignore[misc]


def test_nvme_without_path_errors():
    with pytest.raises(ConfigError, match=r"Offload\.path.*nvme_path"):
        Offload("nvme")


def test_pathlike_path_becomes_str(tmp_path):
    assert Offload("nvme", path=tmp_path).path == str(tmp_path)


def test_integral_floats_are_ints():
    o = Offload("cpu", buffer_count=4.0)
    assert o.buffer_count == 4 and type(o.buffer_count) is int
    assert type(ZeroConfig(sub_group_size=1e6).sub_group_size) is int
    with pytest.raises(ConfigError, match=r"Offload\.buffer_count"):
        Offload("cpu", buffer_count=1.5)


@pytest.mark.parametrize("cls, kwargs, expected", [
    (Offload, {"device": "disk"}, ["Offload.device", "'none'", "'cpu'", "'nvme'", "'disk'"]),
    (Offload, {"buffer_count": -1}, ["Offload.buffer_count", ">= 1"]),
    (Offload, {"buffer_count": "5"}, ["Offload.buffer_count", "integer"]),
    (Offload, {"buffer_count": True}, ["Offload.buffer_count", "integer"]),
    (Offload, {"direct_io": 1}, ["Offload.direct_io", "true or false"]),
    (Offload, {"path": ""}, ["Offload.path"]),
    (AioConfig, {"intra_op_parallelism": 0}, ["AioConfig.intra_op_parallelism", ">= 1"]),
    (AioConfig, {"block_size": 100}, ["AioConfig.block_size", ">= 4096"]),
    (ZeroConfig, {"nvme_update": "copy"}, ["ZeroConfig.nvme_update", "'in_place'", "'double_slot'"]),
    (LossScaleConfig, {"min_scale": 0}, ["LossScaleConfig.min_scale", "> 0"]),
    (LossScaleConfig, {"window": 2.5}, ["LossScaleConfig.window", "integer"]),
    (OptimizerConfig, {"name": "sgd"}, ["OptimizerConfig.name", "'adam'", "'adamw'"]),
    (OptimizerConfig, {"b2": 1.0}, ["OptimizerConfig.b2", "[0, 1)"]),
    (OptimizerConfig, {"lr": float("nan")}, ["OptimizerConfig.lr"]),
    (ZeroConfig, {"prefetch_depth": -1}, ["ZeroConfig.prefetch_depth", ">= 0"]),
    (ZeroConfig, {"compute_dtype": "fp16"}, ["ZeroConfig.compute_dtype", "'bfloat16'", "or None"]),
    (ZeroConfig, {"max_live_bytes": 0}, ["ZeroConfig.max_live_bytes", ">= 1 or None"]),
    (ZeroConfig, {"gradient_clipping": "1.0"}, ["ZeroConfig.gradient_clipping", ">= 0"]),
    (ZeroConfig, {"offload_param": {"device": "cpu"}}, ["ZeroConfig.offload_param", "zinf_jax.Offload"]),
    (ZeroConfig, {"aio": None}, ["ZeroConfig.aio", "zinf_jax.AioConfig"]),
    (ZeroConfig, {"optimizer": "adamw"}, ["ZeroConfig.optimizer", "OptimizerConfig or None"]),
])
def test_invalid_field_values(cls, kwargs, expected):
    with pytest.raises(ConfigError) as info:
        cls(**kwargs)
    for text in expected:
        assert text in str(info.value)
    assert isinstance(info.value, ValueError)


def test_resolved_compute_dtype():
    assert ZeroConfig().resolved_compute_dtype("cpu") == "float32"
    assert ZeroConfig().resolved_compute_dtype("gpu") == "bfloat16"
    assert ZeroConfig().resolved_compute_dtype("tpu") == "bfloat16"
    assert ZeroConfig(compute_dtype="float16").resolved_compute_dtype("cpu") == "float16"


# --- to_dict / from_dict ----------------------------------------------------------------------


def test_dict_round_trip_through_json():
    config = ZeroConfig(
        offload_param=Offload("nvme", path="/nvme/p", buffer_count=3, direct_io=True),
        offload_optimizer=Offload("nvme", path="/nvme/o", buffer_count=2), nvme_update="double_slot",
        prefetch_depth=0, max_live_bytes=1 << 28, compute_dtype="float16",
        aio=AioConfig(block_size=1 << 20, intra_op_parallelism=4),
        loss_scale=LossScaleConfig(enabled=True, window=500),
        optimizer=OptimizerConfig(name="adam", lr=3e-4, weight_decay=0.1), gradient_clipping=1.0, seed=7)
    d = json.loads(json.dumps(config.to_dict()))
    assert d["offload_param"]["path"] == "/nvme/p" and d["optimizer"]["lr"] == 3e-4
    assert ZeroConfig.from_dict(d) == config
    assert ZeroConfig.from_dict(ZeroConfig().to_dict()) == ZeroConfig()


def test_from_dict_partial_uses_defaults():
    c = ZeroConfig.from_dict({"prefetch_depth": 4, "offload_param": {"device": "cpu"}})
    assert c == ZeroConfig(prefetch_depth=4, offload_param=Offload("cpu"))


@pytest.mark.parametrize("d, key", [
    ({"prefetch_dept": 1}, "prefetch_dept"),
    ({"offload_param": {"device": "cpu", "nvme_dir": "/x"}}, "offload_param.nvme_dir"),
    ({"optimizer": {"name": "adamw", "beta1": 0.9}}, "optimizer.beta1"),
])
def test_from_dict_unknown_key_errors(d, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        ZeroConfig.from_dict(d)


def test_from_dict_bad_value_names_field():
    with pytest.raises(ConfigError, match=r"offload_param\.device"):  # the key as the file spells it
        ZeroConfig.from_dict({"offload_param": {"device": "gpu"}})


# --- from_deepspeed: DeepSpeed's examples ---------------------------------------------------


def test_deepspeed_zero_infinity_cpu_example():
    c, msgs = _from_deepspeed(DATA / "ds_offload_cpu.json")
    assert c.offload_param == Offload("cpu") and c.offload_optimizer == Offload("cpu", buffer_count=4)
    assert (c.persistence_threshold, c.sub_group_size) == (100_000, 10**9)
    assert c.compute_dtype == "float32" and c.max_live_bytes == 4 * 10**9  # fp32: 4 bytes per element
    assert c.optimizer is None and c.loss_scale == LossScaleConfig() and c.gradient_clipping == 0.0
    assert len(msgs) == 1
    assert ("zero_optimization.contiguous_gradients, zero_optimization.reduce_bucket_size, "
            "zero_optimization.stage3_max_reuse_distance, zero_optimization.stage3_prefetch_bucket_size") in msgs[0]


def test_deepspeed_zero_infinity_nvme_example():
    c, msgs = _from_deepspeed(str(DATA / "ds_infinity_nvme.json"))
    assert c.offload_param == Offload("nvme", path="/local_nvme", buffer_count=5)
    assert c.offload_optimizer == Offload("nvme", path="/local_nvme", buffer_count=4)
    assert c.aio == AioConfig(block_size=1_048_576, intra_op_parallelism=1)
    assert c.inert_settings() == []  # offload_param.buffer_count=5 is the default
    assert c.compute_dtype == "float16" and c.max_live_bytes == 2 * 10**9  # fp16: 2 bytes per element
    assert c.loss_scale == LossScaleConfig(enabled=True, static_scale=0.0, initial_scale_power=16, window=1000,
                                           hysteresis=2, min_scale=1.0, consecutive_hysteresis=False)
    # DeepSpeed's "Adam" applies decoupled weight decay unless params.adam_w_mode is false.
    assert c.optimizer == OptimizerConfig(name="adamw", lr=1e-3, b1=0.8, b2=0.999, eps=1e-8, weight_decay=3e-7)
    assert (c.persistence_threshold, c.gradient_clipping) == (10**6, 1.0)
    assert len(msgs) == 1
    for key in ("train_batch_size", "fp16.auto_cast", "fp16.fp16_master_weights_and_grads",
                "zero_optimization.offload_optimizer.ratio", "zero_optimization.offload_optimizer.fast_init",
                # DeepSpeed knobs with no counterpart here are named, not silently accepted
                "zero_optimization.offload_param.pin_memory", "zero_optimization.offload_param.buffer_size",
                "zero_optimization.offload_param.max_in_cpu", "zero_optimization.offload_optimizer.pin_memory",
                "aio.queue_depth", "aio.single_submit", "aio.overlap_events",
                "zero_optimization.stage3_max_reuse_distance", "zero_optimization.stage3_prefetch_bucket_size"):
        assert key in msgs[0]
    assert "aio.thread_count" not in msgs[0]  # thread_count is the old name of intra_op_parallelism


def test_deepspeed_auto_values_are_filled_from_the_run():
    c, msgs = _from_deepspeed_run(DATA / "ds_zero3_auto.json", hidden_size=64, lr=2e-3, clip=0.5, weight_decay=0.01,
                                  compute_dtype="float32", gradient_accumulation_steps=2, warmup_steps=7)
    assert c.offload_param == Offload("cpu") and c.offload_optimizer == Offload("cpu", buffer_count=4)
    assert (c.persistence_threshold, c.gradient_clipping, c.gradient_accumulation_steps) == (640, 0.5, 2)
    assert c.optimizer.lr == 2e-3 and c.optimizer.weight_decay == 0.01 and (c.optimizer.b1, c.optimizer.b2) == (0.9, 0.999)
    assert c.optimizer.schedule.warmup_max_lr == 2e-3 and c.optimizer.schedule.warmup_num_steps == 7
    assert c.compute_dtype == "float32" and not c.loss_scale.enabled
    assert len(msgs) == 1
    for key in ("train_batch_size", "steps_per_print", "wall_clock_breakdown",
                "zero_optimization.overlap_comm", "zero_optimization.stage3_gather_16bit_weights_on_model_save",
                "zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size"):
        assert key in msgs[0], key
    assert "scheduler" not in msgs[0] and "optimizer.params" not in msgs[0]  # followed, so not listed


def test_deepspeed_stage_2_example_is_refused():
    with pytest.raises(ConfigError, match=r'zero_optimization\.stage.*stage 3.*"stage": 3'):
        ZeroConfig.from_deepspeed(DATA / "ds_zero2.json")


# --- from_deepspeed: warnings, errors -------------------------------------------------------


def test_all_keys_used_means_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 3}})
    # Sections DeepSpeed leaves out keep DeepSpeed's meaning: nothing offloaded.
    assert c.offload_param.device == "none" and c.offload_optimizer.device == "none"
    assert c.max_live_bytes is None and c.compute_dtype == "float32"


def test_unused_keys_warn_once_one_line_per_kind():
    ds = {"train_batch_size": 8, "steps_per_print": 10, "wall_clock_breakdown": False,
          "zero_optimization": {"stage": 3, "contiguous_gradients": True,
                                "offload_param": {"device": "cpu", "pipeline": True, "bogus": 1}},
          "aio": {"block_size": 4096, "mystery": 2}, "optimizer": {"type": "adamw", "params": {"amsgrad": True}}}
    c, msgs = _from_deepspeed(ds)
    assert c.aio.block_size == 4096
    assert len(msgs) == 1
    lines = msgs[0].splitlines()[1:]
    assert lines == [
        "no counterpart here, no effect on the numbers: steps_per_print, train_batch_size, wall_clock_breakdown, "
        "zero_optimization.contiguous_gradients",
        "changes training, not supported: optimizer.params.amsgrad=true (AMSGrad)",
        "not DeepSpeed keys zinf_jax knows (typos?): aio.mystery, zero_optimization.offload_param.bogus, "
        "zero_optimization.offload_param.pipeline"]


def test_input_dict_is_not_modified():
    ds = _load("ds_infinity_nvme.json")
    before = copy.deepcopy(ds)
    _from_deepspeed(ds)
    assert ds == before


_NVME = _load("ds_infinity_nvme.json")


@pytest.mark.parametrize("key, value, expected", [
    ("zero_optimization.offload_param.device", "disk", ["'none'", "'cpu'", "'nvme'", "'disk'"]),
    ("zero_optimization.offload_optimizer.device", 3, ["'nvme'"]),
    ("zero_optimization.offload_param.buffer_count", -1, [">= 1", "-1"]),
    ("aio.block_size", "1e6", ["integer"]),
    ("aio.thread_count", 0, [">= 1"]),
    ("zero_optimization.offload_param.nvme_path", 5, ["directory path"]),
    ("zero_optimization.stage3_max_live_parameters", -5, [">= 1"]),
    ("zero_optimization.sub_group_size", 1.5, ["integer"]),
    ("zero_optimization.offload_optimizer", "cpu", ["JSON object"]),
    ("aio.thread_count", 0, [">= 1"]),
    ("fp16.enabled", "yes", ["true or false"]),
    ("fp16.loss_scale_window", 0, [">= 1"]),
    ("fp16.min_loss_scale", -1, ["> 0"]),
    ("optimizer.type", "Lamb", ["'Adam'", "'AdamW'", "'Lamb'"]),
    ("optimizer.params.lr", "fast", [">= 0"]),
    ("optimizer.params.betas", [0.9], ["[b1, b2]"]),
    ("optimizer.params.adam_w_mode", 0, ["true or false"]),
    ("gradient_clipping", "1.0", [">= 0"]),
])
def test_deepspeed_invalid_value_names_dotted_key(key, value, expected):
    with pytest.raises(ConfigError) as info:
        ZeroConfig.from_deepspeed(_set(_NVME, key, value))
    assert str(info.value).startswith(key + ":"), str(info.value)
    for text in expected:
        assert text in str(info.value)


def test_deepspeed_nvme_without_path_names_nvme_path():
    ds = _set(_NVME, "zero_optimization.offload_param", {"device": "nvme"})
    with pytest.raises(ConfigError, match=r"^zero_optimization\.offload_param\.nvme_path: required"):
        ZeroConfig.from_deepspeed(ds)


@pytest.mark.parametrize("stage", [0, 1, 2, 4, None])
def test_deepspeed_only_stage_3(stage):
    ds = {"zero_optimization": {} if stage is None else {"stage": stage}}
    with pytest.raises(ConfigError, match=r'zero_optimization\.stage: zinf_jax implements ZeRO stage 3'):
        ZeroConfig.from_deepspeed(ds)


def test_deepspeed_without_zero_section_errors():
    with pytest.raises(ConfigError, match=r"zero_optimization\.stage.*got no stage"):
        ZeroConfig.from_deepspeed({"train_batch_size": 1})


def test_deepspeed_bf16_and_fp16_together_error():
    ds = _set(_NVME, "bf16", {"enabled": True})
    with pytest.raises(ConfigError, match=r"bf16\.enabled, fp16\.enabled"):
        ZeroConfig.from_deepspeed(ds)


def test_deepspeed_bf16():
    ds = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e6}}
    c, msgs = _from_deepspeed(ds)
    assert c.compute_dtype == "bfloat16" and c.max_live_bytes == 2 * 10**6 and not c.loss_scale.enabled
    assert msgs == []


def test_deepspeed_static_loss_scale_and_old_names():
    ds = {"fp16": {"enabled": True, "loss_scale": 128}, "zero_optimization": {"stage": 3},
          "aio": {"intra_op_parallelism": 4}}
    c, _ = _from_deepspeed(ds)
    assert c.loss_scale.enabled and c.loss_scale.static_scale == 128.0
    assert c.aio.intra_op_parallelism == 4


@pytest.mark.parametrize("params, name", [
    ({}, "adamw"), ({"adam_w_mode": True}, "adamw"), ({"adam_w_mode": False}, "adam")])
def test_deepspeed_adam_w_mode(params, name):
    ds = {"zero_optimization": {"stage": 3}, "optimizer": {"type": "ADAM", "params": params}}
    assert ZeroConfig.from_deepspeed(ds).optimizer.name == name


def test_deepspeed_optimizer_without_type_errors():
    with pytest.raises(ConfigError, match=r"optimizer\.type.*'Adam', 'AdamW'"):
        ZeroConfig.from_deepspeed({"zero_optimization": {"stage": 3}, "optimizer": {"params": {"lr": 1.0}}})


def test_deepspeed_missing_file(tmp_path):
    path = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match="not found") as info:
        ZeroConfig.from_deepspeed(path)
    assert str(path) in str(info.value)


def test_deepspeed_invalid_json(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"zero_optimization": {"stage": 3,}}')
    with pytest.raises(ConfigError) as info:
        ZeroConfig.from_deepspeed(path)
    assert str(path) in str(info.value) and "Expecting property name" in str(info.value)


def test_deepspeed_top_level_must_be_an_object(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        ZeroConfig.from_deepspeed(path)


def test_deepspeed_result_round_trips():
    c, _ = _from_deepspeed(DATA / "ds_infinity_nvme.json")
    assert ZeroConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
