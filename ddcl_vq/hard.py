"""HardVQ: the classic VQ-VAE quantizer (argmin + straight-through), an honest baseline."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import QuantizerOutput, Quantizer, check_finite, squared_distances
from .kmeans import kmeans_init_

#: HardVQ's allowed distances, and its choice arguments -> allowed values (the default: the signature)
DISTANCES = ("euclidean", "cosine")
HARDVQ_CHOICES = {"distance": DISTANCES}


class HardVQ(Quantizer):
    """argmin_k ‖z − w_k‖², straight-through gradient to the encoder.

    loss = (‖sg(z) − w‖² + beta·‖z − sg(w)‖²) / D  (terms ``codebook`` and ``commitment``
    are the sum-over-D, mean-over-vectors values before weighting).

    Args:
        beta: commitment weight (0.25 as in the VQ-VAE paper).
        distance: ``"euclidean"`` or ``"cosine"`` (z and codes l2-normalised before the
            lookup, as in ViT-VQGAN; the decoder then sees normalised codes).
        kmeans_init: initialise the codebook with k-means on the first training batch.
    """

    term_names = ("codebook", "commitment")

    def __init__(self, num_codes: int, dim: int, *, beta: float = 0.25, distance: str = "euclidean",
                 kmeans_init: bool = False, channel_dim: int = 1):
        super().__init__(num_codes, dim, channel_dim)
        if distance not in DISTANCES:
            raise ValueError(f"expected distance 'euclidean' or 'cosine', got {distance!r}")
        self.beta = check_finite("beta", beta)
        self.distance = distance
        self.weight = nn.Parameter(torch.empty(num_codes, dim).uniform_(-1.0 / num_codes, 1.0 / num_codes))
        self.register_buffer("initialized", torch.tensor(not kmeans_init))

    @property
    def codebook(self) -> Tensor:
        return F.normalize(self.weight, dim=1) if self.distance == "cosine" else self.weight

    def quantize(self, x: Tensor) -> QuantizerOutput:
        if self.distance == "cosine":
            x = F.normalize(x, dim=1)
        if self.training and not bool(self.initialized):
            kmeans_init_(self.weight.data, x)
            self.initialized.fill_(True)
        w = self.codebook.to(x.dtype)
        with torch.no_grad():
            indices = squared_distances(x, w).argmin(1)
        hard = w[indices]
        codebook_term = (x.detach() - hard).pow(2).sum(1).mean()
        commitment = (x - hard.detach()).pow(2).sum(1).mean()
        out = hard.detach() + (x - x.detach())  # value exactly w_{k*}, gradient identity
        return QuantizerOutput(out, indices, (codebook_term + self.beta * commitment) / self.dim,
                               {"codebook": codebook_term.detach(), "commitment": commitment.detach()})

    def extra_repr(self) -> str:
        return super().extra_repr() + f", beta={self.beta:g}, distance={self.distance!r}"
