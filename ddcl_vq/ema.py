"""EMAVQ: codebook updated by exponential moving averages (VQ-VAE-2 style), a baseline."""
from __future__ import annotations

import torch
from torch import Tensor

from .base import QuantizerOutput, Quantizer, batch_perplexity, compute_dtype, flatten, squared_distances, unflatten
from .distributed import all_reduce_sum_, broadcast_, gather_rows


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

    def __init__(self, num_codes: int, dim: int, *, decay: float = 0.99, eps: float = 1e-5,
                 beta: float = 0.25, dead_code_threshold: float = 0.0, channel_dim: int = 1):
        super().__init__(num_codes, dim, channel_dim)
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"expected 0 <= decay < 1, got {decay!r}")
        if not eps > 0:
            raise ValueError(f"expected eps > 0, got {eps!r}")
        if not beta >= 0 or not dead_code_threshold >= 0:
            raise ValueError(f"expected beta >= 0 and dead_code_threshold >= 0, got {beta!r}, {dead_code_threshold!r}")
        self.decay, self.eps, self.beta = float(decay), float(eps), float(beta)
        self.dead_code_threshold = float(dead_code_threshold)
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
            # Start every process from rank 0's codebook (DDP with broadcast_buffers=False does
            # not copy buffers); afterwards the all-reduced statistics keep them identical.
            for buf in (self.embed, self.embed_sum, self.cluster_size):
                broadcast_(buf)
            self._synced = True
        counts = torch.bincount(indices, minlength=self.num_codes).to(self.cluster_size.dtype)
        sums = torch.zeros_like(self.embed_sum).index_add_(0, indices, x.to(self.embed_sum.dtype))
        all_reduce_sum_(counts)
        all_reduce_sum_(sums)
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
        dead_flags = (self.cluster_size < self.dead_code_threshold).to(torch.uint8)
        broadcast_(dead_flags)  # identical on every rank already (statistics are all-reduced)
        dead = dead_flags.bool()
        num_dead = int(dead.sum())
        if num_dead == 0:
            return 0
        from .distributed import world_size
        per_rank = -(-num_dead // world_size())
        pool = gather_rows(x.to(self.embed.dtype), per_rank)[:num_dead]
        broadcast_(pool)
        self.embed[dead] = pool
        self.embed_sum[dead] = pool * self.dead_code_threshold
        self.cluster_size[dead] = self.dead_code_threshold
        self.restarts += num_dead
        return num_dead

    def forward(self, z: Tensor) -> QuantizerOutput:
        flat, last_shape = flatten(z, self.dim, self.channel_dim)
        if flat.shape[0] == 0:  # an empty batch: nothing to quantize, nothing learned
            return self.empty_output(flat, last_shape, ("commitment",))
        dtype = compute_dtype(z)
        with torch.autocast(device_type=z.device.type, enabled=False):
            x = flat.to(dtype)
            w = self.embed.to(dtype)
            with torch.no_grad():
                indices = squared_distances(x, w).argmin(1)
            hard = w[indices]
            commitment = (x - hard).pow(2).sum(1).mean()
            loss = self.beta * commitment / self.dim
            out = hard.detach() + (x - x.detach())  # value exactly w_{k*}, gradient identity
            if self.training:
                self._update(x.detach(), indices)
        return QuantizerOutput(
            quantized=unflatten(out.to(z.dtype), last_shape, self.channel_dim),
            indices=unflatten(indices, last_shape, self.channel_dim), loss=loss,
            terms={"commitment": commitment.detach()},
            perplexity=batch_perplexity(indices, self.num_codes))

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", decay={self.decay:g}, beta={self.beta:g}, "
                f"dead_code_threshold={self.dead_code_threshold:g}")
