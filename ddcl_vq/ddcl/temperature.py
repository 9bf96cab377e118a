"""The DDCL temperature τ and its schedule (constant, or annealed over training steps): :class:`TemperatureSchedule`,
the part of :class:`~ddcl_vq.DDCLQuantizer` that owns τ, its ``schedule_step`` buffer and their state."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor

from .arguments import TEMPERATURE_SCHEDULES
from ..base import check_finite

__all__ = ["TemperatureSchedule", "scheduled_temperature", "check_temperature"]


def scheduled_temperature(step: int, start: float, final: float, schedule: str, steps: int) -> float:
    """τ after ``step`` of ``steps`` steps: ``"constant"`` (start), ``"cosine"`` or ``"exponential"``
    anneal from ``start`` to ``final``; past ``steps`` it stays at ``final``."""
    if schedule == "constant":
        return start
    frac = min(step, steps) / steps
    if schedule == "cosine":
        return final + (start - final) * 0.5 * (1 + math.cos(math.pi * frac))
    return start * (final / start) ** frac


def check_temperature(value: Any, name: str = "temperature") -> float:
    """``value`` as a float, or ValueError unless it is a finite number > 0."""
    return check_finite(name, value, positive=True)


class TemperatureSchedule:
    """Mixin for a module with a long ``schedule_step`` buffer: τ, its schedule and their state.

    The settings are saved as ``schedule``, one float64 tensor [index in ``TEMPERATURE_SCHEDULES``, start τ,
    final τ, steps] (not a buffer: dtype casts leave it exact)."""

    schedule_step: Tensor

    def set_schedule(self, temperature: float, temperature_final: Optional[float] = None,
                     temperature_schedule: str = "constant", schedule_steps: Optional[int] = None) -> None:
        """Replace the schedule (start τ, final τ, shape, length); the step counter is kept."""
        start = check_temperature(temperature)
        if temperature_schedule not in TEMPERATURE_SCHEDULES:
            raise ValueError(f"expected temperature_schedule in {TEMPERATURE_SCHEDULES}, got {temperature_schedule!r}")
        final, steps = start, schedule_steps
        if temperature_schedule != "constant":
            final = check_temperature(temperature_final, f"temperature_final for a {temperature_schedule} schedule")
            if isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0:
                raise ValueError(f"expected schedule_steps, a positive int, for a {temperature_schedule} "
                                 f"temperature schedule, got {steps!r}")
        self.temperature_start, self.temperature_final = start, final
        self.temperature_schedule, self.schedule_steps = temperature_schedule, steps

    @property
    def temperature(self) -> float:
        """τ now: the schedule's value after ``schedule_step`` steps."""
        if self.temperature_schedule == "constant":
            return self.temperature_start
        return scheduled_temperature(int(self.schedule_step), self.temperature_start, self.temperature_final,
                                     self.temperature_schedule, self.schedule_steps)

    @temperature.setter
    def temperature(self, value: float) -> None:
        # τ becomes constant; the training length stays (other schedules, the commitment ramp, use it)
        self.set_schedule(value, schedule_steps=self.schedule_steps)

    def step(self) -> None:
        """Advance the temperature schedule by one training step."""
        self.schedule_step.add_(1)

    def schedule_tensor(self) -> Tensor:
        """The schedule's settings as saved in the ``state_dict`` (key ``schedule``)."""
        return torch.tensor([TEMPERATURE_SCHEDULES.index(self.temperature_schedule), self.temperature_start,
                             self.temperature_final, self.schedule_steps or 0], dtype=torch.float64)

    def _load_schedule(self, state_dict: Dict[str, Any], prefix: str, unexpected_keys: List[str],
                       error_msgs: List[str]) -> None:
        """Restore the schedule saved under ``prefix + "schedule"`` (if any)."""
        key = prefix + "schedule"
        if key in unexpected_keys:
            unexpected_keys.remove(key)
        if key in state_dict:
            try:
                kind, start, final, steps = state_dict[key].tolist()
                self.set_schedule(start, final, TEMPERATURE_SCHEDULES[int(kind)], int(steps) or None)
            except (ValueError, IndexError, TypeError) as err:
                error_msgs.append(f"{key}: expected [schedule index, start τ, final τ, steps], got "
                                  f"{state_dict[key]!r} ({err})")
