"""Dataset-level codebook-usage statistics."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import List, Optional

import torch
from torch import Tensor

from .base import check_positive_int
from .distributed import all_reduce_sum_, rank

USAGE_DEFINITIONS = """\
utilization     = (codes with count > 0) / K over the whole pass (hard indices)
active_codes    = codes with count > 0;  dead_codes = K - active_codes
perplexity      = exp(H(p)), p = counts / sum(counts)   (dataset-level, hard indices)
soft_perplexity = exp(H(mean_i q_i))                    (DDCL only: mean soft assignment)
entropy_bits    = H(p) / ln 2
utilization_ceiling = 1 - (1 - 1/K)^M for the M vectors of the pass: the share of codes that M
                  draws spread evenly over all K codes would reach (< 1 when M is not >> K)
queue_utilization = codes among the last 65,536 hard indices of training / K (LlamaGen's and
                  visual-tokenizer-pytorch's definition; at the end of training; its ceiling as above
                  with M = 65,536, e.g. 63% at K = 65,536)
batch_utilization = mean over the last usage window's training batches of (distinct codes in the
                  batch) / K (vector-quantize-pytorch's examples' "active %"; at most batch vectors / K;
                  under torchrun each process's batch)"""


def uniform_ceiling(num_codes: int, draws: int) -> float:
    """1 − (1 − 1/K)^M: the expected share of K codes hit at least once by M draws spread evenly over them."""
    if draws <= 0:
        return 0.0
    return -math.expm1(draws * math.log1p(-1.0 / num_codes)) if num_codes > 1 else 1.0


def _entropy(p: Tensor) -> float:
    p = p.double()
    p = p / p.sum()
    nz = p[p > 0]
    return float(-(nz * nz.log()).sum())


@dataclass
class UsageStats:
    num_codes: int
    num_vectors: int
    utilization: float
    active_codes: int
    dead_codes: int
    perplexity: float
    soft_perplexity: Optional[float]
    entropy_bits: float
    counts: List[int] = field(repr=False)
    #: with ``CodebookUsage(K, codebooks=C)`` (C > 1): C, and each codebook's figures (the fields above are then
    #: those of the C·K (codebook, code) pairs, ``counts`` codebook-major); None (left out of ``to_dict``) for one
    codebooks: Optional[int] = None
    utilization_per_codebook: Optional[List[float]] = None
    active_codes_per_codebook: Optional[List[int]] = None
    dead_codes_per_codebook: Optional[List[int]] = None
    perplexity_per_codebook: Optional[List[float]] = None
    soft_perplexity_per_codebook: Optional[List[Optional[float]]] = None

    def to_dict(self) -> dict:
        out = asdict(self)
        if self.codebooks is None:
            for name in PER_CODEBOOK_FIELDS:
                out.pop(name)
        return out


PER_CODEBOOK_FIELDS = ("codebooks", "utilization_per_codebook", "active_codes_per_codebook", "dead_codes_per_codebook",
                       "perplexity_per_codebook", "soft_perplexity_per_codebook")


class CodebookUsage:
    """Accumulates hard-index counts (and DDCL assignment mass) over a pass.

    ``update(indices, soft_counts=None)``: any-shaped long ``indices`` and, for DDCL, the (K,) soft counts of the
    same vectors. ``compute()`` (every process calls it) sums over processes and applies ``USAGE_DEFINITIONS``.
    Out-of-range indices are a ValueError (on an accelerator raised by ``compute``).

    ``codebooks=C`` > 1 (a residual or grouped quantizer: ``ResidualDDCL``, ``GroupedDDCL``, ResidualVQ): ``indices``
    (..., C), one entry per codebook, −1 for a level left out (quantizer dropout, not counted); ``soft_counts``
    (C, K). ``compute()`` then adds each codebook's utilization, active and dead codes and perplexity
    (``*_per_codebook`` lists, the same definitions per codebook); the aggregate fields count the C·K
    (codebook, code) pairs as one codebook (``utilization`` = Σ active / (C·K)). A codebook shared by every level
    is one codebook: count its pooled use with ``CodebookUsage(K)`` and all the indices.
    """

    def __init__(self, num_codes: int, device: torch.device | str = "cpu", *, codebooks: int = 1):
        self.num_codes = check_positive_int("num_codes", num_codes)
        self.codebooks = check_positive_int("codebooks", codebooks)
        self.counts = torch.zeros(num_codes * codebooks, dtype=torch.long, device=device)
        self.soft_mass = torch.zeros(num_codes * codebooks, dtype=torch.float64, device=device)
        self.out_of_range = torch.zeros((), dtype=torch.long, device=device)  # deferred check, see above
        self.has_soft = False

    def reset(self) -> None:
        self.counts.zero_()
        self.soft_mass.zero_()
        self.out_of_range.zero_()
        self.has_soft = False

    @torch.no_grad()
    def update(self, indices: Tensor, soft_counts: Optional[Tensor] = None) -> None:
        if self.codebooks > 1:
            return self._update_codebooks(indices, soft_counts)
        flat = indices.reshape(-1).to(self.counts.device).long()
        if flat.device.type == "cpu":
            if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_codes):
                raise ValueError(f"expected indices in [0, {self.num_codes - 1}], got "
                                 f"[{int(flat.min())}, {int(flat.max())}]")
            self.counts += torch.bincount(flat, minlength=self.num_codes)
        else:
            self._count_on_device(flat)
        if soft_counts is not None:
            if soft_counts.shape != (self.num_codes,):
                raise ValueError(f"expected soft_counts of shape ({self.num_codes},), got {tuple(soft_counts.shape)}")
            self.soft_mass += soft_counts.detach().to(self.soft_mass.device, torch.float64)
            self.has_soft = True

    def _update_codebooks(self, indices: Tensor, soft_counts: Optional[Tensor]) -> None:
        """(..., C) indices (−1: not counted) -> counts of codebook c at c·K + index."""
        c, k = self.codebooks, self.num_codes
        if indices.dim() == 0 or indices.shape[-1] != c:
            raise ValueError(f"expected indices of shape (..., {c}), one entry per codebook, got shape "
                             f"{tuple(indices.shape)}")
        idx = indices.to(self.counts.device).long().reshape(-1, c)
        if idx.device.type == "cpu" and idx.numel() and (int(idx.min()) < -1 or int(idx.max()) >= k):
            raise ValueError(f"expected indices in [-1, {k - 1}] (-1: a level left out), got "
                             f"[{int(idx.min())}, {int(idx.max())}]")
        kept = (idx >= 0) & (idx < k)
        self.out_of_range += (idx.numel() - kept.sum()) - (idx == -1).sum()  # deferred check (accelerators)
        flat = (idx.clamp(0, k - 1) + torch.arange(c, device=idx.device) * k)[kept]
        self.counts.index_add_(0, flat, torch.ones_like(flat))
        if soft_counts is not None:
            if soft_counts.shape != (c, k):
                raise ValueError(f"expected soft_counts of shape ({c}, {k}), got {tuple(soft_counts.shape)}")
            self.soft_mass += soft_counts.detach().reshape(-1).to(self.soft_mass.device, torch.float64)
            self.has_soft = True

    def _count_on_device(self, flat: Tensor) -> None:
        """Count without a host sync; out-of-range indices are tallied for ``compute`` to refuse."""
        valid = (flat >= 0) & (flat < self.num_codes)
        self.out_of_range += flat.numel() - valid.sum()
        self.counts.index_add_(0, flat.clamp(0, self.num_codes - 1), valid.long())

    def compute(self) -> UsageStats:
        bad = int(self.out_of_range)
        if bad:
            raise ValueError(f"expected indices in [0, {self.num_codes - 1}], got {bad} out of range")
        counts = all_reduce_sum_(self.counts.clone())
        soft = all_reduce_sum_(self.soft_mass.clone())
        total = int(counts.sum())
        active = int((counts > 0).sum())
        size = counts.numel()
        entropy = _entropy(counts) if total > 0 else 0.0
        soft_perplexity = math.exp(_entropy(soft)) if self.has_soft and float(soft.sum()) > 0 else None
        stats = UsageStats(num_codes=self.num_codes, num_vectors=total, utilization=active / size,
                           active_codes=active, dead_codes=size - active,
                           perplexity=math.exp(entropy), soft_perplexity=soft_perplexity,
                           entropy_bits=entropy / math.log(2), counts=[int(c) for c in counts.tolist()])
        if self.codebooks > 1:
            per, per_soft = counts.reshape(self.codebooks, -1), soft.reshape(self.codebooks, -1)
            alive = [int((row > 0).sum()) for row in per]
            stats.codebooks = self.codebooks
            stats.utilization_per_codebook = [a / self.num_codes for a in alive]
            stats.active_codes_per_codebook = alive
            stats.dead_codes_per_codebook = [self.num_codes - a for a in alive]
            stats.perplexity_per_codebook = [math.exp(_entropy(row)) if int(row.sum()) > 0 else 1.0 for row in per]
            stats.soft_perplexity_per_codebook = [
                math.exp(_entropy(row)) if self.has_soft and float(row.sum()) > 0 else None for row in per_soft]
        return stats


#: LlamaGen's and visual-tokenizer-pytorch's queue of recent training indices
QUEUE_LENGTH = 65536


class RecentUsage:
    """Codebook usage over recent training batches (``USAGE_DEFINITIONS``): the queue figure (distinct codes among
    the last ``queue_length`` hard indices / K) and the batch figure (mean distinct codes in a batch / K).

    ``update(indices)`` once per training batch (no host sync); ``compute()`` (every process calls it) returns both
    with their uniform ceilings and starts a new batch average. Each process keeps ``queue_length // world`` indices.
    """

    def __init__(self, num_codes: int, queue_length: int = QUEUE_LENGTH, device: torch.device | str = "cpu",
                 world: int = 1):
        check_positive_int("num_codes", num_codes)
        if not isinstance(queue_length, int) or queue_length < world:
            raise ValueError(f"expected queue_length to be an int >= the number of processes, got {queue_length!r}")
        self.num_codes, self.world = num_codes, world
        self.queue = torch.full((queue_length // world,), -1, dtype=torch.long, device=device)
        self.position = 0         # where the next index goes (a ring buffer)
        self.filled = 0           # how many entries hold an index
        self.batch_share = torch.zeros((), dtype=torch.float64, device=device)  # Σ over batches of distinct / K
        self.batch_vectors = 0    # Σ over batches of the batch's vectors (for the ceiling)
        self.batches = 0

    @torch.no_grad()
    def update(self, indices: Tensor) -> None:
        flat = indices.reshape(-1).to(self.queue.device).long()
        n, length = flat.numel(), self.queue.numel()
        if n == 0:
            return
        present = torch.zeros(self.num_codes, dtype=torch.float64, device=flat.device)
        present.index_fill_(0, flat.clamp(0, self.num_codes - 1), 1.0)
        self.batch_share += present.sum() / self.num_codes
        self.batch_vectors += n
        self.batches += 1
        kept = min(n, length)  # the batch's last indices, written on from the ring's position
        slots = (self.position + n - kept + torch.arange(kept, device=flat.device)) % length
        self.queue[slots] = flat[n - kept:]
        self.position = (self.position + n) % length
        self.filled = min(length, self.filled + n)

    def compute(self) -> dict:
        """-> {queue_utilization, queue_indices, queue_ceiling, batch_utilization, batch_ceiling, batches}
        (None for a figure with nothing behind it); starts a new batch average."""
        seen = torch.zeros(self.num_codes, dtype=torch.float64, device=self.queue.device)
        held = self.queue[:self.filled] if self.filled < self.queue.numel() else self.queue
        if held.numel():
            seen.index_fill_(0, held.clamp_min(0), 1.0)
        stats = torch.cat([seen, seen.new_tensor([float(self.filled), float(self.batch_share), float(self.batches),
                                                  float(self.batch_vectors)])])
        all_reduce_sum_(stats)
        seen, (filled, share, batches, vectors) = stats[:self.num_codes], stats[self.num_codes:].tolist()
        self.batch_share.zero_()
        self.batch_vectors = self.batches = 0
        filled, batches = int(filled), int(batches)
        return {"queue_utilization": float((seen > 0).sum()) / self.num_codes if filled else None,
                "queue_indices": filled, "queue_ceiling": uniform_ceiling(self.num_codes, filled) if filled else None,
                "batch_utilization": share / batches if batches else None,
                "batch_ceiling": uniform_ceiling(self.num_codes, round(vectors / batches)) if batches else None,
                "batches": batches}

    def state_dict(self) -> dict:
        """Every process calls this: the queues gathered in rank order, the batch average's sums."""
        length = self.queue.numel()
        ordered = torch.roll(self.queue, -self.position) if self.filled == length else self.queue.clone()
        gathered = torch.zeros(self.world * length, dtype=torch.long, device=self.queue.device)
        gathered[rank() * length:(rank() + 1) * length] = ordered + 1  # +1: the empty slots (-1) sum to 0
        all_reduce_sum_(gathered)
        sums = all_reduce_sum_(torch.tensor([float(self.batch_share), float(self.batch_vectors), float(self.batches)],
                                            dtype=torch.float64, device=self.queue.device)).tolist()
        return {"queue": (gathered - 1).cpu(), "filled": self.filled, "batch_share": sums[0],
                "batch_vectors": int(sums[1]), "batches": int(sums[2])}

    def load_state_dict(self, state: dict) -> None:
        length = self.queue.numel()
        queue = state["queue"]
        if queue.numel() != self.world * length:
            raise ValueError(f"expected a saved queue of {self.world * length} indices, got {queue.numel()} "
                             "(another number of processes or queue length)")
        self.queue.copy_(queue[rank() * length:(rank() + 1) * length])
        self.filled = int(state["filled"])
        self.position = self.filled % length
        main = rank() == 0  # the sums over processes come back on one process, as CodebookUsage's window does
        self.batch_share.fill_(float(state["batch_share"]) if main else 0.0)
        self.batch_vectors = int(state["batch_vectors"]) if main else 0
        self.batches = int(state["batches"]) if main else 0
