"""Block policy and exact per-row helpers shared by the blocked DDCL computations (only torch): rows per block,
exact first extremes of rows, a row softmax into a preallocated block, nearest distances without an N×K matrix."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

__all__ = ["block_rows", "chunk_rows", "first_argmax", "first_min", "nearest_codes", "nearest_other_code",
           "softmax_into", "softmax_into_public", "DEVICE_BLOCK_BUDGET_BYTES", "NEAREST_BLOCK_BYTES"]

#: CPU: about this many elements per (rows × K) block, within MIN_CHUNK_ROWS .. MAX_CHUNK_ROWS rows
CHUNK_ELEMENTS = 1 << 18
MIN_CHUNK_ROWS = 64
MAX_CHUNK_ROWS = 1024
#: GPUs: one block for the whole batch while the N×K tensors one block holds fit this many bytes (read at each call)
DEVICE_BLOCK_BUDGET_BYTES = 1 << 30
#: N×K-sized tensors one block of the fused/chunked paths holds at once (softmax temporaries included)
BLOCK_LIVE_TENSORS = 4
#: group widths for the exact two-level argmin: K / 16 within these bounds
_ARGMIN_BLOCK_MIN, _ARGMIN_BLOCK_MAX = 32, 128


def block_rows(device_type: str, num_rows: int, num_codes: int, *, itemsize: int = 4,
               memory_budget_bytes: Optional[int] = None, chunk_size: Optional[int] = None,
               live_tensors: int = BLOCK_LIVE_TENSORS) -> int:
    """Rows per block over ``num_rows`` × ``num_codes``: ``chunk_size`` if given; on the CPU ≈ CHUNK_ELEMENTS / K
    within MIN_CHUNK_ROWS .. MAX_CHUNK_ROWS; elsewhere the fewest equal blocks whose ``live_tensors`` (rows × K)
    tensors of ``itemsize`` bytes fit ``memory_budget_bytes`` (default :data:`DEVICE_BLOCK_BUDGET_BYTES`)."""
    n = max(int(num_rows), 1)
    if chunk_size is not None:
        return max(1, min(int(chunk_size), n))
    k = max(int(num_codes), 1)
    if device_type == "cpu":
        return max(1, min(n, MAX_CHUNK_ROWS, max(MIN_CHUNK_ROWS, CHUNK_ELEMENTS // k)))
    budget = DEVICE_BLOCK_BUDGET_BYTES if memory_budget_bytes is None else memory_budget_bytes
    fit = max(1, int(budget) // (k * max(int(itemsize), 1) * max(int(live_tensors), 1)))
    blocks = -(-n // fit)                               # 1 when the whole batch fits
    return -(-n // blocks)                              # equal blocks, each within the budget


def chunk_rows(num_rows: int, num_codes: int, chunk_size: Optional[int] = None) -> int:
    """Rows per block on the CPU: ``chunk_size`` if given, else ≈ CHUNK_ELEMENTS / K within the bounds."""
    return block_rows("cpu", num_rows, num_codes, chunk_size=chunk_size)


def _first_extreme(x: Tensor, largest: bool) -> Tuple[Tensor, Tensor]:
    """``x.max(1)`` / ``x.min(1)`` of a (rows, K) matrix (values, first extreme index) exactly, faster on the CPU:
    the extremes of column groups (vectorised), then the indexed reduction inside the first group holding it."""
    rows, k = x.shape
    b = min(_ARGMIN_BLOCK_MAX, max(_ARGMIN_BLOCK_MIN, k // 16))
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


def softmax_into_public(logits: Tensor, out: Tensor) -> Tensor:
    """out ← softmax(logits) along rows through the public API (one extra block temporary)."""
    return out.copy_(torch.softmax(logits, 1))


def _softmax_kernel(logits: Tensor, out: Tensor) -> Tensor:
    """out ← softmax(logits) along rows, written in place by the library's own kernel."""
    return torch._softmax(logits, 1, False, out=out)


def _pick_softmax():
    """The private out= kernel when this torch has it and it agrees with torch.softmax; else the public one."""
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


#: :func:`nearest_codes` works in blocks of at most this many bytes of distances
NEAREST_BLOCK_BYTES = 1 << 26


def _distance_blocks(z: Tensor, codebook: Tensor, rows: Optional[int]):
    """(start, (m, K) squared distances of z[start:start + m]) per row block of one (rows, K) buffer (default rows:
    :data:`NEAREST_BLOCK_BYTES`): squared_distances(x, w) bit for bit, ((‖x‖² − 2 x·w) + ‖w‖²) clamped at 0."""
    n, k = z.shape[0], codebook.shape[0]
    if rows is None:
        rows = max(1, min(n, NEAREST_BLOCK_BYTES // max(k * z.element_size(), 1)))
    w_t, w_norm = codebook.t(), (codebook * codebook).sum(1)
    buf = z.new_empty(min(rows, n), k)
    for start in range(0, n, rows):
        x = z[start:start + rows]
        d = torch.mm(x, w_t, out=buf[:x.shape[0]]).mul_(-2.0).add_((x * x).sum(1, keepdim=True))
        yield start, d.add_(w_norm).clamp_min_(0.0)


@torch.no_grad()
def nearest_codes(z: Tensor, codebook: Tensor, rows: Optional[int] = None) -> Tuple[Tensor, Tensor]:
    """(N, D) ``z``, (K, D) ``codebook`` -> (squared distance to the nearest code (N,), its first index (N,)):
    ``squared_distances(z, codebook).min(1)`` bit for bit, in row blocks (default: :data:`NEAREST_BLOCK_BYTES`)."""
    values = z.new_empty(z.shape[0])
    indices = torch.empty(z.shape[0], dtype=torch.long, device=z.device)
    for start, d in _distance_blocks(z, codebook, rows):
        values[start:start + d.shape[0]], indices[start:start + d.shape[0]] = first_min(d)
    return values, indices


@torch.no_grad()
def nearest_other_code(codebook: Tensor, rows: Optional[int] = None) -> Tensor:
    """(K, D) ``codebook`` -> (K,) squared distance from each code to its nearest other code (inf for
    K = 1). Row blocks as in :func:`nearest_codes`: O(rows·K) extra memory."""
    values = codebook.new_empty(codebook.shape[0])
    for start, d in _distance_blocks(codebook, codebook, rows):
        own = torch.arange(d.shape[0], device=d.device)
        d[own, own + start] = float("inf")
        values[start:start + d.shape[0]] = d.min(1).values
    return values
