"""RunConfig(callbacks=[...]) on a real local Ray cluster: a user's ControllerCallback gets every hook, in
order, in the driver; one that raises fails the run with a CallbackError and is not restarted."""

from __future__ import annotations

import json
import os
import threading

import pytest

import zeroray.train as zt
from tests.support.ray import assert_nothing_left, run_config
from zeroray.train import FailureConfig, ZeroTrainer


def _loop():
    for i in range(3):
        zt.report({"loss": float(i), "pid": os.getpid()})


class Recorder(zt.ControllerCallback):
    """Every hook as a tuple, state changes only when the state's type changes (RUNNING -> RUNNING comes at
    every poll), in one list that other recorders may share."""

    def __init__(self, tag: str, events: list) -> None:
        self.tag, self.events = tag, events
        self.where: set[tuple[int, str]] = set()

    def _seen(self) -> None:
        self.where.add((os.getpid(), threading.current_thread().name))

    def after_state_change(self, previous, current) -> None:
        self._seen()
        if previous is None or previous.type != current.type:
            self.events.append((self.tag, "state", previous.type.value if previous else None, current.type.value))

    def after_report(self, report, entry) -> None:
        self._seen()
        self.events.append((self.tag, "report", report.index, entry["loss"], entry["_report"]))

    def after_attempt_start(self, attempt) -> None:
        self._seen()
        self.events.append((self.tag, "attempt_start", attempt.index, attempt.world_size))

    def after_attempt_end(self, attempt) -> None:
        self._seen()
        self.events.append((self.tag, "attempt_end", attempt.end))


class Exploding(zt.ControllerCallback):
    """Raises at the second report, and again when told the run ended (that one is only logged)."""

    def after_report(self, report, entry) -> None:
        if report.index == 2:
            raise ValueError("no room for report 2")

    def after_state_change(self, previous, current) -> None:
        if current.type.value == "ERRORED":
            raise RuntimeError("and not for the end either")


def test_user_callbacks_get_every_hook_in_order_in_the_driver(ray_cluster, tmp_path):
    events: list = []
    first, second = Recorder("a", events), Recorder("b", events)
    result = ZeroTrainer(_loop, run_config=run_config(tmp_path, "callbacks", callbacks=[first, second])).fit()

    # Per event, the callbacks run in list order (after the built-ins: the history already has the row).
    assert [e[0] for e in events] == ["a", "b"] * (len(events) // 2)
    assert [e[1:] for e in events[::2]] == [e[1:] for e in events[1::2]]
    assert [e[1:] for e in events[::2]] == [
        ("state", None, "INITIALIZING"),
        ("state", "INITIALIZING", "SCHEDULING"),
        ("attempt_start", 1, 1),
        ("state", "SCHEDULING", "RUNNING"),
        ("report", 1, 0.0, 1),
        ("report", 2, 1.0, 2),
        ("report", 3, 2.0, 3),
        ("attempt_end", "finished"),
        ("state", "RUNNING", "FINISHED"),
    ]
    assert [h["loss"] for h in result.metrics_history] == [0.0, 1.0, 2.0]
    # In the driver, in the thread that called fit(); the loop ran in another process.
    assert first.where == second.where == {(os.getpid(), threading.current_thread().name)}
    assert result.metrics["pid"] != os.getpid()
    assert_nothing_left("callbacks", [result.metrics["pid"]])


def test_a_callback_that_raises_fails_the_run_with_a_callback_error(ray_cluster, tmp_path):
    events: list = []
    config = run_config(tmp_path, "callback-raises", callbacks=[Exploding(), Recorder("r", events)],
                        failure_config=FailureConfig(max_failures=2))
    with pytest.raises(zt.CallbackError, match=r"\(callback\): Exploding.after_report raised ValueError: no room "
                                               r"for report 2 \(an exception out of a callback's hook fails the run"
                       ) as info:
        ZeroTrainer(_loop, run_config=config).fit()
    err = info.value
    assert err.hook == "after_report" and isinstance(err.callback, Exploding)
    assert isinstance(err.__cause__, ValueError)  # not the RuntimeError of the ERRORED hook: that one is logged
    # Not restarted (max_failures=2 is for the group's failures); the run ends ERRORED, the others see the end.
    assert [e[1:] for e in events if e[1] != "report"][-3:] == [
        ("state", "SCHEDULING", "RUNNING"), ("attempt_end", "errored"), ("state", "RUNNING", "ERRORED")]
    assert [e[2] for e in events if e[1] == "report"] == [1]  # report 2 stopped at the callback before it
    assert err.result is not None and err.result.error is err and err.result.attempts == 1
    assert [h["_report"] for h in err.result.metrics_history] == [1, 2]  # the built-in history ran first
    info_json = json.loads((tmp_path / "runs" / "callback-raises" / "run.json").read_text())
    assert info_json["status"] == "ERRORED" and "Exploding.after_report raised ValueError" in info_json["error"]
    assert_nothing_left("callback-raises", [err.result.metrics_history[0]["pid"]])
