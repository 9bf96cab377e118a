"""What :class:`~ddcl_vq.ddcl.residual.ResidualDDCL` and :class:`~ddcl_vq.ddcl.grouped.GroupedDDCL` share: a
:class:`~ddcl_vq.Quantizer` made of several :class:`~ddcl_vq.DDCLQuantizer` (one per level or group, each used
through its public interface), indices with one trailing entry per codebook, the checks of their arguments and
of ``lookup``'s indices, and the output in the input's layout."""
from __future__ import annotations

import inspect
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from einops import rearrange
from torch import Tensor, nn

from ..base import QuantizerOutput, Quantizer, batch_perplexity, compute_dtype, flatten, unflatten
from .quantizer import DDCLQuantizer

__all__ = ["MultiCodebookDDCL", "DDCL_LEVEL_OPTIONS", "check_ddcl_options"]

#: the DDCLQuantizer keyword arguments a level or group takes (all but what the container sets)
DDCL_LEVEL_OPTIONS = tuple(name for name, p in inspect.signature(DDCLQuantizer.__init__).parameters.items()
                           if p.default is not p.empty and name != "channel_dim")


def check_ddcl_options(owner: str, options: Dict[str, Any]) -> None:
    """ValueError naming the unknown ones among ``options`` (DDCLQuantizer checks the values)."""
    unknown = sorted(set(options) - set(DDCL_LEVEL_OPTIONS))
    if unknown:
        raise ValueError(f"expected {owner} options among {DDCL_LEVEL_OPTIONS}, got unknown {unknown}")


class MultiCodebookDDCL(Quantizer):
    """Base of the multi-codebook DDCL quantizers: ``quantizers`` (an ``nn.ModuleList`` of DDCLQuantizer, channel-last
    (N, d) inputs), ``num_codebooks`` trailing index entries. Subclasses implement ``_quantize(x, z)`` on the (N, D)
    matrix and ``_lookup_codes(indices)``."""

    has_soft_codes = True
    #: the keyword arguments ``**ddcl_options`` hands to every level's or group's DDCLQuantizer
    level_options: Tuple[str, ...] = DDCL_LEVEL_OPTIONS
    quantizers: nn.ModuleList
    num_codebooks: int
    #: what one trailing index entry is called in messages and ``terms`` ("level", "group")
    part_name = "codebook"
    #: True when ``lookup`` decodes any prefix (..., C') of the indices, C' ≤ C (a residual chain's first levels)
    decodes_prefixes = False

    def forward(self, z: Tensor) -> QuantizerOutput:
        return self.forward_parts(z)[0]

    def forward_parts(self, z: Tensor, **options: Any) -> Tuple[QuantizerOutput, Tensor]:
        """``forward(z)``'s output and the (C,) losses of the codebooks (with their graph; ``loss`` is their sum, or
        for :class:`GroupedDDCL` their mean): what a host reporting one loss per codebook returns."""
        flat, last_shape = flatten(z, self.dim, self.channel_dim)
        if flat.shape[0] == 0:
            out = self._empty(flat, last_shape)
            return out, out.loss.expand(self.num_codebooks)
        with torch.autocast(device_type=z.device.type, enabled=False):
            out, part_losses = self._quantize(flat.to(compute_dtype(flat)), z, **options)
        index_shape = last_shape[:-1] + (self.num_codebooks,)
        out.quantized = unflatten(out.quantized.to(z.dtype), last_shape, self.channel_dim)
        out.indices = out.indices.reshape(index_shape)
        if out.soft_codes is not None:
            out.soft_codes = unflatten(out.soft_codes.to(z.dtype), last_shape, self.channel_dim)
        return out, part_losses

    def _quantize(self, x: Tensor, z: Tensor) -> Tuple[QuantizerOutput, Tensor]:  # (N, D); z: the input
        raise NotImplementedError

    def _empty(self, flat: Tensor, last_shape: Tuple[int, ...]) -> QuantizerOutput:
        out = self.empty_output(flat, last_shape)
        out.indices = out.indices.reshape(last_shape[:-1] + (self.num_codebooks,))
        out.soft_counts = flat.new_zeros(self.num_codebooks, self.num_codes, dtype=compute_dtype(flat))
        return out

    @property
    def term_names(self) -> Tuple[str, ...]:  # type: ignore[override]
        names = self.quantizers[0].term_names
        return tuple(f"{self.part_name}{i}_{n}" for i in range(self.num_codebooks) for n in names) + names

    def _gather(self, parts: Sequence[Optional[QuantizerOutput]], indices: Tensor) -> Tuple[Dict[str, Tensor], Tensor]:
        """The ``terms`` (each part's, prefixed, and their sums) and the mean batch perplexity over the parts that
        ran (None: a part with no vectors this batch, its terms zeros)."""
        names = self.quantizers[0].term_names
        terms: Dict[str, Tensor] = {}
        totals: Dict[str, Tensor] = {}
        zero = indices.new_zeros((), dtype=torch.float32)
        perplexities: List[Tensor] = []
        for i, out in enumerate(parts):
            for name in names:
                value = out.terms[name] if out is not None and name in out.terms else None
                if value is None and out is not None:
                    continue  # a term the quantizer left out of this training step (report_terms=False)
                value = zero if value is None else value
                terms[f"{self.part_name}{i}_{name}"] = value
                totals[name] = value if name not in totals else totals[name] + value.to(totals[name].dtype)
            if out is not None:
                perplexities.append(batch_perplexity(indices[:, i][indices[:, i] >= 0], self.num_codes))
        terms.update(totals)
        perplexity = torch.stack(perplexities).mean() if perplexities else zero
        return terms, perplexity

    # ------------------------------------------------------------------ indices -> codes
    def _check_indices(self, indices: Tensor, allow_prefix: bool, allow_dropped: bool) -> None:
        if not isinstance(indices, Tensor) or indices.is_floating_point() or indices.is_complex():
            got = indices.dtype if isinstance(indices, Tensor) else type(indices).__name__
            raise ValueError(f"expected an integer index tensor, got {got}")
        count = indices.shape[-1] if indices.dim() else 0
        ok = 1 <= count <= self.num_codebooks if allow_prefix else count == self.num_codebooks
        if not ok:
            want = (f"(..., L') with 1 <= L' <= {self.num_codebooks}" if allow_prefix
                    else f"(..., {self.num_codebooks})")
            raise ValueError(f"expected indices of shape {want}, one entry per {self.part_name}, got shape "
                             f"{tuple(indices.shape)}")
        low = -1 if allow_dropped else 0
        if indices.numel() and (int(indices.min()) < low or int(indices.max()) >= self.num_codes):
            extra = " (-1: a level left out by quantizer dropout)" if allow_dropped else ""
            raise ValueError(f"expected indices in [{low}, {self.num_codes - 1}]{extra}, got values in "
                             f"[{int(indices.min())}, {int(indices.max())}]")

    def _layout(self, codes: Tensor) -> Tensor:
        """(*idx, D) codes -> the input layout, as :meth:`Quantizer.lookup` lays them out."""
        return rearrange(codes, "b ... d -> b d ...") if self.channel_dim == 1 and codes.dim() > 2 else codes

    # ------------------------------------------------------------------ hooks
    def step(self) -> None:
        """Advance every codebook's schedules (temperature, commitment ramp) by one training step."""
        for q in self.quantizers:
            q.step()

    def log_stats(self) -> Dict[str, float]:
        """Each DDCL codebook's :meth:`~ddcl_vq.DDCLQuantizer.log_stats`, prefixed (``level0_temperature``, ...)."""
        prefix = self.part_name if len(self.quantizers) > 1 else "shared"
        return {f"{prefix}{i if len(self.quantizers) > 1 else ''}_{k}": v
                for i, q in enumerate(self.quantizers) for k, v in q.log_stats().items()}

    @property
    def mode(self) -> str:
        return self.quantizers[0].mode

    @property
    def temperature(self) -> float:
        return self.quantizers[0].temperature
