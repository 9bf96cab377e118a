"""FSQ (Mentzer et al. 2023, "Finite Scalar Quantization: VQ-VAE Made Simple") behind ddcl_vq's interface.

The quantizer is vector-quantize-pytorch's ``FSQ`` (an optional dependency, imported only when
this class is built). FSQ has no codebook to learn: a linear map takes the D-dimensional feature
to len(levels) numbers, each is bounded and rounded to one of levels[i] values, and a linear map
takes the rounded vector back to D. The codes are the points of that grid, prod(levels) of them.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .base import QuantizerOutput, Quantizer, batch_perplexity, flatten, unflatten
from .vqp import peer_class

#: the FSQ paper's recommended levels per target codebook size (its Table 1)
FSQ_LEVELS: Dict[int, Tuple[int, ...]] = {
    2 ** 8: (8, 6, 5),
    2 ** 10: (8, 5, 5, 5),
    2 ** 12: (7, 5, 5, 5, 5),
    2 ** 14: (8, 8, 8, 6, 5),
    2 ** 16: (8, 8, 8, 5, 5, 5),
}


def fsq_levels(num_codes: int) -> Tuple[Tuple[int, ...], bool]:
    """(levels, exact) for a target codebook size K: the paper's entry for K when it has one
    (exact=True), else the entry whose grid size prod(levels) is closest to K (exact=False; ties go
    to the smaller grid)."""
    if num_codes in FSQ_LEVELS:
        return FSQ_LEVELS[num_codes], True
    best = min(FSQ_LEVELS.values(), key=lambda lv: (abs(math.prod(lv) - num_codes), math.prod(lv)))
    return best, False


class FSQQuantizer(Quantizer):
    """Wraps ``vector_quantize_pytorch.FSQ(levels, dim, **fsq_kwargs)``.

    Args:
        num_codes: the target codebook size K; without ``levels`` the grid is taken from the FSQ
            paper's table (:data:`FSQ_LEVELS`: 256 -> [8, 6, 5], 1024 -> [8, 5, 5, 5], 4096 ->
            [7, 5, 5, 5, 5], 16384 -> [8, 8, 8, 6, 5], 65536 -> [8, 8, 8, 5, 5, 5]); another K takes the
            entry whose grid size is closest to it, with a warning that says which.
        levels: the grid explicitly (each level an int >= 3; 2 needs the peer's ``preserve_symmetry``).
        **fsq_kwargs: any other keyword argument of ``FSQ`` (``preserve_symmetry``, ``noise_dropout``, ...).

    ``num_codes`` of the built quantizer is the grid's real size prod(levels) (what indices range
    over, what utilization and dead codes are counted against); ``requested_codes`` keeps K.
    ``codebook`` is the grid projected back to D (FSQ's ``indices_to_codes``), so ``lookup(indices)``
    gives the codes the decoder sees. ``loss`` is 0 (FSQ has no auxiliary loss; the projections learn
    from the task loss through the rounding's straight-through gradient). No state beyond the
    projections' weights: under torch.distributed nothing is shared but gradients.
    Computes in float32 whatever the input's dtype (autocast off), returns the input's dtype.
    """

    assigns_nearest_code = False  # the index rounds a projection of the input

    def __init__(self, num_codes: int, dim: int, *, levels: Optional[Sequence[int]] = None, channel_dim: int = 1,
                 **fsq_kwargs: Any):
        if not isinstance(num_codes, int) or isinstance(num_codes, bool) or num_codes <= 0:
            raise ValueError(f"expected num_codes to be a positive int, got {num_codes!r}")
        if levels is None:
            chosen, exact = fsq_levels(num_codes)
            if not exact:
                size = math.prod(chosen)
                ratio = (f" ({size / num_codes:.3g}x the {num_codes} asked for)"
                         if not 0.5 <= size / num_codes <= 2 else "")
                warnings.warn(f"FSQ: K = {num_codes} is not in the FSQ paper's table of levels (K = "
                              f"{', '.join(map(str, FSQ_LEVELS))}); using the entry whose grid size is nearest, "
                              f"{list(chosen)} = {size} codes{ratio}; pass levels (quantizer.fsq_levels in a "
                              "config) to choose the grid", stacklevel=2)
            levels = chosen
        levels = list(levels)
        min_level = 2 if fsq_kwargs.get("preserve_symmetry") else 3
        if not levels or any(not isinstance(lv, int) or isinstance(lv, bool) or lv < min_level for lv in levels):
            raise ValueError(f"expected FSQ levels as a non-empty list of ints >= {min_level}, got {levels!r}")
        super().__init__(math.prod(levels), dim, channel_dim)
        FSQ = peer_class("FSQ", "fsq")
        self.requested_codes = num_codes
        self.levels = levels
        self.fsq_kwargs = dict(fsq_kwargs)
        if self.fsq_kwargs.get("num_codebooks", 1) != 1:
            raise ValueError(f"expected num_codebooks 1 (one index per vector), got {self.fsq_kwargs['num_codebooks']!r}")
        if torch.empty(0).device.type == "meta":  # built for shapes only (a memory estimate): FSQ's
            with torch.device("cpu"):             # constructor reads values (.item()), so build it on
                self.fsq = FSQ(levels=levels, dim=dim, **fsq_kwargs).to("meta")  # the CPU, then move it
        else:
            self.fsq = FSQ(levels=levels, dim=dim, **fsq_kwargs)

    @property
    def codebook(self) -> Tensor:
        """(prod(levels), D): every grid point, projected back to D."""
        with torch.autocast(device_type=self.fsq.implicit_codebook.device.type, enabled=False):
            indices = torch.arange(self.num_codes, device=self.fsq.implicit_codebook.device)
            return self.fsq.indices_to_codes(indices)

    def forward(self, z: Tensor) -> QuantizerOutput:
        flat, last_shape = flatten(z, self.dim, self.channel_dim)
        if flat.shape[0] == 0:  # an empty batch: nothing to quantize, nothing learned
            return self.empty_output(flat, last_shape, ())
        with torch.autocast(device_type=z.device.type, enabled=False):
            quantized, indices = self.fsq(flat.float().unsqueeze(0))
        indices = indices.reshape(-1).long()
        loss = quantized.new_zeros(())
        return QuantizerOutput(
            quantized=unflatten(quantized.reshape(-1, self.dim).to(z.dtype), last_shape, self.channel_dim),
            indices=unflatten(indices, last_shape, self.channel_dim), loss=loss, terms={},
            perplexity=batch_perplexity(indices, self.num_codes))

    def describe(self) -> Dict[str, Any]:
        return {"levels": list(self.levels), "requested_codes": self.requested_codes}

    def extra_repr(self) -> str:
        return super().extra_repr() + f", levels={self.levels}, requested_codes={self.requested_codes}" + (
            f", fsq_kwargs={self.fsq_kwargs}" if self.fsq_kwargs else "")
