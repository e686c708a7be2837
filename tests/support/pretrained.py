"""Tiny models from transformers configs (no hub) and zeroray's GPT, and the safetensors sources the
load_pretrained tests read: written with save_pretrained / safetensors, locally and on S3."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

import zeroray
from tests.support.recipe import train
from zeroray.engine import ZeroEngine
from zeroray.models import GPT, GPTConfig


def llama(seed: int) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, bos_token_id=0,
        eos_token_id=1,
    )
    return LlamaForCausalLM(cfg)


def gpt2(seed: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=200, n_embd=64, n_layer=2, n_head=4, n_positions=32, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def zgpt(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=97, block_size=16, n_layer=2, n_head=2, n_embd=32))


BUILDERS = {"llama": llama, "gpt2": gpt2, "zgpt": zgpt}


def engine_for(model: nn.Module, stage: int) -> ZeroEngine:
    return zeroray.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), zeroray.ZeroConfig(stage=stage))


def hf_loss(engine: ZeroEngine, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss of a transformers causal LM (it shifts the labels itself)."""
    return engine(input_ids=x, labels=y).loss


def hf_step(engine: ZeroEngine, vocab: int) -> float:
    """One training step of a transformers causal LM."""
    x = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(5))
    return train(engine, [(x, x)], loss=hf_loss)[0]


def write_sources(root: Path) -> dict[str, dict[str, Any]]:
    """The sources the tests load, as local directories: {name: {"dir", "model", "expected"}}.

    "llama": fp32, one file, tied embeddings (save_pretrained keeps one name);
    "llama_bf16": bf16, sharded into several files with an index;
    "gpt2": fp16, one file; "zgpt": zeroray's GPT under a "model." prefix, written by safetensors
    itself, the tied lm_head left out."""
    out: dict[str, dict[str, Any]] = {}
    for name, model, dtype, shard in (
        ("llama", "llama", torch.float32, None),
        ("llama_bf16", "llama", torch.bfloat16, "60KB"),
        ("gpt2", "gpt2", torch.float16, None),
    ):
        d = root / name
        m = BUILDERS[model](0).to(dtype)
        m.save_pretrained(d, **({"max_shard_size": shard} if shard else {}))
        out[name] = {"dir": d, "model": model}
    d = root / "zgpt"
    d.mkdir()
    state = {f"model.{k}": v for k, v in zgpt(0).state_dict().items() if k != "lm_head.weight"}
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})
    out["zgpt"] = {"dir": d, "model": "zgpt"}
    for name, src in out.items():
        src["expected"] = expected(src["dir"], "model." if name == "zgpt" else "")
        src["bytes"] = sum(f.stat().st_size for f in src["dir"].glob("*.safetensors"))
    return out


def expected(d: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """What a load must give: every tensor of the files, fp32 (read by the safetensors package),
    ``prefix`` stripped from the names."""
    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update({k.removeprefix(prefix): v.float() for k, v in load_file(f).items()})
    return out


def assert_loaded(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    """``got`` (a full_state_dict) equals ``want`` exactly, tied names counted once."""
    assert set(got) <= set(want), f"{what}: not in the file: {sorted(set(got) - set(want))}"
    for k, t in got.items():
        assert torch.equal(t, want[k]), f"{what}: {k} differs"


def upload(fs: Any, local: Path, url: str) -> None:
    for f in sorted(os.listdir(local)):
        fs.put_file(str(local / f), f"{url}/{f}")


def load_all(
    rank: int, world: int, stage: int, srcs: dict[str, dict[str, Any]], failing: str | None
) -> dict[str, Any]:
    """Worker: a fresh engine per source (the fp32 llama one trained a step first, so there is an
    optimizer state and a step to drop), loaded; then, with ``failing``, a load that fails on rank 1 only."""
    out: dict[str, Any] = {}
    for name, src in srcs.items():
        engine = engine_for(BUILDERS[src["model"]](1), stage)
        trained = name == "llama"
        if trained:
            hf_step(engine, 256)
        before = (engine.global_step, len(engine.optimizer.state))
        report = zeroray.load_pretrained(engine, src["url"], storage_options=src["options"])
        out[name] = {
            "sd": engine.full_state_dict(), "report": report, "before": before,
            "after": (engine.global_step, len(engine.optimizer.state)),
        }
        if trained:
            out[name]["loss"] = hf_step(engine, 256)
        engine.close()
    if failing is not None:
        engine = engine_for(zgpt(1), stage)
        before_sd = engine.full_state_dict()
        error = None
        try:
            zeroray.load_pretrained(engine, failing if rank == 0 else failing + "-missing-on-rank-1")
        except zeroray.PretrainedError as e:
            error = str(e)
        after_sd = engine.full_state_dict()
        engine.close()
        out["one_rank_fails"] = {"error": error, "same": all(torch.equal(before_sd[k], after_sd[k]) for k in before_sd)}
    return out


def export_round_trip(rank: int, world: int, ckpt: str, out_dir: str) -> dict[str, Any]:
    """Worker: train the llama a step at stage 3, save, export on rank 0 (no process group needed),
    then load the export into a fresh stage-1 engine with load_pretrained."""
    import torch.distributed as dist

    import zeroray.checkpoint as zc

    engine = engine_for(llama(0), 3)
    hf_step(engine, 256)
    zc.save(engine, ckpt)
    trained = engine.full_state_dict()
    engine.close()
    error = None
    if rank == 0:
        try:
            zc.export(ckpt, out_dir)
        except Exception as e:  # reach the barrier anyway, so rank 1 does not wait for ever
            error = e
    dist.barrier()
    if error is not None:
        raise error
    fresh = engine_for(llama(1), 1)
    report = zeroray.load_pretrained(fresh, out_dir)
    loaded = fresh.full_state_dict()
    fresh.close()
    return {"trained": trained, "loaded": loaded, "report": report}
