"""Dataset-level codebook-usage statistics."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import List, Optional

import torch
from torch import Tensor

from .distributed import all_reduce_sum_

USAGE_DEFINITIONS = """\
utilization     = (codes with count > 0) / K over the whole pass (hard indices)
active_codes    = codes with count > 0;  dead_codes = K - active_codes
perplexity      = exp(H(p)), p = counts / sum(counts)   (dataset-level, hard indices)
soft_perplexity = exp(H(mean_i q_i))                    (DDCL only: mean soft assignment)
entropy_bits    = H(p) / ln 2"""


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

    def to_dict(self) -> dict:
        return asdict(self)


class CodebookUsage:
    """Accumulates hard-index counts (and DDCL assignment mass) over a pass.

    ``update(indices, soft_counts=None)`` with any-shaped long ``indices`` and, for DDCL,
    ``soft_counts`` (K,) = Σ_i q_i over the same vectors (``QuantizerOutput.soft_counts``).
    ``compute()`` sums the accumulators over all processes when torch.distributed is
    initialized (every process must call it), then applies the definitions in
    ``USAGE_DEFINITIONS``. Accumulators stay local, so ``compute`` can be called repeatedly.

    Indices out of range are a ValueError: from ``update`` for CPU tensors; for tensors on an
    accelerator ``update`` counts them on the device instead (checking there would wait for the
    device every batch) and ``compute`` raises.
    """

    def __init__(self, num_codes: int, device: torch.device | str = "cpu"):
        if not isinstance(num_codes, int) or num_codes <= 0:
            raise ValueError(f"expected num_codes to be a positive int, got {num_codes!r}")
        self.num_codes = num_codes
        self.counts = torch.zeros(num_codes, dtype=torch.long, device=device)
        self.soft_mass = torch.zeros(num_codes, dtype=torch.float64, device=device)
        self.out_of_range = torch.zeros((), dtype=torch.long, device=device)  # deferred check, see above
        self.has_soft = False

    def reset(self) -> None:
        self.counts.zero_()
        self.soft_mass.zero_()
        self.out_of_range.zero_()
        self.has_soft = False

    @torch.no_grad()
    def update(self, indices: Tensor, soft_counts: Optional[Tensor] = None) -> None:
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

    def _count_on_device(self, flat: Tensor) -> None:
        """Count without a host sync (bincount's output size would need one): scatter-add of the
        in-range indices, the others tallied in ``out_of_range`` for ``compute`` to refuse."""
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
        entropy = _entropy(counts) if total > 0 else 0.0
        soft_perplexity = math.exp(_entropy(soft)) if self.has_soft and float(soft.sum()) > 0 else None
        return UsageStats(num_codes=self.num_codes, num_vectors=total, utilization=active / self.num_codes,
                          active_codes=active, dead_codes=self.num_codes - active,
                          perplexity=math.exp(entropy), soft_perplexity=soft_perplexity,
                          entropy_bits=entropy / math.log(2), counts=[int(c) for c in counts.tolist()])
