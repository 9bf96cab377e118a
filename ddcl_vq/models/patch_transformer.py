"""The readout study's patch transformer: mean pooling, a class token, or the DDCL readout."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ddcl_vq import DDCLReadout


class PatchTransformer(nn.Module):
    """Linear patch embedding + learned positions + pre-LN TransformerEncoder + final LayerNorm + readout."""

    def __init__(self, readout: str, num_tokens: int, patch_dim: int, dim: int, layers: int, heads: int,
                 num_classes: int, num_prototypes: int, temperature: float, loss_weight: float,
                 distortion_to_tokens: bool, prototype_init: str = "kmeans", task_grad_to_prototypes: bool = True,
                 mode: str = "straight_through"):
        super().__init__()
        self.kind = readout
        # shared parts first, so every arm starts from the same encoder weights for the same seed
        self.embed = nn.Linear(patch_dim, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(1, num_tokens, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)
        self.cls = nn.Parameter(0.02 * torch.randn(1, 1, dim)) if readout == "cls" else None
        self.readout = (DDCLReadout(dim, num_prototypes, temperature=temperature, loss_weight=loss_weight,
                                    distortion_to_tokens=distortion_to_tokens, prototype_init=prototype_init,
                                    task_grad_to_prototypes=task_grad_to_prototypes, mode=mode)
                        if readout == "ddcl" else None)

    def tokens(self, x: Tensor) -> Tensor:
        h = self.embed(x) + self.pos
        if self.cls is not None:
            h = torch.cat([self.cls.expand(h.shape[0], -1, -1), h], 1)
        return self.norm(self.encoder(h))

    def forward(self, x: Tensor):
        h = self.tokens(x)
        if self.kind == "mean":
            return self.head(h.mean(1)), None
        if self.kind == "cls":
            return self.head(h[:, 0]), None
        out = self.readout(h)
        return self.head(out.pooled), out
