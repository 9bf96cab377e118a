"""DDCLQuantizer's arguments: the allowed values of each choice and the rules of the others.

The defaults live in one place, :class:`~ddcl_vq.DDCLQuantizer`'s signature; what is allowed lives
here, as public tuples (and :data:`DDCL_CHOICES`, argument -> allowed values) that a training
config or a command line can derive its choices from.
"""
from __future__ import annotations

import numbers
from typing import Any, Callable, Dict, Tuple

from .assignment import IMPLEMENTATIONS as _PATHS

__all__ = ["MODES", "CODEBOOK_UPDATES", "CODEBOOK_INITS", "TEMPERATURE_REFERENCES", "TEMPERATURE_SCHEDULES",
           "ENCODER_GRADIENTS", "REVIVE_CRITERIA", "IMPLEMENTATIONS", "DDCL_CHOICES", "ARGUMENT_RULES",
           "check_arguments"]

MODES = ("soft", "straight_through", "soft_straight_through")
CODEBOOK_UPDATES = ("mstep", "gradient")
CODEBOOK_INITS = ("uniform", "normal", "kmeans")
TEMPERATURE_REFERENCES = ("data", "dim")
#: the order is the index a saved ``schedule`` tensor stores: append, never reorder
TEMPERATURE_SCHEDULES = ("constant", "cosine", "exponential")
ENCODER_GRADIENTS = ("identity", "rotation")
REVIVE_CRITERIA = ("usage", "mass")
IMPLEMENTATIONS = ("auto",) + _PATHS
#: constructor argument -> its allowed values (a training config derives its choices from this)
DDCL_CHOICES: Dict[str, Tuple[str, ...]] = {
    "mode": MODES, "codebook_update": CODEBOOK_UPDATES, "codebook_init": CODEBOOK_INITS,
    "temperature_reference": TEMPERATURE_REFERENCES, "temperature_schedule": TEMPERATURE_SCHEDULES,
    "encoder_gradient": ENCODER_GRADIENTS, "revive_criterion": REVIVE_CRITERIA, "implementation": IMPLEMENTATIONS,
}


def _number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


#: (argument, rule, what was expected) for DDCLQuantizer's numeric arguments, checked in order
#: after the choices (the temperature and its schedule: :meth:`DDCLQuantizer.set_schedule`)
ARGUMENT_RULES: Tuple[Tuple[str, Callable[[Any], bool], str], ...] = (
    ("beta", lambda v: _number(v) and v >= 0, "beta >= 0"),
    ("beta_final", lambda v: v is None or (_number(v) and v >= 0), "beta_final >= 0 or None"),
    ("decay", lambda v: _number(v) and 0 <= v < 1, "0 <= decay < 1"),
    ("revive_threshold", lambda v: _number(v) and 0 <= v < 1, "0 <= revive_threshold < 1"),
    ("revive_twins", lambda v: isinstance(v, bool), "revive_twins, a bool"),
    ("chunk_size", lambda v: v is None or (_int(v) and v > 0), "chunk_size to be a positive int or None"),
    ("chunk_threshold_bytes", lambda v: _number(v) and v >= 0, "chunk_threshold_bytes >= 0"),
    ("restart_step", lambda v: _int(v) and v >= 0, "restart_step, an int >= 0 (0 = never)"),
    ("warmup_steps", lambda v: _int(v) and v >= 0, "warmup_steps, an int >= 0 (0 = none)"),
)


def check_arguments(arguments: Dict[str, Any]) -> None:
    """Raise ValueError, saying what was expected and what came, for the first argument in
    ``arguments`` (name -> value) outside :data:`DDCL_CHOICES` or failing :data:`ARGUMENT_RULES`."""
    for name, allowed in DDCL_CHOICES.items():
        if name in arguments and arguments[name] not in allowed:
            raise ValueError(f"expected {name} in {allowed}, got {arguments[name]!r}")
    for name, rule, expected in ARGUMENT_RULES:
        if name in arguments and not rule(arguments[name]):
            raise ValueError(f"expected {expected}, got {arguments[name]!r}")
