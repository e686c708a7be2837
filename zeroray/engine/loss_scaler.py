"""fp16 loss scaling, DeepSpeed's dynamic rule: halve on overflow (after ``hysteresis`` overflows),
double after ``loss_scale_window`` clean steps, never below ``min_loss_scale``.

Overflow is agreed by all ranks before this is told about it, so every rank skips the same steps.
"""

from __future__ import annotations

from zeroray.config import ZeroConfig


class LossScaler:
    def __init__(self, config: ZeroConfig):
        self.dynamic = config.precision == "fp16" and config.loss_scale == 0
        if config.precision != "fp16":
            self.scale = 1.0
        else:
            self.scale = config.loss_scale if config.loss_scale > 0 else float(2**config.initial_scale_power)
        self.window = config.loss_scale_window
        self.min_scale = config.min_loss_scale
        self.hysteresis = config.hysteresis
        self.cur_hysteresis = config.hysteresis
        self.good_steps = 0

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self.good_steps = 0
            if self.cur_hysteresis <= 1:
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            return
        self.good_steps += 1
        if self.good_steps % self.window == 0:
            self.scale *= 2
            self.cur_hysteresis = self.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "cur_hysteresis": self.cur_hysteresis, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.cur_hysteresis = int(state["cur_hysteresis"])
        self.good_steps = int(state["good_steps"])
