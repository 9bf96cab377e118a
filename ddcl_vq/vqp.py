"""The real peer: vector-quantize-pytorch's ``VectorQuantize`` (optional, imported when built) behind ddcl_vq's
interface."""
from __future__ import annotations

import importlib
from typing import Any

from torch import Tensor

from .base import QuantizerOutput, Quantizer


def peer_class(name: str, qtype: str) -> type:
    """``vector_quantize_pytorch.<name>``; a missing package is an ImportError saying how to install it."""
    try:
        module = importlib.import_module("vector_quantize_pytorch")
    except ImportError as err:  # pragma: no cover - exercised only without the package
        raise ImportError(
            f"quantizer type {qtype!r} needs the vector-quantize-pytorch package: "
            "pip install vector-quantize-pytorch (or install ddcl-vq with the 'dev' extra)") from err
    return getattr(module, name)


def peer_output(quantized: Tensor, indices: Tensor, loss: Tensor, term: str) -> QuantizerOutput:
    """A vector-quantize-pytorch module's ``(quantized (1, N, D), indices, loss)`` as the common output; the
    peer's loss (a scalar or one per codebook, summed) is also ``terms[term]``."""
    loss = loss.reshape(()) if loss.numel() == 1 else loss.sum()
    return QuantizerOutput(quantized, indices, loss, {term: loss.detach()})


class VQPQuantizer(Quantizer):
    """Wraps ``vector_quantize_pytorch.VectorQuantize(dim, codebook_size, **vq_kwargs)``, unchanged (its
    defaults: EMA codebook, decay 0.8, commitment weight 1; it syncs its own statistics under
    torch.distributed); its loss is ``loss`` and ``terms["commitment"]``."""

    term_names = ("commitment",)
    peer = "VectorQuantize"  # the vector_quantize_pytorch class that takes the other keyword arguments

    def __init__(self, num_codes: int, dim: int, *, channel_dim: int = 1, **vq_kwargs: Any):
        super().__init__(num_codes, dim, channel_dim)
        VectorQuantize = peer_class(self.peer, "vqp")
        self.vq_kwargs = dict(vq_kwargs)
        self.vq = VectorQuantize(dim=dim, codebook_size=num_codes, **vq_kwargs)

    @property
    def codebook(self) -> Tensor:
        return self.vq.codebook

    def quantize(self, x: Tensor) -> QuantizerOutput:
        return peer_output(*self.vq(x.unsqueeze(0)), "commitment")

    def extra_repr(self) -> str:
        return super().extra_repr() + f", vq_kwargs={self.vq_kwargs}"
