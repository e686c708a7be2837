"""ZeroTrainer's argument checks and the pure parts of the Ray layer (no Ray cluster needed)."""

from __future__ import annotations

import shutil

import pytest

import zeroray.checkpoint as zc
from tests.support.checkpoint import make_engine
from zeroray.train import (
    CheckpointConfig,
    ControllerCallback,
    FailureConfig,
    RunConfig,
    ScalingConfig,
    ZeroTrainer,
)
from zeroray.train.driver.failure_policy import FailureDecision, FailurePolicy
from zeroray.train.driver.run_dir import RunStorage, StorageError
from zeroray.train.driver.scaling_policy import (
    BatchPlan,
    ElasticScalingPolicy,
    FixedScalingPolicy,
    make_scaling_policy,
)
from zeroray.train.group.worker_group import rank_layout
from zeroray.train.result import Checkpoint, latest_checkpoint


def _loop(config):
    pass


@pytest.mark.parametrize("n", [0, -1, 1.5, True, "2"])
def test_num_workers_must_be_positive_int(n):
    with pytest.raises(ValueError, match="num_workers"):
        ScalingConfig(num_workers=n)


def test_scaling_config_checks_and_resources():
    with pytest.raises(ValueError, match="placement_strategy"):
        ScalingConfig(placement_strategy="SCATTER")
    with pytest.raises(ValueError, match="use_gpu is False"):
        ScalingConfig(resources_per_worker={"GPU": 1})
    with pytest.raises(ValueError, match="resources_per_worker"):
        ScalingConfig(resources_per_worker={"CPU": -1})
    assert ScalingConfig().worker_resources == {"CPU": 1.0}
    assert ScalingConfig(use_gpu=True).worker_resources == {"CPU": 1.0, "GPU": 1.0}
    assert ScalingConfig(resources_per_worker={"CPU": 2, "accel": 1}).worker_resources == {"CPU": 2.0, "accel": 1.0}
    assert ScalingConfig(use_gpu=True).backend == "nccl" and ScalingConfig().backend == "gloo"


def test_failure_and_checkpoint_configs():
    assert FailureConfig(max_failures=3).max_failures == 3
    assert FailureConfig(max_failures=-1).max_failures == -1
    for bad in (-2, 1.0, None):
        with pytest.raises(ValueError, match="max_failures"):
            FailureConfig(max_failures=bad)
    with pytest.raises(ValueError, match="num_to_keep"):
        CheckpointConfig(num_to_keep=0)
    with pytest.raises(ValueError, match="async_save"):
        CheckpointConfig(async_save="yes")
    assert CheckpointConfig(num_to_keep=2, async_save=True).num_to_keep == 2
    assert FailureConfig().collective_timeout_s == 60.0  # about a minute, not torch's 30 minutes
    for bad in (0, -1.0, "60", True):
        with pytest.raises(ValueError, match="collective_timeout_s"):
            FailureConfig(collective_timeout_s=bad)
    assert FailureConfig().snapshot_interval == 0 and FailureConfig(snapshot_interval=5).snapshot_interval == 5
    for bad in (-1, 1.5, "1", None):
        with pytest.raises(ValueError, match=r"FailureConfig.snapshot_interval must be an integer >= 0 \(0 = no"):
            FailureConfig(snapshot_interval=bad)


def test_run_config_checks(tmp_path):
    with pytest.raises(ValueError, match="name"):
        RunConfig(name="a/b")
    with pytest.raises(ValueError, match="failure_config"):
        RunConfig(failure_config={"max_failures": 1})
    assert RunConfig(storage_path=tmp_path).storage_path == str(tmp_path)
    assert RunConfig().name.startswith("zeroray-")
    assert RunConfig(lease_timeout_s=5).lease_timeout_s == 5
    for bad in (0, -1, None):
        with pytest.raises(ValueError, match="lease_timeout_s"):
            RunConfig(lease_timeout_s=bad)


class _Callback(ControllerCallback):
    pass


def test_run_config_callbacks_are_controller_callbacks():
    cb = _Callback()
    assert RunConfig().callbacks == [] and RunConfig(callbacks=(cb,)).callbacks == [cb]
    for bad, says in (([object()], r"RunConfig.callbacks\[0\] must be a zeroray.train.ControllerCallback \(subclass it"),
                      ([cb, _Callback], r"RunConfig.callbacks\[1\] is the class _Callback: pass an instance, _Callback\(\)"),
                      (cb, "RunConfig.callbacks must be a list"), ([lambda *a: None], "got function")):
        with pytest.raises(ValueError, match=says) as info:
            RunConfig(callbacks=bad)
        assert "\n" not in str(info.value)


def test_a_scaling_policy_is_picked_by_make_scaling_policy():
    fixed = make_scaling_policy(ScalingConfig(num_workers=2))
    elastic = make_scaling_policy(ScalingConfig(num_workers=(1, 3)), BatchPlan("none"))
    assert type(fixed) is FixedScalingPolicy and not fixed.elastic and fixed.plan == BatchPlan("none")
    assert type(elastic) is ElasticScalingPolicy and elastic.elastic
    assert fixed.decide_for_new_group().num_workers == 2 and fixed.decide_while_running(2) is None


def test_trainer_rejects_bad_arguments_without_ray():
    with pytest.raises(TypeError, match="train_loop_per_worker"):
        ZeroTrainer("not a function")
    with pytest.raises(ValueError, match="zero arguments or one"):
        ZeroTrainer(lambda a, b: None)
    with pytest.raises(TypeError, match="train_loop_config"):
        ZeroTrainer(_loop, train_loop_config=[1, 2])
    with pytest.raises(ValueError, match="takes no argument"):
        ZeroTrainer(lambda: None, train_loop_config={"a": 1})
    with pytest.raises(TypeError, match="scaling_config"):
        ZeroTrainer(_loop, scaling_config={"num_workers": 2})
    with pytest.raises(ValueError, match="stage"):
        ZeroTrainer(_loop, zero_config={"zero_optimization": {"stage": 7}})
    with pytest.raises(ValueError, match="train_batch_size"):  # 10 is not divisible by 4 x 3 workers
        ZeroTrainer(_loop, zero_config={"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4},
                    scaling_config=ScalingConfig(num_workers=3))
    with pytest.raises(TypeError, match="datasets"):
        ZeroTrainer(_loop, datasets={"train": [1, 2, 3]})


def test_storage_validation(tmp_path):
    RunStorage(str(tmp_path), "run").validate(processes=3)
    assert (tmp_path / "run").is_dir() and list((tmp_path / "run").iterdir()) == []
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(StorageError, match="not reachable or not writable"):
        RunStorage(str(blocker / "sub"), "run").validate(processes=3)
    with pytest.raises(StorageError, match="cannot open storage URL"):
        RunStorage("nosuchprotocol://bucket/x", "run")
    # One process may use its own memory filesystem; the ranks of a run are several processes.
    mem = RunStorage("memory://zeroray-test", "run")
    mem.validate(processes=1)
    with pytest.raises(StorageError, match="process-local"):
        mem.validate(processes=3)
    assert mem.open_history() == 0
    mem.append_history([{"loss": 1.0}])
    mem.append_history([{"loss": 0.5}])
    assert mem.fs.cat(mem.dir + "/metrics.jsonl") == b'{"loss": 1.0}\n{"loss": 0.5}\n'


def test_rank_layout_groups_ranks_by_node():
    order, infos = rank_layout(["B", "A", "B", "A", "C"])
    assert order == [0, 2, 1, 3, 4]  # node B's bundles first (first seen), then A, then C
    assert [(i.world_rank, i.node_rank, i.local_rank, i.local_world_size) for i in infos] == [
        (0, 0, 0, 2), (1, 0, 1, 2), (2, 1, 0, 2), (3, 1, 1, 2), (4, 2, 0, 1)
    ]
    assert all(i.world_size == 5 for i in infos)


def test_failure_policy_counts_failures():
    policy = FailurePolicy(FailureConfig(max_failures=2))
    assert [policy.decide([]) for _ in range(3)] == [FailureDecision.RESTART] * 2 + [FailureDecision.RAISE]
    assert FailurePolicy(FailureConfig()).decide([]) is FailureDecision.RAISE
    unlimited = FailurePolicy(FailureConfig(max_failures=-1))
    assert all(unlimited.decide([]) is FailureDecision.RESTART for _ in range(50))


def test_latest_checkpoint_is_the_newest_committed_on_storage(tmp_path):
    run = tmp_path / "run"
    assert latest_checkpoint(str(run)) is None  # no run directory yet: a fresh start
    zc.save(make_engine(0), str(run / "checkpoint_2"))
    shutil.copytree(run / "checkpoint_2", run / "checkpoint_10")
    (run / "checkpoint_12").mkdir()  # a save in flight or one that died: a rank file, no manifest
    (run / "checkpoint_12" / "rank-00000.bin").write_bytes(b"")
    assert latest_checkpoint(str(run)) == Checkpoint(f"{run}/checkpoint_10", 10)  # by step, not by name


def test_history_of_a_run_appends_across_fits_and_drops_a_torn_line(tmp_path):
    (tmp_path / "run").mkdir()
    # An earlier fit of the run wrote two reports, and its writer died in the middle of a third.
    (tmp_path / "run" / "metrics.jsonl").write_text('{"fit": 1}\n{"fit": 1}\n{"fit": 1, "lo')
    storage = RunStorage(str(tmp_path), "run")
    assert storage.open_history() == 2
    storage.append_history([{"loss": 3.0}])
    storage.append_history([])
    storage.append_history([{"loss": 2.0}, {"loss": 1.0}])
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == (
        '{"fit": 1}\n{"fit": 1}\n{"loss": 3.0}\n{"loss": 2.0}\n{"loss": 1.0}\n'
    )


def test_worker_api_outside_a_train_loop_says_so():
    import zeroray.train as zt

    for call in (zt.get_context, lambda: zt.report({"a": 1}), lambda: zt.get_dataset_shard("train"),
                 lambda: zt.prepare(None)):
        with pytest.raises(RuntimeError, match="inside a train loop run by ZeroTrainer"):
            call()
