"""The DDCL options every adapter accepts: :class:`DDCLOptions`, :class:`~ddcl_vq.DDCLQuantizer`'s keyword arguments
and defaults (read from its signature) but for what the host sets."""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Dict, Mapping, Optional

from ..ddcl import DDCLQuantizer

# set by the adapter from the host quantizer, not options
HOST_ARGUMENTS = ("num_codes", "dim", "channel_dim")


def _option_fields():
    params = inspect.signature(DDCLQuantizer.__init__).parameters.values()  # self, *args, **kwargs: no default
    return [(p.name, Any, dataclasses.field(default=p.default)) for p in params
            if p.default is not p.empty and p.name not in HOST_ARGUMENTS]


def _from_kwargs(cls, options: Mapping[str, Any], *, beta: Optional[float] = None,
                 beta_name: str = "beta") -> "DDCLOptions":
    """Validated options from keyword arguments (unknown names: ValueError). ``beta``: the commitment weight from the
    host's own argument ``beta_name`` (not also in ``options``)."""
    unknown = sorted(set(options) - set(DDCL_OPTIONS))
    if unknown:
        raise ValueError(f"expected DDCL options among {DDCL_OPTIONS}, got unknown {unknown}")
    values = dict(options)
    if beta is not None:
        if "beta" in values:
            raise ValueError(f"expected the commitment weight once, as {beta_name}=..., got beta={values['beta']!r} "
                             "as well")
        values["beta"] = float(beta)
    return cls(**values)


def _as_kwargs(self) -> Dict[str, Any]:
    """The options as ``DDCLQuantizer`` keyword arguments."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def _build(self, num_codes: int, dim: int, channel_dim: int) -> DDCLQuantizer:
    """A ``DDCLQuantizer(num_codes, dim, channel_dim=channel_dim, **options)``."""
    return DDCLQuantizer(num_codes, dim, channel_dim=channel_dim, **self.as_kwargs())


DDCLOptions = dataclasses.make_dataclass(
    "DDCLOptions", _option_fields(),
    namespace={"from_kwargs": classmethod(_from_kwargs), "as_kwargs": _as_kwargs, "build": _build,
               "__doc__": "The DDCL options shared by every adapter and :func:`~ddcl_vq.swap_quantizer`: "
                          "DDCLQuantizer's keyword arguments and defaults (temperature, mode, beta, "
                          "codebook_init, implementation, chunk_size, ...), all but num_codes, dim and "
                          "channel_dim, which come from the host."})
DDCLOptions.__module__ = __name__

DDCL_OPTIONS = tuple(f.name for f in dataclasses.fields(DDCLOptions))

