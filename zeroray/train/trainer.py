"""ZeroTrainer: start a ZeRO run the way Ray Train users start a TorchTrainer run.

The constructor checks every argument; ``fit()`` connects to Ray, checks the cluster can hold the group
and the storage path is writable, and only then hands over to the controller. So bad input fails in
the driver with a clear message before any actor starts.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

from zeroray.config.load import ConfigArg, load_config
from zeroray.storage import join_url
from zeroray.train.config import RunConfig, ScalingConfig
from zeroray.train.dataset import validate_datasets
from zeroray.train.result import Result
from zeroray.train.run_spec import RunSpec

logger = logging.getLogger(__name__)


def _takes_config(fn: Callable[..., Any]) -> bool:
    """Whether the loop takes the config argument (0 or 1 positional parameters, as in Ray Train)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    if len(required) > 1 or any(
        p.kind == p.KEYWORD_ONLY and p.default is p.empty for p in params
    ):
        raise ValueError(
            f"train_loop_per_worker must take zero arguments or one (the config), got {fn.__name__}{inspect.signature(fn)}"
        )
    return bool(positional) or any(p.kind == p.VAR_POSITIONAL for p in params)


class ZeroTrainer:
    """Runs ``train_loop_per_worker(config)`` on ``num_workers`` Ray actors, one rank each, with ZeRO."""

    def __init__(
        self,
        train_loop_per_worker: Callable[..., Any],
        *,
        train_loop_config: dict[str, Any] | None = None,
        zero_config: ConfigArg = None,
        scaling_config: ScalingConfig | None = None,
        run_config: RunConfig | None = None,
        datasets: dict[str, Any] | None = None,
    ) -> None:
        if not callable(train_loop_per_worker):
            raise TypeError(
                f"train_loop_per_worker must be a function taking the config, got "
                f"{type(train_loop_per_worker).__name__}"
            )
        self.pass_config = _takes_config(train_loop_per_worker)
        if train_loop_config is not None and not isinstance(train_loop_config, dict):
            raise TypeError(f"train_loop_config must be a dict or None, got {type(train_loop_config).__name__}")
        if train_loop_config is not None and not self.pass_config:
            raise ValueError("train_loop_config was given but train_loop_per_worker takes no argument")
        scaling_config = scaling_config if scaling_config is not None else ScalingConfig()
        run_config = run_config if run_config is not None else RunConfig()
        if not isinstance(scaling_config, ScalingConfig):
            raise TypeError(f"scaling_config must be a zeroray ScalingConfig, got {type(scaling_config).__name__}")
        if not isinstance(run_config, RunConfig):
            raise TypeError(f"run_config must be a zeroray RunConfig, got {type(run_config).__name__}")
        # Checked here, before any actor starts; the ranks get the config as given, so that zt.prepare
        # resolves the HF-style "auto"s that need the model and the optimizer.
        checked = load_config(zero_config, defer=True)
        self.zero_config = zero_config
        # Batch sizes must agree with the world size; checked here, not in the first rank to start.
        if scaling_config.elasticity_enabled:  # a size between min and max must keep the batch rule
            from zeroray.train.sizing import BatchPlan

            self.batch_plan: Any = BatchPlan.from_config(checked, scaling_config)
            self.samples_per_step = self.batch_plan.samples_per_step
        else:
            self.batch_plan = None
            self.samples_per_step = checked.resolve_batch(scaling_config.num_workers).train_batch_size
        self.train_fn = train_loop_per_worker
        self.train_loop_config = train_loop_config
        self.scaling_config, self.run_config = scaling_config, run_config
        self.datasets = validate_datasets(datasets)
        self._controller: Any = None

    def _check_picklable(self) -> None:
        from ray import cloudpickle

        for what, obj in (("train_loop_per_worker", self.train_fn), ("train_loop_config", self.train_loop_config),
                          ("zero_config", self.zero_config)):
            try:
                cloudpickle.dumps(obj)
            except Exception as e:
                raise TypeError(
                    f"{what} cannot be sent to the rank actors (it must be picklable; build models, locks and "
                    f"open files inside the loop): {type(e).__name__}: {e}"
                ) from e

    def _spec(self) -> RunSpec:
        """The run as the controller, the worker group and the ranks see it."""
        sc, rc = self.scaling_config, self.run_config
        return RunSpec(
            name=rc.name,
            run_url=join_url(rc.storage_path, rc.name),
            storage_path=rc.storage_path,
            storage_options=rc.storage_options,
            train_fn=self.train_fn,
            train_loop_config=self.train_loop_config,
            pass_config=self.pass_config,
            zero_config=self.zero_config,
            use_gpu=sc.use_gpu,
            placement_strategy=sc.placement_strategy,
            placement_timeout_s=sc.placement_timeout_s,
            collective_timeout_s=rc.failure_config.collective_timeout_s,
            snapshot_interval=rc.failure_config.snapshot_interval,
            replica_recovery=rc.failure_config.replica_recovery,
            sigterm_grace_s=rc.failure_config.sigterm_grace_s,
            checkpoint_config=rc.checkpoint_config,
            samples_per_step=self.samples_per_step,
            progress_bar=rc.progress_bar,
        )

    def fit(self) -> Result:
        """Run the loop on the group until it ends; return the Result or raise TrainingFailedError.

        Before any actor starts: the loop pickles, the storage is writable and shareable by every rank,
        no other fit() runs this run (its lease), the cluster can hold the group.
        """
        from zeroray.train.driver.cluster import AutoscalerDemand, check_fits, ensure_ray
        from zeroray.train.driver.controller import Controller
        from zeroray.train.driver.failure_policy import FailurePolicy
        from zeroray.train.driver.lease import RunLease
        from zeroray.train.driver.run_dir import RunStorage
        from zeroray.train.driver.scaling_policy import make_scaling_policy

        self._check_picklable()
        rc = self.run_config
        storage = RunStorage(rc.storage_path, rc.name, rc.storage_options)
        storage.validate(processes=self.scaling_config.max_workers + 1)  # every rank, and this driver
        ensure_ray()
        scaling_policy = make_scaling_policy(self.scaling_config, self.batch_plan)
        decision = scaling_policy.decide_for_new_group()
        check_fits(self.scaling_config.min_workers, decision.resources_per_worker)
        lease = RunLease(storage, rc.lease_timeout_s)
        lease.acquire()
        try:
            earlier = storage.open_history()
            if earlier:
                logger.info("zeroray: run %r: appending to %s/metrics.jsonl (%d earlier reports)",
                            rc.name, storage.url, earlier)
            self._controller = Controller(
                spec=self._spec(),
                datasets=self.datasets,
                storage=storage,
                scaling_policy=scaling_policy,
                failure_policy=FailurePolicy(rc.failure_config),
                lease=lease,
                callbacks=list(rc.callbacks),
            )
            if not self.scaling_config.elasticity_enabled:
                return self._controller.run()
            with AutoscalerDemand(self.scaling_config.max_workers, decision.resources_per_worker):
                return self._controller.run()
        finally:
            lease.release()
