"""The DDCL assignment: distances, soft assignments, soft codes, hard indices, distortion.

:func:`assign` maps (N, D) vectors and a (K, D) codebook to an :class:`Assignment`;
``implementation`` picks how it is computed (same values and z-gradients, to float rounding):

* ``"reference"``: plain autograd, several N×K tensors kept for backward; the only path that
  returns the assignment matrix q and differentiates the codebook (:class:`~ddcl_vq.DDCLReadout`'s);
* ``"fused"``: rows in blocks, each N×K block produced, used and dropped while it is still in
  cache, with z's gradient written out by hand (:class:`ddcl_vq.ddcl.fused.DDCLFunction`); keeps q;
* ``"chunked"``: like fused, but recomputes each block in backward: extra memory O(chunk·K).

Math (s the softmax divisor; z and W are centred on the codebook mean first):

    d_ik = ‖z_i − w_k‖²,  q = softmax_k(−d/s),  ẑ_i = Σ_k q_ik w_k,  L = mean_i Σ_k q_ik d_ik
    L = L_OLS + V,  L_OLS = mean_i ‖z_i − ẑ_i‖²,  V = mean_i Σ_k q_ik ‖w_k − ẑ_i‖² ≥ 0
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ..base import compute_dtype, squared_distances
from ..blocks import block_rows
from .fused import DDCLFunction

__all__ = ["IMPLEMENTATIONS", "Assignment", "assign"]

#: how an assignment can be computed (the quantizer adds ``"auto"``: its own choice per batch)
IMPLEMENTATIONS = ("reference", "fused", "chunked")


@dataclass
class Assignment:
    """The DDCL assignment of N vectors to a K-code codebook.

    soft (N, D) soft codes ẑ; indices (N,) hard argmin; distortion, the differentiable scalar L_q;
    ols, variance: L_OLS and V (differentiable on the reference path only); soft_counts (K,) Σ_i q_ik,
    detached; q (N, K), the assignments, on the reference path only.
    """

    soft: Tensor
    indices: Tensor
    distortion: Tensor
    ols: Tensor
    variance: Tensor
    soft_counts: Tensor
    q: Optional[Tensor] = None


def assign(z: Tensor, codebook: Tensor, scale: float, *, implementation: str = "reference",
           chunk_size: Optional[int] = None, memory_budget_bytes: Optional[int] = None) -> Assignment:
    """DDCL assignment of (N, D) vectors ``z`` to a (K, D) ``codebook``.

    scale: the softmax divisor s (> 0). ``implementation``: ``"reference"``, ``"fused"`` or ``"chunked"``; the
    blocked paths refuse a codebook that requires a gradient and compute in float32 (float64 stays) in blocks of
    ``chunk_size`` rows (default :func:`block_rows` within ``memory_budget_bytes``).
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"expected implementation in {IMPLEMENTATIONS}, got {implementation!r}")
    if not scale > 0:
        raise ValueError(f"expected a softmax scale > 0, got {scale!r}")
    if implementation == "reference":
        return _reference(z, codebook, scale)
    if codebook.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"expected a codebook without gradient on the {implementation} path (it differentiates z "
                         "only); use implementation='reference' to differentiate the codebook")
    if z.dim() != 2 or codebook.dim() != 2 or z.shape[1] != codebook.shape[1]:
        raise ValueError(f"expected z (N, D) and codebook (K, D), got {tuple(z.shape)} and {tuple(codebook.shape)}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size <= 0):
        raise ValueError(f"expected chunk_size to be a positive int or None, got {chunk_size!r}")
    dtype = compute_dtype(z)
    with torch.autocast(device_type=z.device.type, enabled=False):
        zz, ww = z.to(dtype), codebook.to(dtype)
        if z.shape[0] == 0:  # nothing to block; the reference path gives the same empty results
            a = _reference(zz, ww, scale)
            a.ols, a.variance, a.q = a.ols.detach(), a.variance.detach(), None
            return a
        rows = block_rows(z.device.type, z.shape[0], codebook.shape[0], itemsize=zz.element_size(),
                          memory_budget_bytes=memory_budget_bytes, chunk_size=chunk_size)
        soft, dist, ols, var, indices, counts = DDCLFunction.apply(
            zz.contiguous(), ww.contiguous(), float(scale), rows, implementation == "fused")
    return Assignment(soft=soft, indices=indices, distortion=dist, ols=ols, variance=var, soft_counts=counts)


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
                      variance=variance, soft_counts=q.detach().sum(0), q=q)

