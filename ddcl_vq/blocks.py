"""Block policy and exact per-row helpers shared by the blocked DDCL computations.

* :func:`block_rows` / :func:`chunk_rows`: how many rows one block of an N×K computation has,
  following the device (cache-sized on the CPU, the whole batch on a GPU within
  :data:`DEVICE_BLOCK_BUDGET_BYTES`);
* :func:`first_argmax`, :func:`first_min`, :func:`first_argmin`: ``max(1)``/``min(1)`` of a
  (rows, K) block exactly (first extreme index), vectorised on the CPU;
* :func:`nearest_codes`: each vector's nearest code and squared distance, in blocks of bounded
  memory (what ``squared_distances(z, w).min(1)`` gives, without the N×K matrix);
* :data:`softmax_into`: a row softmax written into a preallocated block.

Users: :mod:`ddcl_vq.fused`, :mod:`ddcl_vq.statistics`, :mod:`ddcl_vq.kmeans` and
:class:`~ddcl_vq.DDCLQuantizer`'s first-batch set-up. Only torch.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

__all__ = ["block_rows", "chunk_rows", "first_argmax", "first_min", "first_argmin", "nearest_codes",
           "softmax_into", "softmax_into_public", "DEVICE_BLOCK_BUDGET_BYTES", "NEAREST_BLOCK_BYTES"]

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
#: block widths for the exact two-level argmin (see :func:`first_argmin`): K / 16 within these
#: bounds (2026-12-04, one EPYC core, blocks of 2**18 elements: at K = 512 a width of 32 takes 0.19 ms
#: a block against 0.31 ms at 128; from K = 4096 on, 128 is as fast or faster).
_ARGMIN_BLOCK_MIN, _ARGMIN_BLOCK_MAX = 32, 128


def argmin_block(num_codes: int) -> int:
    """The group width :func:`first_min` uses for a row of ``num_codes`` values."""
    return min(_ARGMIN_BLOCK_MAX, max(_ARGMIN_BLOCK_MIN, num_codes // 16))


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
    :func:`argmin_block` columns, the first block holding the row's extreme, then the indexed
    reduction inside that one block only: the same value and index (ties go to the first).
    """
    rows, k = x.shape
    b = argmin_block(k)
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


def softmax_into_public(logits: Tensor, out: Tensor) -> Tensor:
    """out ← softmax(logits) along rows through the public API (one extra block temporary)."""
    return out.copy_(torch.softmax(logits, 1))


def _softmax_kernel(logits: Tensor, out: Tensor) -> Tensor:
    """out ← softmax(logits) along rows, written in place by the library's own kernel."""
    return torch._softmax(logits, 1, False, out=out)


def _pick_softmax():
    """The private out= kernel (the one torch.softmax runs) when this torch has it and it agrees
    with torch.softmax; else the public fallback."""
    if not hasattr(torch, "_softmax"):
        return softmax_into_public
    try:
        probe = torch.tensor([[0.0, 1.0, -2.0]])
        out = torch.empty_like(probe)
        _softmax_kernel(probe, out)
        if torch.equal(out, torch.softmax(probe, 1)):
            return _softmax_kernel
    except Exception:  # noqa: BLE001 - any failure means: use the public API
        pass
    return softmax_into_public


#: out ← softmax(logits) along rows (the kernel :func:`_pick_softmax` chose)
softmax_into = _pick_softmax()


#: :func:`nearest_codes` works in blocks of at most this many bytes of distances (one block, the
#: whole batch, while N·K·itemsize fits)
NEAREST_BLOCK_BYTES = 1 << 26


@torch.no_grad()
def nearest_codes(z: Tensor, codebook: Tensor, rows: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """(N, D) ``z``, (K, D) ``codebook`` -> (squared distance to the nearest code (N,), its first
    index (N,)): ``squared_distances(z, codebook).min(1)`` computed in row blocks (default: as many
    rows as fit :data:`NEAREST_BLOCK_BYTES`), so extra memory is O(rows·K) whatever N is. Each
    block's distances are the bits :func:`~ddcl_vq.base.squared_distances` gives for it (the same
    operations, in place); no autograd."""
    n, k = z.shape[0], codebook.shape[0]
    if rows is None:
        rows = max(1, min(n, NEAREST_BLOCK_BYTES // max(k * z.element_size(), 1)))
    values = z.new_empty(n)
    indices = torch.empty(n, dtype=torch.long, device=z.device)
    if n == 0:
        return values, indices
    w_t = codebook.t()
    w_norm = (codebook * codebook).sum(1)
    buf = z.new_empty(min(rows, n), k)
    for start in range(0, n, rows):
        x = z[start:start + rows]
        # squared_distances(x, w) bit for bit: ((‖x‖² − 2 x·w) + ‖w‖²) clamped at 0
        d = torch.mm(x, w_t, out=buf[:x.shape[0]]).mul_(-2.0).add_((x * x).sum(1, keepdim=True))
        d = d.add_(w_norm).clamp_min_(0.0)
        v, i = first_min(d)
        values[start:start + x.shape[0]] = v
        indices[start:start + x.shape[0]] = i
    return values, indices


@torch.no_grad()
def nearest_other_code(codebook: Tensor, begin: int = 0, end: Optional[int] = None, earlier_only: bool = False,
                       rows: Optional[int] = None) -> Tensor:
    """(K, D) ``codebook`` -> (end − begin,) squared distance from each code of rows [begin, end)
    (default: all) to its nearest other code — with ``earlier_only``, its nearest lower-indexed code
    — or inf where there is none. Row blocks as in :func:`nearest_codes`: O(rows·K) extra memory,
    O((end − begin)·K·D) work."""
    k = codebook.shape[0]
    end = k if end is None else min(end, k)
    if rows is None:
        rows = max(1, min(k, NEAREST_BLOCK_BYTES // max(k * codebook.element_size(), 1)))
    w_norm = (codebook * codebook).sum(1)
    columns = torch.arange(k, device=codebook.device)
    values = codebook.new_empty(max(end - begin, 0))
    for start in range(begin, end, rows):
        block = codebook[start:min(start + rows, end)]
        # squared_distances(block, codebook): ((‖x‖² − 2 x·w) + ‖w‖²) clamped at 0
        d = torch.mm(block, codebook.t()).mul_(-2.0).add_(w_norm[start:start + block.shape[0], None])
        d = d.add_(w_norm).clamp_min_(0.0)
        own = columns[start:start + block.shape[0], None]
        excluded = columns[None, :] >= own if earlier_only else columns[None, :] == own
        values[start - begin:start - begin + block.shape[0]] = d.masked_fill_(excluded, float("inf")).min(1).values
    return values
