"""The fused and chunked DDCL assignment: one autograd function, :class:`DDCLFunction`, over row
blocks, with its backward written out by hand.

* fused (``store``): each N×K block is produced, used and dropped while it is still in cache; the
  N×K assignments q are kept for backward (on the CPU their buffer is reused from step to step:
  :func:`set_buffer_reuse`, :func:`release_buffers`);
* chunked: the same, but q is recomputed per block in backward: extra memory O(chunk·K).

The blocks of one call run on :mod:`ddcl_vq.cpu_pool` on the CPU; block sizes come from
:func:`ddcl_vq.blocks.block_rows`. :func:`ddcl_vq.assignment.assign` is the public entry.

Analytic backward of the blocked paths. With an upstream gradient G (N×D) on ẑ and g on L,
the gradient reaching d is

    ∂/∂d_ik = (g/N)·q_ik − (q_ik/s)·(G_i·w_k + (g/N)·d_ik − r_i),
    r_i     = Σ_k q_ik (G_i·w_k + (g/N) d_ik) = G_i·ẑ_i + (g/N)·Σ_k q_ik d_ik,

(the softmax Jacobian), and with dd = ∂/∂d and ẑ = qW:

    ∂/∂z_i = 2 Σ_k dd_ik (z_i − w_k)                = 2 (rowsum(dd)_i z_i − (dd W)_i)
    ∂/∂w_k = −2 Σ_i dd_ik (z_i − w_k) + (qᵀG)_k     = −2 (ddᵀZ)_k + 2 colsum(dd)_k w_k + (qᵀG)_k

with rowsum(dd)_i = g/N exactly (the Jacobian's part sums to zero over k). dd = q ⊙ b, and b
comes out of one matmul against the forward's own logit operand (d expanded as
‖zc‖² − 2 zc·wc + ‖wc‖², its (g/N)·d/s part folded into the row coefficients), so backward
needs q but not the logits: fused keeps q and runs no softmax and no N×K add in backward;
chunked recomputes q per block. Σ_k q_ik d_ik per row is ‖zc_i − ẑc_i‖² + (Σ_k q_ik ‖wc_k‖² −
‖ẑc_i‖²) (the decomposition itself), from N×D and K-vector products: no pass over N×K.

Matmuls: two forward (Z Wᵀ, q W), four backward (G Wᵀ, dd W, ddᵀ Z, qᵀ G) — the floor
for the full gradient. ``codebook_only`` (the ``straight_through`` mode: the assignment
sees sg(z), only the distortion is differentiated, only w gets gradient) needs a single
backward matmul, and because its only upstream is the scalar g it is computed in the
forward pass (ddᵀZ is linear in g): backward just scales a K×D tensor, nothing N×K is kept.

The blocked paths produce the same values as the reference path up to float rounding: same
centring, same clamped expansion ‖z‖² − 2 z·w + ‖w‖² (here summed inside one augmented
matmul), same stable softmax kernel; hard indices are the first minimum of the computed
distances (an exact argmin; only codes tied to within rounding can come out differently from
the reference's own rounding); the reported terms are ols = ‖z − ẑ‖² and variance =
Σ q‖w‖² − ‖ẑ‖² clamped at 0, as in the reference, and distortion = ols + variance per row
(the reference sums q·d; equal to rounding).
"""
from __future__ import annotations

import os
import threading
from typing import Dict, List, Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .blocks import first_argmax, softmax_into
from .cpu_pool import run_blocks

__all__ = ["DDCLFunction", "set_buffer_reuse", "release_buffers", "REUSE_MAX_BYTES", "REUSE_MAX_BUFFERS"]


class _Blocks:
    """Per-call constants shared by every block (read-only while the blocks run).

    Logits ℓ = −d/s come out of one matmul with augmented operands,
        [zc, 1, ‖zc‖²] @ [(2/s)·wcᵀ ; −‖wc‖²/s ; −1/s]  =  −(‖zc‖² − 2 zc·wc + ‖wc‖²)/s,
    then are clamped at 0 (d clamped at 0 as in the reference). No N×K add or scale pass.
    """

    def __init__(self, z: Tensor, w: Tensor, scale: float, rows: int):
        n, dim = z.shape
        k = w.shape[0]
        self.n, self.dim, self.k, self.rows, self.scale = n, dim, k, rows, scale
        self.z = z
        self.center = w.mean(0)
        self.wc = (w - self.center).contiguous()        # (K, D)
        self.wn = self.wc.pow(2).sum(1)                 # (K,)
        inv_s = 1.0 / scale
        a = w.new_empty(dim + 2, k)
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

#: The fused path keeps q (N×K) from forward to backward. On the CPU a fresh N×K tensor costs a
#: page fault per 4 KiB page on first touch (at N = K = 8192 about as much as everything but the
#: matmuls; docs/performance.md), so once backward is done with q its memory is kept for the
#: next forward of the same or a smaller size: at most ``REUSE_MAX_BUFFERS`` buffers per dtype of at
#: most ``REUSE_MAX_BYTES`` each, held between steps (what one step allocates anyway).
#: ``set_buffer_reuse(False)`` (or ``DDCL_VQ_REUSE_BUFFERS=0`` at import) turns it off;
#: ``release_buffers()`` frees what is held. Never on a GPU (its caching allocator does this).
#: A buffer is only taken back when the backward pass frees the graph (not under retain_graph or
#: create_graph), so a graph that is kept never shares its q with a later forward.
REUSE_MAX_BYTES = 1 << 30
REUSE_MAX_BUFFERS = 2
_REUSE = os.environ.get("DDCL_VQ_REUSE_BUFFERS", "1").strip().lower() not in ("0", "false", "no", "off")
_SPARE: Dict[torch.dtype, List[Tensor]] = {}
_SPARE_LOCK = threading.Lock()


def set_buffer_reuse(enabled: bool) -> bool:
    """Keep the fused path's q buffer between steps on the CPU (True, the default) or not.
    Returns the previous setting; turning it off frees what is held."""
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
    """True inside a backward pass that frees the graph (no retain_graph/create_graph); False when
    it is kept or this torch cannot tell."""
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


def _forward(z: Tensor, w: Tensor, scale: float, rows: int, store_q: bool, eager_codebook_grad: bool):
    n, dim = z.shape
    k = w.shape[0]
    inv_s = 1.0 / scale

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
        st = dict(za=c.new_za(), l=z.new_empty(c.width, k), counts=z.new_zeros(k),
                  q=None if store_q else z.new_empty(c.width, k), diff=z.new_empty(c.width, dim),
                  sq=z.new_empty(c.width))
        if eager_codebook_grad:
            st["acc"] = z.new_zeros(dim + 2, k)      # [zcᵀ e ; colsum(e) ; ·], e = ∂(Σ_k q d)/∂d
        return st

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
        # Σ_k q d = ‖zc − ẑc‖² + Σ_k q ‖wc − ẑc‖² (parallel axis): from N×D and K-vector products,
        # no pass over the N×K block
        dist = torch.add(ols, var, out=c.row_dist[i0:i1])
        if eager_codebook_grad:
            # e_ik = q_ik (1 − (d_ik − Σ_k q d)/s) = q_ik (1 + Σ_k q d / s + ℓ_ik)
            e = lg.add_((1.0 + dist * inv_s)[:, None]).mul_(q)
            st["acc"].addmm_(za.t(), e)

    def finish(c, states):
        counts = states[0]["counts"]
        for st in states[1:]:
            counts.add_(st["counts"])
        state = dict(soft_c=c.soft_c, row_dist=c.row_dist, q=c.q_all)
        if eager_codebook_grad:
            acc = states[0]["acc"]
            for st in states[1:]:
                acc.add_(st["acc"])
            # ∂L/∂w_k = −(2/N) Σ_i e_ik (zc_i − wc_k), L = mean_i Σ_k q d; backward scales by g.
            state["codebook_grad"] = (acc[:dim].t() - acc[dim][:, None] * c.wc).mul_(-2.0 / n)
        terms = (c.row_dist.mean(), c.row_ols.mean(), c.row_var.mean())
        return c.soft, c.indices, terms, counts, state

    return run_blocks(z, -(-n // rows), setup, make_state, body, finish)


def _backward(z: Tensor, w: Tensor, scale: float, rows: int, q_all: Optional[Tensor],
              soft_c: Tensor, row_dist: Tensor, g_soft: Optional[Tensor], g_dist: Optional[Tensor],
              need_z: bool, need_w: bool):
    n, dim = z.shape
    k = w.shape[0]
    gn = 0.0 if g_dist is None else float(g_dist) / n      # g / N

    def setup():
        c = _Blocks(z, w, scale, rows)
        c.grad_z = z.new_empty(n, dim) if need_z else None
        return c

    def make_state(c):
        width = c.width
        st = dict(za=c.new_za(), a=z.new_empty(width, dim + 2), p=z.new_empty(width, k),
                  acc=z.new_zeros(dim + 1, k) if need_w else None,   # [Gᵀq − 2 zcᵀdd ; colsum(dd)]
                  r=z.new_empty(width, dim + 1) if need_w else None)
        if q_all is None:                                        # chunked: q recomputed per block
            st["l"], st["q"] = z.new_empty(width, k), z.new_empty(width, k)
        return st

    def body(c, st, i0, i1):
        m = i1 - i0
        za = c.centred(st["za"], i0, i1)
        zc = za[:, :dim]
        if q_all is not None:
            q = q_all[i0:i1]
        else:
            q = softmax_into(c.logits(za, st["l"][:m]), st["q"][:m])
        # dd = q ⊙ b with b_ik = β_i − G_i·wc_k/s − (g/N) d_ik/s, β_i = r_i/s + g/N,
        # r_i = G_i·ẑc_i + (g/N) Σ_k q d.  Expanding d_ik = ‖zc_i‖² − 2 zc_i·wc_k + ‖wc_k‖², b is one
        # matmul against the logits' own right operand [2wcᵀ/s ; −‖wc‖²/s ; −1/s]:
        #     b = [(g/N) zc − G/2,  g/N,  (g/N)‖zc‖² − s β] @ logit_rhs
        # so backward needs q but not the logits (fused keeps q: no softmax, no N×K add here).
        a = torch.mul(za, gn, out=st["a"][:m])
        if g_soft is not None:
            gs = g_soft[i0:i1]
            a[:, :dim].sub_(gs, alpha=0.5)
            r = torch.linalg.vecdot(gs, soft_c[i0:i1]).add_(row_dist[i0:i1], alpha=gn)
        else:
            r = row_dist[i0:i1] * gn
        a[:, dim + 1].sub_(r).sub_(scale * gn)
        dd = torch.mm(a, c.logit_rhs, out=st["p"][:m]).mul_(q)
        if need_z:
            # ∂/∂z_i = 2 (rowsum(dd)_i zc_i − (dd wc)_i), and rowsum(dd)_i = g/N exactly (the softmax
            # Jacobian's rows sum to zero): no N×K row sum
            gz = torch.mm(dd, c.wc, out=c.grad_z[i0:i1])
            gz.mul_(-2.0).add_(zc, alpha=2.0 * gn)
        if need_w:
            acc = st["acc"]
            if g_soft is not None:
                acc[:dim].addmm_(gs.t(), q)                      # Gᵀq
            rb = st["r"][:m]
            torch.mul(zc, -2.0, out=rb[:, :dim])
            rb[:, dim] = 1.0
            acc.addmm_(rb.t(), dd)                               # −2 zcᵀdd ; colsum(dd)

    def finish(c, states):
        grad_w = None
        if need_w:
            acc = states[0]["acc"]
            for st in states[1:]:
                acc.add_(st["acc"])
            # ∂/∂w_k = (qᵀG)_k − 2 (ddᵀzc)_k + 2 colsum(dd)_k wc_k
            grad_w = acc[:dim].t().addcmul(acc[dim][:, None], c.wc, value=2.0)
        return c.grad_z, grad_w

    return run_blocks(z, -(-n // rows), setup, make_state, body, finish)


class DDCLFunction(torch.autograd.Function):
    """(z, w) -> (ẑ, L_q, ols, variance, indices, soft_counts) with an analytic backward.

    Only ẑ and L_q are differentiable (ols/variance/soft_counts are reported detached).
    ``codebook_only``: z gets no gradient and ẑ is not differentiable (straight-through
    mode); the codebook gradient of L_q is formed during forward, nothing N×K is kept.
    ``store``: keep the N×K assignments q for backward ("fused") or recompute them ("chunked").
    """

    @staticmethod
    def forward(ctx, z: Tensor, w: Tensor, scale: float, rows: int, codebook_only: bool,
                store: bool):
        need_z, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_needed = need_w if codebook_only else (need_z or need_w)
        eager = codebook_only and need_w
        store_q = store and grad_needed and not codebook_only
        soft, indices, (dist, ols, var), counts, st = _forward(z, w, scale, rows, store_q, eager)
        ctx.scale, ctx.rows, ctx.codebook_only = scale, rows, codebook_only
        if eager:
            ctx.save_for_backward(st["codebook_grad"])
        elif grad_needed:
            saved = (z, w, st["soft_c"], st["row_dist"]) + ((st["q"],) if store_q else ())
            ctx.save_for_backward(*saved)
        ctx.set_materialize_grads(False)
        # one call: each call replaces the set of non-differentiable outputs
        ctx.mark_non_differentiable(ols, var, indices, counts, *((soft,) if codebook_only else ()))
        return soft, dist, ols, var, indices, counts

    @staticmethod
    @once_differentiable
    def backward(ctx, g_soft, g_dist, _g_ols=None, _g_var=None, _g_idx=None, _g_counts=None):
        need_z, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        nothing = (None, None, None, None, None, None)
        if ctx.codebook_only:
            if g_dist is None or not need_w:
                return nothing
            (base,) = ctx.saved_tensors
            return None, base * g_dist, None, None, None, None
        if g_soft is None and g_dist is None:
            return nothing
        saved = ctx.saved_tensors
        z, w, soft_c, row_dist = saved[:4]
        q = saved[4] if len(saved) > 4 else None
        with torch.autocast(device_type=z.device.type, enabled=False):
            grad_z, grad_w = _backward(z, w, ctx.scale, ctx.rows, q, soft_c, row_dist,
                                       g_soft, g_dist, need_z, need_w)
        if q is not None:
            del saved
            _hold_q(q)                # the graph is freed after this backward: q's memory is free
        return grad_z, grad_w, None, None, None, None
