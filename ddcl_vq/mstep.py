"""The DDCL codebook's running state: set-up on the first batch, the M-step, revival.

:class:`MStepCodebook` is the part of :class:`~ddcl_vq.DDCLQuantizer` that keeps the codebook in
step with the data: k-means and the distance scale on the first training batch, the exponential
moving averages of each code's soft mass, hard usage and (M-step) soft sums, the codebook they
define, and the re-seeding of starved codes. Every statistic is all-reduced, so the codebook is
identical on every process.
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from .blocks import nearest_codes, nearest_other_code
from .distributed import all_reduce_sum_, broadcast_, world_size
from .kmeans import kmeans_init_
from .statistics import SoftStatistics

__all__ = ["MStepCodebook", "TWIN_ROWS"]

#: codes checked for a twin per training batch (``revive_twins``)
TWIN_ROWS = 512


class MStepCodebook:
    """Mixin for :class:`~ddcl_vq.DDCLQuantizer`: reads its settings (``num_codes``, ``decay``,
    ``codebook_update``, ``revive_threshold``, ``revive_criterion``, ``revive_twins``) and updates its codebook
    ``weight`` and buffers (``initialized``, ``distance_scale``, ``cluster_mass``, ``cluster_usage``,
    ``cluster_sums``, ``revived``)."""

    @torch.no_grad()
    def _initialize(self, x: Tensor) -> None:
        """First training batch: k-means codebook (if asked), the distance scale, the M-step sums."""
        if not bool(self.initialized):
            kmeans_init_(self.weight.data, x)
            if x.shape[0] * world_size() < self.num_codes:
                # k-means seeded with repeats: identical codes would share every update forever
                jitter = torch.randn(self.weight.shape, generator=torch.Generator().manual_seed(0))
                spread = self.weight.data.std(0, keepdim=True).clamp_min(1e-6)
                self.weight.data += 0.01 * spread * jitter.to(self.weight.device, self.weight.dtype)
            self.initialized.fill_(True)
        # The running mean starts at the first batch's distance to its nearest code (in-sample:
        # k-means was fitted on this very batch; 0 when codes outnumber vectors, then a hundredth
        # of the batch's variance).
        xc = x - x.mean(0)
        nearest = nearest_codes(x, self.weight.data.to(x.dtype))[0]
        totals = torch.stack([nearest.sum(), xc.pow(2).sum(), torch.tensor(float(x.shape[0]), device=x.device)
                              ]).to(torch.float64)
        all_reduce_sum_(totals)
        mean_nearest, variance = float(totals[0] / totals[2].clamp_min(1)), float(totals[1] / totals[2].clamp_min(1))
        self.distance_scale.fill_(mean_nearest if mean_nearest > 1e-6 * variance else max(0.01 * variance, 1e-12))
        self._restart_statistics(x.shape[0])

    @torch.no_grad()
    def _restart_statistics(self, batch_vectors: int) -> None:
        """M-step statistics consistent with the current codes: every code holds its uniform
        share of a batch (over all processes) and sits at its own mean."""
        share = batch_vectors * world_size() / self.num_codes
        self.cluster_mass.fill_(share)
        self.cluster_usage.fill_(share)
        self.cluster_sums.copy_(self.weight.data * self.cluster_mass[:, None])

    @torch.no_grad()
    def _restart(self, x: Tensor) -> None:
        """Re-fit the codebook by k-means on this batch (the encoder has left its random start):
        codes and M-step statistics restart; the distance scale and counters go on."""
        kmeans_init_(self.weight.data, x)
        self._restart_statistics(x.shape[0])

    @torch.no_grad()
    def _update_statistics(self, x: Tensor, stats: SoftStatistics, scale: float) -> None:
        """One training batch: EMA of the distance scale and of the soft mass (and, for the M-step,
        of the soft sums, and the new codebook); revival of starved codes (and, with
        ``revive_twins``, of codes within ``scale``, the batch's softmax divisor, of an earlier
        code). All-reduced: identical on every process."""
        g = self.decay
        k = self.num_codes
        hits = torch.bincount(stats.indices, minlength=k).to(stats.mass.dtype)
        totals = torch.cat([stats.mass, hits, stats.nearest.sum()[None],
                            torch.tensor([float(x.shape[0])], device=x.device)]).to(torch.float64)
        all_reduce_sum_(totals)
        mass, hits, nearest_sum, count = totals[:k], totals[k:2 * k], totals[-2], totals[-1]
        # A slow running mean (time constant ~100 steps): early in training, while the encoder's
        # features contract several-fold, the lagging scale keeps the assignment soft; codes merge
        # where the data left them and are re-seeded where the distortion is — a second,
        # better-placed start of the codebook (what it buys: docs/results.md).
        # (the batch's mean in float64 on the device, rounded once as a Python float would be: no host sync)
        batch_mean = (0.01 * (nearest_sum / count.clamp_min(1))).to(self.distance_scale.dtype)
        self.distance_scale.mul_(0.99).add_(batch_mean)
        self.cluster_mass.mul_(g).add_(mass.to(self.cluster_mass.dtype), alpha=1 - g)
        self.cluster_usage.mul_(g).add_(hits.to(self.cluster_usage.dtype), alpha=1 - g)
        if self.codebook_update == "mstep":
            sums = stats.sums.to(self.cluster_sums.dtype)
            all_reduce_sum_(sums)
            self.cluster_sums.mul_(g).add_(sums, alpha=1 - g)
            self.weight.data.copy_(self.cluster_sums / self.cluster_mass.clamp_min(1e-12)[:, None])
        if self.revive_threshold > 0:
            self._revive(x, stats.nearest, count, scale)

    @torch.no_grad()
    def _twins(self, scale: float, begin: int = 0, end: Optional[int] = None) -> Tensor:
        """(K,) bool: the codes of rows [begin, end) (default: all) within ``scale`` (squared
        distance) of an earlier-indexed code.

        Closer than the softmax's divisor, two codes receive the same soft statistics, and the
        M-step keeps them together: they are one code in two places, and the hard index between
        them is decided by noise (docs/prior.md). O((end − begin)·K·D) work."""
        w = self.weight.data.float()
        end = w.shape[0] if end is None else min(end, w.shape[0])
        twins = torch.zeros(w.shape[0], dtype=torch.bool, device=w.device)
        twins[begin:end] = nearest_other_code(w, begin, end, earlier_only=True) < scale
        return twins

    @torch.no_grad()
    def _revive(self, x: Tensor, nearest: Tensor, batch_vectors: Tensor, scale: float) -> None:
        """Re-seed codes whose EMA hard usage (or soft mass) is below the threshold (and, with
        ``revive_twins``, the later code of each pair within ``scale`` of each other) on batch
        vectors drawn with probability ∝ their distance to the nearest code (where the distortion
        is), at most one code per batch vector (the most starved first). ``batch_vectors``: the
        (all-reduced, float64) batch size as a tensor; the one host sync is the number of codes to
        re-seed (with the batch size)."""
        # rounded to the buffers' dtype: what comparing with (and writing) a Python float does
        threshold = (self.revive_threshold * batch_vectors / self.num_codes).to(self.cluster_mass.dtype)
        measure = self.cluster_usage if self.revive_criterion == "usage" else self.cluster_mass
        starved = measure < threshold  # identical on every process (all-reduced statistics)
        if self.revive_twins:
            # one block of TWIN_ROWS rows per training batch, in turn: the whole codebook every
            # ceil(K / TWIN_ROWS) batches, at most TWIN_ROWS·K·D work per batch
            blocks = -(-self.num_codes // TWIN_ROWS)
            begin = int(self.twin_position) % blocks * TWIN_ROWS
            self.twin_position.add_(1)
            twins = self._twins(scale, begin, begin + TWIN_ROWS)  # identical on every process (the codebook is)
            self.revived_twins += twins.sum()
            starved |= twins
        count, batch_total = (int(v) for v in torch.stack([starved.sum().to(batch_vectors.dtype),
                                                           batch_vectors]).tolist())
        if count == 0:
            return
        if count > batch_total:
            # At most one code per batch vector, the most starved first (ties: the lower index): drawn with
            # repeats, the codes seeded on one vector would be identical, share every update and never
            # separate. At K = 65,536 and 262,144 with N = 2,048, the whole codebook fell below the
            # threshold together ~33 batches in and was re-seeded on 2,048 points (docs/results.md,
            # "Large codebooks"); the others wait for the next batches' vectors.
            order = torch.argsort(measure.masked_fill(~starved, float("inf")), stable=True)
            starved = torch.zeros_like(starved)
            starved[order[:batch_total]] = True
            count = batch_total
        per_rank = -(-count // world_size())
        weights = nearest.clamp_min(0) + 1e-12
        pick = torch.multinomial(weights, per_rank, replacement=per_rank > x.shape[0])
        seeds = x[pick].to(self.weight.dtype).contiguous()
        if world_size() > 1:
            parts = [torch.empty_like(seeds) for _ in range(world_size())]
            torch.distributed.all_gather(parts, seeds)
            seeds = torch.cat(parts, 0)
        seeds = seeds[:count]
        broadcast_(seeds)
        self.weight.data[starved] = seeds
        self.cluster_mass[starved] = threshold
        # A re-seeded code is a fresh code: its usage starts, as every code's does, at its uniform
        # share N/K, so it has ~33 batches (0.9^33 = 0.03) to win a vector before it can be
        # re-seeded. Started at the threshold it was re-seeded again by the next batch it did not
        # win, which is most batches once codes outnumber a batch's vectors: at K = 65,536 and
        # N = 2,048 that churned 42,600 codes a step, drawn with repeats from 2,048 vectors
        # (docs/results.md, "Large codebooks").
        self.cluster_usage[starved] = (batch_vectors / self.num_codes).to(self.cluster_usage.dtype)
        self.cluster_sums[starved] = seeds * threshold
        self.revived += count

    def _load_without_mstep_statistics(self, prefix: str, missing_keys: List[str], error_msgs: List[str]) -> None:
        """A state_dict from before the M-step existed (codebook trained by gradient): keep the
        constructor's neutral values for the M-step buffers it lacks."""
        legacy = [prefix + name for name in ("cluster_mass", "cluster_usage", "cluster_sums", "distance_scale",
                                             "revived")]
        if all(key in missing_keys for key in legacy):
            if self.codebook_update != "gradient" or self.temperature_reference != "dim":
                error_msgs.append(
                    f"{prefix or 'DDCLQuantizer '}state_dict was saved before the M-step codebook existed; "
                    "load it into DDCLQuantizer(..., codebook_update='gradient', temperature_reference='dim')")
            for key in legacy:
                missing_keys.remove(key)
