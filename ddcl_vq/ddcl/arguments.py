"""DDCLQuantizer's arguments: the allowed values of each choice and the rules of the others.

The defaults live in :class:`~ddcl_vq.DDCLQuantizer`'s signature; what is allowed lives here, as public tuples.
"""
from __future__ import annotations

import numbers
from typing import Any, Callable, Dict, Tuple

from .assignment import IMPLEMENTATIONS as _PATHS

__all__ = ["MODES", "CODEBOOK_INITS", "TEMPERATURE_SCHEDULES", "IMPLEMENTATIONS", "DDCL_CHOICES", "ARGUMENT_RULES",
           "check_arguments"]

MODES = ("soft", "straight_through", "soft_straight_through")
CODEBOOK_INITS = ("uniform", "normal", "kmeans")
#: the order is the index a saved ``schedule`` tensor stores: append, never reorder
TEMPERATURE_SCHEDULES = ("constant", "cosine", "exponential")
IMPLEMENTATIONS = ("auto",) + _PATHS
#: constructor argument -> its allowed values (a training config derives its choices from this)
DDCL_CHOICES: Dict[str, Tuple[str, ...]] = {
    "mode": MODES, "codebook_init": CODEBOOK_INITS, "temperature_schedule": TEMPERATURE_SCHEDULES,
    "implementation": IMPLEMENTATIONS,
}


def _number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


#: (argument, rule, what was expected) for DDCLQuantizer's numeric arguments, checked after the choices
ARGUMENT_RULES: Tuple[Tuple[str, Callable[[Any], bool], str], ...] = (
    ("beta", lambda v: _number(v) and v >= 0, "beta >= 0"),
    ("beta_final", lambda v: v is None or (_number(v) and v >= 0), "beta_final >= 0 or None"),
    ("decay", lambda v: _number(v) and 0 <= v < 1, "0 <= decay < 1"),
    ("revive_threshold", lambda v: _number(v) and 0 <= v < 1, "0 <= revive_threshold < 1"),
    ("chunk_size", lambda v: v is None or (_int(v) and v > 0), "chunk_size to be a positive int or None"),
    ("chunk_threshold_bytes", lambda v: _number(v) and v >= 0, "chunk_threshold_bytes >= 0"),
    ("warmup_steps", lambda v: _int(v) and v >= 0, "warmup_steps, an int >= 0 (0 = none)"),
)


def check_arguments(arguments: Dict[str, Any]) -> None:
    """ValueError for the first of ``arguments`` outside :data:`DDCL_CHOICES` or failing :data:`ARGUMENT_RULES`."""
    for name, allowed in DDCL_CHOICES.items():
        if name in arguments and arguments[name] not in allowed:
            raise ValueError(f"expected {name} in {allowed}, got {arguments[name]!r}")
    for name, rule, expected in ARGUMENT_RULES:
        if name in arguments and not rule(arguments[name]):
            raise ValueError(f"expected {expected}, got {arguments[name]!r}")
