"""DeepSpeed JSON -> ZeroConfig (through load_config), batch-size arithmetic, and the named optimizer / LR
schedules. HF "auto" resolution: test_config_hf_auto.py; the validator itself: test_config_validate.py."""

from __future__ import annotations

import json
import logging
import math
import re
import warnings

import pytest
import torch

from zeroray.config import OffloadConfig, ZeroConfig
from zeroray.config.deepspeed import DeepSpeedConfigError
from zeroray.config.load import load_config as parse_deepspeed
from zeroray.engine.named_optim import WarmupDecayLR, WarmupLR, build_optimizer, build_scheduler

# The ZeRO-3 example of DeepSpeed's configuration docs, with offload set to "none" (zeroray has no
# offload yet) and with the keys zeroray ignores left in, as users copy them.
ZERO3_EXAMPLE = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "steps_per_print": 10,
    "wall_clock_breakdown": False,
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": 0,
            "warmup_max_lr": 3e-4,
            "warmup_num_steps": 100,
            "total_num_steps": 1000,
        },
    },
    "bf16": {"enabled": True},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "none", "pin_memory": True},
        "offload_param": {"device": "none", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": 5e8,
        "allgather_bucket_size": 2e8,
        "stage3_prefetch_bucket_size": 4.5e8,
        "stage3_param_persistence_threshold": 1e6,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
        "reduce_scatter": True,
        "zeroray_units": ["TransformerBlock"],
        "all_gather_by_broadcast": False,
    },
}


def parse_quietly(config):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return parse_deepspeed(config)


# ------------------------------------------------------------------------------ full example
def test_zero3_example_parses_to_the_right_fields(caplog):
    with caplog.at_level(logging.WARNING, logger="zeroray"):
        cfg = parse_deepspeed(ZERO3_EXAMPLE)
    assert cfg.stage == 3
    assert cfg.precision.param_dtype == "bf16" and cfg.precision.name == "bf16"
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (
        64,
        4,
        2,
    )
    assert cfg.gradient_clipping == 1.0
    comm = cfg.comm
    assert comm.reduce_bucket_size == 500_000_000 and type(comm.reduce_bucket_size) is int
    assert comm.allgather_bucket_size == 200_000_000 and type(comm.allgather_bucket_size) is int
    assert comm.prefetch_bucket_size == 450_000_000 and type(comm.prefetch_bucket_size) is int
    assert comm.overlap_comm is True and comm.reduce_scatter is True
    assert comm.all_gather_by_broadcast is False
    assert cfg.units == ("TransformerBlock",)
    assert cfg.offload_optimizer == OffloadConfig(device="none", pin_memory=True)
    assert cfg.offload_param == OffloadConfig(device="none", pin_memory=True)
    assert cfg.optimizer == {"type": "AdamW", "params": ZERO3_EXAMPLE["optimizer"]["params"]}
    assert cfg.scheduler == {"type": "WarmupDecayLR", "params": ZERO3_EXAMPLE["scheduler"]["params"]}
    assert cfg.resolve_batch(8).gradient_accumulation_steps == 2
    assert cfg.sub_group_size == 1_000_000_000
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    for key in (
        "'steps_per_print'",
        "'wall_clock_breakdown'",
        "'zero_optimization.contiguous_gradients'",
        "'zero_optimization.stage3_param_persistence_threshold'",
        "'zero_optimization.stage3_max_live_parameters'",
        "'zero_optimization.stage3_max_reuse_distance'",
        "'zero_optimization.stage3_gather_16bit_weights_on_model_save'",
    ):
        assert key in warned
    # The used keys do not warn.
    assert "'zero_optimization.stage'" not in warned and "reduce_bucket_size" not in warned


def test_parse_does_not_mutate_its_input():
    before = json.dumps(ZERO3_EXAMPLE, sort_keys=True)
    parse_quietly(ZERO3_EXAMPLE)
    assert json.dumps(ZERO3_EXAMPLE, sort_keys=True) == before


def test_empty_config_gives_the_defaults():
    assert parse_deepspeed({}) == ZeroConfig()


def test_load_config_takes_every_kind_of_config(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    assert parse_deepspeed(path).stage == 1
    assert parse_deepspeed(str(path)).stage == 1
    assert parse_deepspeed({"zero_optimization": {"stage": 3}}).stage == 3
    assert parse_deepspeed(None) == ZeroConfig()
    cfg = ZeroConfig(stage=2)
    assert parse_deepspeed(cfg) is cfg
    # ZeroConfig itself no longer knows DeepSpeed (that was an import cycle).
    assert not hasattr(ZeroConfig, "from_deepspeed") and not hasattr(ZeroConfig, "coerce")


# ------------------------------------------------------------------------------ precision
@pytest.mark.parametrize(
    "raw, precision",
    [
        ({}, "fp32"),
        ({"fp16": {"enabled": True}}, "fp16"),
        ({"bf16": {"enabled": True}}, "bf16"),
        ({"bfloat16": {"enabled": True}}, "bf16"),
        ({"fp16": {"enabled": False}, "bf16": {"enabled": False}}, "fp32"),
        ({"fp16": {"enabled": False}, "bf16": {"enabled": True}}, "bf16"),
    ],
)
def test_precision(raw, precision):
    assert parse_deepspeed(raw).precision.param_dtype == precision


def test_fp16_and_bf16_both_enabled_is_an_error():
    with pytest.raises(
        ValueError,
        match=r"DeepSpeed config keys 'fp16\.enabled' and 'bf16\.enabled' both set ZeroConfig\.precision\.param_dtype; "
        "give only one",
    ):
        parse_deepspeed({"fp16": {"enabled": True}, "bf16": {"enabled": True}})


def test_bf16_and_its_alias_together_is_an_error():
    with pytest.raises(ValueError, match=r"'bf16\.enabled' and 'bfloat16\.enabled'"):
        parse_deepspeed({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}})


def test_fp16_loss_scaling_fields():
    cfg = parse_deepspeed(
        {
            "fp16": {
                "enabled": True,
                "loss_scale": 0,
                "initial_scale_power": 12,
                "loss_scale_window": 500,
                "hysteresis": 3,
                "min_loss_scale": 0.5,
            }
        }
    )
    ls = cfg.loss_scaling
    assert (
        ls.loss_scale,
        ls.initial_scale_power,
        ls.loss_scale_window,
        ls.hysteresis,
        ls.min_loss_scale,
    ) == (
        0.0,
        12,
        500,
        3,
        0.5,
    )
    assert parse_deepspeed({"fp16": {"enabled": True, "loss_scale": 128}}).loss_scaling.loss_scale == 128.0


@pytest.mark.parametrize(
    "fp16, key",
    [
        ({"loss_scale": -1}, "fp16.loss_scale"),
        ({"min_loss_scale": 0}, "fp16.min_loss_scale"),
        ({"loss_scale_window": 0}, "fp16.loss_scale_window"),
        ({"hysteresis": 0}, "fp16.hysteresis"),
        ({"initial_scale_power": "16"}, "fp16.initial_scale_power"),
    ],
)
def test_bad_fp16_values_name_the_key(fp16, key):
    with pytest.raises(DeepSpeedConfigError, match=rf"DeepSpeed config key '{key}': must be") as info:
        parse_deepspeed({"fp16": {"enabled": True, **fp16}})
    assert info.value.keys == [key]


@pytest.mark.parametrize("block", ["fp16", "bf16", "bfloat16"])
def test_auto_enabled_is_off_as_hf_trainer_without_its_flag(block, caplog):
    with caplog.at_level(logging.INFO, logger="zeroray"):
        assert parse_deepspeed({block: {"enabled": "auto"}}).precision.param_dtype == "fp32"
    flag = "fp16" if block == "fp16" else "bf16"
    assert [r.getMessage() for r in caplog.records] == [
        f"resolved '{block}.enabled': auto -> false (HF's Trainer without --{flag})"
    ]


@pytest.mark.parametrize("on", ["fp16", "bf16"])
def test_an_auto_switch_off_leaves_the_other_switch_on(on):
    off = "bf16" if on == "fp16" else "fp16"
    assert parse_deepspeed({on: {"enabled": True}, off: {"enabled": "auto"}}).precision.param_dtype == on


# ------------------------------------------------------------------------------ warnings
@pytest.mark.parametrize(
    "raw, key",
    [
        ({"steps_per_print": 100}, "steps_per_print"),
        ({"wall_clock_breakdown": True}, "wall_clock_breakdown"),
        ({"dump_state": False}, "dump_state"),
        ({"zero_allow_untested_optimizer": True}, "zero_allow_untested_optimizer"),
        ({"tensorboard": {"enabled": True, "output_path": "/tmp/tb"}}, "tensorboard"),
        ({"wandb": {"enabled": True}}, "wandb"),
        ({"csv_monitor": {"enabled": True}}, "csv_monitor"),
        ({"comms_logger": {"enabled": True}}, "comms_logger"),
        ({"flops_profiler": {"enabled": True}}, "flops_profiler"),
        ({"zero_optimization": {"contiguous_gradients": True}}, "zero_optimization.contiguous_gradients"),
        ({"zero_optimization": {"allgather_partitions": True}}, "zero_optimization.allgather_partitions"),
        ({"zero_optimization": {"round_robin_gradients": True}}, "zero_optimization.round_robin_gradients"),
        (
            {"zero_optimization": {"stage3_max_reuse_distance": 1e9}},
            "zero_optimization.stage3_max_reuse_distance",
        ),
        (
            {"zero_optimization": {"offload_param": {"device": "none", "buffer_size": 1e8}}},
            "zero_optimization.offload_param.buffer_size",
        ),
        ({"fp16": {"enabled": True, "auto_cast": False}}, "fp16.auto_cast"),
        ({"fp16": {"enabled": True, "consecutive_hysteresis": False}}, "fp16.consecutive_hysteresis"),
        ({"bfloat16": {"enabled": True, "immediate_grad_update": True}}, "bfloat16.immediate_grad_update"),
        ({"elasticity": {"enabled": False, "max_train_batch_size": 2000}}, "elasticity"),
        ({"amp": {"enabled": False}}, "amp"),
        (
            {"activation_checkpointing": {"partition_activations": False, "number_checkpoints": 4}},
            "activation_checkpointing.number_checkpoints",
        ),
        ({"zero_optimization": {"stage3_param_persistence_threshold": "auto"}},
         "zero_optimization.stage3_param_persistence_threshold"),
    ],
)
def test_ignored_keys_are_logged_with_their_dotted_name(raw, key, caplog):
    with caplog.at_level(logging.WARNING, logger="zeroray"):
        parse_deepspeed(raw)
    assert any(re.fullmatch(rf"zeroray ignores DeepSpeed config key '{key}': \w.*", r.getMessage())
               for r in caplog.records)


def test_keys_set_to_their_off_default_are_accepted_silently(caplog):
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="zeroray"):
        warnings.simplefilter("error")
        cfg = parse_deepspeed(
            {
                "prescale_gradients": False,
                "gradient_predivide_factor": 1.0,
                "sparse_gradients": False,
                "communication_data_type": None,
                "zero_optimization": {
                    "stage": 2,
                    "zero_quantized_weights": False,
                    "zero_hpz_partition_size": 1,
                },
            }
        )
    assert cfg.stage == 2 and not caplog.records


# ------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    "raw, key",
    [
        ({"amp": {"enabled": True}}, "amp"),
        ({"elasticity": {"enabled": True}}, "elasticity"),
        ({"sparse_attention": {"mode": "fixed"}}, "sparse_attention"),
        ({"pipeline": {"stages": 2}}, "pipeline"),
        ({"prescale_gradients": True}, "prescale_gradients"),
        ({"gradient_predivide_factor": 2.0}, "gradient_predivide_factor"),
        ({"sequence_parallel_size": 2}, "sequence_parallel_size"),
        (
            {"zero_optimization": {"zero_quantized_nontrainable_weights": True}},
            "zero_optimization.zero_quantized_nontrainable_weights",
        ),
        ({"zero_optimization": {"zeropp_loco_param": {"err_beta": 0.8}}}, "zero_optimization.zeropp_loco_param"),
        (
            {"activation_checkpointing": {"partition_activations": True}},
            "activation_checkpointing.partition_activations",
        ),
        (
            {"activation_checkpointing": {"cpu_checkpointing": True}},
            "activation_checkpointing.cpu_checkpointing",
        ),
        (
            {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
            "fp16.fp16_master_weights_and_grads",
        ),
    ],
)
def test_unsupported_keys_are_errors_naming_the_key(raw, key):
    with pytest.raises(ValueError, match=rf"DeepSpeed config key '{key}'.* not supported by zeroray: \w"):
        parse_deepspeed(raw)


@pytest.mark.parametrize(
    "raw, key, suggestion",
    [
        ({"zero_optimisation": {"stage": 3}}, "zero_optimisation", "zero_optimization"),
        ({"zero_optimization": {"stgae": 3}}, "zero_optimization.stgae", "stage"),
        (
            {"zero_optimization": {"offload_param": {"devise": "none"}}},
            "zero_optimization.offload_param.devise",
            "device",
        ),
        ({"fp16": {"enabled": True, "loss_scael": 0}}, "fp16.loss_scael", "loss_scale"),
        ({"bf16": {"enabeld": True}}, "bf16.enabeld", "enabled"),
        ({"optimizer": {"type": "AdamW", "parmas": {}}}, "optimizer.parmas", "params"),
        (
            {"activation_checkpointing": {"partition_activation": True}},
            "activation_checkpointing.partition_activation",
            None,
        ),
        ({"train_batch": 8}, "train_batch", None),
    ],
)
def test_unknown_keys_are_errors_naming_the_dotted_key(raw, key, suggestion):
    with pytest.raises(ValueError, match=rf"unknown DeepSpeed config key '{key}'") as info:
        parse_deepspeed(raw)
    if suggestion:
        assert f"did you mean '{suggestion}'" in str(info.value)


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage"),
        ({"zero_optimization": {"stage": "3"}}, "zero_optimization.stage"),
        ({"zero_optimization": {"reduce_bucket_size": 1.5}}, "zero_optimization.reduce_bucket_size"),
        ({"zero_optimization": {"reduce_bucket_size": 0}}, "zero_optimization.reduce_bucket_size"),
        ({"zero_optimization": {"allgather_bucket_size": "big"}}, "zero_optimization.allgather_bucket_size"),
        ({"zero_optimization": {"overlap_comm": "yes"}}, "zero_optimization.overlap_comm"),
        ({"zero_optimization": {"zeroray_units": "Block"}}, "zero_optimization.zeroray_units"),
        ({"zero_optimization": {"all_gather_by_broadcast": 1}}, "zero_optimization.all_gather_by_broadcast"),
        (
            {"zero_optimization": {"offload_param": {"device": "gpu"}}},
            "zero_optimization.offload_param.device",
        ),
        ({"zero_optimization": []}, "zero_optimization"),
        ({"train_batch_size": 0}, "train_batch_size"),
        ({"train_micro_batch_size_per_gpu": 2.5}, "train_micro_batch_size_per_gpu"),
        ({"gradient_accumulation_steps": True}, "gradient_accumulation_steps"),
        ({"gradient_clipping": -1.0}, "gradient_clipping"),
        ({"gradient_clipping": "1.0"}, "gradient_clipping"),
        ({"gradient_clipping": float("nan")}, "gradient_clipping"),
        ({"gradient_clipping": float("inf")}, "gradient_clipping"),
        ({"fp16": {"enabled": "yes"}}, "fp16.enabled"),
        ({"zero_optimization": {"cpu_offload": "yes"}}, "zero_optimization.cpu_offload"),
        ({"zero_optimization": {"offload_param": {"pin_memory": "yes"}}}, "zero_optimization.offload_param.pin_memory"),
        ({"data_types": {"grad_accum_dtype": "int8"}}, "data_types.grad_accum_dtype"),
        ({"data_types": {"buffer_dtype": "int8"}}, "data_types.buffer_dtype"),
    ],
)
def test_bad_values_name_the_key(raw, key):
    with pytest.raises(DeepSpeedConfigError, match=rf"DeepSpeed config key '{key}'") as info:
        parse_deepspeed(raw)
    assert info.value.keys == [key]
    assert "ZeroConfig." not in str(info.value)  # the JSON key, not the dataclass field


def test_offload_devices_parse_and_what_cannot_work_is_refused():
    cfg = parse_deepspeed({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}})
    assert cfg.offload_optimizer.device == "cpu"
    # DeepSpeed's deprecated spelling means the same.
    assert parse_deepspeed({"zero_optimization": {"stage": 2, "cpu_offload": True}}).offload_optimizer.device == "cpu"
    assert parse_deepspeed({"zero_optimization": {"cpu_offload": False}}).offload_optimizer == OffloadConfig()
    cfg = parse_deepspeed({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}})
    assert (cfg.offload_param.device, cfg.offload_param.nvme_path) == ("nvme", "/nvme")
    with pytest.raises(ValueError, match=r"'zero_optimization\.offload_param\.device'.*'nvme' needs stage 3"):
        parse_deepspeed({"zero_optimization": {"stage": 2, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}})
    with pytest.raises(ValueError, match=r"'zero_optimization\.offload_optimizer\.device'"):
        parse_deepspeed({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}})
    with pytest.raises(ValueError, match=r"'zero_optimization\.offload_param\.device'.*needs stage 3"):
        parse_deepspeed({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})


def test_deprecated_offload_spellings_map_onto_the_offload_fields():
    cfg = parse_deepspeed(
        {"zero_optimization": {"cpu_offload": False, "cpu_offload_param": False, "cpu_offload_use_pin_memory": True}}
    )
    assert cfg.offload_optimizer == cfg.offload_param == OffloadConfig(device="none", pin_memory=True)
    with pytest.raises(
        ValueError,
        match=r"keys 'zero_optimization\.offload_optimizer\.device' and 'zero_optimization\.cpu_offload' both set",
    ):
        parse_deepspeed({"zero_optimization": {"offload_optimizer": {"device": "none"}, "cpu_offload": True}})


# ------------------------------------------------------------------------------ buffer dtype
def test_buffers_keep_their_dtype_unless_data_types_buffer_dtype_says():
    """DeepSpeed's default keeps buffers as built (a bf16 run's fp32 rotary inv_freq stays fp32);
    data_types.buffer_dtype opts into casting them."""
    assert parse_deepspeed({"bf16": {"enabled": True}}).precision.buffer_dtype is None
    for spelling, dtype in (("bf16", "bf16"), ("bfloat16", "bf16"), ("float32", "fp32"), ("torch.float16", "fp16")):
        cfg = parse_deepspeed({"bf16": {"enabled": True}, "data_types": {"buffer_dtype": spelling}})
        assert cfg.precision.param_dtype == "bf16" and cfg.precision.buffer_dtype == dtype
    assert cfg.precision.name == "param=bf16,reduce=bf16,master=fp32,buffer=fp16"
    assert parse_deepspeed({"bf16": {"enabled": True}}).precision.name == "bf16"
    assert ZeroConfig(precision={"param_dtype": "bf16", "buffer_dtype": "bf16"}).precision.buffer_dtype == "bf16"


# ------------------------------------------------------------------------------ optimizer / scheduler specs
def test_optimizer_and_scheduler_types_are_checked_at_parse_time():
    with pytest.raises(
        ValueError, match=r"key 'optimizer\.type': 'Lamb' is not supported.*Adam, AdamW, SGD, Adagrad, RMSprop"
    ):
        parse_deepspeed({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}})
    with pytest.raises(
        ValueError, match=r"key 'scheduler\.type': 'OneCycle' is not supported.*WarmupLR, WarmupDecayLR"
    ):
        parse_deepspeed({"scheduler": {"type": "OneCycle", "params": {}}})
    with pytest.raises(ValueError, match=r"key 'optimizer\.params\.momentun': is not a parameter of torch\.optim\.SGD"):
        parse_deepspeed({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentun": 0.9}}})
    with pytest.raises(ValueError, match=r"key 'scheduler\.params\.total_num_steps': is required for WarmupDecayLR"):
        parse_deepspeed({"scheduler": {"type": "WarmupDecayLR", "params": {}}})
    with pytest.raises(ValueError, match=r"key 'optimizer\.params\.lr' is 'auto', which zeroray cannot resolve"):
        parse_deepspeed({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}})


# ------------------------------------------------------------------------------ "auto" and file input
def test_auto_batch_sizes_mean_not_given():
    cfg = parse_deepspeed(
        {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}
    )
    assert cfg.train_batch_size is None and cfg.train_micro_batch_size_per_gpu is None
    assert cfg.gradient_accumulation_steps is None
    # With "auto" the micro batch given elsewhere decides.
    resolved = parse_deepspeed(
        {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4}
    ).resolve_batch(2)
    assert (resolved.train_batch_size, resolved.gradient_accumulation_steps) == (8, 1)


def test_file_path_input(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ZERO3_EXAMPLE))
    from_path = parse_quietly(path)
    assert from_path == parse_quietly(str(path)) == parse_quietly(ZERO3_EXAMPLE)


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match="nope.json"):
        parse_deepspeed(path)


def test_invalid_json_names_the_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"zero_optimization": {"stage": 3,}}')
    with pytest.raises(ValueError, match="broken.json.*not valid JSON"):
        parse_deepspeed(str(path))
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="broken.json.*JSON object"):
        parse_deepspeed(path)


def test_wrong_input_type():
    with pytest.raises(TypeError, match="dict or a path"):
        parse_deepspeed(42)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ batch arithmetic
@pytest.mark.parametrize(
    "tb, mb, gas, ws, expected",
    [
        (64, 4, 2, 8, (64, 4, 2)),  # all three, consistent
        (64, 4, None, 8, (64, 4, 2)),  # train + micro -> accumulation
        (64, None, 2, 8, (64, 4, 2)),  # train + accumulation -> micro
        (None, 4, 2, 8, (64, 4, 2)),  # micro + accumulation -> train
        (None, 4, None, 8, (32, 4, 1)),  # micro only -> one accumulation step
        (64, None, None, 8, (64, 8, 1)),  # train only -> one accumulation step
        (None, None, 3, 8, (None, None, 3)),  # accumulation only: batch sizes unknown
        (None, None, None, 8, (None, None, 1)),  # nothing: accumulation 1
        (6, 3, 2, 1, (6, 3, 2)),  # single rank
    ],
)
def test_resolve_batch(tb, mb, gas, ws, expected):
    cfg = ZeroConfig(train_batch_size=tb, train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=gas)
    out = cfg.resolve_batch(ws)
    assert (
        out.train_batch_size,
        out.train_micro_batch_size_per_gpu,
        out.gradient_accumulation_steps,
    ) == expected
    assert cfg.train_batch_size == tb  # the original is left as it was
    if None not in expected:
        assert expected[0] == expected[1] * expected[2] * ws


@pytest.mark.parametrize(
    "tb, mb, gas, ws, message",
    [
        (
            64,
            4,
            4,
            8,
            r"train_batch_size \(64\) must equal train_micro_batch_size_per_gpu \(4\) x "
            r"gradient_accumulation_steps \(4\) x data-parallel world size \(8\) = 128",
        ),
        (
            60,
            4,
            None,
            8,
            r"train_batch_size \(60\) is not divisible by train_micro_batch_size_per_gpu \(4\) x world size \(8\)",
        ),
        (
            60,
            None,
            4,
            8,
            r"train_batch_size \(60\) is not divisible by gradient_accumulation_steps \(4\) x world size \(8\)",
        ),
        (60, None, None, 8, r"train_batch_size \(60\) is not divisible by the world size \(8\)"),
    ],
)
def test_resolve_batch_errors(tb, mb, gas, ws, message):
    cfg = ZeroConfig(train_batch_size=tb, train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=gas)
    with pytest.raises(ValueError, match=message):
        cfg.resolve_batch(ws)


@pytest.mark.parametrize("ws", [0, -1, 2.0, True])
def test_resolve_batch_rejects_a_bad_world_size(ws):
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        ZeroConfig(train_micro_batch_size_per_gpu=2).resolve_batch(ws)


# ------------------------------------------------------------------------------ build_optimizer
def _params():
    return [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2))]


def test_adam_means_adamw_with_deepspeed_defaults():
    opt = build_optimizer(
        {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.8, 0.99], "torch_adam": True}}, _params()
    )
    assert type(opt) is torch.optim.AdamW
    group = opt.param_groups[0]
    assert group["lr"] == 1e-3 and group["betas"] == (0.8, 0.99)
    assert group["weight_decay"] == 0.0  # DeepSpeed's default, not torch AdamW's 0.01


def test_adam_w_mode_false_is_plain_adam():
    opt = build_optimizer(
        {"type": "adam", "params": {"lr": 2e-3, "weight_decay": 0.1, "adam_w_mode": False}}, _params()
    )
    assert type(opt) is torch.optim.Adam
    assert opt.param_groups[0]["weight_decay"] == 0.1
    assert not opt.param_groups[0].get("decoupled_weight_decay", False)


def test_adamw_keeps_decoupled_decay_whatever_adam_w_mode_says():
    opt = build_optimizer(
        {"type": "ADAMW", "params": {"weight_decay": 0.05, "adam_w_mode": False}}, _params()
    )
    assert type(opt) is torch.optim.AdamW and opt.param_groups[0]["weight_decay"] == 0.05


@pytest.mark.parametrize(
    "kind, cls, params",
    [
        ("SGD", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
        ("sgd", torch.optim.SGD, {"lr": 0.05}),
        ("Adagrad", torch.optim.Adagrad, {"lr": 0.01, "lr_decay": 0.001}),
        ("RMSprop", torch.optim.RMSprop, {"lr": 0.01, "alpha": 0.9, "centered": True}),
    ],
)
def test_other_optimizers_get_their_hyperparameters(kind, cls, params):
    opt = build_optimizer({"type": kind, "params": params}, _params())
    assert type(opt) is cls
    for key, value in params.items():
        assert opt.param_groups[0][key] == value


def test_build_optimizer_accepts_param_groups():
    a, b = _params()
    opt = build_optimizer(
        {"type": "AdamW", "params": {"lr": 1e-3}},
        [{"params": [a]}, {"params": [b], "weight_decay": 0.5, "lr": 1e-2}],
    )
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 1e-2]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.5]


def test_build_optimizer_errors():
    with pytest.raises(
        ValueError, match=r"optimizer\.params\.betaz: is not a parameter of torch\.optim\.AdamW"
    ):
        build_optimizer({"type": "Adam", "params": {"betaz": [0.9, 0.9]}}, _params())
    with pytest.raises(
        ValueError, match=r"optimizer\.params\.adam_w_mode: is not a parameter of torch\.optim\.SGD"
    ):
        build_optimizer({"type": "SGD", "params": {"adam_w_mode": True}}, _params())
    with pytest.raises(ValueError, match=r"'Lion' is not supported.*Adam, AdamW, SGD, Adagrad, RMSprop"):
        build_optimizer({"type": "Lion"}, _params())
    with pytest.raises(ValueError, match="bias_correction: false is not supported"):
        build_optimizer({"type": "Adam", "params": {"bias_correction": False}}, _params())


# ------------------------------------------------------------------------------ schedules
def _opt(lr=0.5, groups=1):
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(groups)]
    return torch.optim.SGD([{"params": [p]} for p in params], lr=lr)


def _lrs_seen_by_optimizer_steps(opt, sched, n):
    """The lr each optimizer.step() uses, with scheduler.step() after it (DeepSpeed's order)."""
    seen = []
    for _ in range(n):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return seen


def _ds_warmup(it, lo, hi, n, kind):
    """DeepSpeed's WarmupLR lr at last_batch_iteration ``it`` (from lr_schedules.py)."""
    n = max(2, n)
    if it < 0:
        return lo
    if it < n:
        gamma = math.log(it + 1) / math.log(n) if kind == "log" else it / n
    else:
        gamma = 1.0
    return lo + (hi - lo) * gamma


def test_warmup_lr_log_matches_deepspeed():
    opt = _opt()
    sched = build_scheduler(
        {"type": "WarmupLR", "params": {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 10}},
        opt,
    )
    assert isinstance(sched, WarmupLR)
    seen = _lrs_seen_by_optimizer_steps(opt, sched, 14)
    # DeepSpeed: lr = min before its first scheduler.step(); then iteration 0, 1, ...
    expected = [_ds_warmup(k - 1, 0.01, 0.1, 10, "log") for k in range(14)]
    assert seen == pytest.approx(expected, rel=1e-12)
    # By hand: iteration 4 -> 0.01 + 0.09 * ln(5)/ln(10); the warmup ends at max.
    assert seen[5] == pytest.approx(0.01 + 0.09 * math.log(5) / math.log(10))
    assert seen[:2] == [0.01, 0.01] and seen[11:] == pytest.approx([0.1] * 3)


def test_warmup_lr_with_zero_steps_is_deepspeeds():
    """HF's Trainer fills "auto" warm-up steps with 0 by default; DeepSpeed takes it (as 2 steps, log)."""
    opt = _opt()
    sched = build_scheduler({"type": "WarmupLR", "params": {"warmup_max_lr": 0.1, "warmup_num_steps": 0}}, opt)
    seen = _lrs_seen_by_optimizer_steps(opt, sched, 4)
    assert seen == pytest.approx([_ds_warmup(k - 1, 0.0, 0.1, 0, "log") for k in range(4)]) == [0.0, 0.0, 0.1, 0.1]


def test_warmup_lr_linear_and_default_max_is_the_optimizer_lr():
    opt = _opt(lr=0.2)
    sched = build_scheduler(
        {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_type": "linear"}}, opt
    )
    seen = _lrs_seen_by_optimizer_steps(opt, sched, 7)
    assert seen == pytest.approx([0.0, 0.0, 0.05, 0.1, 0.15, 0.2, 0.2])


def test_warmup_decay_lr_matches_deepspeed():
    opt = _opt()
    spec = {
        "type": "WarmupDecayLR",
        "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 5, "total_num_steps": 15},
    }
    sched = build_scheduler(spec, opt)
    assert isinstance(sched, WarmupDecayLR)
    seen = _lrs_seen_by_optimizer_steps(opt, sched, 19)

    def ds(it):  # DeepSpeed's WarmupDecayLR, written out
        if it < 0:
            return 0.0
        if it < 5:
            return 0.1 * math.log(it + 1) / math.log(5)
        return 0.1 * max(0.0, (15 - it) / max(1.0, 15 - 5))

    assert seen == pytest.approx([ds(k - 1) for k in range(19)], rel=1e-12, abs=1e-15)
    assert seen[6] == pytest.approx(0.1)  # iteration 5: end of warmup, full lr
    assert seen[11] == pytest.approx(0.05)  # iteration 10: halfway down
    assert seen[16:] == [0.0, 0.0, 0.0]  # iteration >= 15: zero, not negative


def test_warmup_decay_lr_linear_warmup_with_default_max():
    opt = _opt()
    sched = build_scheduler(
        {
            "type": "WarmupDecayLR",
            "params": {"warmup_num_steps": 2, "total_num_steps": 4, "warmup_type": "linear"},
        },
        opt,
    )
    # DeepSpeed default warmup_max_lr = 0.001; iterations -1, 0, 1, 2, 3, 4.
    assert _lrs_seen_by_optimizer_steps(opt, sched, 6) == pytest.approx(
        [0.0, 0.0, 0.0005, 0.001, 0.0005, 0.0]
    )


def test_per_group_warmup_values():
    opt = _opt(groups=2)
    sched = build_scheduler(
        {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": [0.0, 0.1],
                "warmup_max_lr": [1.0, 0.2],
                "warmup_num_steps": 2,
                "warmup_type": "linear",
            },
        },
        opt,
    )
    for _ in range(2):
        opt.step()
        sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.5, 0.15])


def test_scheduler_state_dict_is_plain_data_and_resumes():
    spec = {
        "type": "WarmupDecayLR",
        "params": {"warmup_max_lr": 0.1, "warmup_num_steps": 5, "total_num_steps": 20},
    }
    opt = _opt()
    sched = build_scheduler(spec, opt)
    _lrs_seen_by_optimizer_steps(opt, sched, 7)
    state = sched.state_dict()
    assert json.loads(json.dumps(state)) == state  # JSON round trip: plain data
    opt2 = _opt()
    sched2 = build_scheduler(spec, opt2)
    sched2.load_state_dict(state)
    opt2.step()
    sched2.step()
    opt.step()
    sched.step()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_build_scheduler_none_and_errors():
    opt = _opt()
    assert build_scheduler(None, opt) is None
    with pytest.raises(
        ValueError, match=r"scheduler\.type: 'CosineLR' is not supported; supported types: WarmupLR"
    ):
        build_scheduler({"type": "CosineLR", "params": {}}, opt)
    with pytest.raises(ValueError, match=r"scheduler\.params\.warmup_steps: is not a parameter of WarmupLR"):
        build_scheduler({"type": "WarmupLR", "params": {"warmup_steps": 10}}, opt)
    with pytest.raises(ValueError, match=r"warmup_type must be 'log' or 'linear', got 'cosine'"):
        build_scheduler({"type": "WarmupLR", "params": {"warmup_type": "cosine"}}, opt)
    with pytest.raises(ValueError, match=r"warmup_num_steps must be an integer >= 0, got -1"):
        build_scheduler({"type": "WarmupLR", "params": {"warmup_num_steps": -1}}, opt)
    with pytest.raises(ValueError, match=r"warmup_min_lr has 2 values for 1 param groups"):
        build_scheduler({"type": "WarmupLR", "params": {"warmup_min_lr": [0.0, 0.0]}}, opt)
