"""torch.compile with the engine, at every stage: the forms users write, compiled against compiled peers.

Every form trains (per-block ``block.compile()`` / ``torch.compile(block)`` before or after
``zeroray.initialize``, the whole model, ``ZeroConfig.compile``), each block shape compiles once
(TinyLM's blocks are alike: one graph) and nothing recompiles after the second step, counted by dynamo.
Compiled zeroray is held to compiled DDP (inductor, both) as closely as compiled FSDP2 is, and to eager
zeroray where the reductions are the same. Forms that cannot work fail at the first forward, naming the
module and the way out.

The world-2 cases share one process group (``world_2``): torch, dynamo and inductor are imported once, and
compiled DDP (the yardstick of every comparison), eager stage 3 and the stage-3 "config" form are run once,
then read by each test. Every compiled run still starts from a reset dynamo (``_fresh_dynamo``).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import zeroray
from tests.support.dist import run_ranks
from tests.support.models import TinyLM, batches
from tests.support.recipe import (
    FLOOR,
    GAS,
    OPT_STEPS,
    config,
    fsdp2_run,
    loss_distance,
    optimizer,
    reference,
    train,
    weight_distance,
    zero_run,
)
from zeroray.config import ConfigError
from zeroray.config.load import load_config
from zeroray.train.worker.preparation import compile_config


def _counters() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return dict(counters["stats"])


def _fresh_dynamo() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def _compiled_run(init: TinyLM, data: list, stage: int, precision: str, form: str, **extra: Any) -> dict:
    """The recipe through zeroray with the model compiled in ``form``: losses, weights, dynamo's graph count
    after the second micro-step and at the end."""
    _fresh_dynamo()
    model = copy.deepcopy(init)

    def per_block() -> None:
        for i, blk in enumerate(model.h):
            if form.startswith("block"):
                blk.compile()
            else:
                model.h[i] = torch.compile(blk)

    if form.endswith("before"):
        per_block()
    cfg = config(stage, precision, compile={"enabled": form == "config"}, **extra)
    engine = zeroray.initialize(model, optimizer(model), cfg)
    forward: Any = engine
    if form.endswith("after"):
        per_block()
    elif form == "whole":
        forward = torch.compile(model)
    seen: list[dict[str, int]] = []
    losses = train(engine, data, loss=lambda e, x, y: forward(x, y), on_step=lambda _: seen.append(_counters()))
    state = engine.full_state_dict()
    engine.close()
    return {"losses": losses, "state": state, "graphs_at_2": seen[1].get("unique_graphs", 0),
            "graphs": seen[-1].get("unique_graphs", 0)}


def _ddp_compiled(rank: int, model: TinyLM, data: list) -> tuple[list[float], dict, list[float]]:
    for blk in model.h:
        blk.compile()
    return reference(rank, model, data)


def _yardstick(rank: int, init: TinyLM, data: list) -> tuple[float, float]:
    """How far compiling moves DDP (inductor fuses, so it rounds differently): weights and losses, compiled
    DDP against eager DDP, at least the rounding floor."""
    eager = reference(rank, copy.deepcopy(init), data)
    _fresh_dynamo()
    return _moved(_ddp_compiled(rank, copy.deepcopy(init), data), eager)


def _moved(compiled: tuple, eager: tuple) -> tuple[float, float]:
    return (max(weight_distance(compiled[1], eager[1]), FLOOR["fp32"]), max(loss_distance(compiled[0], eager[0]), FLOOR["fp32"]))


FORMS = ["config", "block-after", "block-before", "wrap-after", "wrap-before", "whole"]
PRECISIONS = ["fp32", "bf16"]


def _world_2(rank: int, world: int, nvme_path: str) -> dict:
    """Every world-2 case of this file on one process group; each test reads its part. Compiled DDP is run
    once (the parity tests' reference and, against eager DDP, the yardstick of the others), and the
    stage-3 fp32 "config" form once (a form, and stage 3 of the fp32 parity)."""
    data = batches(rank, GAS * OPT_STEPS)
    torch.manual_seed(0)
    init = TinyLM()
    eager_ddp = reference(rank, copy.deepcopy(init), data)
    _fresh_dynamo()
    ddp = _ddp_compiled(rank, copy.deepcopy(init), data)
    yardstick = _moved(ddp, eager_ddp)
    _fresh_dynamo()
    whole_ddp = copy.deepcopy(init)
    whole_ddp.compile()  # the whole model, as the "whole" form compiles it: more fusion than the blocks alone
    forms: dict[Any, Any] = {"eager": zero_run(copy.deepcopy(init), data, 3, "fp32"), "yardstick": yardstick,
                             "yardstick whole": _moved(reference(rank, whole_ddp, data), eager_ddp)}
    for form in FORMS:
        forms[form] = _compiled_run(init, data, 3, "fp32", form)
    out: dict[str, Any] = {"forms": forms}
    for precision in PRECISIONS:
        _fresh_dynamo()
        parity: dict[Any, Any] = {"ddp": ddp, "fsdp2": fsdp2_run(copy.deepcopy(init), data, precision, compile_blocks=True)}
        for stage in (0, 1, 2, 3):
            parity[stage] = (forms["config"] if (precision, stage) == ("fp32", 3)
                             else _compiled_run(init, data, stage, precision, "config"))
        out[precision] = parity
    offload = {"offload_param": {"device": "nvme", "nvme_path": nvme_path}, "offload_optimizer": {"device": "cpu"}}
    out["offload"] = {"yardstick": yardstick, 0: (_compiled_run(init, data, 3, "fp32", "config", **offload),
                                                  zero_run(copy.deepcopy(init), data, 3, "fp32", **offload))}
    out["llama"] = _llama(rank, world)
    out["fullgraph"] = _whole_fullgraph(rank, world)
    return out


# The first test to ask for world_2 pays all of its set-up (what six tests of 600 s each used to share): the
# bound of the tests that use it, on a swamped machine.
SHARED_TIMEOUT = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def world_2(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """``_world_2`` on 2 ranks: each rank's results."""
    return run_ranks(_world_2, 2, str(tmp_path_factory.mktemp("nvme")))


@SHARED_TIMEOUT
def test_every_form_trains_at_stage_3_compiling_each_block_once(world_2: list[dict]) -> None:
    """The per-block forms run the same compiled block: the same bits. Against eager zeroray, compiled zeroray
    moves no more than 3x what compiling moves DDP: the blocks' compile for the per-block forms, the whole
    model's (graph breaks at the units' hooks) for "whole", which fuses more (embedding, final norm, head and
    loss) and so rounds further (on this AVX-512 CPU: DDP 1.3e-6 blocks, 3.9e-6 whole; zeroray whole 7.8e-6)."""
    for rank, res in enumerate(r["forms"] for r in world_2):
        losses, state, _ = res["eager"]
        for form in FORMS:
            w_tol, l_tol = (3 * t for t in res["yardstick whole" if form == "whole" else "yardstick"])
            got = res[form]
            what = f"rank {rank} {form}"
            assert got["graphs"] == got["graphs_at_2"], (what, "recompiled after the second step", got)
            assert list(got["state"]) == list(state), what  # torch.compile(block)'s _orig_mod is not in the names
            if form == "whole":
                assert got["graphs"] >= 1, what
            else:
                assert got["graphs"] == 1, (what, got["graphs"])  # one block shape, one graph
                assert got["losses"] == res["config"]["losses"], what
                assert all(torch.equal(t, res["config"]["state"][n]) for n, t in got["state"].items()), what
            assert loss_distance(got["losses"], losses) <= l_tol, (what, got["losses"], losses, l_tol)
            assert weight_distance(got["state"], state) <= w_tol, (what, weight_distance(got["state"], state), w_tol)


@SHARED_TIMEOUT
@pytest.mark.parametrize("precision", PRECISIONS)
def test_compiled_stages_match_compiled_ddp_as_closely_as_compiled_fsdp2(world_2: list[dict], precision: str) -> None:
    results = [r[precision] for r in world_2]
    fsdp_w = max(weight_distance(r["fsdp2"][1], r["ddp"][1]) for r in results)
    fsdp_l = max(loss_distance(r["fsdp2"][0], r["ddp"][0]) for r in results)
    w_tol, l_tol = 3 * max(fsdp_w, FLOOR[precision]), 3 * max(fsdp_l, FLOOR[precision])
    for rank, res in enumerate(results):
        for stage in (0, 1, 2, 3):
            got, what = res[stage], f"rank {rank} stage {stage} {precision}"
            assert got["graphs"] == got["graphs_at_2"] == 1, (what, got)
            assert weight_distance(got["state"], res["ddp"][1]) <= w_tol, (what, weight_distance(got["state"], res["ddp"][1]), w_tol)
            assert loss_distance(got["losses"], res["ddp"][0]) <= l_tol, (what, got["losses"], res["ddp"][0], l_tol)


def _against_eager(rank: int, world: int, cases: list[tuple[int, dict]]) -> dict:
    data = batches(rank, GAS * OPT_STEPS)
    torch.manual_seed(0)
    init = TinyLM()
    out: dict[Any, Any] = {"yardstick": _yardstick(rank, init, data)}
    for i, (stage, extra) in enumerate(cases):
        out[i] = (_compiled_run(init, data, stage, "fp32", "config", **extra),
                  zero_run(copy.deepcopy(init), data, stage, "fp32", **extra))
    return out


def _assert_near_eager(results: list[dict], cases: list) -> None:
    for rank, res in enumerate(results):
        w_tol, l_tol = (3 * t for t in res["yardstick"])
        for i, (stage, _) in enumerate(cases):
            (got, (losses, state, _)), what = res[i], f"rank {rank} of {len(results)}, stage {stage}"
            assert got["graphs"] == got["graphs_at_2"] == 1, (what, got)
            assert loss_distance(got["losses"], losses) <= l_tol, (what, got["losses"], losses, l_tol)
            assert weight_distance(got["state"], state) <= w_tol, (what, weight_distance(got["state"], state), w_tol)


@pytest.mark.parametrize(("world", "cases"), [(1, [(3, {}), (2, {})]), (3, [(3, {}), (1, {})])])
def test_compiled_matches_eager_at_world_1_and_3(world: int, cases: list) -> None:
    _assert_near_eager(run_ranks(_against_eager, world, cases), cases)


@SHARED_TIMEOUT
def test_compiled_stage_3_with_parameters_and_optimizer_offloaded(world_2: list[dict]) -> None:
    """Parameters in NVMe files and the optimizer in host memory (``_world_2``'s offload case)."""
    _assert_near_eager([r["offload"] for r in world_2], [(3, {})])


def _llama(rank: int, world: int) -> dict:
    from tests.support.pretrained import llama

    g = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, 256, (2, 12), generator=g) for _ in range(4)]
    out = {}
    for compiled in (False, True):
        _fresh_dynamo()
        model = llama(0)
        engine = zeroray.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                    zeroray.ZeroConfig(stage=3, compile={"enabled": compiled}))
        seen: list[dict[str, int]] = []
        losses = train(engine, [(x, x) for x in data], loss=lambda e, x, y: e(input_ids=x, labels=y).loss,
                       on_step=lambda _, seen=seen: seen.append(_counters()))
        out[compiled] = (losses, seen[1].get("unique_graphs", 0), seen[-1].get("unique_graphs", 0))
        engine.close()
    return out


@SHARED_TIMEOUT
def test_hugging_face_llama_with_its_rotary_cache_compiles_per_block_at_stage_3(world_2: list[dict]) -> None:
    for res in (r["llama"] for r in world_2):
        (eager, _, _), (compiled, at_2, end) = res[False], res[True]
        assert at_2 == end >= 1, (at_2, end)
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=0)


def _whole_fullgraph(rank: int, world: int) -> str:
    _fresh_dynamo()
    torch.manual_seed(0)
    model = TinyLM()
    engine = zeroray.initialize(model, optimizer(model), zeroray.ZeroConfig(stage=3))
    x, y = batches(rank, 1)[0]
    try:
        torch.compile(model, fullgraph=True)(x, y)
    except Exception as e:  # dynamo's Unsupported
        return str(e)
    finally:
        engine.close()
    return "no error"


@SHARED_TIMEOUT
def test_whole_model_fullgraph_at_stage_3_fails_at_the_first_forward_naming_the_way_out(world_2: list[dict]) -> None:
    for message in (r["fullgraph"] for r in world_2):
        assert "runs eagerly, outside compiled regions; compile each unit instead of the whole model" in message
        assert "ZeroConfig(compile={'enabled': True})" in message


def test_cuda_graph_modes_are_refused_at_stage_3_and_the_deepspeed_block_maps() -> None:
    with pytest.raises(ConfigError, match="'reduce-overhead' captures CUDA graphs, which need fixed parameter addresses"):
        zeroray.ZeroConfig(stage=3, compile={"enabled": True, "kwargs": {"mode": "reduce-overhead"}})
    assert zeroray.ZeroConfig(stage=2, compile={"enabled": True, "kwargs": {"mode": "reduce-overhead"}}).compile.enabled
    with pytest.raises(ConfigError, match=r"compile.kwargs.modes: is not a torch.compile argument"):
        zeroray.ZeroConfig(compile={"enabled": True, "kwargs": {"modes": "default"}})
    cfg = load_config({"zero_optimization": {"stage": 3}, "compile": {"deepcompile": True, "backend": "aot_eager",
                                                                       "kwargs": {"fullgraph": True}}})
    assert (cfg.compile.enabled, cfg.compile.backend, cfg.compile.kwargs) == (True, "aot_eager", {"fullgraph": True})
    assert load_config({"compile": {"disable": False}}).compile.enabled
    assert not load_config({"compile": {"deepcompile": False, "free_activation": True}}).compile.enabled
    assert compile_config({"kwargs": {"dynamic": False}}).enabled
    assert not compile_config(False).enabled
    with pytest.raises(TypeError, match=r"zt.prepare\(compile=...\) takes True/False"):
        compile_config("inductor")
