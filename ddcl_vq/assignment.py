"""The DDCL assignment: distances, soft assignments, soft codes, hard indices, distortion.

One concept, one result type. :func:`assign` maps (N, D) vectors and a (K, D) codebook to an
:class:`Assignment`; ``implementation`` picks how it is computed (same values and gradients,
to float rounding):

* ``"reference"``: plain autograd, several N×K tensors kept for backward; the only path that
  returns the assignment matrix q (and keeps ``ols``/``variance`` differentiable);
* ``"fused"``: rows in blocks, each N×K block produced, used and dropped while it is still in
  cache, with the backward written out by hand (:class:`ddcl_vq.fused.DDCLFunction`); keeps the N×K
  assignments q (on the CPU their buffer is reused from step to step, see
  :func:`ddcl_vq.fused.set_buffer_reuse`);
* ``"chunked"``: like fused, but recomputes each block in backward: extra memory O(chunk·K).

Users: :class:`~ddcl_vq.DDCLQuantizer` (which chooses the implementation per batch) and
:class:`~ddcl_vq.DDCLReadout` (reference path). This module imports neither; on CPU the
blocks of one call run on :mod:`ddcl_vq.cpu_pool`. Block sizes follow the device
(:func:`ddcl_vq.blocks.block_rows`): cache-sized on the CPU, the whole batch on a GPU while a
block's N×K tensors fit :data:`ddcl_vq.blocks.DEVICE_BLOCK_BUDGET_BYTES`.

Math (z_i ∈ R^D, W ∈ R^{K×D}, s = τ·D the softmax divisor; z and W are centred on the
codebook mean first, distances being translation invariant, so that large common offsets do
not cancel in ‖z‖² − 2 z·w + ‖w‖²):

    d_ik = ‖z_i − w_k‖²,  q = softmax_k(−d/s),  ẑ_i = Σ_k q_ik w_k,  L = mean_i Σ_k q_ik d_ik
    L = L_OLS + V,  L_OLS = mean_i ‖z_i − ẑ_i‖²,  V = mean_i Σ_k q_ik ‖w_k − ẑ_i‖² ≥ 0

The blocked paths live in :mod:`ddcl_vq.fused` (the autograd function, its analytic backward
and the CPU q buffer), their block policy in :mod:`ddcl_vq.blocks`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .base import squared_distances
from .blocks import block_rows
from .fused import DDCLFunction

__all__ = ["IMPLEMENTATIONS", "Assignment", "assign"]

#: how an assignment can be computed (the quantizer adds ``"auto"``: its own choice per batch)
IMPLEMENTATIONS = ("reference", "fused", "chunked")


@dataclass
class Assignment:
    """The DDCL assignment of N vectors to a K-code codebook.

    soft:        (N, D) soft codes ẑ_i = Σ_k q_ik w_k.
    indices:     (N,) long, hard argmin k*_i.
    distortion:  scalar L_q = mean_i Σ_k q_ik d_ik (sum over D, mean over vectors), differentiable.
    ols, variance: scalars L_OLS and V, distortion = ols + variance (to rounding); differentiable
                 on the reference path, detached on the fused/chunked paths.
    soft_counts: (K,) Σ_i q_ik, detached (for soft perplexity).
    q:           (N, K) assignments (rows on the simplex), differentiable; reference path only
                 (None on the fused/chunked paths, which never hold q as a whole).
    """

    soft: Tensor
    indices: Tensor
    distortion: Tensor
    ols: Tensor
    variance: Tensor
    soft_counts: Tensor
    q: Optional[Tensor] = None


def assign(z: Tensor, codebook: Tensor, scale: float, *, implementation: str = "reference",
           codebook_only: bool = False, chunk_size: Optional[int] = None,
           memory_budget_bytes: Optional[int] = None) -> Assignment:
    """DDCL assignment of (N, D) vectors ``z`` to a (K, D) ``codebook``.

    scale: the softmax divisor s = τ·D (> 0). ``implementation``: ``"reference"``, ``"fused"``
    or ``"chunked"`` (see the module docstring). ``codebook_only``: the straight-through mode's
    assignment — z is treated as constant and only the codebook receives the gradient of the
    distortion. ``chunk_size``: rows per block on the blocked paths (default: :func:`block_rows` —
    about CHUNK_ELEMENTS / K rows on the CPU, the whole batch on a GPU while a block's N×K tensors
    fit ``memory_budget_bytes``, default :data:`~ddcl_vq.blocks.DEVICE_BLOCK_BUDGET_BYTES`). The
    reference path computes in the inputs' dtype; the blocked paths keep float64 and compute
    everything else in float32, with autocast off.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"expected implementation in {IMPLEMENTATIONS}, got {implementation!r}")
    if not scale > 0:
        raise ValueError(f"expected a softmax scale > 0, got {scale!r}")
    if implementation == "reference":
        a = _reference(z.detach() if codebook_only else z, codebook, scale)
        a.soft_counts = a.q.detach().sum(0)
        return a
    return _blocked(z, codebook, scale, codebook_only, implementation == "fused", chunk_size, memory_budget_bytes)


def _reference(z: Tensor, codebook: Tensor, scale: float) -> Assignment:
    """Plain autograd (every intermediate kept by autograd)."""
    center = codebook.detach().mean(0)
    zc, wc = z - center, codebook - center
    d = squared_distances(zc, wc)                       # (N, K)
    q = torch.softmax(-d / scale, dim=1)                # (N, K), stable (max-subtracted)
    soft_c = q @ wc                                     # (N, D)
    distortion = (q * d).sum(1).mean()
    ols = (zc - soft_c).pow(2).sum(1).mean()
    # V_i = Σ_k q_ik ‖w_k‖² − ‖ẑ_i‖² (parallel-axis form, centred); ≥ 0 in exact arithmetic.
    variance = (q @ wc.pow(2).sum(1) - soft_c.pow(2).sum(1)).clamp_min(0).mean()
    return Assignment(soft=soft_c + center, indices=d.argmin(1), distortion=distortion, ols=ols,
                      variance=variance, soft_counts=None, q=q)


def _blocked(z: Tensor, codebook: Tensor, scale: float, codebook_only: bool, store: bool,
             chunk_size: Optional[int], memory_budget_bytes: Optional[int] = None) -> Assignment:
    """The fused (``store``: keep the N×K logits for backward) or chunked path."""
    if z.dim() != 2 or codebook.dim() != 2 or z.shape[1] != codebook.shape[1]:
        raise ValueError(f"expected z (N, D) and codebook (K, D), got {tuple(z.shape)} and {tuple(codebook.shape)}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size <= 0):
        raise ValueError(f"expected chunk_size to be a positive int or None, got {chunk_size!r}")
    dtype = torch.float64 if z.dtype == torch.float64 else torch.float32
    with torch.autocast(device_type=z.device.type, enabled=False):
        zz = z.to(dtype)
        ww = codebook.to(dtype)
        if codebook_only:
            zz = zz.detach()
        if z.shape[0] == 0:  # nothing to block; the reference path gives the same empty results
            a = _reference(zz, ww, scale)
            return Assignment(soft=a.soft.detach() if codebook_only else a.soft, indices=a.indices,
                              distortion=a.distortion, ols=a.ols.detach(), variance=a.variance.detach(),
                              soft_counts=a.q.detach().sum(0))
        rows = block_rows(z.device.type, z.shape[0], codebook.shape[0], itemsize=zz.element_size(),
                          memory_budget_bytes=memory_budget_bytes, chunk_size=chunk_size)
        soft, dist, ols, var, indices, counts = DDCLFunction.apply(
            zz.contiguous(), ww.contiguous(), float(scale), rows, bool(codebook_only), bool(store))
    return Assignment(soft=soft, indices=indices, distortion=dist, ols=ols, variance=var, soft_counts=counts)
