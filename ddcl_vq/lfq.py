"""LFQ (Yu et al. 2023, "Language Model Beats Diffusion": lookup-free quantization) behind ddcl_vq's interface.

The quantizer is vector-quantize-pytorch's ``LFQ`` (an optional dependency, imported only when
this class is built): a linear map takes the D-dimensional feature to log2(K) numbers, each is
replaced by its sign (±1), and a linear map takes the sign vector back to D; the codes are the K
corners of the hypercube. An entropy loss (low per-vector entropy, high batch entropy) keeps them used.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .base import QuantizerOutput, Quantizer, flatten
from .vqp import peer_class, peer_output


class LFQQuantizer(Quantizer):
    """Wraps ``vector_quantize_pytorch.LFQ(dim=D, codebook_size=K, **lfq_kwargs)``; K must be a power of 2.

    The peer runs unchanged (its defaults: entropy loss weight 0.1, no commitment loss); its
    auxiliary loss is ``loss`` and ``terms["entropy_aux"]`` (0 in eval mode, as the peer returns
    it). ``codebook`` is every corner projected back to D (LFQ's ``indices_to_codes``), so
    ``lookup(indices)`` gives the codes the decoder sees. The peer averages its batch entropy over
    processes under torch.distributed (its ``maybe_distributed_mean``); nothing else is shared but
    gradients. Computes in float32 whatever the input's dtype (autocast off), returns the input's dtype.
    """

    assigns_nearest_code = False  # the index rounds a projection of the input

    def __init__(self, num_codes: int, dim: int, *, channel_dim: int = 1, **lfq_kwargs: Any):
        super().__init__(num_codes, dim, channel_dim)
        if num_codes < 2 or num_codes & (num_codes - 1):
            raise ValueError(f"expected num_codes a power of 2 >= 2 for LFQ (log2(K) sign bits), got {num_codes}")
        for name in ("channel_first", "num_codebooks", "keep_num_codebooks_dim"):
            if name in lfq_kwargs:
                raise ValueError(f"expected no {name} option (one index per vector, layout set by channel_dim), "
                                 f"got {name}={lfq_kwargs[name]!r}")
        LFQ = peer_class("LFQ", "lfq")
        self.lfq_kwargs = dict(lfq_kwargs)
        self.lfq = LFQ(dim=dim, codebook_size=num_codes, **lfq_kwargs)

    @property
    def codebook(self) -> Tensor:
        """(K, D): every corner of the hypercube, projected back to D."""
        device = self.lfq.mask.device
        with torch.autocast(device_type=device.type, enabled=False):
            return self.lfq.indices_to_codes(torch.arange(self.num_codes, device=device))

    def forward(self, z: Tensor) -> QuantizerOutput:
        flat, last_shape = flatten(z, self.dim, self.channel_dim)
        if flat.shape[0] == 0:  # an empty batch: nothing to quantize, nothing learned
            return self.empty_output(flat, last_shape, ("entropy_aux",))
        with torch.autocast(device_type=z.device.type, enabled=False):
            quantized, indices, loss = self.lfq(flat.float().unsqueeze(0))
        return peer_output(self, z, last_shape, quantized, indices, loss.float(), "entropy_aux")

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", lfq_kwargs={self.lfq_kwargs}" if self.lfq_kwargs else "")
