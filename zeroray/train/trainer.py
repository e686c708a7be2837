"""ZeroTrainer: start a ZeRO run the way Ray Train users start a TorchTrainer run.

The constructor checks every argument; ``fit()`` connects to Ray, checks the cluster can hold the group
and the storage path is writable, and only then hands over to the controller. So bad input fails in
the driver with a clear message before any actor starts.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from zeroray.config import ZeroConfig
from zeroray.train.config import RunConfig, ScalingConfig
from zeroray.train.dataset import validate_datasets
from zeroray.train.result import Result


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
        zero_config: ZeroConfig | dict[str, Any] | str | None = None,
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
        self.zero_config = ZeroConfig.coerce(zero_config)
        # Batch sizes must agree with the world size; checked here, not in the first rank to start.
        self.samples_per_step = self.zero_config.resolve_batch(scaling_config.num_workers).train_batch_size
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

    def fit(self) -> Result:
        """Run the loop on the group until it ends; return the Result or raise TrainingFailedError."""
        from zeroray.train.cluster import check_fits, ensure_ray
        from zeroray.train.controller import Controller
        from zeroray.train.failure_policy import FailurePolicy
        from zeroray.train.scaling_policy import FixedScalingPolicy
        from zeroray.train.storage import RunStorage

        self._check_picklable()
        storage = RunStorage(self.run_config.storage_path, self.run_config.name, self.run_config.storage_options)
        storage.validate()
        ensure_ray()
        scaling_policy = FixedScalingPolicy(self.scaling_config)
        decision = scaling_policy.decide_for_new_group()
        check_fits(decision.num_workers, decision.resources_per_worker)
        self._controller = Controller(
            train_fn=self.train_fn,
            train_loop_config=self.train_loop_config,
            pass_config=self.pass_config,
            zero_config=self.zero_config,
            scaling_config=self.scaling_config,
            run_config=self.run_config,
            datasets=self.datasets,
            storage=storage,
            scaling_policy=scaling_policy,
            failure_policy=FailurePolicy(self.run_config.failure_config),
            samples_per_step=self.samples_per_step,
        )
        return self._controller.run()
