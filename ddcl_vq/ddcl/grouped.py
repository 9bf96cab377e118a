"""Grouped DDCL (:class:`GroupedDDCL`): the channels split into G groups, each quantized by its own DDCL codebook
(product quantization; UniTok's sub-codebooks, vector-quantize-pytorch's ``GroupedResidualVQ`` with one level)."""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch
from torch import Tensor, nn

from ..base import QuantizerOutput, check_positive_int
from .multi import MultiCodebookDDCL, check_ddcl_options
from .quantizer import DDCLQuantizer

__all__ = ["GroupedDDCL"]


class GroupedDDCL(MultiCodebookDDCL):
    """G DDCLQuantizers over G contiguous channel groups of D / G channels each.

    Args:
        num_codes: K, codes per group (or ``codebook_size=K``); the codes of a vector are K^G combinations.
        dim: D, the channel size; divisible by ``groups``.
        groups: G.
        channel_dim: 1 for (B, D, *spatial) inputs, −1 for (..., D).
        **ddcl_options: any other :class:`~ddcl_vq.DDCLQuantizer` keyword argument, given to every group.

    ``forward(z)``: ``quantized`` the groups' outputs concatenated on the channel dimension, in z's layout;
    ``indices`` z's shape without the channel dimension, plus (G,); ``loss`` the mean of the groups' losses (each a
    per-element mean over its D / G channels: the mean is a per-element mean over D); ``terms`` each group's terms
    prefixed ``group{g}_`` and their sums (sums over D, as a single DDCLQuantizer's); ``perplexity`` the groups'
    mean batch perplexity; ``soft_counts`` (G, K). Each group's M-step, temperature, revival and warm-up act on its
    own channels. ``lookup(indices)`` takes (..., G); ``codebook`` is (G, K, D / G); ``quantizers`` the G
    DDCLQuantizers.
    """

    part_name = "group"

    def __init__(self, num_codes: int, dim: int, groups: int = 2, *, channel_dim: int = 1, **ddcl_options: Any):
        super().__init__(num_codes, dim, channel_dim)
        self.groups = self.num_codebooks = check_positive_int("groups", groups)
        if dim % groups:
            raise ValueError(f"expected dim divisible by groups, got dim={dim} and groups={groups} "
                             f"({dim} % {groups} = {dim % groups})")
        check_ddcl_options("GroupedDDCL", ddcl_options)
        self.group_dim = dim // groups
        self.quantizers = nn.ModuleList([DDCLQuantizer(num_codes, self.group_dim, channel_dim=-1, **ddcl_options)
                                         for _ in range(groups)])

    @property
    def codebook(self) -> Tensor:
        return torch.stack([q.weight for q in self.quantizers])

    def describe(self) -> Dict[str, Any]:
        return {"mode": self.mode, "temperature": self.temperature, "groups": self.groups}

    def extra_repr(self) -> str:
        return super().extra_repr() + f", groups={self.groups}"

    def _quantize(self, x: Tensor, z: Tensor) -> Tuple[QuantizerOutput, Tensor]:
        parts: List[QuantizerOutput] = [q(chunk) for q, chunk in zip(self.quantizers, x.split(self.group_dim, 1))]
        indices = torch.stack([p.indices for p in parts], 1)
        terms, perplexity = self._gather(parts, indices)
        soft = None if parts[0].soft_codes is None else torch.cat([p.soft_codes for p in parts], 1)
        losses = torch.stack([p.loss for p in parts])
        return QuantizerOutput(torch.cat([p.quantized for p in parts], 1), indices, losses.mean(), terms, perplexity,
                               soft_counts=torch.stack([p.soft_counts for p in parts]), soft_codes=soft), losses

    def lookup(self, indices: Tensor) -> Tensor:
        """Indices (B, *S, G) -> the groups' codes concatenated, in the input layout ((B, D, *S) or (B, *S, D))."""
        self._check_indices(indices, allow_prefix=False, allow_dropped=False)
        indices = indices.long()
        codes = torch.cat([q.weight[indices[..., g]] for g, q in enumerate(self.quantizers)], -1)
        return self._layout(codes)

    @torch.no_grad()
    def soft_codes(self, z: Tensor) -> Tensor:
        """The groups' soft codes, concatenated, in z's layout."""
        moved = z.movedim(1, -1) if self.channel_dim == 1 else z
        if moved.shape[-1] != self.dim:
            raise ValueError(f"expected channel size D={self.dim}, got shape {tuple(z.shape)}")
        soft = torch.cat([q.soft_codes(c) for q, c in zip(self.quantizers, moved.split(self.group_dim, -1))], -1)
        return soft.movedim(-1, 1) if self.channel_dim == 1 else soft
