"""k-means initialisation of a codebook from data, identical on every process.

Memory and time stay bounded whatever K is: each Lloyd iteration finds the nearest centroid in
row blocks (:func:`ddcl_vq.blocks.nearest_codes`, never the N×K distance matrix), and the fit
evaluates at most :data:`KMEANS_WORK` point–centroid distances in all — past it, fewer
iterations, and when a single iteration over the points would exceed it, a sample of points.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .blocks import nearest_codes
from .distributed import broadcast_, gather_rows, world_size

#: the most point–centroid distances one k-means fit evaluates (iterations × points × K): at
#: K = 65,536 and 16,384 points, two iterations (seconds on one core, not minutes); fits up to
#: 10 iterations × 8,192 points × K = 16,384 (and every smaller one) keep all their iterations
KMEANS_WORK = 1 << 31


@torch.no_grad()
def kmeans(x: Tensor, num_codes: int, iters: int = 10, generator: torch.Generator | None = None,
           rows: Optional[int] = None) -> Tensor:
    """Lloyd's k-means on (N, D) ``x`` -> (K, D) centroids (float32 or float64 as ``x``).

    Seeds are K rows drawn from ``x`` (with replacement when N < K); an empty cluster
    keeps its previous centroid. Assignments are computed in blocks of ``rows`` points
    (default: :func:`~ddcl_vq.blocks.nearest_codes`' memory bound).
    """
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
    """(points, iterations) of a fit within ``work`` point–centroid distances: all ``points`` and
    ``iters`` when they fit; else fewer iterations (at least one); and when one iteration over
    all points exceeds ``work`` alone, a sample of ``work // num_codes`` points (at least one)."""
    points = max(1, min(points, work // max(num_codes, 1)))
    return points, max(1, min(iters, work // (points * max(num_codes, 1))))


@torch.no_grad()
def kmeans_init_(weight: Tensor, flat: Tensor, iters: int = 10, max_points: int = 16384) -> None:
    """Overwrite (K, D) ``weight`` with k-means centroids of (N, D) ``flat``.

    Under torch.distributed the points are sampled on every rank and gathered, k-means
    runs on the same points with the same seed everywhere, and rank 0's result is
    broadcast, so the codebook is one codebook. At most ``max_points`` points (over all
    ranks) take part, fewer (and fewer than ``iters`` iterations) when the fit would exceed
    :data:`KMEANS_WORK` (see :func:`kmeans_budget`).
    """
    if flat.shape[0] == 0:
        raise ValueError(f"expected at least one vector to fit k-means on, got shape {tuple(flat.shape)}")
    generator = torch.Generator().manual_seed(0)
    points, iters = kmeans_budget(min(flat.shape[0] * world_size(), max_points), weight.shape[0], iters)
    per_rank = max(1, min(flat.shape[0], points // world_size()))
    points = gather_rows(flat.detach().to(weight.dtype), per_rank, generator)
    centroids = kmeans(points, weight.shape[0], iters, generator)
    broadcast_(centroids)
    weight.copy_(centroids)
