"""The DDCL assignment: distances, soft assignments, soft codes, hard indices, distortion.

One concept, one result type. :func:`assign` maps (N, D) vectors and a (K, D) codebook to an
:class:`Assignment`; ``implementation`` picks how it is computed (same values and gradients,
to float rounding):

* ``"reference"``: plain autograd, several N×K tensors kept for backward; the only path that
  returns the assignment matrix q (and keeps ``ols``/``variance`` differentiable);
* ``"fused"``: rows in blocks, each N×K block produced, used and dropped while it is still in
  cache, with the backward written out by hand (:class:`DDCLFunction`); keeps the N×K
  assignments q (on the CPU their buffer is reused from step to step, see ``set_buffer_reuse``);
* ``"chunked"``: like fused, but recomputes each block in backward: extra memory O(chunk·K).

Users: :class:`~ddcl_vq.DDCLQuantizer` (which chooses the implementation per batch) and
:class:`~ddcl_vq.DDCLReadout` (reference path). This module imports neither; on CPU the
blocks of one call run on :mod:`ddcl_vq.cpu_pool`. Block sizes follow the device
(:func:`block_rows`): cache-sized on the CPU, the whole batch on a GPU while a block's N×K
tensors fit :data:`DEVICE_BLOCK_BUDGET_BYTES`.

Math (z_i ∈ R^D, W ∈ R^{K×D}, s = τ·D the softmax divisor; z and W are centred on the
codebook mean first, distances being translation invariant, so that large common offsets do
not cancel in ‖z‖² − 2 z·w + ‖w‖²):

    d_ik = ‖z_i − w_k‖²,  q = softmax_k(−d/s),  ẑ_i = Σ_k q_ik w_k,  L = mean_i Σ_k q_ik d_ik
    L = L_OLS + V,  L_OLS = mean_i ‖z_i − ẑ_i‖²,  V = mean_i Σ_k q_ik ‖w_k − ẑ_i‖² ≥ 0

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
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .base import squared_distances
from .cpu_pool import run_blocks

__all__ = ["IMPLEMENTATIONS", "Assignment", "assign", "SoftStatistics", "soft_statistics", "DDCLFunction", "block_rows",
           "chunk_rows", "first_argmax", "first_argmin", "first_min", "statistics_rows", "set_buffer_reuse",
           "release_buffers"]

#: how an assignment can be computed (the quantizer adds ``"auto"``: its own choice per batch)
IMPLEMENTATIONS = ("reference", "fused", "chunked")

#: CPU: rows per block are chosen so that one (rows × K) block has about this many elements …
CHUNK_ELEMENTS = 1 << 18
#: … but never fewer rows than this (skinny matmuls are slow) nor more than this.
MIN_CHUNK_ROWS = 64
MAX_CHUNK_ROWS = 1024
#: GPUs (any device but the CPU): one block for the whole batch while the N×K tensors that one
#: block holds at once fit this many bytes; above it, equal blocks that each fit. Launches, not
#: cache, are what costs there: dozens of small blocks per call would be dozens of kernel
#: launches per op. Read at each call, so it can be changed at run time.
DEVICE_BLOCK_BUDGET_BYTES = 1 << 30
#: N×K-sized tensors one block of the fused/chunked paths holds at once (the chunked backward:
#: the recomputed logits, q and dd), plus one for the softmax's own temporaries.
BLOCK_LIVE_TENSORS = 4
#: block width for the exact two-level argmin (see :func:`first_argmin`).
_ARGMIN_BLOCK = 128


def block_rows(device_type: str, num_rows: int, num_codes: int, *, itemsize: int = 4,
               memory_budget_bytes: Optional[int] = None, chunk_size: Optional[int] = None,
               live_tensors: int = BLOCK_LIVE_TENSORS, cache_elements: int = CHUNK_ELEMENTS,
               max_cache_rows: int = MAX_CHUNK_ROWS) -> int:
    """Rows per block of a blocked computation over ``num_rows`` × ``num_codes`` (a pure function).

    * ``chunk_size`` given: that (at most ``num_rows``), whatever the device.
    * ``device_type == "cpu"``: cache-sized blocks, ≈ ``cache_elements`` / K rows within
      ``MIN_CHUNK_ROWS`` .. ``max_cache_rows``.
    * any other device (``"cuda"`` …): the whole batch in one block while its ``live_tensors``
      (rows × K) tensors of ``itemsize`` bytes fit ``memory_budget_bytes`` (default
      :data:`DEVICE_BLOCK_BUDGET_BYTES`, 1 GiB); above it, the fewest equal blocks that fit (at
      least one row each).

    Always at least 1 and at most ``max(num_rows, 1)``.
    """
    n = max(int(num_rows), 1)
    if chunk_size is not None:
        return max(1, min(int(chunk_size), n))
    k = max(int(num_codes), 1)
    if device_type == "cpu":
        return max(1, min(n, max_cache_rows, max(MIN_CHUNK_ROWS, cache_elements // k)))
    budget = DEVICE_BLOCK_BUDGET_BYTES if memory_budget_bytes is None else memory_budget_bytes
    fit = max(1, int(budget) // (k * max(int(itemsize), 1) * max(int(live_tensors), 1)))
    if fit >= n:
        return n
    blocks = -(-n // fit)
    return -(-n // blocks)                              # equal blocks, each within the budget


def chunk_rows(num_rows: int, num_codes: int, chunk_size: Optional[int] = None) -> int:
    """Rows per block on the CPU: ``chunk_size`` if given, else ≈ CHUNK_ELEMENTS / K within the bounds."""
    return block_rows("cpu", num_rows, num_codes, chunk_size=chunk_size)


def _first_extreme(x: Tensor, largest: bool) -> Tuple[Tensor, Tensor]:
    """``x.max(1)`` / ``x.min(1)`` of a (rows, K) matrix (values, first extreme index), exactly,
    but faster on the CPU.

    A reduction with its index along a row is not vectorised on the CPU (≈1 ns per element, as
    much as a matmul's share); ``amax``/``amin`` are. Block extremes over groups of
    ``_ARGMIN_BLOCK`` columns, the first block holding the row's extreme, then the indexed
    reduction inside that one block only: the same value and index (ties go to the first).
    """
    rows, k = x.shape
    b = _ARGMIN_BLOCK
    nb = k // b
    if nb < 2 or not x.is_contiguous() or x.device.type != "cpu":
        return x.max(1) if largest else x.min(1)
    head = x[:, : nb * b].view(rows, nb, b)
    block = head.amax(2) if largest else head.amin(2)
    if nb * b < k:
        tail = x[:, nb * b:]
        block = torch.cat([block, tail.amax(1, keepdim=True) if largest else tail.amin(1, keepdim=True)], 1)
    start = (block.argmax(1) if largest else block.argmin(1)).mul_(b)
    cols = (start[:, None] + torch.arange(b, device=x.device)).clamp_max_(k - 1)
    inside = x.gather(1, cols)
    values, offset = inside.max(1) if largest else inside.min(1)
    return values, start.add_(offset)


def first_argmax(x: Tensor) -> Tensor:
    """``x.argmax(1)`` for a (rows, K) matrix, exactly (first maximal index), but faster on the CPU."""
    return _first_extreme(x, True)[1]


def first_min(d: Tensor) -> Tuple[Tensor, Tensor]:
    """``d.min(1)`` (values, first minimal index) exactly, but faster on the CPU."""
    return _first_extreme(d, False)


def first_argmin(d: Tensor) -> Tensor:
    """``d.argmin(1)`` exactly (first minimal index), but faster on the CPU."""
    return _first_extreme(d, False)[1]


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
    fit ``memory_budget_bytes``, default :data:`DEVICE_BLOCK_BUDGET_BYTES`). The reference path computes in the inputs' dtype; the blocked paths
    keep float64 and compute everything else in float32, with autocast off.
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


# ----------------------------------------------------------------------------- blocked paths


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


def _softmax_public(logits: Tensor, out: Tensor) -> Tensor:
    """out ← softmax(logits) along rows through the public API (one extra block temporary)."""
    return out.copy_(torch.softmax(logits, 1))


def _softmax_into(logits: Tensor, out: Tensor) -> Tensor:
    """out ← softmax(logits) along rows, written in place by the library's own kernel."""
    return torch._softmax(logits, 1, False, out=out)


def _pick_softmax():
    """The private out= kernel (the one torch.softmax runs) when this torch has it and it agrees
    with torch.softmax; else the public fallback."""
    if not hasattr(torch, "_softmax"):
        return _softmax_public
    try:
        probe = torch.tensor([[0.0, 1.0, -2.0]])
        out = torch.empty_like(probe)
        _softmax_into(probe, out)
        if torch.equal(out, torch.softmax(probe, 1)):
            return _softmax_into
    except Exception:  # noqa: BLE001 - any failure means: use the public API
        pass
    return _softmax_public


_softmax = _pick_softmax()


# ----------------------------------------------------------------------------- q buffer reuse (CPU)

#: The fused path keeps q (N×K) from forward to backward. On the CPU a fresh N×K tensor costs a
#: page fault per 4 KiB page on first touch (measured on a 2-core VM: 0.19 s for N = K = 8192, as
#: much as everything but the matmuls), so once backward is done with q its memory is kept for the
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
        q = _softmax(lg, c.q_all[i0:i1] if store_q else st["q"][:m])
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
            q = _softmax(c.logits(za, st["l"][:m]), st["q"][:m])
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
#: … on the truncated path larger blocks (on a GPU: :func:`block_rows`' memory budget).
STATISTICS_BLOCK_ELEMENTS_LARGE = 1 << 22


def statistics_rows(num_codes: int, device: torch.device | str = "cpu", truncated: bool = False, *,
                    num_rows: Optional[int] = None, dim: int = 1, support: Optional[int] = None,
                    itemsize: int = 4) -> int:
    """Rows per block of :func:`soft_statistics` by default. On the CPU: a multiple of 64 (BLAS
    kernels give a row the same bits whatever block it is in more reliably for such blocks) from
    64 to 4096. On a GPU, given ``num_rows``: :func:`block_rows` — the whole batch while the block's
    N×K-sized tensors fit :data:`DEVICE_BLOCK_BUDGET_BYTES` (the dense path's distances, shifted
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
                    support: Optional[int] = None) -> SoftStatistics:
    """DDCL soft statistics of (N, D) ``z`` against a (K, D) ``codebook`` at softmax divisor ``scale``.

    Computed in blocks of ``rows`` vectors (default :func:`statistics_rows`: on the CPU ≈ 2**18 / K,
    a block that stays in cache, or ≈ 2**22 / K with a truncated ``support``, whose top-k gains
    nothing from smaller blocks, 64 to 4096; on a GPU the whole batch while the block fits
    :data:`DEVICE_BLOCK_BUDGET_BYTES`, see :func:`block_rows`), so extra memory is
    O(rows·K) whatever N is; nothing is kept for autograd. Same centring, distance expansion and
    stable softmax as :func:`assign`; q is shifted by each row's minimum distance before the
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
        # per block: one matmul for the distances, then (dense) one for Σ q z and one for ẑ, every
        # N×K pass (expansion, clamp, minimum, shift, softmax, q·d) in place on a cached block;
        # (truncated) a top-k of the block's distances and O(rows·support·D) work
        width = min(rows, n)
        w_t = w.t()
        w_norm = (w * w).sum(1)                       # as squared_distances computes ‖w‖²
        x_buf, soft_buf = z.new_empty(width, z.shape[1]), z.new_empty(width, z.shape[1])
        d_buf = z.new_empty(width, k)
        if not truncated:
            l_buf, q_buf = z.new_empty(width, k), z.new_empty(width, k)
        for start in range(0, n, rows):
            m = min(rows, n - start)
            x = torch.sub(z[start:start + m], center, out=x_buf[:m])
            # squared_distances(x, w) bit for bit: ((‖x‖² − 2 x·w) + ‖w‖²) clamped at 0
            d = torch.mm(x, w_t, out=d_buf[:m]).mul_(-2.0).add_((x * x).sum(1, keepdim=True))
            d = d.add_(w_norm).clamp_min_(0.0)
            if truncated:
                d_top, code = torch.topk(d, support, dim=1, largest=False, sorted=True)
                dmin, idx = d_top[:, 0], code[:, 0]
                indices[start:start + m] = idx
                nearest[start:start + m] = dmin
                q = torch.softmax((dmin[:, None] - d_top) / scale, 1)           # (rows, support)
                mass.index_add_(0, code.reshape(-1), q.reshape(-1))
                sums.index_add_(0, code.reshape(-1), (q[:, :, None] * x[:, None, :]).reshape(-1, x.shape[1]))
                soft = torch.einsum("rs,rsd->rd", q, w[code])
                totals[0] += (q * d_top).sum()
                totals[1] += (x - soft).pow(2).sum()
                totals[2] += ((q * w_sq[code]).sum(1) - soft.pow(2).sum(1)).clamp_min(0).sum()
                continue
            dmin, idx = first_min(d)
            indices[start:start + m] = idx
            nearest[start:start + m] = dmin
            q = _softmax(torch.sub(dmin[:, None], d, out=l_buf[:m]).div_(scale), q_buf[:m])
            mass += q.sum(0)
            sums.addmm_(q.t(), x)
            soft = torch.mm(q, w, out=soft_buf[:m])
            totals[0] += torch.mul(q, d, out=l_buf[:m]).sum()
            totals[1] += (x - soft).pow(2).sum()
            totals[2] += (q @ w_sq - soft.pow(2).sum(1)).clamp_min(0).sum()
    totals /= max(n, 1)
    sums += mass[:, None] * center  # Σ_i q_ik (x_i + c) = Σ_i q_ik z_i
    return SoftStatistics(indices=indices, nearest=nearest, mass=mass, sums=sums,
                          distortion=totals[0], ols=totals[1], variance=totals[2])
