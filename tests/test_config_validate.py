"""ZeroConfig.validate, the only validator: every rule, types included, with all problems in one error."""

from __future__ import annotations

import pytest

from zeroray.config import ConfigError, PrecisionPolicy, ZeroConfig


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"stage": 4}, "stage"),
        ({"stage": True}, "stage"),
        ({"gradient_clipping": "1.0"}, "gradient_clipping"),
        ({"gradient_clipping": float("nan")}, "gradient_clipping"),
        ({"gradient_clipping": -1.0}, "gradient_clipping"),
        ({"train_batch_size": 0}, "train_batch_size"),
        ({"comm": {"reduce_bucket_size": 1.5}}, "comm.reduce_bucket_size"),
        ({"comm": {"overlap_comm": "yes"}}, "comm.overlap_comm"),
        ({"comm": {"reduce_scatter": 1}}, "comm.reduce_scatter"),
        ({"comm": {"all_gather_by_broadcast": "auto"}}, "comm.all_gather_by_broadcast"),
        ({"loss_scaling": {"loss_scale": "16"}}, "loss_scaling.loss_scale"),
        ({"loss_scaling": {"min_loss_scale": float("inf")}}, "loss_scaling.min_loss_scale"),
        ({"loss_scaling": {"initial_scale_power": "16"}}, "loss_scaling.initial_scale_power"),
        ({"loss_scaling": {"initial_scale_power": -1}}, "loss_scaling.initial_scale_power"),
        ({"loss_scaling": {"hysteresis": 0}}, "loss_scaling.hysteresis"),
        ({"offload_param": {"pin_memory": "yes"}}, "offload_param.pin_memory"),
        ({"offload_param": {"nvme_path": 5}}, "offload_param.nvme_path"),
        ({"offload_optimizer": {"device": "gpu"}}, "offload_optimizer.device"),
        ({"units": 5}, "units"),
        ({"units": "Block"}, "units"),
        ({"optimizer": {"type": "Lamb"}}, "optimizer.type"),
        ({"optimizer": {"type": "SGD", "params": {"momentun": 0.9}}}, "optimizer.params.momentun"),
        ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, "optimizer.params.lr"),
        ({"optimizer": {"type": "Adam", "params": {"bias_correction": False}}}, "optimizer.params.bias_correction"),
        ({"optimizer": "AdamW"}, "optimizer"),
        ({"scheduler": {"type": "WarmupDecayLR", "params": {}}}, "scheduler.params.total_num_steps"),
        ({"precision": {"param_dtype": "bf16", "reduce_dtype": "int8"}}, "precision.reduce_dtype"),
        ({"precision": "fp64"}, "precision"),
        ({"precision": {"buffer_dtype": "fp64"}}, "precision.buffer_dtype"),
    ],
)
def test_bad_fields_raise_a_config_error_naming_the_field(kwargs, field):
    with pytest.raises(ConfigError) as info:
        ZeroConfig(**kwargs)
    assert info.value.field == field
    assert str(info.value).startswith(f"ZeroConfig.{field}: ")


def test_one_error_lists_every_bad_field():
    with pytest.raises(ConfigError) as info:
        ZeroConfig(stage=5, gradient_clipping=float("nan"), comm={"overlap_comm": "yes"}, offload_param={"device": "cpu"})
    fields = [f for f, _ in info.value.problems]
    assert fields == ["stage", "gradient_clipping", "comm.overlap_comm", "offload_param.device"]
    assert info.value.field == "stage"
    assert str(info.value).startswith("4 bad settings:\n  ZeroConfig.stage: must be 0, 1, 2 or 3, got 5\n")


def test_good_values_and_short_forms():
    cfg = ZeroConfig(
        stage=3,
        precision={"param_dtype": "bf16", "reduce_dtype": "fp32"},
        comm={"reduce_scatter": None, "overlap_comm": False},
        loss_scaling={"loss_scale": 128},
        units=["Block"],
        optimizer={"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False, "torch_adam": True}},
        scheduler={"type": "warmupdecaylr", "params": {"total_num_steps": 10}},
    )
    assert cfg.precision == PrecisionPolicy("bf16", "fp32") and cfg.precision.name == "param=bf16,reduce=fp32,master=fp32"
    assert cfg.units == ("Block",) and cfg.comm.overlap_comm is False
    assert ZeroConfig(precision="fp16").precision.loss_scaling
