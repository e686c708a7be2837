"""Hugging Face-style DeepSpeed configs: "auto" resolved from the model and optimizer, or as HF's Trainer
does with none of its flags given; what has no meaning here in ONE error.

The configs are transformers' own test configs (tests/data/hf_deepspeed/, Apache-2.0). load_config is
called the way zeroray.initialize calls it: load_config(config, model=model, optimizer=optimizer).
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from zeroray.config import ZeroConfig
from zeroray.config.deepspeed import DeepSpeedConfigError
from zeroray.config.load import load_config
from zeroray.engine.named_optim import WarmupLR, build_optimizer, build_scheduler

DATA = Path(__file__).resolve().parent / "data" / "hf_deepspeed"
ZERO2, ZERO3 = DATA / "ds_config_zero2.json", DATA / "ds_config_zero3.json"


class HFLikeConfig:
    """What HF's Trainer reads off ``model.config``: a PretrainedConfig has only its model's attributes."""

    def __init__(self, **attrs: object) -> None:
        self.__dict__.update(attrs)


class TinyHFModel(nn.Module):
    def __init__(self, config: HFLikeConfig | None) -> None:
        super().__init__()
        if config is not None:
            self.config = config
        self.proj = nn.Linear(8, 8)


def _model(hidden: int = 768) -> nn.Module:
    return TinyHFModel(HFLikeConfig(hidden_size=hidden))


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)


def _load(config, **kw) -> ZeroConfig:
    return load_config(config, **kw)


def _error(config, **kw) -> DeepSpeedConfigError:
    with pytest.raises(DeepSpeedConfigError) as info:
        _load(config, **kw)
    return info.value


def _edited(path: Path) -> dict:
    """The HF config with numbers where it says "auto" for the fp16 switch and the warm-up."""
    raw = json.loads(path.read_text())
    raw["fp16"]["enabled"] = False
    raw["scheduler"]["params"]["warmup_num_steps"] = 100
    return raw


def _zero3_docs() -> dict:
    """HF's ZeRO-3 test config with the ``"bf16": {"enabled": "auto"}`` block HF's DeepSpeed docs add to it."""
    return {**json.loads(ZERO3.read_text()), "bf16": {"enabled": "auto"}}


def _logged(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "zeroray" and r.levelno == level]


# ------------------------------------------------------------------------------ the real HF configs
@pytest.mark.parametrize("config", [ZERO2, ZERO3, _zero3_docs()], ids=["zero2", "zero3", "zero3+bf16"])
def test_stock_hf_config_loads_as_hf_trainer_without_flags(config, caplog):
    """fp16/bf16 "auto": off (fp32), warm-up steps "auto": 0, as HF's Trainer with no --fp16, --bf16,
    --warmup_steps or --warmup_ratio; one INFO line per resolution, one WARNING line per ignored key,
    and no UserWarning (each would echo a line of source)."""
    model = _model(768)
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="zeroray"):
        warnings.simplefilter("error")
        cfg = load_config(config, model=model, optimizer=_adamw(model))
    assert cfg.precision.param_dtype == "fp32" and cfg.offload_optimizer.device == "cpu"
    assert cfg.scheduler == {
        "type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4, "warmup_num_steps": 0}
    }
    resolved = _logged(caplog, logging.INFO)
    assert "resolved 'fp16.enabled': auto -> false (HF's Trainer without --fp16)" in resolved
    assert ("resolved 'scheduler.params.warmup_num_steps': auto -> 0 "
            "(HF's Trainer without --warmup_steps or --warmup_ratio)") in resolved
    assert len(resolved) == len(set(resolved)) and all(line.startswith("resolved '") for line in resolved)
    ignored = _logged(caplog, logging.WARNING)
    assert all(line.startswith("zeroray ignores DeepSpeed config key '") for line in ignored)
    if not isinstance(config, Path):  # HF's docs' ZeRO-3: 15 "auto"s, 7 ignored keys
        assert "resolved 'bf16.enabled': auto -> false (HF's Trainer without --bf16)" in resolved
        assert len(resolved) == 15 and len(ignored) == 7
    opt = build_optimizer(cfg.optimizer, model.parameters())
    sched = build_scheduler(cfg.scheduler, opt)
    assert isinstance(sched, WarmupLR)


def test_hf_config_reports_what_has_no_meaning_here_in_one_error(caplog):
    raw = json.loads(ZERO3.read_text())
    raw["scheduler"] = {"type": "WarmupDecayLR", "params": {**raw["scheduler"]["params"], "total_num_steps": "auto"}}
    raw["zero_optimization"]["allgather_bucket_size"] = "auto"
    model = _model()
    with caplog.at_level(logging.INFO, logger="zeroray"):
        err = _error(raw, model=model, optimizer=_adamw(model))
    assert err.keys == ["scheduler.params.total_num_steps", "zero_optimization.allgather_bucket_size"]
    text = str(err)
    assert text.startswith("2 problems in the DeepSpeed config (all of them):\n  - ")
    assert "'scheduler.params.total_num_steps' is 'auto', which zeroray cannot resolve: HF's Trainer computes it" in text
    assert "ZeroConfig." not in text
    assert not caplog.records  # nothing is logged, resolved or ignored, when the config is refused


def test_hf_zero3_config_with_numbers_for_the_flags(caplog):
    model = _model(768)
    optimizer = _adamw(model)
    with caplog.at_level(logging.INFO, logger="zeroray"):
        cfg = load_config(_edited(ZERO3), model=model, optimizer=optimizer)
    assert cfg.stage == 3 and cfg.precision.param_dtype == "fp32"
    assert cfg.sub_group_size == 100_000_000_000_000  # HF ships 1e14: the whole shard is one sub-group
    assert cfg.comm.reduce_bucket_size == 768 * 768 == 589824
    assert cfg.comm.prefetch_bucket_size == int(0.9 * 768 * 768) == 530841
    assert cfg.gradient_clipping == 1.0  # HF's default max_grad_norm
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (None,) * 3
    assert cfg.resolve_batch(4).gradient_accumulation_steps == 1
    assert cfg.optimizer == {
        "type": "AdamW",
        "params": {"lr": 3e-4, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.05},
    }
    assert cfg.scheduler == {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-4, "warmup_num_steps": 100},
    }
    messages = _logged(caplog, logging.INFO)
    assert "resolved 'zero_optimization.reduce_bucket_size': auto -> 589824 (hidden_size 768 squared, as HF)" in messages
    assert (
        "resolved 'zero_optimization.stage3_prefetch_bucket_size': auto -> 530841 (0.9 x hidden_size 768 squared, as HF)"
        in messages
    )
    assert "resolved 'gradient_clipping': auto -> 1.0 (HF's default max_grad_norm)" in messages
    assert "resolved 'optimizer.params.betas': auto -> [0.8, 0.99] (the betas of the AdamW passed to initialize)" in messages
    assert len(messages) == 12  # 3 batch sizes, clipping, 2 buckets, 4 optimizer params, 2 warmup lrs
    # The resolved blocks build the optimizer and schedule they name.
    opt = build_optimizer(cfg.optimizer, model.parameters())
    assert opt.param_groups[0]["betas"] == (0.8, 0.99) and opt.param_groups[0]["weight_decay"] == 0.05
    assert isinstance(build_scheduler(cfg.scheduler, opt), WarmupLR)


def test_hf_zero2_config_with_numbers_for_the_flags():
    model = _model(1024)
    cfg = _load(_edited(ZERO2), model=model, optimizer=_adamw(model))
    assert cfg.stage == 2 and cfg.comm.reduce_scatter is True and cfg.comm.overlap_comm is True
    assert cfg.comm.reduce_bucket_size == cfg.comm.allgather_bucket_size == 200_000_000
    assert cfg.optimizer["params"]["lr"] == 3e-4 and cfg.gradient_clipping == 1.0


def test_without_an_optimizer_its_autos_are_listed_too():
    err = _error(_edited(ZERO3), model=_model())
    assert err.keys == [
        "optimizer.params.lr",
        "optimizer.params.betas",
        "optimizer.params.eps",
        "optimizer.params.weight_decay",
        "scheduler.params.warmup_max_lr",
    ]
    assert "from the lr of the optimizer passed to initialize, and none was passed; give a value" in str(err)


def test_without_a_model_the_bucket_autos_are_listed():
    model = _model()
    err = _error(_edited(ZERO3), optimizer=_adamw(model))
    assert err.keys == ["zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size"]
    assert "pass the model" in str(err)


def test_hidden_size_rules_as_hf():
    raw = {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"}}
    cfg = load_config(raw, model=TinyHFModel(HFLikeConfig(hidden_sizes=[96, 192, 384])))
    assert (cfg.comm.reduce_bucket_size, cfg.comm.prefetch_bucket_size) == (384 * 384, int(0.9 * 384 * 384))
    err = _error(raw, model=TinyHFModel(None))
    assert err.keys == ["zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size"]
    assert "model.config.hidden_size (or hidden_sizes), which this TinyHFModel does not have" in str(err)


def test_defer_leaves_model_and_optimizer_autos_for_later():
    """The Ray trainer's driver checks the config before any model exists."""
    cfg = _load(_edited(ZERO3), defer=True)
    assert cfg.comm.reduce_bucket_size == ZeroConfig().comm.reduce_bucket_size
    assert "lr" not in cfg.optimizer["params"]
    # What no model or optimizer can resolve is still an error at that point.
    err = _error({**_edited(ZERO3), "zero_optimization": {"stage": "auto"}}, defer=True)
    assert err.keys == ["zero_optimization.stage"]


# ------------------------------------------------------------------------------ single keys
def test_gradient_clipping_auto_is_hf_default_not_off():
    assert load_config({"gradient_clipping": "auto"}).gradient_clipping == 1.0


def test_warmup_max_lr_from_the_config_lr_without_an_optimizer():
    cfg = load_config(
        {
            "optimizer": {"type": "AdamW", "params": {"lr": 2e-4}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto"}},
        }
    )
    assert cfg.scheduler["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-4}


def test_optimizer_autos_need_an_optimizer_instance():
    model = _model()
    raw = {"optimizer": {"type": "SGD", "params": {"lr": "auto", "betas": "auto"}}}
    err = _error(raw, model=model, optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    assert err.keys == ["optimizer.params.lr", "optimizer.params.betas"]
    assert "is not a torch optimizer instance" in str(err)
    err = _error(raw, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert err.keys == ["optimizer.params.betas"]  # lr resolved; SGD has no betas
    assert "the SGD passed to initialize has no betas" in str(err)


@pytest.mark.parametrize(
    "raw",
    [
        {"zero_optimization": {"stage": "auto"}},
        {"zero_optimization": {"allgather_bucket_size": "auto"}},
        {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}},
    ],
)
def test_autos_without_a_meaning_here_are_errors(raw):
    err = _error(raw, model=_model(), optimizer=_adamw(_model()))
    assert len(err.keys) == 1 and "is 'auto', which zeroray cannot resolve" in str(err)


# ------------------------------------------------------------------------------ reduce dtype
@pytest.mark.parametrize(
    "spelling, dtype",
    [("fp32", "fp32"), ("float32", "fp32"), ("FP32", "fp32"), ("bf16", "bf16"), ("bfloat16", "bf16"),
     ("bfp16", "bf16"), ("fp16", "fp16"), ("half", "fp16"), ("torch.float32", "fp32")],
)
@pytest.mark.parametrize("key", ["data_types.grad_accum_dtype", "communication_data_type"])
def test_grad_accum_and_communication_dtype_set_the_reduce_dtype(key, spelling, dtype):
    head, _, last = key.rpartition(".")
    raw = {"bf16": {"enabled": True}, **({head: {last: spelling}} if head else {key: spelling})}
    cfg = load_config(raw)
    assert cfg.precision.param_dtype == "bf16" and cfg.precision.reduce_dtype == dtype


def test_grad_accum_dtype_and_communication_data_type_together_is_an_error():
    err = _error({"communication_data_type": "fp32", "data_types": {"grad_accum_dtype": "fp32"}})
    assert "keys 'communication_data_type' and 'data_types.grad_accum_dtype' both set ZeroConfig.precision.reduce_dtype" in str(err)
