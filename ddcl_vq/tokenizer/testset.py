"""One pass over a dataset split: hard-code (and soft-code) reconstruction error and
dataset-level codebook usage. Distributed-aware: each process takes a disjoint share of
the images, sums are all-reduced, so the result equals a single-process pass."""
from __future__ import annotations

from typing import Dict

import torch
from torch.utils.data import Dataset, Subset

from ddcl_vq import CodebookUsage, Quantizer
from ddcl_vq.distributed import all_reduce_sum_, rank, world_size
from ddcl_vq.models import VQVAE

from ddcl_vq.common.data import DataUnavailable, SequentialBatches, make_loader
from ddcl_vq.common.progress import Progress

#: images per batch of an evaluation pass (the end-of-run summary, evaluate, compare, gap,
#: tokenize, decode, a study's evaluation); lower it where memory is short
EVAL_BATCH_SIZE = 256


def shard(dataset: Dataset, max_images: int = 0) -> tuple[Subset, int]:
    """The first ``max_images`` images (all when 0), strided over processes."""
    n = len(dataset) if not max_images else min(max_images, len(dataset))
    return Subset(dataset, list(range(rank(), n, world_size()))), n


def _hard_codes(quantizer: Quantizer, indices: torch.Tensor) -> torch.Tensor:
    """``quantizer.lookup(indices)`` without its range check (a host sync per batch on a GPU): the
    indices are the quantizer's own."""
    if type(quantizer).lookup is not Quantizer.lookup:
        return quantizer.lookup(indices)
    codes = quantizer.codebook[indices]
    return codes.movedim(-1, 1) if quantizer.channel_dim == 1 and codes.dim() > 2 else codes


@torch.no_grad()
def reconstruction_pass(model: VQVAE, dataset: Dataset, batch_size: int = EVAL_BATCH_SIZE, device="cpu",
                        max_images: int = 0, on_batch=None, progress: bool = False, num_workers: int = 0) -> Dict:
    """-> {"num_images", "hard": {"mse", "psnr"}, "soft": {...} or None, "usage": UsageStats}.

    ``soft`` is measured when the quantizer has soft codes (``quantizer.has_soft_codes``), else None. MSE = mean over
    images and pixels; PSNR = mean over images of 10·log10(1 / MSE_image) (images in [0, 1]; a perfect image's MSE is
    floored at 1e-10). ``on_batch(x, hard, soft)`` lets callers add metrics on the same pass. The pass adds no host sync
    per batch (the quantizer's own input checks aside): every sum stays on the device until the end.
    """
    was_training = model.training
    model.eval()
    part, n = shard(dataset, max_images)
    if n == 0:
        raise DataUnavailable("nothing to evaluate: the split has no images")
    loader = make_loader(part, SequentialBatches(len(part), batch_size), num_workers, device)
    has_soft = model.quantizer.has_soft_codes
    usage = CodebookUsage(model.quantizer.num_codes, device=device)
    sums = torch.zeros(5, dtype=torch.float64, device=device)  # hard mse, hard psnr, soft mse, soft psnr, count
    # a bar on a terminal, a line per 10% of the batches in a log file
    bar = Progress(len(loader), "evaluate", unit="batch", every=max(len(loader) // 10, 1), leave=False,
                   off=not (progress and rank() == 0))
    for x, _ in loader:
        x = x.to(device, non_blocking=True)
        z = model.encoder(x)
        q = model.quantizer(z)
        usage.update(q.indices, q.soft_counts)
        hard = model.decoder(_hard_codes(model.quantizer, q.indices)).float().clamp(0, 1)
        mse_img = (hard - x).pow(2).flatten(1).mean(1).double()
        sums[0] += mse_img.sum()
        sums[1] += (10 * torch.log10(1.0 / mse_img.clamp_min(1e-10))).sum()
        soft = None
        if has_soft:
            soft = model.decoder(model.quantizer.soft_codes(z)).float().clamp(0, 1)
            mse_soft = (soft - x).pow(2).flatten(1).mean(1).double()
            sums[2] += mse_soft.sum()
            sums[3] += (10 * torch.log10(1.0 / mse_soft.clamp_min(1e-10))).sum()
        sums[4] += x.shape[0]
        if on_batch is not None:
            on_batch(x, hard, soft)
        bar.update(1)
    bar.close()
    all_reduce_sum_(sums)
    model.train(was_training)
    count = float(sums[4])
    if count != n:  # pragma: no cover - guards the sharding arithmetic
        raise RuntimeError(f"evaluation covered {count:.0f} images, expected {n}")
    return {"num_images": int(count), "hard": {"mse": float(sums[0]) / count, "psnr": float(sums[1]) / count},
            "soft": {"mse": float(sums[2]) / count, "psnr": float(sums[3]) / count} if has_soft else None,
            "usage": usage.compute()}

