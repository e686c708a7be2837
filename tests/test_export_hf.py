"""Close the round trip: a stage-3 run of a transformers model, saved and exported, loads with
transformers' from_pretrained as it is (config.json included) and with zeroray.load_pretrained."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import zeroray
from tests.support.dist import run_ranks
from tests.support.pretrained import engine_for, export_round_trip, llama
from zeroray.cli import main


def test_export_loads_with_from_pretrained(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    ckpt, out = tmp_path / "checkpoint_1", tmp_path / "export"
    r0, r1 = run_ranks(export_round_trip, 2, str(ckpt), str(out))
    trained = r0["trained"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["model_type"], config["dtype"]) == (["LlamaForCausalLM"], "llama", "float32")

    hf = AutoModelForCausalLM.from_pretrained(out)
    assert type(hf) is LlamaForCausalLM and hf.lm_head.weight is hf.model.embed_tokens.weight
    got = dict(hf.named_parameters())
    assert got.keys() == trained.keys()
    for k, t in trained.items():
        assert torch.equal(got[k].detach(), t), k

    for r in (r0, r1):  # load_pretrained reads the export: every rank, stage 1 at world 2
        assert all(torch.equal(r["loaded"][k], t) for k, t in trained.items())
        assert r["report"].files[-1].endswith("model-00001-of-00001.safetensors")

    # bf16 through the CLI: config.json says so, and both loaders give the cast weights
    bf16 = tmp_path / "bf16"
    assert main(["export", str(ckpt), str(bf16), "--dtype", "bf16"]) == 0
    assert "config.json" in capsys.readouterr().out.split()
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    cast = {k: t.to(torch.bfloat16).float() for k, t in trained.items()}
    hf = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.float32)
    assert all(torch.equal(p.detach(), cast[k]) for k, p in hf.named_parameters())
    engine = engine_for(llama(1), 3)
    zeroray.load_pretrained(engine, str(bf16))
    assert all(torch.equal(t, cast[k]) for k, t in engine.full_state_dict().items())
    engine.close()
