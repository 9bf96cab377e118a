"""Where a trained run's reconstruction error comes from; prints a markdown table, one row per run.

On the first --images images of the split: psnr_hard (the decoder on the hard codes); psnr_unquantized (the decoder
fed the encoder's features without quantization); gap_db = psnr_unquantized - psnr_hard; relative_distortion (mean
squared nearest-code distance over the features' variance); psnr_lloyd (after --lloyd hard k-means steps on
--fit-images training images' features); none of these for FSQ and LFQ. Codebook use: utilization_hard,
utilization_lloyd (the re-fitted codebook's), utilization_sampled / psnr_sampled (K training features drawn at random
as a codebook). Token stability: token_flips under Gaussian pixel noise of sd --noise, duplicate_codes (nearest other
code within DUPLICATE_FRACTION of the median spacing, squared), their share of the tokens and how often those flip.

  ddcl-vq gap runs/fashion_ddcl runs/fashion_vqp
  ddcl-vq gap runs/a runs/b --images 10000 --lloyd 0 --json gap.json
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
from einops import rearrange
from torch import Tensor

from ddcl_vq import blocks
from ddcl_vq.usage import CodebookUsage

from ddcl_vq.common.checkpoint import write_json
from ddcl_vq.common.config import Options, Rules, option
from ddcl_vq.common.data import SPLITS, SequentialBatches, build_dataset, make_loader
from ddcl_vq.common.errors import entry_point
from ddcl_vq.common.progress import fmt
from ddcl_vq.tokenizer.config import CHOICES
from ddcl_vq.tokenizer.evaluate import EVAL_BATCH_SIZE, EvaluateError, load_run


def nearest_codes(vectors: Tensor, codebook: Tensor) -> tuple[Tensor, Tensor]:
    """(N, D), (K, D) -> (indices (N,), squared distance to the nearest code (N,)), the codebook centred first."""
    center = codebook.mean(0)
    distances, indices = blocks.nearest_codes(vectors - center, codebook - center)
    return indices, distances


def lloyd_step(codebook: Tensor, vectors: Tensor) -> Tensor:
    """One hard k-means step: each code with assigned vectors moves to their mean; the rest stay."""
    idx, _ = nearest_codes(vectors, codebook)
    counts = torch.bincount(idx, minlength=codebook.shape[0]).to(vectors.dtype)
    sums = torch.zeros_like(codebook).index_add_(0, idx, vectors)
    return torch.where(counts[:, None] > 0, sums / counts.clamp_min(1)[:, None], codebook)


def _images(dataset, n: int) -> Tensor:
    n = min(n, len(dataset))
    if n <= 0:
        raise EvaluateError("nothing to measure: the split has no images")
    return torch.cat([x for x, _ in make_loader(dataset, SequentialBatches(n, EVAL_BATCH_SIZE))])


@torch.no_grad()
def _features(model, images: Tensor, batch_size: int) -> Tensor:
    return torch.cat([model.encoder(images[i:i + batch_size]).float() for i in range(0, len(images), batch_size)])


@torch.no_grad()
def _psnr(model, images: Tensor, features: Tensor, batch_size: int) -> float:
    """Mean over images of 10·log10(1 / MSE_image), reconstructions clamped to [0, 1]."""
    total = 0.0
    for i in range(0, len(images), batch_size):
        rec = model.decoder(features[i:i + batch_size]).float().clamp(0, 1)
        mse = (rec - images[i:i + batch_size]).pow(2).flatten(1).mean(1).double()
        total += float((10 * torch.log10(1.0 / mse.clamp_min(1e-10))).sum())
    return total / len(images)


def _hard_codes(quantizer, features: Tensor, batch_size: int) -> tuple[Tensor, Tensor]:
    """(B, D, h, w) features -> (the codes the quantizer decodes (B, D, h, w), their indices (B·h·w,))."""
    codes, indices = [], []
    for i in range(0, len(features), batch_size):
        out = quantizer(features[i:i + batch_size])
        codes.append(out.quantized.float())
        indices.append(out.indices.flatten())
    return torch.cat(codes), torch.cat(indices)


#: a code is a near-duplicate below this fraction of the median squared nearest-other-code distance
DUPLICATE_FRACTION = 0.01


def duplicate_codes(codebook: Tensor, rows: Optional[int] = None) -> Tensor:
    """(K, D) -> (K,) bool: the near-duplicate codes (:data:`DUPLICATE_FRACTION`)."""
    nearest = blocks.nearest_other_code(codebook, rows=rows)
    return nearest < DUPLICATE_FRACTION * nearest.median()


@torch.no_grad()
def quantization_gap(run_dir: str | Path, images: int = 2000, fit_images: int = 4000, lloyd: int = 3,
                     split: str = "test", batch_size: int = 250, noise: float = 0.005,
                     data: Optional[str] = None) -> Dict:
    """The figures described in the module docstring, for one run directory (``data``: measure on that dataset)."""
    cfg, model, step, _ = load_run(run_dir)
    if model.quantizer.channel_dim != 1:
        raise EvaluateError("gap expects a VQ-VAE whose quantizer takes (B, D, h, w) features")
    measured = cfg.data
    if data is not None:
        if data not in CHOICES["data.name"]:
            raise EvaluateError(f"--data: expected one of {CHOICES['data.name']}, got {data!r}")
        measured = dataclasses.replace(cfg.data, name=data)
    x = _images(build_dataset(measured, split, seed=cfg.run.seed), images)
    z = _features(model, x, batch_size)
    quantizer = model.quantizer
    codebook = quantizer.codebook.detach().float()
    hard, tokens = _hard_codes(quantizer, z, batch_size)
    flat = rearrange(z, "b d h w -> (b h w) d")
    dist = (flat - rearrange(hard, "b d h w -> (b h w) d")).pow(2).sum(1)
    variance = float((flat - flat.mean(0)).pow(2).sum(1).mean())
    k = int(codebook.shape[0])
    out = {"run": str(run_dir), "step": step, "split": split, "data": measured.name, "num_images": len(x),
           "num_codes": k, "psnr_hard": _psnr(model, x, hard, batch_size),
           "psnr_unquantized": None, "relative_distortion": None, "gap_db": None,
           "utilization_hard": _utilization(tokens, k)}
    if quantizer.assigns_nearest_code:  # FSQ/LFQ: the decoder never sees z, only a projection of it
        out.update(psnr_unquantized=_psnr(model, x, z, batch_size),
                   relative_distortion=float(dist.mean()) / max(variance, 1e-12))
        out["gap_db"] = out["psnr_unquantized"] - out["psnr_hard"]
    noisy = x + noise * torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    flipped = _hard_codes(quantizer, _features(model, noisy.clamp(0, 1), batch_size), batch_size)[1] != tokens
    duplicate = duplicate_codes(codebook)
    duplicates = duplicate[tokens]
    out.update(noise=noise, token_flips=float(flipped.double().mean()), duplicate_codes=int(duplicate.sum()),
               duplicate_token_share=float(duplicates.double().mean()),
               duplicate_token_flips=float(flipped[duplicates].double().mean()) if bool(duplicates.any()) else None)
    if quantizer.assigns_nearest_code:
        fit = _features(model, _images(build_dataset(cfg.data, "train", seed=cfg.run.seed), fit_images), batch_size)
        fit_flat = rearrange(fit, "b d h w -> (b h w) d")
        b, _, h, w = z.shape

        def decoded(book: Tensor) -> tuple[float, float]:
            # (PSNR, utilization) of the features decoded from ``book``'s nearest codes
            idx = nearest_codes(flat, book)[0]
            codes = rearrange(book[idx], "(b h w) d -> b d h w", b=b, h=h, w=w)
            return _psnr(model, x, codes, batch_size), _utilization(idx, k)

        out.update(psnr_sampled=None, utilization_sampled=None)
        if fit_flat.shape[0] >= k:
            drawn = torch.randperm(fit_flat.shape[0], generator=torch.Generator().manual_seed(0))[:k]
            out["psnr_sampled"], out["utilization_sampled"] = decoded(fit_flat[drawn])
        if lloyd > 0:
            refit = codebook
            for _ in range(lloyd):
                refit = lloyd_step(refit, fit_flat)
            psnr_lloyd, utilization_lloyd = decoded(refit)
            out.update(lloyd_steps=lloyd, psnr_lloyd=psnr_lloyd, utilization_lloyd=utilization_lloyd)
    return out


def _utilization(indices: Tensor, num_codes: int) -> float:
    """Share of the ``num_codes`` codes that ``indices`` (any shape) use: the evaluation's definition."""
    usage = CodebookUsage(num_codes)
    usage.update(indices)
    return usage.compute().utilization


def markdown(rows: Sequence[Dict]) -> str:
    lines = ["| run | K | PSNR hard (dB) | after Lloyd steps | decoder(z), unquantized | quantization gap (dB) "
             "| nearest-code distance / variance | tokens flipped by noise | near-duplicate codes "
             "| their share of tokens (flipped) | codes used: hard / after Lloyd / K features drawn (their PSNR) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lloyd = f"{r['psnr_lloyd']:.2f} ({r['lloyd_steps']})" if "psnr_lloyd" in r else "—"
        dup_flips = "—" if r["duplicate_token_flips"] is None else f"{100 * r['duplicate_token_flips']:.1f}%"
        sampled = "—" if r.get("utilization_sampled") is None else \
            f"{r['utilization_sampled']:.1%} ({r['psnr_sampled']:.2f} dB)"
        lines.append(f"| {Path(r['run']).name} | {r['num_codes']} | {r['psnr_hard']:.2f} | {lloyd} | "
                     f"{fmt(r['psnr_unquantized'], '.2f')} | {fmt(r['gap_db'], '.2f')} | "
                     f"{fmt(r['relative_distortion'], '.2%')} | {100 * r['token_flips']:.1f}% (sd {r['noise']:g}) | "
                     f"{r['duplicate_codes']} | {100 * r['duplicate_token_share']:.1f}% ({dup_flips}) | "
                     f"{r['utilization_hard']:.1%} / {fmt(r.get('utilization_lloyd'), '.1%')} / {sampled} |")
    return "\n".join(lines)


@dataclass(kw_only=True)
class GapOptions:
    runs: List[str] = option(help="run directories written by ddcl-vq train", positional=True, nargs="+",
                             metavar="RUN_DIR")
    images: int = option(2000, "images of the split to measure")
    fit_images: int = option(4000, "training images whose features the Lloyd steps fit")
    lloyd: int = option(3, "hard k-means steps of the codebook (0: skip)")
    split: str = option("test", "the split to measure")
    data: Optional[str] = option(None, "measure on this dataset instead of the run's own (data.name, e.g. digits "
                                 "for a Fashion-MNIST run)", metavar="NAME")
    noise: float = option(0.005, "sd of the Gaussian pixel noise (images in [0, 1]) for the token flip rate")
    json: Optional[str] = option(None, "also write the rows as JSON", metavar="FILE")


OPTIONS = Options(GapOptions, prog="ddcl-vq gap", description=__doc__,
                  rules=Rules(choices={"split": SPLITS}, positive={"images", "fit_images", "noise"},
                              non_negative={"lloyd"}))


@entry_point("ddcl-vq gap")
def main(argv: Optional[List[str]] = None) -> int:
    opts = OPTIONS.parse(argv)
    rows = [quantization_gap(r, opts.images, opts.fit_images, opts.lloyd, opts.split, noise=opts.noise, data=opts.data)
            for r in opts.runs]
    print(markdown(rows))
    if opts.json:
        write_json(opts.json, rows)
    return 0
