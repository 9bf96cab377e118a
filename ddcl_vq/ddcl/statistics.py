"""DDCL's M-step statistics (:func:`soft_statistics`): what one batch tells the codebook update,
in row blocks of bounded memory, without autograd."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..blocks import block_rows, first_min, softmax_into

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
    soft:     (N, D) the soft codes ẑ_i = Σ_k q_ik w_k, with ``keep_soft`` (else None).
    """

    indices: Tensor
    nearest: Tensor
    mass: Tensor
    sums: Tensor
    distortion: Tensor
    ols: Tensor
    variance: Tensor
    soft: Optional[Tensor] = None


#: CPU: about this many elements per (rows × K) block, so a block and its temporaries stay in cache …
STATISTICS_BLOCK_ELEMENTS = 1 << 18
#: … and on the truncated path (whose top-k gains nothing from smaller blocks) this many
STATISTICS_BLOCK_ELEMENTS_LARGE = 1 << 22


def statistics_rows(num_codes: int, device: torch.device | str = "cpu", truncated: bool = False, *,
                    num_rows: Optional[int] = None, dim: int = 1, support: Optional[int] = None,
                    itemsize: int = 4) -> int:
    """Rows per block of :func:`soft_statistics` by default: on the CPU a multiple of 64 from 64 to 4096; on a GPU,
    given ``num_rows``, :func:`~ddcl_vq.blocks.block_rows`."""
    dev = torch.device(device).type
    if dev != "cpu" and num_rows is not None:
        k = max(num_codes, 1)
        live = 4 if not truncated else 2 + -(-(3 * (support or 0) + 2 * (support or 0) * dim) // k)
        return block_rows(dev, num_rows, num_codes, itemsize=itemsize, live_tensors=live)
    large = truncated or dev != "cpu"
    elements = STATISTICS_BLOCK_ELEMENTS_LARGE if large else STATISTICS_BLOCK_ELEMENTS
    return max(64, min(4096, elements // max(num_codes, 1)) // 64 * 64)


class _Blocks:
    """One :func:`soft_statistics` pass: centred codebook, buffers, accumulators, the work on one block."""

    def __init__(self, z: Tensor, codebook: Tensor, scale: float, rows: int, support: Optional[int], split: bool,
                 keep_soft: bool = False):
        n, k = z.shape[0], codebook.shape[0]
        self.scale, self.support, self.split = scale, support, split
        self.center = codebook.mean(0)
        self.w = codebook - self.center
        self.w_t = (self.w * -2.0).t()   # the distance expansion's -2 in the product: the same bits (a power of two)
        self.w_norm = (self.w * self.w).sum(1)                # as squared_distances computes ‖w‖²
        self.indices = torch.empty(n, dtype=torch.long, device=z.device)
        self.nearest = torch.empty(n, dtype=z.dtype, device=z.device)
        self.mass = torch.zeros(k, dtype=z.dtype, device=z.device)
        self.sums = torch.zeros_like(self.w)
        self.totals = z.new_zeros(3)  # distortion, ols, variance (sums over rows)
        self.soft_rows = torch.empty_like(z) if keep_soft else None
        width = min(rows, n)
        self.x_buf, self.soft_buf = z.new_empty(width, z.shape[1]), z.new_empty(width, z.shape[1])
        self.d_buf = z.new_empty(width, k)
        if support is None:
            self.l_buf, self.q_buf = z.new_empty(width, k), z.new_empty(width, k)

    def distances(self, z: Tensor, start: int, m: int) -> Tuple[Tensor, Tensor]:
        """(centred rows (m, D), their squared distances (m, K)): squared_distances(x, w) bit for bit."""
        x = torch.sub(z[start:start + m], self.center, out=self.x_buf[:m])
        d = torch.mm(x, self.w_t, out=self.d_buf[:m]).add_((x * x).sum(1, keepdim=True))
        return x, d.add_(self.w_norm).clamp_min_(0.0)

    def dense(self, x: Tensor, d: Tensor, start: int) -> None:
        """Every code: each N×K pass in place on the cached block; one matmul for Σ q z, (split) one for ẑ."""
        m = x.shape[0]
        dmin, idx = first_min(d)
        self.indices[start:start + m] = idx
        self.nearest[start:start + m] = dmin
        q = softmax_into(torch.sub(dmin[:, None], d, out=self.l_buf[:m]).div_(self.scale), self.q_buf[:m])
        self.mass += q.sum(0)
        self.sums.addmm_(q.t(), x)
        if self.split:
            soft = torch.mm(q, self.w, out=self.soft_buf[:m])
            self.add_terms(x, soft, torch.mul(q, d, out=self.l_buf[:m]).sum(), q @ self.w_norm, start)

    def truncated(self, x: Tensor, d: Tensor, start: int) -> None:
        """The nearest ``support`` codes: a top-k of the block's distances, O(rows·support·D) work."""
        m = x.shape[0]
        d_top, code = torch.topk(d, self.support, dim=1, largest=False, sorted=True)
        dmin = d_top[:, 0]
        self.indices[start:start + m] = code[:, 0]
        self.nearest[start:start + m] = dmin
        q = torch.softmax((dmin[:, None] - d_top) / self.scale, 1)           # (rows, support)
        self.mass.index_add_(0, code.reshape(-1), q.reshape(-1))
        self.sums.index_add_(0, code.reshape(-1), (q[:, :, None] * x[:, None, :]).reshape(-1, x.shape[1]))
        if self.split:
            soft = torch.einsum("rs,rsd->rd", q, self.w[code])
            self.add_terms(x, soft, (q * d_top).sum(), (q * self.w_norm[code]).sum(1), start)

    def add_terms(self, x: Tensor, soft: Tensor, distortion: Tensor, spread: Tensor, start: int) -> None:
        """A block's loss terms from its centred rows, soft codes, Σ q d and (per row) Σ_k q ‖w_k‖²; with
        ``keep_soft`` its soft codes (uncentred) -> rows of ``soft_rows``."""
        self.totals[0] += distortion
        self.totals[1] += (x - soft).pow(2).sum()
        self.totals[2] += (spread - soft.pow(2).sum(1)).clamp_min(0).sum()
        if self.soft_rows is not None:
            torch.add(soft, self.center, out=self.soft_rows[start:start + soft.shape[0]])


@torch.no_grad()
def soft_statistics(z: Tensor, codebook: Tensor, scale: float, rows: Optional[int] = None,
                    support: Optional[int] = None, split: bool = True, keep_soft: bool = False) -> SoftStatistics:
    """DDCL soft statistics of (N, D) ``z`` against a (K, D) ``codebook`` at softmax divisor ``scale``.

    In blocks of ``rows`` vectors (default :func:`statistics_rows`): extra memory O(rows·K); the hard index is the
    exact first minimum. ``support`` < K: each vector's softmax over its ``support`` nearest codes only.
    ``split=False`` leaves out the loss terms (NaN). ``keep_soft`` (needs ``split``) also returns the soft codes ẑ.
    """
    if not scale > 0:
        raise ValueError(f"expected a softmax scale > 0, got {scale!r}")
    n, k = z.shape[0], codebook.shape[0]
    truncated = support is not None and support < k
    if rows is None:
        rows = statistics_rows(k, z.device, truncated, num_rows=n, dim=z.shape[1], support=support,
                               itemsize=z.element_size())
    if keep_soft and not split:
        raise ValueError("keep_soft needs split=True (the soft codes are computed with the loss terms)")
    b = _Blocks(z, codebook, scale, rows, support if truncated else None, split, keep_soft)
    block = b.truncated if truncated else b.dense
    for start in range(0, n, rows):
        x, d = b.distances(z, start, min(rows, n - start))
        block(x, d, start)
    totals = b.totals / max(n, 1)
    sums = b.sums + b.mass[:, None] * b.center  # Σ_i q_ik (x_i + c) = Σ_i q_ik z_i
    if not split:
        totals[:] = float("nan")
    return SoftStatistics(indices=b.indices, nearest=b.nearest, mass=b.mass, sums=sums,
                          distortion=totals[0], ols=totals[1], variance=totals[2], soft=b.soft_rows)
