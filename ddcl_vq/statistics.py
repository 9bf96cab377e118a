"""DDCL's M-step statistics: what one batch tells the codebook update, without autograd.

:func:`soft_statistics` maps (N, D) vectors and a (K, D) codebook to :class:`SoftStatistics` (the
hard assignment, each code's soft mass Σ_i q_ik and soft sum Σ_i q_ik z_i, the loss terms) in
row blocks of bounded memory (:func:`statistics_rows`), optionally over each vector's nearest
codes only. Same centring, distance expansion and stable softmax as
:func:`ddcl_vq.assignment.assign`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .blocks import block_rows, first_min, softmax_into

__all__ = ["SoftStatistics", "soft_statistics", "statistics_rows", "STATISTICS_BLOCK_ELEMENTS",
           "STATISTICS_BLOCK_ELEMENTS_LARGE"]


@dataclass
class SoftStatistics:
    """What one batch tells DDCL's M-step (no autograd): the sufficient statistics of the soft
    clustering at fixed assignments, plus the hard assignment.

    indices:  (N,) long, hard argmin k*_i.
    nearest:  (N,) squared distance to the nearest code, d_{i k*_i}.
    mass:     (K,) soft mass Σ_i q_ik (the soft counts).
    sums:     (K, D) Σ_i q_ik z_i; ``sums / mass`` is the codebook that minimises L_q at these q.
    distortion, ols, variance: scalars (sum over D, mean over N), distortion = ols + variance.
    """

    indices: Tensor
    nearest: Tensor
    mass: Tensor
    sums: Tensor
    distortion: Tensor
    ols: Tensor
    variance: Tensor


#: rows per block of :func:`soft_statistics` on the CPU: about this many elements per (rows × K)
#: block, so that a block (1 MiB in float32) and its temporaries stay in cache while the block's
#: distance, minimum, softmax and products pass over it (64 to 4096 rows) …
STATISTICS_BLOCK_ELEMENTS = 1 << 18
#: … on the truncated path larger blocks (on a GPU: :func:`~ddcl_vq.blocks.block_rows`' memory budget).
STATISTICS_BLOCK_ELEMENTS_LARGE = 1 << 22


def statistics_rows(num_codes: int, device: torch.device | str = "cpu", truncated: bool = False, *,
                    num_rows: Optional[int] = None, dim: int = 1, support: Optional[int] = None,
                    itemsize: int = 4) -> int:
    """Rows per block of :func:`soft_statistics` by default. On the CPU: a multiple of 64 (BLAS
    kernels give a row the same bits whatever block it is in more reliably for such blocks) from
    64 to 4096. On a GPU, given ``num_rows``: :func:`~ddcl_vq.blocks.block_rows` — the whole batch while the block's
    N×K-sized tensors fit :data:`~ddcl_vq.blocks.DEVICE_BLOCK_BUDGET_BYTES` (the dense path's distances, shifted
    logits and q plus a spare; truncated: the distances and the (rows, support, D) products)."""
    dev = torch.device(device).type
    if dev != "cpu" and num_rows is not None:
        k = max(num_codes, 1)
        live = 4 if not truncated else 2 + -(-(3 * (support or 0) + 2 * (support or 0) * dim) // k)
        return block_rows(dev, num_rows, num_codes, itemsize=itemsize, live_tensors=live)
    large = truncated or dev != "cpu"
    elements = STATISTICS_BLOCK_ELEMENTS_LARGE if large else STATISTICS_BLOCK_ELEMENTS
    return max(64, min(4096, elements // max(num_codes, 1)) // 64 * 64)


@torch.no_grad()
def soft_statistics(z: Tensor, codebook: Tensor, scale: float, rows: Optional[int] = None,
                    support: Optional[int] = None, split: bool = True) -> SoftStatistics:
    """DDCL soft statistics of (N, D) ``z`` against a (K, D) ``codebook`` at softmax divisor ``scale``.

    Computed in blocks of ``rows`` vectors (default :func:`statistics_rows`: on the CPU ≈ 2**18 / K,
    a block that stays in cache, or ≈ 2**22 / K with a truncated ``support``, whose top-k gains
    nothing from smaller blocks, 64 to 4096; on a GPU the whole batch while the block fits
    :data:`~ddcl_vq.blocks.DEVICE_BLOCK_BUDGET_BYTES`, see :func:`~ddcl_vq.blocks.block_rows`), so extra memory is
    O(rows·K) whatever N is; nothing is kept for autograd. Same centring, distance expansion and
    stable softmax as :func:`~ddcl_vq.assignment.assign`; q is shifted by each row's minimum distance before the
    softmax (the same q, exactly: the shift cancels). Each block's distances are the bits
    :func:`~ddcl_vq.base.squared_distances` gives for that block (computed in place, in buffers
    allocated once per call), and the hard index is the exact first minimum; a row's distances
    come out the same in any block wherever the BLAS computes a row independently of the others
    (float32 here, tested), and the sums over rows (mass, sums, the terms) depend on the blocking
    only to float rounding.

    ``support``: when given and < K, each vector's softmax is taken over its ``support`` nearest
    codes only (the others get q = 0). Large codebooks need it: the full q costs an N×K softmax
    and two more N×K×D matmuls, the truncated one a top-k and O(N·support·D) work, and at a
    temperature relative to the nearest-code distance the dropped codes' weights are
    exp(−gap / scale) with a gap many scales wide. The hard index and nearest distance stay exact.

    ``split=False`` leaves out the loss terms (``distortion``, ``ols``, ``variance``: NaN then), which
    the M-step does not read: the soft codes ẑ the split needs cost one more N×K·K×D product, about a
    quarter of the dense path's time, and Σ q·d two more passes over the N×K block.
    """
    if not scale > 0:
        raise ValueError(f"expected a softmax scale > 0, got {scale!r}")
    n, k = z.shape[0], codebook.shape[0]
    truncated = support is not None and support < k
    if rows is None:
        rows = statistics_rows(k, z.device, truncated, num_rows=n, dim=z.shape[1], support=support,
                               itemsize=z.element_size())
    center = codebook.mean(0)
    w = codebook - center
    w_sq = w.pow(2).sum(1)
    indices = torch.empty(n, dtype=torch.long, device=z.device)
    nearest = torch.empty(n, dtype=z.dtype, device=z.device)
    mass = torch.zeros(k, dtype=z.dtype, device=z.device)
    sums = torch.zeros_like(w)
    totals = z.new_zeros(3)  # distortion, ols, variance (sums over rows)
    if n > 0:
        # per block: one matmul for the distances, then (dense) one for Σ q z and (split) one for ẑ, every
        # N×K pass (expansion, clamp, minimum, shift, softmax, q·d) in place on a cached block;
        # (truncated) a top-k of the block's distances and O(rows·support·D) work
        width = min(rows, n)
        w_t = (w * -2.0).t()   # the distance expansion's -2 in the product: the same bits (a power of two)
        w_norm = (w * w).sum(1)                       # as squared_distances computes ‖w‖²
        x_buf, soft_buf = z.new_empty(width, z.shape[1]), z.new_empty(width, z.shape[1])
        d_buf = z.new_empty(width, k)
        if not truncated:
            l_buf, q_buf = z.new_empty(width, k), z.new_empty(width, k)
        for start in range(0, n, rows):
            m = min(rows, n - start)
            x = torch.sub(z[start:start + m], center, out=x_buf[:m])
            # squared_distances(x, w) bit for bit: ((‖x‖² − 2 x·w) + ‖w‖²) clamped at 0
            d = torch.mm(x, w_t, out=d_buf[:m]).add_((x * x).sum(1, keepdim=True))
            d = d.add_(w_norm).clamp_min_(0.0)
            if truncated:
                d_top, code = torch.topk(d, support, dim=1, largest=False, sorted=True)
                dmin, idx = d_top[:, 0], code[:, 0]
                indices[start:start + m] = idx
                nearest[start:start + m] = dmin
                q = torch.softmax((dmin[:, None] - d_top) / scale, 1)           # (rows, support)
                mass.index_add_(0, code.reshape(-1), q.reshape(-1))
                sums.index_add_(0, code.reshape(-1), (q[:, :, None] * x[:, None, :]).reshape(-1, x.shape[1]))
                if split:
                    totals[0] += (q * d_top).sum()
                    soft = torch.einsum("rs,rsd->rd", q, w[code])
                    totals[1] += (x - soft).pow(2).sum()
                    totals[2] += ((q * w_sq[code]).sum(1) - soft.pow(2).sum(1)).clamp_min(0).sum()
                continue
            dmin, idx = first_min(d)
            indices[start:start + m] = idx
            nearest[start:start + m] = dmin
            q = softmax_into(torch.sub(dmin[:, None], d, out=l_buf[:m]).div_(scale), q_buf[:m])
            mass += q.sum(0)
            sums.addmm_(q.t(), x)
            if split:
                totals[0] += torch.mul(q, d, out=l_buf[:m]).sum()
                soft = torch.mm(q, w, out=soft_buf[:m])
                totals[1] += (x - soft).pow(2).sum()
                totals[2] += (q @ w_sq - soft.pow(2).sum(1)).clamp_min(0).sum()
    totals /= max(n, 1)
    sums += mass[:, None] * center  # Σ_i q_ik (x_i + c) = Σ_i q_ik z_i
    if not split:
        totals[:] = float("nan")
    return SoftStatistics(indices=indices, nearest=nearest, mass=mass, sums=sums,
                          distortion=totals[0], ols=totals[1], variance=totals[2])
