"""Reconstruction and codebook metrics, defined in RECON_DEFINITIONS / GEOMETRY_DEFINITIONS. LPIPS and rFID only with
real weights, else ``None`` with a one-line reason. Accumulators keep float64 sums (all-reduced across processes).
"""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ddcl_vq import USAGE_DEFINITIONS
from ddcl_vq.distributed import all_reduce_sum_

from ddcl_vq.common import lpips_weights

RECON_DEFINITIONS = """\
images in [0, 1]; every image-level value is averaged over the images of the split
mse             = mean over images of the per-pixel mean squared error
psnr            = mean over images of 10*log10(1 / MSE_image) dB (MSE_image floored at 1e-10)
ssim            = mean over images of torchmetrics structural_similarity_index_measure
                  (Gaussian window 11, sigma 1.5, data_range 1, k1 0.01, k2 0.03)
lpips           = mean over images of LPIPS v0.1 (lpips package, AlexNet trunk with ImageNet
                  weights, inputs mapped to [-1, 1], grayscale repeated to 3 channels,
                  native resolution); lower is better; null when no real weights are available
hard / soft     = decoded from the hard codes w_k* (every quantizer; the headline) / from the
                  DDCL soft codes z_hat = sum_k q_k w_k at the checkpoint's temperature (DDCL only)
soft_minus_hard = soft value - hard value, per metric"""

GEOMETRY_DEFINITIONS = """\
code distances are Euclidean ||w_j - w_k|| between distinct codes j != k of the final codebook
min_code_distance / mean_code_distance               = over all K codes
min_active_code_distance / mean_active_code_distance = over active codes only (null if < 2)"""


PER_LEVEL_DEFINITIONS = """\
for a quantizer with several codebooks (indices (..., L): a residual quantizer's L levels, a
grouped quantizer's L groups; the quantizer's num_codebooks):
*_per_level     = utilization, active_codes, dead_codes, perplexity, soft_perplexity, entropy_bits
                  and num_vectors of each codebook on its own (its K codes, the vectors that reach
                  it; index -1, a level left out, is not counted), in the order of the index axis
utilization, active_codes, dead_codes, perplexity, soft_perplexity, entropy_bits, num_vectors
                = the mean over the L codebooks of the per-level figure (soft_perplexity: null
                  unless every level has one); utilization_ceiling: from that mean num_vectors
code distances  = the mean over the L codebooks of each one's figure (a codebook shared by every
                  level: that codebook's, with the counts of every level pooled)
usage_counts    = L*K counts, codebook-major (codebook i's code k at i*K + k)
hard_by_levels  = residual quantizers only: mse and psnr decoded from the hard codes of the first
                  l levels, l = 1..L (l = L: the hard codes above)"""


#: where the definitions behind a report's figures are, when a command does not print them (one line)
DEFINITIONS_HINT = "definitions of these figures: --verbose, or docs/reference/quantizer.md#what-the-reports-print"


def definitions(per_level: bool = False) -> str:
    """All metric definitions, as printed under every report; ``per_level``: with those of a quantizer with several
    codebooks (:data:`PER_LEVEL_DEFINITIONS`)."""
    parts = ["reconstruction:", _indent(RECON_DEFINITIONS), "codebook usage (dataset level):",
             _indent(USAGE_DEFINITIONS), "codebook geometry:", _indent(GEOMETRY_DEFINITIONS)]
    if per_level:
        parts += ["several codebooks (per level):", _indent(PER_LEVEL_DEFINITIONS)]
    return "\n".join(parts)


def _indent(text: str) -> str:
    return "  " + text.replace("\n", "\n  ")


# --------------------------------------------------------------------------- SSIM
def ssim_per_image(pred: Tensor, target: Tensor) -> Tensor:
    """(B, C, H, W) images in [0, 1] -> (B,) SSIM values (torchmetrics, data_range 1)."""
    return ssim_many([pred], target)[0]


def ssim_many(preds: Sequence[Tensor], target: Tensor) -> List[Tensor]:
    """SSIM of each (B, C, H, W) batch in ``preds`` against ``target`` -> one (B,) tensor per batch, in one torchmetrics
    call with every image channel as a channel of one image (the same values, faster)."""
    from torchmetrics.functional.image import structural_similarity_index_measure
    b, c, h, w = target.shape
    stacked = torch.cat([p.float() for p in preds]).reshape(1, len(preds) * b * c, h, w)
    targets = target.float().repeat(len(preds), 1, 1, 1).reshape(1, len(preds) * b * c, h, w)
    _, full = structural_similarity_index_measure(stacked, targets, data_range=1.0, reduction="none",
                                                  return_full_image=True)
    return list(full.reshape(len(preds) * b, -1).mean(-1).split(b))


# --------------------------------------------------------------------------- LPIPS
def build_lpips(device: torch.device | str = "cpu") -> Tuple[Optional[torch.nn.Module], str]:
    """-> (LPIPS module (AlexNet trunk) or None, one-line note saying which weights were used or why not)."""
    return lpips_weights.build_lpips(device, "alex")


@torch.no_grad()
def lpips_per_image(model: torch.nn.Module, pred: Tensor, target: Tensor) -> Tensor:
    """(B, C, H, W) images in [0, 1] -> (B,) LPIPS; inputs mapped to [-1, 1], gray -> 3 channels."""
    if pred.shape[1] == 1:
        pred, target = pred.repeat(1, 3, 1, 1), target.repeat(1, 3, 1, 1)
    return model(pred.float() * 2 - 1, target.float() * 2 - 1).reshape(pred.shape[0])


@torch.no_grad()
def lpips_many(model: torch.nn.Module, preds: Sequence[Tensor], target: Tensor) -> List[Tensor]:
    """LPIPS of each (B, C, H, W) batch in ``preds`` against ``target`` -> one (B,) tensor per batch (the target's
    features computed once): :func:`lpips_per_image`'s values."""
    import lpips

    def prepared(t: Tensor) -> Tensor:
        t = t.float() * 2 - 1
        return model.scaling_layer(t.repeat(1, 3, 1, 1) if t.shape[1] == 1 else t)

    b = target.shape[0]
    ref = model.net.forward(prepared(target))
    outs = model.net.forward(prepared(torch.cat(list(preds))))
    total = None
    for kk in range(model.L):
        f0 = lpips.normalize_tensor(outs[kk])
        f1 = lpips.normalize_tensor(ref[kk]).repeat(len(preds), 1, 1, 1)
        layer = model.lins[kk]((f0 - f1) ** 2).mean([2, 3], keepdim=True)
        total = layer if total is None else total + layer
    return list(total.reshape(len(preds) * b).split(b))


# --------------------------------------------------------------------------- rFID
INCEPTION_FILE = "pt_inception-2015-12-05-6726825d.pth"


def rfid_availability() -> Tuple[bool, str]:
    """rFID needs real Inception weights: torch-fidelity's file in the hub cache + the package."""
    path = Path(torch.hub.get_dir()) / "checkpoints" / INCEPTION_FILE
    if not path.is_file():
        return False, f"rFID not computed: no Inception weights offline ({path} is missing and no package ships them)"
    if importlib.util.find_spec("torch_fidelity") is None:
        return False, "rFID not computed: Inception weights found but the torch-fidelity package is not installed"
    return True, f"rFID: torchmetrics FrechetInceptionDistance (2048-d pool features, {INCEPTION_FILE})"


# --------------------------------------------------------------------------- accumulators
class ImageMetricSums:
    """float64 sums of per-image SSIM and LPIPS for hard and soft reconstructions (``update`` is an ``on_batch``)."""

    def __init__(self, lpips_model: Optional[torch.nn.Module], device: torch.device | str = "cpu", rfid: bool = False):
        self.lpips_model = lpips_model
        # hard ssim, hard lpips, soft ssim, soft lpips, images, images with soft
        self.sums = torch.zeros(6, dtype=torch.float64, device=device)
        self.fid = None
        if rfid:  # pragma: no cover - needs Inception weights, absent on the project's machines
            from torchmetrics.image.fid import FrechetInceptionDistance
            self.fid = FrechetInceptionDistance(feature=2048, normalize=True).to(device)

    @torch.no_grad()
    def update(self, x: Tensor, hard: Tensor, soft: Optional[Tensor]) -> None:
        """Add one batch's SSIM and LPIPS of the hard (and soft) reconstructions (no host sync)."""
        preds = [hard] if soft is None else [hard, soft]
        lp = lpips_many(self.lpips_model, preds, x) if self.lpips_model is not None else [None, None]
        for i, (ssim, lpips) in enumerate(zip(ssim_many(preds, x), lp)):  # hard: sums 0, 1; soft: 2, 3
            self.sums[2 * i] += ssim.double().sum()
            if lpips is not None:
                self.sums[2 * i + 1] += lpips.double().sum()
        self.sums[4:4 + len(preds)] += x.shape[0]
        if self.fid is not None:  # pragma: no cover
            rgb = (lambda t: t.repeat(1, 3, 1, 1) if t.shape[1] == 1 else t)
            self.fid.update(rgb(x), real=True)
            self.fid.update(rgb(hard), real=False)

    def compute(self) -> Dict[str, Optional[float]]:
        sums = all_reduce_sum_(self.sums.clone())
        n, n_soft = float(sums[4]), float(sums[5])
        has_lpips = self.lpips_model is not None
        return {"hard_ssim": float(sums[0]) / n if n else None,
                "hard_lpips": float(sums[1]) / n if n and has_lpips else None,
                "soft_ssim": float(sums[2]) / n_soft if n_soft else None,
                "soft_lpips": float(sums[3]) / n_soft if n_soft and has_lpips else None,
                "rfid": float(self.fid.compute()) if self.fid is not None else None}


# --------------------------------------------------------------------------- codebook geometry
def _geometry_tile(device: torch.device, k: int) -> Tuple[int, int]:
    """(rows, columns) of one tile of pairwise distances: ~4 MiB on the CPU, 256 MiB of whole rows on a GPU."""
    if device.type == "cpu":
        columns = min(k, 4096)
        return max(1, 2 ** 20 // columns), columns
    return max(1, 2 ** 26 // k), k


@torch.no_grad()
def codebook_geometry(codebook: Tensor, counts: Sequence[int]) -> Dict[str, Optional[float]]:
    """Min and mean Euclidean distance between distinct codes of the (K, D) codebook, over all codes and over the
    active ones (count > 0), in tiles of K×K; the minima exact (the closest candidates redone in float64)."""
    w64 = codebook.detach().double()
    k = w64.shape[0]
    if len(counts) != k:
        raise ValueError(f"expected {k} usage counts, got {len(counts)}")
    device = w64.device
    active = torch.tensor([c > 0 for c in counts], dtype=torch.bool, device=device)
    n_active = int(active.sum())
    if k < 2:
        return {"min_code_distance": None, "mean_code_distance": None,
                "min_active_code_distance": None, "mean_active_code_distance": None}
    # the active codes first: "to an active code" is then the first n_active columns of every row
    w64 = w64[torch.argsort((~active).to(torch.uint8), stable=True)]
    w = w64.float()
    sq = w.pow(2).sum(1)
    nearest = torch.full((2, k), math.inf, device=device)  # squared float32: to any code / to an active code
    sums = torch.zeros(2, k, dtype=torch.float64, device=device)  # each row's distances to all / active codes
    tile_rows, tile_columns = _geometry_tile(device, k)
    for r0 in range(0, k, tile_rows):
        r1 = min(r0 + tile_rows, k)
        for c0 in range(0, k, tile_columns):
            c1 = min(c0 + tile_columns, k)
            d2 = torch.addmm(sq[None, c0:c1], w[r0:r1], w[c0:c1].T, alpha=-2).add_(sq[r0:r1, None])
            lo = max(r0, c0)  # the diagonal (j == k) within this tile: [lo, hi)
            hi = max(lo, min(r1, c1))
            own = (torch.arange(lo - r0, hi - r0, device=device), torch.arange(lo - c0, hi - c0, device=device))
            d2[own] = math.inf
            torch.minimum(nearest[0, r0:r1], d2.amin(1), out=nearest[0, r0:r1])
            if c0 < n_active:
                torch.minimum(nearest[1, r0:r1], d2[:, :n_active - c0].amin(1), out=nearest[1, r0:r1])
            d2[own] = 0.0
            d = d2.clamp_min_(0).sqrt_()
            sums[0, r0:r1] += d.sum(1)
            if c0 < n_active:
                sums[1, r0:r1] += d[:, :n_active - c0].sum(1)
    nearest[1, n_active:] = math.inf
    # the float32 expansion errs by a few ulps of ‖a‖² + ‖b‖²: rows within that of the smallest are redone
    slack = 16 * torch.finfo(torch.float32).eps * float(sq.max())

    def exact_min(which: int, columns: int) -> float:
        # candidate rows, their float32 distances again, and in float64 only the pairs within the slack
        candidates = torch.nonzero(nearest[which] <= nearest[which].min() + slack).flatten()
        best = math.inf
        for part in candidates.split(max(1, 2 ** 22 // columns)):
            d2 = torch.addmm(sq[None, :columns], w[part], w[:columns].T, alpha=-2).add_(sq[part, None])
            d2[torch.arange(len(part), device=device), part] = math.inf  # j == k (part < columns)
            rows, cols = torch.nonzero(d2 <= d2.amin(1, keepdim=True) + slack, as_tuple=True)
            exact = (w64[part[rows]] - w64[cols]).pow(2).sum(1)
            best = min(best, float(exact.min()))
        return math.sqrt(best)

    pairs_active = n_active * (n_active - 1)
    return {"min_code_distance": exact_min(0, k), "mean_code_distance": float(sums[0].sum()) / (k * (k - 1)),
            "min_active_code_distance": exact_min(1, n_active) if n_active >= 2 else None,
            "mean_active_code_distance": float(sums[1, :n_active].sum()) / pairs_active if n_active >= 2 else None}

