"""The real peer: vector-quantize-pytorch's ``VectorQuantize`` behind ddcl_vq's interface.

vector-quantize-pytorch is an optional dependency (``pip install vector-quantize-pytorch``,
included in the ``dev`` extra); it is imported only when this class is built.
"""
from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import Tensor

from .base import QuantizerOutput, Quantizer, batch_perplexity, flatten, unflatten


def peer_class(name: str, qtype: str) -> type:
    """``vector_quantize_pytorch.<name>``, imported now (the package is an optional dependency:
    ddcl_vq imports without it); a missing package is an ImportError saying how to install it."""
    try:
        module = importlib.import_module("vector_quantize_pytorch")
    except ImportError as err:  # pragma: no cover - exercised only without the package
        raise ImportError(
            f"quantizer type {qtype!r} needs the vector-quantize-pytorch package: "
            "pip install vector-quantize-pytorch (or install ddcl-vq with the 'dev' extra)") from err
    return getattr(module, name)


def peer_output(quantizer: Quantizer, z: Tensor, last_shape, quantized: Tensor, indices: Tensor, loss: Tensor,
                term: str) -> QuantizerOutput:
    """A vector-quantize-pytorch module's ``(quantized (1, N, D), indices, loss)`` as the common output, in
    ``z``'s layout and dtype; the peer's loss (a scalar or one per codebook, summed) is ``terms[term]``."""
    indices = indices.reshape(-1).long()
    loss = loss.reshape(()) if loss.numel() == 1 else loss.sum()
    return QuantizerOutput(
        quantized=unflatten(quantized.reshape(-1, quantizer.dim).to(z.dtype), last_shape, quantizer.channel_dim),
        indices=unflatten(indices, last_shape, quantizer.channel_dim), loss=loss,
        terms={term: loss.detach()},
        perplexity=batch_perplexity(indices, quantizer.num_codes))


class VQPQuantizer(Quantizer):
    """Wraps ``vector_quantize_pytorch.VectorQuantize(dim, codebook_size, **vq_kwargs)``.

    The peer runs unchanged (its defaults: EMA codebook, decay 0.8, commitment weight 1);
    only the layout is adapted: (B, D, *S) or (..., D) in, the same layout out. The peer's
    returned loss is passed through as ``loss`` and reported as ``terms["commitment"]``.
    Its EMA and dead-code statistics are the peer's own (it all-reduces them itself when
    its ``sync_codebook`` is on, which it enables by default under torch.distributed).
    """

    def __init__(self, num_codes: int, dim: int, *, channel_dim: int = 1, **vq_kwargs: Any):
        super().__init__(num_codes, dim, channel_dim)
        VectorQuantize = peer_class("VectorQuantize", "vqp")
        self.vq_kwargs = dict(vq_kwargs)
        self.vq = VectorQuantize(dim=dim, codebook_size=num_codes, **vq_kwargs)

    @property
    def codebook(self) -> Tensor:
        return self.vq.codebook

    def forward(self, z: Tensor) -> QuantizerOutput:
        flat, last_shape = flatten(z, self.dim, self.channel_dim)
        if flat.shape[0] == 0:  # an empty batch: nothing to quantize, nothing learned (the peer's EMA untouched)
            return self.empty_output(flat, last_shape, ("commitment",))
        with torch.autocast(device_type=z.device.type, enabled=False):
            x = flat.float() if flat.dtype != torch.float64 else flat
            quantized, indices, loss = self.vq(x.unsqueeze(0))
        return peer_output(self, z, last_shape, quantized, indices, loss, "commitment")

    def extra_repr(self) -> str:
        return super().extra_repr() + f", vq_kwargs={self.vq_kwargs}"
