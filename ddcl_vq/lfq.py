"""LFQ (Yu et al. 2023, "Language Model Beats Diffusion": lookup-free quantization) behind ddcl_vq's interface.

The quantizer is vector-quantize-pytorch's ``LFQ`` (imported when this class is built): the feature's log2(K) signs
name one of the K corners of a hypercube; an entropy loss keeps them used.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .base import QuantizerOutput, Quantizer
from .vqp import peer_class, peer_output


class LFQQuantizer(Quantizer):
    """Wraps ``vector_quantize_pytorch.LFQ(dim=D, codebook_size=K, **lfq_kwargs)``; K must be a power of 2.
    The peer runs unchanged; its auxiliary loss (0 in eval mode) is ``loss`` and ``terms["entropy_aux"]``;
    ``codebook`` is every corner projected back to D. Computes in float32."""

    assigns_nearest_code = False  # the index rounds a projection of the input
    term_names = ("entropy_aux",)
    keeps_float64 = False
    peer = "LFQ"  # the vector_quantize_pytorch class that takes the other keyword arguments

    def __init__(self, num_codes: int, dim: int, *, channel_dim: int = 1, **lfq_kwargs: Any):
        super().__init__(num_codes, dim, channel_dim)
        if num_codes < 2 or num_codes & (num_codes - 1):
            raise ValueError(f"expected num_codes a power of 2 >= 2 for LFQ (log2(K) sign bits), got {num_codes}")
        for name in ("channel_first", "num_codebooks", "keep_num_codebooks_dim"):
            if name in lfq_kwargs:
                raise ValueError(f"expected no {name} option (one index per vector, layout set by channel_dim), "
                                 f"got {name}={lfq_kwargs[name]!r}")
        LFQ = peer_class(self.peer, "lfq")
        self.lfq_kwargs = dict(lfq_kwargs)
        self.lfq = LFQ(dim=dim, codebook_size=num_codes, **lfq_kwargs)

    @property
    def codebook(self) -> Tensor:
        """(K, D): every corner of the hypercube, projected back to D."""
        device = self.lfq.mask.device
        with torch.autocast(device_type=device.type, enabled=False):
            return self.lfq.indices_to_codes(torch.arange(self.num_codes, device=device))

    def quantize(self, x: Tensor) -> QuantizerOutput:
        quantized, indices, loss = self.lfq(x.unsqueeze(0))
        return peer_output(quantized, indices, loss.float(), "entropy_aux")

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", lfq_kwargs={self.lfq_kwargs}" if self.lfq_kwargs else "")
