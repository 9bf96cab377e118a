"""FSQ (Mentzer et al. 2023, "Finite Scalar Quantization: VQ-VAE Made Simple") behind ddcl_vq's interface.

The quantizer is vector-quantize-pytorch's ``FSQ`` (imported when this class is built): a linear map takes the
feature to len(levels) numbers, each rounded to one of levels[i] values, and a linear map takes them back to D.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .base import QuantizerOutput, Quantizer, check_positive_int
from .vqp import peer_class

#: the FSQ paper's recommended levels per target codebook size (its Table 1)
FSQ_LEVELS: Dict[int, Tuple[int, ...]] = {2 ** 8: (8, 6, 5), 2 ** 10: (8, 5, 5, 5), 2 ** 12: (7, 5, 5, 5, 5),
                                          2 ** 14: (8, 8, 8, 6, 5), 2 ** 16: (8, 8, 8, 5, 5, 5)}


def fsq_levels(num_codes: int) -> Tuple[Tuple[int, ...], bool]:
    """(levels, exact) for a target codebook size K: the paper's entry for K, else the nearest grid size's."""
    if num_codes in FSQ_LEVELS:
        return FSQ_LEVELS[num_codes], True
    best = min(FSQ_LEVELS.values(), key=lambda lv: (abs(math.prod(lv) - num_codes), math.prod(lv)))
    return best, False


class FSQQuantizer(Quantizer):
    """Wraps ``vector_quantize_pytorch.FSQ(levels, dim, **fsq_kwargs)``.

    Args:
        num_codes: the target codebook size K; without ``levels`` the grid is the FSQ paper's entry
            (:data:`FSQ_LEVELS`), or the nearest one with a warning.
        levels: the grid explicitly (each level an int >= 3; 2 needs the peer's ``preserve_symmetry``).
        **fsq_kwargs: any other keyword argument of ``FSQ`` (``preserve_symmetry``, ``noise_dropout``, ...).

    ``num_codes`` is prod(levels) (``requested_codes`` keeps K); ``codebook`` is the grid projected back to D;
    ``loss`` is 0. Computes in float32.
    """

    assigns_nearest_code = False  # the index rounds a projection of the input
    keeps_float64 = False
    peer = "FSQ"  # the vector_quantize_pytorch class that takes the other keyword arguments

    def __init__(self, num_codes: int, dim: int, *, levels: Optional[Sequence[int]] = None, channel_dim: int = 1,
                 **fsq_kwargs: Any):
        check_positive_int("num_codes", num_codes)
        if levels is None:
            chosen, exact = fsq_levels(num_codes)
            if not exact:
                size = math.prod(chosen)
                ratio = (f" ({size / num_codes:.3g}x the {num_codes} asked for)"
                         if not 0.5 <= size / num_codes <= 2 else "")
                warnings.warn(f"FSQ: K = {num_codes} is not in the FSQ paper's table of levels (K = "
                              f"{', '.join(map(str, FSQ_LEVELS))}); using the entry whose grid size is nearest, "
                              f"{list(chosen)} = {size} codes{ratio}; pass levels (quantizer.levels in a "
                              "config) to choose the grid", stacklevel=2)
            levels = chosen
        levels = list(levels)
        min_level = 2 if fsq_kwargs.get("preserve_symmetry") else 3
        if not levels or any(not isinstance(lv, int) or isinstance(lv, bool) or lv < min_level for lv in levels):
            raise ValueError(f"expected FSQ levels as a non-empty list of ints >= {min_level}, got {levels!r}")
        super().__init__(math.prod(levels), dim, channel_dim)
        FSQ = peer_class(self.peer, "fsq")
        self.requested_codes = num_codes
        self.levels = levels
        self.fsq_kwargs = dict(fsq_kwargs)
        if self.fsq_kwargs.get("num_codebooks", 1) != 1:
            raise ValueError(f"expected num_codebooks 1 (one index per vector), got "
                             f"{self.fsq_kwargs['num_codebooks']!r}")
        if torch.empty(0).device.type == "meta":  # FSQ's constructor reads values: build on the CPU, then move
            with torch.device("cpu"):
                self.fsq = FSQ(levels=levels, dim=dim, **fsq_kwargs).to("meta")
        else:
            self.fsq = FSQ(levels=levels, dim=dim, **fsq_kwargs)

    @property
    def codebook(self) -> Tensor:
        """(prod(levels), D): every grid point, projected back to D."""
        with torch.autocast(device_type=self.fsq.implicit_codebook.device.type, enabled=False):
            indices = torch.arange(self.num_codes, device=self.fsq.implicit_codebook.device)
            return self.fsq.indices_to_codes(indices)

    def quantize(self, x: Tensor) -> QuantizerOutput:
        quantized, indices = self.fsq(x.unsqueeze(0))
        return QuantizerOutput(quantized, indices, quantized.new_zeros(()), {})

    def describe(self) -> Dict[str, Any]:
        return {"levels": list(self.levels), "requested_codes": self.requested_codes}

    def extra_repr(self) -> str:
        return super().extra_repr() + f", levels={self.levels}, requested_codes={self.requested_codes}" + (
            f", fsq_kwargs={self.fsq_kwargs}" if self.fsq_kwargs else "")
