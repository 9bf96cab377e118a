"""k-means initialisation of a codebook from data, identical on every process, in bounded memory and time."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .blocks import nearest_codes
from .distributed import broadcast_, gather_rows, world_size

#: the most point–centroid distances one k-means fit evaluates (iterations × points × K)
KMEANS_WORK = 1 << 31


@torch.no_grad()
def kmeans(x: Tensor, num_codes: int, iters: int = 10, generator: torch.Generator | None = None,
           rows: Optional[int] = None) -> Tensor:
    """Lloyd's k-means on (N, D) ``x`` -> (K, D) centroids in ``x``'s dtype: seeds are K rows of ``x``
    (with replacement when N < K), an empty cluster keeps its centroid, assignments in row blocks."""
    n = x.shape[0]
    pick = torch.randint(n, (num_codes,), generator=generator, device="cpu") if n < num_codes \
        else torch.randperm(n, generator=generator, device="cpu")[:num_codes]
    centroids = x[pick.to(x.device)].clone()
    for _ in range(iters):
        assign = nearest_codes(x, centroids, rows)[1]
        sums = torch.zeros_like(centroids).index_add_(0, assign, x)
        counts = torch.bincount(assign, minlength=num_codes).to(x.dtype)
        filled = counts > 0
        centroids[filled] = sums[filled] / counts[filled, None]
    return centroids


def kmeans_budget(points: int, num_codes: int, iters: int, work: int = KMEANS_WORK) -> Tuple[int, int]:
    """(points, iterations) of a fit within ``work`` point–centroid distances: fewer iterations first, then fewer
    points (at least one of each)."""
    points = max(1, min(points, work // max(num_codes, 1)))
    return points, max(1, min(iters, work // (points * max(num_codes, 1))))


@torch.no_grad()
def kmeans_init_(weight: Tensor, flat: Tensor, iters: int = 10, max_points: int = 16384) -> None:
    """Overwrite (K, D) ``weight`` with k-means centroids of (N, D) ``flat`` (at most ``max_points``, gathered from
    every process), rank 0's result broadcast."""
    if flat.shape[0] == 0:
        raise ValueError(f"expected at least one vector to fit k-means on, got shape {tuple(flat.shape)}")
    generator = torch.Generator().manual_seed(0)
    points, iters = kmeans_budget(min(flat.shape[0] * world_size(), max_points), weight.shape[0], iters)
    per_rank = max(1, min(flat.shape[0], points // world_size()))
    points = gather_rows(flat.detach().to(weight.dtype), per_rank, generator)
    centroids = kmeans(points, weight.shape[0], iters, generator)
    broadcast_(centroids)
    weight.copy_(centroids)
