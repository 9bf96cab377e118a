"""DDCL behind the classic VQ-VAE notebook's ``VectorQuantizer`` convention (the Sonnet port)."""
from __future__ import annotations

from typing import Any, Tuple

import torch
from torch import Tensor, nn

from .common import _DDCLAdapter
from .options import DDCLOptions


class NotebookQuantizerAdapter(_DDCLAdapter):
    """DDCL behind the classic VQ-VAE notebook's ``VectorQuantizer`` (the Sonnet port).

    ``forward(inputs)`` with inputs (B, C, H, W), C = ``embedding_dim``, returns
    ``(loss, quantized, perplexity, encodings)``: the DDCL loss (scalar, already weighted),
    quantized (B, C, H, W), the batch perplexity (scalar) and the (B·H·W, K) one-hot float
    matrix of the hard indices (b-h-w order).

    ``_embedding.weight`` IS the DDCL codebook Parameter; ``_num_embeddings``, ``_embedding_dim``
    and ``_commitment_cost`` (= the DDCL ``beta``) are there for the host to read.
    ``**ddcl_options``: any other :class:`~ddcl_vq.DDCLQuantizer` keyword argument
    (:class:`~ddcl_vq.adapters.DDCLOptions`).
    """

    _host_codebook_key = "_embedding.weight"

    def __init__(self, num_embeddings: int, embedding_dim: int, commitment_cost: float = 0.25,
                 **ddcl_options: Any):
        super().__init__()
        ddcl = (DDCLOptions.from_kwargs(ddcl_options, beta=commitment_cost, beta_name="commitment_cost")
                .build(num_embeddings, embedding_dim, channel_dim=1))
        self._num_embeddings = num_embeddings
        self._embedding_dim = embedding_dim
        self._embedding = nn.Embedding(num_embeddings, embedding_dim)
        self._embedding.weight = ddcl.weight
        self._attach(ddcl)

    @property
    def _commitment_cost(self) -> float:
        return self.ddcl.beta

    @_commitment_cost.setter
    def _commitment_cost(self, value: float) -> None:
        self.ddcl.beta = float(value)

    @classmethod
    def from_quantizer(cls, old: nn.Module, **ddcl_options: Any) -> "NotebookQuantizerAdapter":
        """An adapter with the notebook ``VectorQuantizer(EMA)`` ``old``'s sizes, codebook and flags (``beta``
        defaults to its ``_commitment_cost``)."""
        weight = old._embedding.weight
        kwargs = dict(ddcl_options)
        beta = kwargs.pop("beta", old._commitment_cost)
        return cls(int(old._num_embeddings), int(old._embedding_dim), beta, **kwargs)._adopt(old, weight)

    def forward(self, inputs: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        if not isinstance(inputs, Tensor) or inputs.dim() != 4:
            got = tuple(inputs.shape) if isinstance(inputs, Tensor) else type(inputs).__name__
            raise ValueError(f"expected feature maps (B, C, H, W) with C={self._embedding_dim}, got {got}")
        out = self._run_ddcl(inputs)
        flat = out.indices.reshape(-1, 1)
        encodings = torch.zeros(flat.shape[0], self._num_embeddings, device=inputs.device).scatter_(1, flat, 1)
        return out.loss, out.quantized, out.perplexity, encodings

    def extra_repr(self) -> str:
        return f"num_embeddings={self._num_embeddings}, embedding_dim={self._embedding_dim}"
