"""EMAVQ: codebook updated by exponential moving averages (VQ-VAE-2 style), a baseline."""
from __future__ import annotations

import torch
from torch import Tensor

from .base import QuantizerOutput, Quantizer, check_finite, squared_distances
from .distributed import all_reduce_sum_, broadcast_, gather_rows, world_size


class EMAVQ(Quantizer):
    """argmin quantizer whose codebook is an EMA of the vectors assigned to each code.

    Per training step (statistics summed over all processes before the update):
        n_k ← decay·n_k + (1−decay)·count_k,   s_k ← decay·s_k + (1−decay)·Σ_{i→k} z_i
        w_k = s_k / ñ_k,  ñ_k = (n_k + eps)/(Σn + K·eps)·Σn   (Laplace smoothing)
    loss = beta·‖z − sg(w)‖² / D (the codebook has no gradient; it is a buffer).

    Args:
        decay: EMA decay (0.99).
        eps: Laplace smoothing constant.
        beta: commitment weight.
        dead_code_threshold: codes whose EMA count n_k falls below this are restarted from
            random batch vectors (sampled across processes, identical everywhere); 0 = off.
    """

    term_names = ("commitment",)

    def __init__(self, num_codes: int, dim: int, *, decay: float = 0.99, eps: float = 1e-5,
                 beta: float = 0.25, dead_code_threshold: float = 0.0, channel_dim: int = 1):
        super().__init__(num_codes, dim, channel_dim)
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"expected 0 <= decay < 1, got {decay!r}")
        self.decay, self.eps = float(decay), check_finite("eps", eps, positive=True)
        self.beta = check_finite("beta", beta)
        self.dead_code_threshold = check_finite("dead_code_threshold", dead_code_threshold)
        embed = torch.randn(num_codes, dim)
        self.register_buffer("embed", embed)
        self.register_buffer("cluster_size", torch.ones(num_codes))
        self.register_buffer("embed_sum", embed.clone())
        self.register_buffer("restarts", torch.zeros((), dtype=torch.long))

    @property
    def codebook(self) -> Tensor:
        return self.embed

    @torch.no_grad()
    def _update(self, x: Tensor, indices: Tensor) -> None:
        if not getattr(self, "_synced", False):
            # every process starts from rank 0's codebook; the all-reduced statistics keep them identical
            for buf in (self.embed, self.embed_sum, self.cluster_size):
                broadcast_(buf)
            self._synced = True
        counts = all_reduce_sum_(torch.bincount(indices, minlength=self.num_codes).to(self.cluster_size.dtype))
        sums = all_reduce_sum_(torch.zeros_like(self.embed_sum).index_add_(0, indices, x.to(self.embed_sum.dtype)))
        self.cluster_size.mul_(self.decay).add_(counts, alpha=1 - self.decay)
        self.embed_sum.mul_(self.decay).add_(sums, alpha=1 - self.decay)
        total = self.cluster_size.sum()
        smoothed = (self.cluster_size + self.eps) / (total + self.num_codes * self.eps) * total
        self.embed.copy_(self.embed_sum / smoothed[:, None])
        if self.dead_code_threshold > 0:
            self.restart_dead_codes(x)

    @torch.no_grad()
    def restart_dead_codes(self, x: Tensor) -> int:
        """Replace codes with EMA count < threshold by batch vectors; returns how many."""
        # identical on every rank already (statistics are all-reduced)
        dead = broadcast_((self.cluster_size < self.dead_code_threshold).to(torch.uint8)).bool()
        num_dead = int(dead.sum())
        if num_dead == 0:
            return 0
        per_rank = -(-num_dead // world_size())
        pool = gather_rows(x.to(self.embed.dtype), per_rank)[:num_dead]
        broadcast_(pool)
        self.embed[dead] = pool
        self.embed_sum[dead] = pool * self.dead_code_threshold
        self.cluster_size[dead] = self.dead_code_threshold
        self.restarts += num_dead
        return num_dead

    def quantize(self, x: Tensor) -> QuantizerOutput:
        w = self.embed.to(x.dtype)
        with torch.no_grad():
            indices = squared_distances(x, w).argmin(1)
        hard = w[indices]
        commitment = (x - hard).pow(2).sum(1).mean()
        out = hard.detach() + (x - x.detach())  # value exactly w_{k*}, gradient identity
        if self.training:
            self._update(x.detach(), indices)
        return QuantizerOutput(out, indices, self.beta * commitment / self.dim, {"commitment": commitment.detach()})

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", decay={self.decay:g}, beta={self.beta:g}, "
                f"dead_code_threshold={self.dead_code_threshold:g}")
