"""Fused and chunked DDCL assignment: one custom autograd Function, analytic backward.

The reference path (:func:`ddcl_vq.ddcl.soft_assignment`) is plain autograd: it keeps
several N×K tensors alive (distances, assignments, their products) and walks them again
in backward. This module computes the same quantities in blocks of rows so that each
N×K block is produced, used and dropped while it is still in cache, and writes the
backward out by hand (no graph of intermediates).

Math (z_i ∈ R^D centred on the codebook mean, W ∈ R^{K×D}, s = τ·D):

    d_ik = ‖z_i − w_k‖²,  q = softmax_k(−d/s),  ẑ_i = Σ_k q_ik w_k,  L = mean_i Σ_k q_ik d_ik

With an upstream gradient G (N×D) on ẑ and g on L, the gradient reaching d is

    ∂/∂d_ik = (g/N)·q_ik − (q_ik/s)·(G_i·w_k + (g/N)·d_ik − r_i),
    r_i     = Σ_k q_ik (G_i·w_k + (g/N) d_ik) = G_i·ẑ_i + (g/N)·Σ_k q_ik d_ik,

(the softmax Jacobian), and with dd = ∂/∂d and ẑ = qW:

    ∂/∂z_i = 2 Σ_k dd_ik (z_i − w_k)                = 2 (rowsum(dd)_i z_i − (dd W)_i)
    ∂/∂w_k = −2 Σ_i dd_ik (z_i − w_k) + (qᵀG)_k     = −2 (ddᵀZ)_k + 2 colsum(dd)_k w_k + (qᵀG)_k

Matmuls: two forward (Z Wᵀ, q W), four backward (G Wᵀ, dd W, ddᵀ Z, qᵀ G) — the floor
for the full gradient. ``codebook_only`` (the ``straight_through`` mode: the assignment
sees sg(z), only the distortion is differentiated, only w gets gradient) needs a single
backward matmul, and because its only upstream is the scalar g it is computed in the
forward pass (ddᵀZ is linear in g): backward just scales a K×D tensor, nothing N×K is kept.

Two memory policies for the full gradient:

* ``"fused"`` keeps the clamped distances d (one N×K tensor) for backward and recomputes
  q = softmax(−d/s) from them block by block;
* ``"chunked"`` keeps only O(N·D + K·D) tensors and recomputes d and q per block in
  backward (one extra N×D·D×K matmul), so extra memory is O(chunk·K).

Both produce the same values as the reference path up to float rounding: same centring
on the codebook mean, same clamped expansion ‖z‖² − 2 z·w + ‖w‖², same stable softmax,
hard indices are the exact first argmin of the same distances, and the reported terms are
computed as in the reference (distortion = Σ q d, ols = ‖z − ẑ‖², variance = Σ q‖w‖² − ‖ẑ‖²
clamped at 0), so distortion = ols + variance holds to rounding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

IMPLEMENTATIONS = ("auto", "reference", "fused", "chunked")

#: rows per block are chosen so that one (rows × K) block has about this many elements …
CHUNK_ELEMENTS = 1 << 18
#: … but never fewer rows than this (skinny matmuls are slow) nor more than this.
MIN_CHUNK_ROWS = 32
MAX_CHUNK_ROWS = 1024
#: block width for the exact two-level argmin (see :func:`first_argmin`).
_ARGMIN_BLOCK = 128


def chunk_rows(num_rows: int, num_codes: int, chunk_size: Optional[int] = None) -> int:
    """Rows per block: ``chunk_size`` if given, else ≈ CHUNK_ELEMENTS / K within the bounds."""
    if chunk_size is None:
        chunk_size = min(MAX_CHUNK_ROWS, max(MIN_CHUNK_ROWS, CHUNK_ELEMENTS // max(num_codes, 1)))
    return max(1, min(int(chunk_size), max(num_rows, 1)))


def first_argmin(d: Tensor) -> Tensor:
    """``d.argmin(1)`` for a (rows, K) matrix, exactly (first minimal index), but faster.

    ``argmin`` along a row is not vectorised on CPU (≈1 ns per element, as much as a
    matmul's share); ``amin`` is. Block minima over groups of ``_ARGMIN_BLOCK`` columns,
    the first block holding the row minimum, then argmin inside that one block: the same
    index as the plain argmin, for ~1/6 of the cost.
    """
    rows, k = d.shape
    b = _ARGMIN_BLOCK
    nb = k // b
    if nb < 2 or not d.is_contiguous() or d.device.type != "cpu":
        return d.argmin(1)
    block_min = d[:, : nb * b].view(rows, nb, b).amin(2)
    if nb * b < k:
        block_min = torch.cat([block_min, d[:, nb * b:].amin(1, keepdim=True)], 1)
    start = block_min.argmin(1) * b
    cols = (start[:, None] + torch.arange(b, device=d.device)).clamp_max_(k - 1)
    return start + d.gather(1, cols).argmin(1)


@dataclass
class FastAssignment:
    """Result of :func:`ddcl_assign` (the fused/chunked counterpart of ``SoftAssignment``).

    soft: (N, D) soft codes ẑ; indices: (N,) hard argmin; distortion: scalar (differentiable);
    ols, variance: detached scalars (distortion = ols + variance); soft_counts: (K,) Σ_i q_ik,
    detached. The N×K assignment matrix q is never materialised as a whole.
    """

    soft: Tensor
    indices: Tensor
    distortion: Tensor
    ols: Tensor
    variance: Tensor
    soft_counts: Tensor


class _Blocks:
    """Shared per-call state: centred codebook, its norms, block bounds."""

    def __init__(self, w: Tensor, num_rows: int, rows: int):
        self.center = w.mean(0)
        self.wc = w - self.center                 # (K, D)
        self.wct = self.wc.t()                    # (D, K) view, BLAS takes it transposed
        self.wn = self.wc.pow(2).sum(1)           # (K,)
        self.bounds = [(i, min(i + rows, num_rows)) for i in range(0, num_rows, rows)]


def _distances(zc: Tensor, blk: _Blocks, out: Tensor) -> Tensor:
    """out ← clamp(‖zc‖² + ‖wc‖² − 2 zc·wc, 0): the reference's squared distances."""
    torch.addmm(blk.wn, zc, blk.wct, beta=1.0, alpha=-2.0, out=out)
    out.add_(zc.pow(2).sum(1, keepdim=True)).clamp_min_(0.0)
    return out


def _softmax(d: Tensor, neg_inv_scale: float, out: Tensor) -> Tensor:
    """out ← softmax(−d/s) along rows (the library's stable, max-subtracted kernel)."""
    torch.mul(d, neg_inv_scale, out=out)
    return torch._softmax(out, 1, False, out=out)


def _forward(z: Tensor, w: Tensor, scale: float, rows: int, store_d: bool,
             eager_codebook_grad: bool):
    n, dim = z.shape
    k = w.shape[0]
    blk = _Blocks(w, n, rows)
    neg_inv_s = -1.0 / scale
    soft_c = z.new_empty(n, dim)
    indices = torch.empty(n, dtype=torch.long, device=z.device)
    row_dist = z.new_empty(n)
    row_ols = z.new_empty(n)
    row_var = z.new_empty(n)
    counts = z.new_zeros(k)
    d_all = z.new_empty(n, k) if store_d else None
    width = min(rows, n)
    d_buf = None if store_d else z.new_empty(width, k)
    q_buf = z.new_empty(width, k)
    if eager_codebook_grad:
        grad_base = z.new_zeros(k, dim)           # Σ_i e_ik zc_i, e = ∂(Σ_k q d)/∂d
        grad_cols = z.new_zeros(k)                # Σ_i e_ik
    for i0, i1 in blk.bounds:
        m = i1 - i0
        zc = z[i0:i1] - blk.center
        d = d_all[i0:i1] if store_d else d_buf[:m]
        _distances(zc, blk, d)
        indices[i0:i1] = first_argmin(d)
        q = _softmax(d, neg_inv_s, q_buf[:m])
        torch.linalg.vecdot(q, d, out=row_dist[i0:i1])
        counts.add_(q.sum(0))
        sc = torch.mm(q, blk.wc, out=soft_c[i0:i1])
        row_ols[i0:i1] = (zc - sc).pow_(2).sum(1)
        row_var[i0:i1] = torch.mv(q, blk.wn).sub_(sc.pow(2).sum(1)).clamp_min_(0.0)
        if eager_codebook_grad:
            # e_ik = q_ik (1 − (d_ik − Σ_k q_ik d_ik)/s): ∂/∂d of Σ_k q d through the softmax.
            e = torch.add((1.0 + row_dist[i0:i1] / scale)[:, None], d, alpha=neg_inv_s, out=d).mul_(q)
            grad_base.addmm_(e.t(), zc)
            grad_cols.add_(e.sum(0))
    state = dict(blk=blk, soft_c=soft_c, row_dist=row_dist, d_all=d_all)
    if eager_codebook_grad:
        # ∂L/∂w_k = −(2/N) Σ_i e_ik (zc_i − wc_k), L = mean_i Σ_k q d; backward scales by g.
        state["codebook_grad"] = (-2.0 / n) * (grad_base - grad_cols[:, None] * blk.wc)
    terms = (row_dist.mean(), row_ols.mean(), row_var.mean())
    return soft_c + blk.center, indices, terms, counts, state


def _backward(z: Tensor, w: Tensor, scale: float, rows: int, d_all: Optional[Tensor],
              soft_c: Tensor, row_dist: Tensor, g_soft: Optional[Tensor], g_dist: Optional[Tensor],
              need_z: bool, need_w: bool):
    n, dim = z.shape
    k = w.shape[0]
    blk = _Blocks(w, n, rows)
    neg_inv_s = -1.0 / scale
    gn = 0.0 if g_dist is None else float(g_dist) / n       # g / N
    width = min(rows, n)
    d_buf = z.new_empty(width, k) if d_all is None else None
    q_buf = z.new_empty(width, k)
    p_buf = z.new_empty(width, k)
    grad_z = z.new_empty(n, dim) if need_z else None
    grad_w = z.new_zeros(k, dim) if need_w else None
    cols = z.new_zeros(k) if need_w else None
    for i0, i1 in blk.bounds:
        m = i1 - i0
        zc = z[i0:i1] - blk.center
        if d_all is not None:
            d = d_all[i0:i1]
        else:
            d = _distances(zc, blk, d_buf[:m])    # bitwise the forward's blocks
        q = _softmax(d, neg_inv_s, q_buf[:m])
        if g_soft is not None:
            gs = g_soft[i0:i1]
            # p = G·w_k + (g/N) d_ik ;  r_i = G_i·ẑ_i + (g/N) Σ_k q d
            p = torch.addmm(d, gs, blk.wct, beta=gn, alpha=1.0, out=p_buf[:m])
            r = torch.linalg.vecdot(gs, soft_c[i0:i1]).add_(row_dist[i0:i1], alpha=gn)
        else:
            p = torch.mul(d, gn, out=p_buf[:m])
            r = row_dist[i0:i1] * gn
        # dd = q ⊙ (g/N − (p − r)/s)
        dd = torch.add((gn + r / scale)[:, None], p, alpha=neg_inv_s, out=p).mul_(q)
        if need_z:
            gz = torch.mm(dd, blk.wc, out=grad_z[i0:i1])
            gz.mul_(-2.0).addcmul_(zc, dd.sum(1, keepdim=True), value=2.0)
        if need_w:
            grad_w.addmm_(dd.t(), zc, alpha=-2.0)
            cols.add_(dd.sum(0))
            if g_soft is not None:
                grad_w.addmm_(q.t(), gs)
    if need_w:
        grad_w.addcmul_(cols[:, None], blk.wc, value=2.0)
    return grad_z, grad_w


class DDCLFunction(torch.autograd.Function):
    """(z, w) -> (ẑ, L_q, ols, variance, indices, soft_counts) with an analytic backward.

    Only ẑ and L_q are differentiable (ols/variance/soft_counts are reported detached).
    ``codebook_only``: z gets no gradient and ẑ is not differentiable (straight-through
    mode); the codebook gradient of L_q is formed during forward, nothing N×K is kept.
    ``store``: keep the N×K distances for backward ("fused") or recompute them ("chunked").
    """

    @staticmethod
    def forward(ctx, z: Tensor, w: Tensor, scale: float, rows: int, codebook_only: bool,
                store: bool):
        need_z, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_needed = need_w if codebook_only else (need_z or need_w)
        eager = codebook_only and need_w
        store_d = store and grad_needed and not codebook_only
        soft, indices, (dist, ols, var), counts, st = _forward(z, w, scale, rows, store_d, eager)
        ctx.scale, ctx.rows, ctx.codebook_only = scale, rows, codebook_only
        if eager:
            ctx.save_for_backward(st["codebook_grad"])
        elif grad_needed:
            saved = (z, w, st["soft_c"], st["row_dist"]) + ((st["d_all"],) if store_d else ())
            ctx.save_for_backward(*saved)
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(ols, var, indices, counts)
        if codebook_only:
            ctx.mark_non_differentiable(soft)
        return soft, dist, ols, var, indices, counts

    @staticmethod
    def backward(ctx, g_soft, g_dist, _g_ols=None, _g_var=None, _g_idx=None, _g_counts=None):
        need_z, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if ctx.codebook_only:
            if g_dist is None or not need_w:
                return None, None, None, None, None, None
            (base,) = ctx.saved_tensors
            return None, base * g_dist, None, None, None, None
        if g_soft is None and g_dist is None:
            return None, None, None, None, None, None
        saved = ctx.saved_tensors
        z, w, soft_c, row_dist = saved[:4]
        d_all = saved[4] if len(saved) > 4 else None
        with torch.autocast(device_type=z.device.type, enabled=False):
            grad_z, grad_w = _backward(z, w, ctx.scale, ctx.rows, d_all, soft_c, row_dist,
                                       g_soft, g_dist, need_z, need_w)
        return grad_z, grad_w, None, None, None, None


def ddcl_assign(z: Tensor, codebook: Tensor, scale: float, *, codebook_only: bool = False,
                implementation: str = "fused", chunk_size: Optional[int] = None) -> FastAssignment:
    """Fused/chunked DDCL assignment of (N, D) vectors to a (K, D) codebook.

    scale: softmax divisor τ·D (> 0). ``implementation``: ``"fused"`` (keeps the N×K
    distances for backward) or ``"chunked"`` (recomputes them per block; extra memory
    O(chunk·K)). ``codebook_only``: the straight-through mode's assignment — z is treated
    as constant and only the codebook receives the gradient of the distortion.
    ``chunk_size``: rows per block (default: about CHUNK_ELEMENTS / K rows).
    Float64 stays float64; anything else is computed in float32 with autocast off.
    """
    if implementation not in ("fused", "chunked"):
        raise ValueError(f"expected implementation 'fused' or 'chunked', got {implementation!r}")
    if not scale > 0:
        raise ValueError(f"expected a softmax scale > 0, got {scale!r}")
    if z.dim() != 2 or codebook.dim() != 2 or z.shape[1] != codebook.shape[1]:
        raise ValueError(f"expected z (N, D) and codebook (K, D), got {tuple(z.shape)} and {tuple(codebook.shape)}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size <= 0):
        raise ValueError(f"expected chunk_size to be a positive int or None, got {chunk_size!r}")
    dtype = torch.float64 if z.dtype == torch.float64 else torch.float32
    rows = chunk_rows(z.shape[0], codebook.shape[0], chunk_size)
    with torch.autocast(device_type=z.device.type, enabled=False):
        zz = z.to(dtype).contiguous()
        ww = codebook.to(dtype).contiguous()
        if codebook_only:
            zz = zz.detach()
        soft, dist, ols, var, indices, counts = DDCLFunction.apply(
            zz, ww, float(scale), rows, bool(codebook_only), implementation == "fused")
    return FastAssignment(soft=soft, indices=indices, distortion=dist, ols=ols, variance=var,
                          soft_counts=counts)
