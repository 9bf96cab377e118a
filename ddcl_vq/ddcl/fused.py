"""The fused and chunked DDCL assignment: one autograd function, :class:`DDCLFunction`, over row
blocks, with its backward written out by hand.

* fused (``store``): each N×K block is produced, used and dropped while it is still in cache; the
  N×K assignments q are kept for backward (their CPU buffer reused: :func:`set_buffer_reuse`);
* chunked: the same, but q is recomputed per block in backward: extra memory O(chunk·K).

The blocks run on :mod:`ddcl_vq.ddcl.cpu_pool` on the CPU; :func:`ddcl_vq.ddcl.assignment.assign` is the public entry.

Analytic backward (z's gradient only: the codebook is a constant here, the M-step trains it). With an
upstream gradient G (N×D) on ẑ and g on L, the gradient reaching d is the softmax Jacobian's

    dd_ik = (g/N)·q_ik − (q_ik/s)·(G_i·w_k + (g/N)·d_ik − r_i),   r_i = G_i·ẑ_i + (g/N)·Σ_k q_ik d_ik,

and ∂/∂z_i = 2 Σ_k dd_ik (z_i − w_k) = 2 ((g/N) z_i − (dd W)_i) (rowsum(dd)_i = g/N exactly). dd = q ⊙ b,
and b comes out of one matmul against the forward's own logit operand, so backward needs q but not
the logits (fused keeps q; chunked recomputes it per block). Σ_k q_ik d_ik per row is
‖zc_i − ẑc_i‖² + (Σ_k q_ik ‖wc_k‖² − ‖ẑc_i‖²) (the decomposition itself): no pass over N×K.

The values equal the reference path's up to float rounding: same centring, same clamped expansion
‖z‖² − 2 z·w + ‖w‖² (here inside one augmented matmul), same softmax kernel; hard indices are the first
minimum of the computed distances.
"""
from __future__ import annotations

import os
import threading
from typing import Dict, List, Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..blocks import first_argmax, softmax_into
from .cpu_pool import run_blocks

__all__ = ["DDCLFunction", "set_buffer_reuse", "release_buffers", "REUSE_MAX_BYTES", "REUSE_MAX_BUFFERS"]


class _Blocks:
    """Per-call constants shared by every block. Logits ℓ = −d/s come out of one matmul with augmented
    operands, [zc, 1, ‖zc‖²] @ [(2/s)·wcᵀ ; −‖wc‖²/s ; −1/s], then are clamped at 0 (d ≥ 0)."""

    def __init__(self, z: Tensor, w: Tensor, scale: float, rows: int):
        n, dim = z.shape
        self.dim, self.z = dim, z
        self.center = w.mean(0)
        self.wc = (w - self.center).contiguous()        # (K, D)
        self.wn = self.wc.pow(2).sum(1)                 # (K,)
        inv_s = 1.0 / scale
        a = w.new_empty(dim + 2, w.shape[0])
        torch.mul(self.wc.t(), 2.0 * inv_s, out=a[:dim])
        torch.mul(self.wn, -inv_s, out=a[dim])
        a[dim + 1].fill_(-inv_s)
        self.logit_rhs = a                              # (D+2, K)
        self.bounds = [(i, min(i + rows, n)) for i in range(0, n, rows)]
        self.width = min(rows, n)

    def new_za(self) -> Tensor:
        za = self.z.new_empty(self.width, self.dim + 2)  # [zc, 1, ‖zc‖²] of one block
        za[:, self.dim].fill_(1.0)
        return za

    def centred(self, za_buf: Tensor, i0: int, i1: int) -> Tensor:
        """Fill a block's augmented rows; returns the (m, D+2) view (zc = [:, :D])."""
        m, dim = i1 - i0, self.dim
        za = za_buf[:m]
        zc = torch.sub(self.z[i0:i1], self.center, out=za[:, :dim])
        torch.linalg.vecdot(zc, zc, out=za[:, dim + 1])
        return za

    def logits(self, za: Tensor, out: Tensor) -> Tensor:
        """out ← −clamp(d, 0)/s for the block (one matmul, one clamp pass)."""
        return torch.mm(za, self.logit_rhs, out=out).clamp_max_(0.0)


# ----------------------------------------------------------------------------- q buffer reuse (CPU)

#: On the CPU, q's memory is kept after a backward for the next forward (a fresh N×K tensor page-faults): at most
#: REUSE_MAX_BUFFERS buffers per dtype of at most REUSE_MAX_BYTES each; ``DDCL_VQ_REUSE_BUFFERS=0`` turns it off.
REUSE_MAX_BYTES = 1 << 30
REUSE_MAX_BUFFERS = 2
_REUSE = os.environ.get("DDCL_VQ_REUSE_BUFFERS", "1").strip().lower() not in ("0", "false", "no", "off")
_SPARE: Dict[torch.dtype, List[Tensor]] = {}
_SPARE_LOCK = threading.Lock()


def set_buffer_reuse(enabled: bool) -> bool:
    """Keep the fused path's q buffer between steps on the CPU (True, the default) or not; -> the previous setting."""
    global _REUSE
    previous, _REUSE = _REUSE, bool(enabled)
    if not _REUSE:
        release_buffers()
    return previous


def release_buffers() -> int:
    """Free the q buffers held for reuse; returns the bytes freed."""
    with _SPARE_LOCK:
        freed = sum(b.numel() * b.element_size() for bufs in _SPARE.values() for b in bufs)
        _SPARE.clear()
    return freed


def _graph_is_freed_after_backward() -> bool:
    """True inside a backward pass that frees the graph; False when it is kept or this torch cannot tell."""
    probe = getattr(getattr(torch._C, "_autograd", None), "_get_current_graph_task_keep_graph", None)
    try:
        return probe is not None and not probe()
    except Exception:  # noqa: BLE001 - any doubt: do not reuse
        return False


def _new_q(n: int, k: int, like: Tensor) -> Tensor:
    """An (n, k) tensor for q: a held buffer when one fits (CPU), else a new one."""
    if _REUSE and like.device.type == "cpu":
        with _SPARE_LOCK:
            bufs = _SPARE.get(like.dtype, [])
            fits = [i for i, b in enumerate(bufs) if b.numel() >= n * k]
            if fits:
                buf = bufs.pop(min(fits, key=lambda i: bufs[i].numel()))
                return buf[: n * k].view(n, k)
    return like.new_empty(n, k)


def _hold_q(q: Tensor) -> None:
    """Keep q's memory for a later forward (called by backward when it is done with q)."""
    if not _REUSE or q.device.type != "cpu" or not _graph_is_freed_after_backward():
        return
    flat = q if q._base is None else q._base
    if not flat.is_contiguous() or flat.numel() * flat.element_size() > REUSE_MAX_BYTES:
        return
    flat = flat.view(-1)
    with _SPARE_LOCK:
        bufs = _SPARE.setdefault(flat.dtype, [])
        if any(b.data_ptr() == flat.data_ptr() for b in bufs):
            return
        bufs.append(flat)
        bufs.sort(key=Tensor.numel, reverse=True)
        del bufs[REUSE_MAX_BUFFERS:]                        # keep the largest


def _forward(z: Tensor, w: Tensor, scale: float, rows: int, store_q: bool):
    n, dim = z.shape
    k = w.shape[0]

    def setup():
        c = _Blocks(z, w, scale, rows)
        c.soft_c = z.new_empty(n, dim)              # ẑ − centre (kept for backward)
        c.soft = z.new_empty(n, dim)                # ẑ (the output)
        c.indices = torch.empty(n, dtype=torch.long, device=z.device)
        c.row_ols = z.new_empty(n)                  # ‖zc − ẑc‖² per row
        c.row_var = z.new_empty(n)                  # max(Σ_k q ‖wc‖² − ‖ẑc‖², 0) per row
        c.row_dist = z.new_empty(n)                 # Σ_k q d = ols + variance per row
        c.q_all = _new_q(n, k, z) if store_q else None
        return c

    def make_state(c):
        return dict(za=c.new_za(), l=z.new_empty(c.width, k), counts=z.new_zeros(k),
                    q=None if store_q else z.new_empty(c.width, k), diff=z.new_empty(c.width, dim),
                    sq=z.new_empty(c.width))

    def body(c, st, i0, i1):
        m = i1 - i0
        za = c.centred(st["za"], i0, i1)
        lg = c.logits(za, st["l"][:m])
        c.indices[i0:i1] = first_argmax(lg)
        q = softmax_into(lg, c.q_all[i0:i1] if store_q else st["q"][:m])
        st["counts"].add_(q.sum(0))
        sc = torch.mm(q, c.wc, out=c.soft_c[i0:i1])
        var = torch.mv(q, c.wn, out=c.row_var[i0:i1])
        torch.add(sc, c.center, out=c.soft[i0:i1])
        diff = torch.sub(za[:, :dim], sc, out=st["diff"][:m])
        ols = torch.linalg.vecdot(diff, diff, out=c.row_ols[i0:i1])
        var.sub_(torch.linalg.vecdot(sc, sc, out=st["sq"][:m])).clamp_min_(0.0)
        torch.add(ols, var, out=c.row_dist[i0:i1])       # Σ_k q d (parallel axis): no pass over N×K

    def finish(c, states):
        counts = states[0]["counts"]
        for st in states[1:]:
            counts.add_(st["counts"])
        terms = (c.row_dist.mean(), c.row_ols.mean(), c.row_var.mean())
        return c.soft, c.indices, terms, counts, dict(soft_c=c.soft_c, row_dist=c.row_dist, q=c.q_all)

    return run_blocks(z, -(-n // rows), setup, make_state, body, finish)


def _backward(z: Tensor, w: Tensor, scale: float, rows: int, q_all: Optional[Tensor],
              soft_c: Tensor, row_dist: Tensor, g_soft: Optional[Tensor], g_dist: Optional[Tensor]) -> Tensor:
    n, dim = z.shape
    k = w.shape[0]
    gn = 0.0 if g_dist is None else float(g_dist) / n      # g / N

    def setup():
        c = _Blocks(z, w, scale, rows)
        c.grad_z = z.new_empty(n, dim)
        return c

    def make_state(c):
        st = dict(za=c.new_za(), a=z.new_empty(c.width, dim + 2), p=z.new_empty(c.width, k))
        if q_all is None:                                        # chunked: q recomputed per block
            st["l"], st["q"] = z.new_empty(c.width, k), z.new_empty(c.width, k)
        return st

    def body(c, st, i0, i1):
        m = i1 - i0
        za = c.centred(st["za"], i0, i1)
        if q_all is not None:
            q = q_all[i0:i1]
        else:
            q = softmax_into(c.logits(za, st["l"][:m]), st["q"][:m])
        # dd = q ⊙ b with b_ik = β_i − G_i·wc_k/s − (g/N) d_ik/s, β_i = r_i/s + g/N. Expanding
        # d_ik = ‖zc_i‖² − 2 zc_i·wc_k + ‖wc_k‖², b is one matmul against the logits' right operand:
        #     b = [(g/N) zc − G/2,  g/N,  (g/N)‖zc‖² − s β] @ logit_rhs
        a = torch.mul(za, gn, out=st["a"][:m])
        if g_soft is not None:
            gs = g_soft[i0:i1]
            a[:, :dim].sub_(gs, alpha=0.5)
            r = torch.linalg.vecdot(gs, soft_c[i0:i1]).add_(row_dist[i0:i1], alpha=gn)
        else:
            r = row_dist[i0:i1] * gn
        a[:, dim + 1].sub_(r).sub_(scale * gn)
        dd = torch.mm(a, c.logit_rhs, out=st["p"][:m]).mul_(q)
        # ∂/∂z_i = 2 ((g/N) zc_i − (dd wc)_i): the softmax Jacobian's rows sum to zero
        torch.mm(dd, c.wc, out=c.grad_z[i0:i1]).mul_(-2.0).add_(za[:, :dim], alpha=2.0 * gn)

    return run_blocks(z, -(-n // rows), setup, make_state, body, lambda c, states: c.grad_z)


class DDCLFunction(torch.autograd.Function):
    """(z, w) -> (ẑ, L_q, ols, variance, indices, soft_counts) with an analytic backward to z.

    Only ẑ and L_q are differentiable, and only in z: the codebook ``w`` is a constant (the M-step
    trains it; :func:`ddcl_vq.ddcl.assignment.assign` refuses a codebook that asks for a gradient).
    ``store``: keep the N×K assignments q for backward ("fused") or recompute them ("chunked").
    """

    @staticmethod
    def forward(ctx, z: Tensor, w: Tensor, scale: float, rows: int, store: bool):
        need_z = ctx.needs_input_grad[0]
        store_q = store and need_z
        soft, indices, (dist, ols, var), counts, st = _forward(z, w, scale, rows, store_q)
        ctx.scale, ctx.rows = scale, rows
        if need_z:
            ctx.save_for_backward(z, w, st["soft_c"], st["row_dist"], *((st["q"],) if store_q else ()))
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(ols, var, indices, counts)
        return soft, dist, ols, var, indices, counts

    @staticmethod
    @once_differentiable
    def backward(ctx, g_soft, g_dist, _g_ols=None, _g_var=None, _g_idx=None, _g_counts=None):
        if g_soft is None and g_dist is None:
            return None, None, None, None, None
        z, w, soft_c, row_dist, *stored = ctx.saved_tensors
        q = stored[0] if stored else None
        with torch.autocast(device_type=z.device.type, enabled=False):
            grad_z = _backward(z, w, ctx.scale, ctx.rows, q, soft_c, row_dist, g_soft, g_dist)
        if q is not None:
            _hold_q(q)                # the graph is freed after this backward: q's memory is free
        return grad_z, None, None, None, None
