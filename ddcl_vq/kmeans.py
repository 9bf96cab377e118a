"""k-means initialisation of a codebook from data, identical on every process."""
from __future__ import annotations

import torch
from torch import Tensor

from .base import squared_distances
from .distributed import broadcast_, gather_rows


@torch.no_grad()
def kmeans(x: Tensor, num_codes: int, iters: int = 10, generator: torch.Generator | None = None) -> Tensor:
    """Lloyd's k-means on (N, D) ``x`` -> (K, D) centroids (float32 or float64 as ``x``).

    Seeds are K rows drawn from ``x`` (with replacement when N < K); an empty cluster
    keeps its previous centroid.
    """
    n = x.shape[0]
    pick = torch.randint(n, (num_codes,), generator=generator, device="cpu") if n < num_codes \
        else torch.randperm(n, generator=generator, device="cpu")[:num_codes]
    centroids = x[pick.to(x.device)].clone()
    for _ in range(iters):
        assign = squared_distances(x, centroids).argmin(1)
        sums = torch.zeros_like(centroids).index_add_(0, assign, x)
        counts = torch.bincount(assign, minlength=num_codes).to(x.dtype)
        filled = counts > 0
        centroids[filled] = sums[filled] / counts[filled, None]
    return centroids


@torch.no_grad()
def kmeans_init_(weight: Tensor, flat: Tensor, iters: int = 10, max_points: int = 16384) -> None:
    """Overwrite (K, D) ``weight`` with k-means centroids of (N, D) ``flat``.

    Under torch.distributed the points are sampled on every rank and gathered, k-means
    runs on the same points with the same seed everywhere, and rank 0's result is
    broadcast, so the codebook is one codebook.
    """
    from .distributed import world_size

    generator = torch.Generator().manual_seed(0)
    per_rank = max(1, min(flat.shape[0], max_points // world_size()))
    points = gather_rows(flat.detach().to(weight.dtype), per_rank, generator)
    centroids = kmeans(points, weight.shape[0], iters, generator)
    broadcast_(centroids)
    weight.copy_(centroids)
