"""The Ray actor that hosts one rank: its device, its process group, its engine, its loop.

The user's loop runs in a thread of the actor (as in Ray Train V2), so the actor's own methods stay
answerable while it trains: the driver polls for reports and errors with ``poll`` and never blocks on
the loop itself.
"""

from __future__ import annotations

import logging
import os
import threading
import traceback
from typing import Any

import torch

from zeroray.engine import Comm
from zeroray.train import checkpoint_manager, rendezvous
from zeroray.train.context import RankInfo, Session, TrainContext, set_session
from zeroray.train.errors import WorkerFailure, is_collective_error, is_collective_timeout
from zeroray.train.recovery_point import RecoveryPointReached
from zeroray.train.run_spec import RunSpec


def actor_name(run: str, rank: int) -> str:
    """The Ray actor name, so the dashboard shows who is who."""
    return f"zeroray:{run}:rank-{rank}"


def _log_info_to_stderr() -> None:
    """zeroray's INFO lines in this rank (e.g. what a pretrained load read) go to stderr, which Ray
    forwards to the driver's console, prefixed with the actor's name."""
    log = logging.getLogger("zeroray")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


class RankActor:
    """One rank. Wrapped with ``ray.remote`` by the worker group (kept a plain class for readability)."""

    def __init__(self, run: str, info: RankInfo, use_gpu: bool) -> None:
        self.run, self.info, self.use_gpu = run, info, use_gpu
        self.session: Session | None = None
        self.thread: threading.Thread | None = None
        self.failure: WorkerFailure | None = None
        self.done = False
        self.stopped_at: int | None = None  # the step of the recovery point the loop stopped at
        self.stopped = False
        _log_info_to_stderr()

    def __repr__(self) -> str:  # Ray prefixes the actor's log lines with this
        return actor_name(self.run, self.info.world_rank)

    # ------------------------------------------------------------------ placement and rendezvous
    def node_info(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "ip": rendezvous.node_address(), "pid": os.getpid(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0 publishes where the group meets."""
        return rendezvous.node_address(), rendezvous.free_port()

    def setup(self, master_addr: str, master_port: int, spec: RunSpec, dataset_shards: dict[str, Any],
              batch: Any = None, elastic: bool = False) -> None:
        """Join the process group and build this rank's session. ``batch``: this group's BatchSizes (elastic
        runs); ``elastic``: agree on recovery points at each report."""
        device = torch.device("cuda", 0) if self.use_gpu else torch.device("cpu")
        if self.use_gpu:
            torch.cuda.set_device(device)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU(s)
        report_group = rendezvous.init_process_group(
            master_addr, master_port, self.info, spec.backend, spec.collective_timeout_s
        )
        from zeroray.train.ray_metrics import RankMetrics

        callbacks = []
        try:
            callbacks.append(RankMetrics(spec.name, self.info.world_rank))
        except Exception:  # no metrics agent (e.g. a minimal cluster): training does not depend on it
            pass
        ctx = TrainContext(self.info, spec.name, spec.storage_path, device, spec.run_url, batch=batch)
        self.session = Session(ctx, spec, dataset_shards, Comm(report_group), report_callbacks=callbacks,
                               elastic=elastic)
        if elastic:
            from zeroray.train.recovery_point import RecoveryPointCallback

            callbacks.append(RecoveryPointCallback(self.session))  # last: it may end the loop
        set_session(self.session)

    # ------------------------------------------------------------------ the loop
    def start(self) -> None:
        """Run the user's loop in a thread; ``poll`` tells how it goes."""
        if self.session is None:
            raise RuntimeError("RankActor.start before setup")
        self.thread = threading.Thread(target=self._run, name="zeroray-train-loop", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from zeroray.train.reporting import finish

        session = self.session
        try:
            if self.use_gpu:
                torch.cuda.set_device(session.context.device)  # the current device is per thread
            session.spec.run_loop()
            checkpoint_manager.wait(session)  # join an async save (rank 0: committed) before "done"
            finish(session)
        except RecoveryPointReached as e:
            self.stopped_at, self.stopped = e.step, True
        except BaseException as e:  # noqa: B036 - SystemExit in a loop is a failure too
            self.failure = WorkerFailure(
                rank=self.info.world_rank,
                message=f"{type(e).__name__}: {e}",
                traceback=traceback.format_exc(),
                secondary=is_collective_error(e),
                num_reports=session.num_reports,
                waiting_in=session.waiting_in,
                timed_out=is_collective_timeout(e),
            )
        finally:
            self.done = True

    def poll(self) -> dict[str, Any]:
        """Reports queued since the last poll, and whether the loop ended or failed."""
        done, failure = self.done, self.failure  # read first: every report of a done loop is queued by now
        reports = []
        if self.session is not None:
            q = self.session.reports
            while not q.empty():
                reports.append(q.get_nowait())
        return {"reports": reports, "done": done, "failure": failure, "stopped": self.stopped and done,
                "stopped_at": self.stopped_at}

    def request_recovery_point(self) -> None:
        """A planned resize: stop the loop at the next report, after saving the engine (recovery_point.py)."""
        if self.session is not None:
            self.session.stop_requested = True

    def shutdown(self) -> None:
        """Leave the process group when the loop is not stuck in a collective (else the actor is killed)."""
        set_session(None)
        if self.done:
            rendezvous.destroy_process_group()
