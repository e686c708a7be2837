"""Models built on the meta device: initialized by the engine, the same on every rank, no broadcast.

The reference for the values is the model materialized whole on the CPU (``to_empty``, ties put
back), seeded the same, with the same initializer run over ``model.modules()`` in order; for a model
whose constructor draws from the RNG in that order, it is simply the model built on the CPU.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

import zeroray
import zeroray.train as zt
from tests.support.dist import run_ranks
from tests.support.models import Block, TinyLM, batches
from tests.support.ray import assert_nothing_left
from tests.support.recipe import CLIP, GAS, LR, optimizer, reference, train
from zeroray.models.gpt import GPT, GPTConfig
from zeroray.train import RunConfig, ScalingConfig, ZeroTrainer

SEED = 7


class StackLM(nn.Module):
    """Its constructor draws from the RNG in ``model.modules()`` order (every module's own
    ``reset_parameters``), so built on meta and reset by the engine it equals the CPU build."""

    def __init__(self, vocab: int = 37, d: int = 13, n_layer: int = 3):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.h = nn.ModuleList(Block(d) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for blk in self.h:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def tiny_init(m: nn.Module) -> None:
    """A user's init_fn for TinyLM, touching only the module's own tensors (buffer included)."""
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.uniform_(m.bias, -0.1, 0.1)
    if isinstance(m, nn.LayerNorm):
        m.reset_parameters()
    if isinstance(m, TinyLM):
        nn.init.normal_(m.wpe, std=0.02)
        m.pos_scale.copy_(torch.linspace(0.5, 1.5, m.pos_scale.shape[0]).unsqueeze(-1))


def gpt_init(m: nn.Module) -> None:
    GPT._init_weights(m)
    if isinstance(m, nn.LayerNorm):
        m.reset_parameters()


GPT_CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)


def _meta(build) -> nn.Module:
    with torch.device("meta"):
        return build()


def _reference_init(meta_model: nn.Module, init, ties: list[tuple[str, str]]) -> nn.Module:
    """Materialized whole on the CPU, ties restored, seeded, ``init`` over modules() in order."""
    ref = copy.deepcopy(meta_model).to_empty(device="cpu")
    for dst, src in ties:
        owner, attr = dst.rsplit(".", 1)
        setattr(ref.get_submodule(owner), attr, ref.get_parameter(src))
    torch.manual_seed(SEED)
    for m in ref.modules():
        init(m)
    return ref


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _engine(model: nn.Module, stage: int, **kw) -> zeroray.ZeroEngine:
    cfg = zeroray.ZeroConfig(stage=stage, gradient_accumulation_steps=GAS, gradient_clipping=CLIP)
    torch.manual_seed(SEED)  # every rank the same: they replay one RNG stream
    return zeroray.initialize(model, optimizer(model), cfg, **kw)


def _worker(rank: int, world: int) -> dict:
    data = batches(rank, GAS * 2)
    torch.manual_seed(SEED)
    cpu = StackLM()
    out: dict = {"stack_cpu": _state(cpu), "ddp": reference(rank, copy.deepcopy(cpu), data)}
    tiny_ref = _state(_reference_init(_meta(TinyLM), tiny_init, [("head.weight", "wte.weight")]))
    gpt_ref = _state(_reference_init(_meta(lambda: GPT(GPT_CFG)), gpt_init, [("lm_head.weight", "transformer.wte.weight")]))
    out["tiny_ref"], out["gpt_ref"] = tiny_ref, gpt_ref
    for stage in range(4):
        model = _meta(StackLM)
        engine = _engine(model, stage)  # reset_parameters path
        init_state, setup = engine.full_state_dict(), engine.setup_comm_report()
        out[("stack", stage)] = (init_state, setup, (train(engine, data), engine.full_state_dict()))
        engine.close()
        out[("stack_closed", stage)] = _state(model)  # close() gives the model its full weights
        model = _meta(TinyLM)
        engine = _engine(model, stage, init_fn=tiny_init)
        out[("tiny", stage)] = (engine.full_state_dict(), engine.setup_comm_report(), model.pos_scale.clone())
        engine.close()
        if stage in (0, 3):
            engine = _engine(_meta(lambda: GPT(GPT_CFG)), stage, init_fn=gpt_init)
            out[("gpt", stage)] = engine.full_state_dict()
            engine.close()
    for stage in (1, 3):  # bf16: the meta build lands in the same bf16 params and fp32 masters
        states = []
        for build in (StackLM, lambda: _meta(StackLM)):
            torch.manual_seed(SEED)
            model = build()
            engine = zeroray.initialize(model, lambda ps: torch.optim.SGD(ps, lr=0.1), zeroray.ZeroConfig(stage=stage, precision="bf16"))
            states.append(engine.full_state_dict())
            engine.close()
        out[("bf16", stage)] = states
    # The accounting sees set-up broadcasts when there are some: the same model built real.
    torch.manual_seed(SEED)
    engine = _engine(StackLM(), 3)
    out["real_setup"] = engine.setup_comm_report()
    engine.close()
    return out


def _all(rank: int, world: int) -> dict:
    out = {"main": _worker(rank, world)}
    if world == 2:  # one start of the processes for the tests below too: spawning costs more than they do
        out["partial"] = _partial(rank, world)
        out["peak"] = _setup_peak(rank, world)
    return out


@functools.cache
def _results(world: int) -> list[dict]:
    return run_ranks(_all, world)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_meta_built_models_equal_cpu_built_train_like_ddp_and_broadcast_nothing(world: int) -> None:
    for rank, res in enumerate(r["main"] for r in _results(world)):
        ddp_losses, ddp_state, _ = res["ddp"]
        for stage in range(4):
            init, setup, (losses, trained) = res[("stack", stage)]
            assert list(init) == list(res["stack_cpu"])
            for name, want in res["stack_cpu"].items():
                assert torch.equal(init[name], want), (stage, rank, name)
            assert setup == {}, (stage, setup)  # no weight or buffer broadcast at set-up
            torch.testing.assert_close(torch.tensor(losses), torch.tensor(ddp_losses), msg=f"stage {stage}")
            for name, want in ddp_state.items():
                torch.testing.assert_close(trained[name], want, msg=f"stage {stage} {name}")
                assert torch.equal(res[("stack_closed", stage)][name], trained[name])

            init, setup, pos_scale = res[("tiny", stage)]
            for name, want in res["tiny_ref"].items():
                assert torch.equal(init[name], want), (stage, rank, name)
            assert torch.equal(pos_scale, torch.linspace(0.5, 1.5, 9).unsqueeze(-1))  # init_fn reached the buffer
            assert setup == {}
        for stage in (1, 3):
            real, meta = res[("bf16", stage)]
            for name, want in real.items():
                assert torch.equal(meta[name], want), (stage, name)
        for stage in (0, 3):
            for name, want in res["gpt_ref"].items():
                assert torch.equal(res[("gpt", stage)][name], want), (stage, rank, name)
        if world > 1:
            assert res["real_setup"].get("broadcast", 0) > 0


def _partial(rank: int, world: int) -> dict:
    """A model partly on meta: block h.1 and h.0.fc.weight; the rest built on the CPU with a seed
    that differs per rank, so only a broadcast from rank 0 makes the real part agree."""
    out = {}
    for stage in (1, 3):
        torch.manual_seed(100 + rank)
        model = TinyLM()
        real = _state(model)
        with torch.device("meta"):
            model.h[1] = Block(13)
            model.h[0].fc.weight = nn.Parameter(torch.empty(model.h[0].fc.weight.shape))
        ref = copy.deepcopy(model)
        ref.h[1].to_empty(device="cpu")
        ref.h[0].fc.weight = nn.Parameter(torch.empty_like(ref.h[0].fc.weight, device="cpu"))
        bias = ref.h[0].fc.bias.detach().clone()
        torch.manual_seed(SEED)
        for m in [ref.h[0].fc, *ref.h[1].modules()]:
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        ref.h[0].fc.bias.data.copy_(bias)  # a real tensor keeps its value
        engine = _engine(model, stage)
        out[stage] = {
            "state": engine.full_state_dict(),
            "real": real,
            "ref": _state(ref),
            "setup": engine.setup_comm_report(),
            "meta_groups": [g.name for g in engine.groups if not g.has_real],
        }
        engine.close()
    return out


def test_partial_meta_real_part_from_rank0_meta_part_initialized_everywhere() -> None:
    results = [r["partial"] for r in _results(2)]
    for stage in (1, 3):
        rank0_real = results[0][stage]["real"]
        for res in results:
            r = res[stage]
            for name, got in r["state"].items():
                if name.startswith("h.1.") or name == "h.0.fc.weight":
                    assert torch.equal(got, r["ref"][name]), (stage, name)
                else:  # real: rank 0's values everywhere (h.0.fc.bias too, though its module was reset)
                    assert torch.equal(got, rank0_real[name]), (stage, name)
            assert r["setup"].get("broadcast", 0) > 0
        if stage == 3:  # the all-meta unit was built straight into shards
            assert sorted(results[0][stage]["meta_groups"]) == ["h.1/pg0", "h.1/pg1"]


def test_bad_init_fn_and_device_fail_early_with_clear_errors() -> None:
    with pytest.raises(TypeError, match="init_fn must be a callable"):
        zeroray.initialize(_meta(StackLM), torch.optim.SGD, init_fn=3)
    real = StackLM()
    with pytest.raises(ValueError, match="init_fn was given but no parameter or buffer .* meta"):
        zeroray.initialize(real, torch.optim.SGD(real.parameters(), lr=0.1), init_fn=tiny_init)
    tiny = _meta(TinyLM)
    with pytest.raises(ValueError, match=r"wpe, pos_scale are held only by modules without reset_parameters"):
        zeroray.initialize(tiny, torch.optim.SGD(tiny.parameters(), lr=0.1))
    def reaches_into_a_child(m: nn.Module) -> None:
        tiny_init(m)
        if isinstance(m, TinyLM):  # the blocks are still on meta when the root's turn comes
            nn.init.zeros_(m.h[0].fc.bias)

    tiny = _meta(TinyLM)
    with pytest.raises(RuntimeError, match=r"initializer of the model \(TinyLM\) ran aten.zero_.* shape \(40,\) .* still on the meta"):
        zeroray.initialize(tiny, torch.optim.SGD(tiny.parameters(), lr=0.1), init_fn=reaches_into_a_child)
    tiny = _meta(TinyLM)
    view = tiny.h[1].proj.weight.view(-1)  # another reference to its storage: it cannot be swapped
    with pytest.raises(RuntimeError, match=r"cannot materialize the meta tensor 'h.1.proj.weight' in place"):
        zeroray.initialize(tiny, torch.optim.SGD(tiny.parameters(), lr=0.1), init_fn=tiny_init)
    del view
    with pytest.raises(ValueError, match="device='meta' cannot hold"):
        zeroray.initialize(_meta(StackLM), lambda ps: torch.optim.SGD(ps, lr=0.1), device="meta")
    engine = zeroray.initialize(real, torch.optim.SGD(real.parameters(), lr=0.1), device="cpu:0")
    assert engine.device == torch.device("cpu")
    engine.close()
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="non-meta parameters are on cpu"):
            zeroray.initialize(real, torch.optim.SGD(real.parameters(), lr=0.1), device="cuda")
    else:
        with pytest.raises(ValueError, match="CUDA is not available"):
            zeroray.initialize(_meta(StackLM), lambda ps: torch.optim.SGD(ps, lr=0.1), device="cuda")


def _setup_peak(rank: int, world: int) -> dict:
    """Bytes of the tensors torch allocates during set-up, counted by the profiler's allocation
    events (deterministic: independent of the CPU allocator, page reuse or other processes)."""
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=6, n_head=4, n_embd=128)
    model = _meta(lambda: GPT(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)  # over the meta parameters: the template
    torch.manual_seed(SEED)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        engine = zeroray.initialize(model, opt, zeroray.ZeroConfig(stage=3), init_fn=gpt_init)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    out = {
        "peak": peak,
        "persistent": engine.memory_report()["total"],
        "largest_unit": max(u.numel for u in engine.scheduler.all_units) * 4,
        "model": sum(p.numel() for p in model.parameters()) * 4,
    }
    engine.close()
    return out


def test_stage3_setup_peak_within_persistent_plus_largest_unit() -> None:
    for r in (res["peak"] for res in _results(2)):
        bound = 1.1 * (r["persistent"] + r["largest_unit"])
        assert r["peak"] <= bound, r
        # Teeth: materializing the whole model beside the shards would break the bound.
        assert r["persistent"] + r["model"] > bound, r


def _prepare_loop() -> None:
    model = _meta(TinyLM)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)  # over the meta parameters
    torch.manual_seed(SEED)
    engine = zt.prepare(model, opt, init_fn=tiny_init)
    init = {k: v.tolist() for k, v in engine.full_state_dict().items()}
    for x, y in batches(zt.get_context().get_world_rank(), 2):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        zt.report({"loss": loss.item()})
    zt.report({"init": init, "setup": engine.setup_comm_report(), "step": engine.global_step})


def test_prepare_takes_a_meta_model_and_init_fn(ray_cluster, tmp_path) -> None:
    result = ZeroTrainer(
        _prepare_loop,
        zero_config={"zero_optimization": {"stage": 3}},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="meta-prepare", storage_path=str(tmp_path), progress_bar=False),
    ).fit()
    want = _state(_reference_init(_meta(TinyLM), tiny_init, [("head.weight", "wte.weight")]))
    got = result.metrics["init"]
    assert got.keys() == want.keys()
    for name, ref in want.items():
        assert torch.equal(torch.tensor(got[name]), ref), name
    assert result.metrics["setup"] == {} and result.metrics["step"] == 2
    assert_nothing_left("meta-prepare")
