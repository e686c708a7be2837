"""fp16 loss scaling, DeepSpeed's dynamic rule: halve on overflow (after ``hysteresis`` overflows),
double after ``loss_scale_window`` clean steps, never below ``min_loss_scale``.

Overflow is agreed by all ranks before this is told about it, so every rank skips the same steps.
"""

from __future__ import annotations

from zeroray.config import ZeroConfig


class LossScaler:
    def __init__(self, config: ZeroConfig):
        ls = config.loss_scaling
        self.dynamic = config.precision.loss_scaling and ls.loss_scale == 0
        if not config.precision.loss_scaling:
            self.scale = 1.0
        else:
            self.scale = ls.loss_scale if ls.loss_scale > 0 else float(2**ls.initial_scale_power)
        self.window = ls.loss_scale_window
        self.min_scale = ls.min_loss_scale
        self.hysteresis = ls.hysteresis
        self.cur_hysteresis = ls.hysteresis
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
