"""``ddcl-vq gap RUN_DIR ...``: where a trained run's reconstruction error comes from (HELP says what it measures).

The row's keys, on the first ``--images`` images of the split: ``psnr_hard`` (the decoder on the hard codes: what a
prior or a deployed decoder sees); ``psnr_unquantized`` (the decoder fed the encoder's features without quantization — a
decoder trained only on coarse codes may not read features between them: in the VQGAN recipe every quantizer's gap is
within 0.12 dB, HardVQ's with 62% of the variance left, docs/vqgan.md); ``gap_db`` = psnr_unquantized − psnr_hard;
``relative_distortion`` (mean squared nearest-code distance over the features' total variance); ``psnr_lloyd`` (after
``--lloyd`` hard k-means steps on ``--fit-images`` training images' features; each step assigns to the nearest code and
moves each code with vectors to their mean). The last four are left out for FSQ and LFQ, whose index rounds a projection
rather than naming the nearest code (their decoder never sees the encoder's features as they are).

Codebook use on the measured images: ``utilization_hard`` (the share of the K codes the hard tokens use), and for
quantizers that assign the nearest code ``utilization_lloyd`` (of the re-fitted codebook) and ``utilization_sampled`` /
``psnr_sampled`` (a codebook of K of the fit features drawn at random, seed 0, when there are at least K: codes that
sit on the encoder's current features and nothing more — where a codebook placed only by re-seeding on data would be;
with fewer than K images' features it is None). How close a codebook's use can come to 100% on a split depends on the
split's size against K as much as on the codebook: this row says what an ideal placement reaches on the same images.

How stable the tokens are (what a prior over them pays for, docs/prior.md): ``token_flips`` (under Gaussian pixel noise
of sd ``--noise``, about 1.3/255 at the default; fixed seed; images clamped to [0, 1]), ``duplicate_codes`` (nearest
other code closer than :data:`DUPLICATE_FRACTION` of the median squared nearest-other-code distance: one code in two
places), ``duplicate_token_share`` (the share of the measured tokens that are such codes) and ``duplicate_token_flips``
(how often those flip under the noise).

Shapes: features are (B, D, h, w); the codebook is (K, D). The hard codes are the quantizer's own (its forward in eval
mode); for a quantizer that assigns the nearest code, the re-fitted codebook is decoded the same way.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
from einops import rearrange
from torch import Tensor

from ddcl_vq.base import squared_distances
from ddcl_vq.usage import CodebookUsage
from ddcl_vq.blocks import nearest_other_code
from ddcl_vq.common.data import SPLITS
from ddcl_vq.common.errors import entry_point
from ddcl_vq.common.config import Options, Rules, option
from ddcl_vq.tokenizer.testset import EVAL_BATCH_SIZE

from ddcl_vq.tokenizer.evaluate import EvaluateError, load_run


def nearest_codes(vectors: Tensor, codebook: Tensor, rows: int = 4096) -> tuple[Tensor, Tensor]:
    """(N, D), (K, D) -> (indices (N,), squared distance to the nearest code (N,)), in row blocks."""
    center = codebook.mean(0)
    w = codebook - center
    mins = [squared_distances(vectors[start:start + rows] - center, w).min(1)
            for start in range(0, vectors.shape[0], rows)]
    return torch.cat([m.indices for m in mins]), torch.cat([m.values for m in mins])


def lloyd_step(codebook: Tensor, vectors: Tensor) -> Tensor:
    """One hard k-means step: each code with assigned vectors moves to their mean; the rest stay."""
    idx, _ = nearest_codes(vectors, codebook)
    counts = torch.bincount(idx, minlength=codebook.shape[0]).to(vectors.dtype)
    sums = torch.zeros_like(codebook).index_add_(0, idx, vectors)
    return torch.where(counts[:, None] > 0, sums / counts.clamp_min(1)[:, None], codebook)


def _images(dataset, n: int) -> Tensor:
    from ddcl_vq.common.data import SequentialBatches, make_loader
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
    """(B, D, h, w) features -> (the codes the quantizer decodes (B, D, h, w), their indices (B·h·w,)),
    by the quantizer itself in eval mode (FSQ and LFQ round a projection: not the nearest row)."""
    codes, indices = [], []
    for i in range(0, len(features), batch_size):
        out = quantizer(features[i:i + batch_size])
        codes.append(out.quantized.float())
        indices.append(out.indices.flatten())
    return torch.cat(codes), torch.cat(indices)


#: a code is a near-duplicate when its squared distance to the nearest other code is below this
#: fraction of the median squared nearest-other-code distance
DUPLICATE_FRACTION = 0.01


def duplicate_codes(codebook: Tensor, rows: Optional[int] = None) -> Tensor:
    """(K, D) -> (K,) bool: codes whose nearest other code is nearer than DUPLICATE_FRACTION of the
    median nearest-other-code distance (squared)."""
    nearest = nearest_other_code(codebook, rows=rows)
    return nearest < DUPLICATE_FRACTION * nearest.median()


@torch.no_grad()
def quantization_gap(run_dir: str | Path, images: int = 2000, fit_images: int = 4000, lloyd: int = 3,
                     split: str = "test", batch_size: int = 250, noise: float = 0.005,
                     data: Optional[str] = None) -> Dict:
    """The figures described in the module docstring, for one run directory (``data``: measure on
    that dataset's ``split`` instead of the run's own; the Lloyd steps still fit the run's own data)."""
    from ddcl_vq.common.data import build_dataset
    cfg, model, step, _ = load_run(run_dir)
    if model.quantizer.channel_dim != 1:
        raise EvaluateError("gap expects a VQ-VAE whose quantizer takes (B, D, h, w) features")
    measured = cfg.data
    if data is not None:
        from ddcl_vq.tokenizer.config import CHOICES
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


def _num(value: Optional[float], spec: str) -> str:
    return "—" if value is None else format(value, spec)


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
                     f"{_num(r['psnr_unquantized'], '.2f')} | {_num(r['gap_db'], '.2f')} | "
                     f"{_num(r['relative_distortion'], '.2%')} | {100 * r['token_flips']:.1f}% (sd {r['noise']:g}) | "
                     f"{r['duplicate_codes']} | {100 * r['duplicate_token_share']:.1f}% ({dup_flips}) | "
                     f"{r['utilization_hard']:.1%} / {_num(r.get('utilization_lloyd'), '.1%')} / {sampled} |")
    return "\n".join(lines)


HELP = """\
Where a trained run's reconstruction error comes from. For each run, on the first --images images
of the split: hard-code PSNR; the decoder fed the encoder's features without quantization (what
the encoder/decoder pair reaches with an infinitely fine codebook, if the decoder reads features
between the codes: a gap near 0 with a large nearest-code distance says it does not); their gap
(the part of the error due to quantization); the mean squared nearest-code distance over the
features' variance; and hard PSNR after --lloyd hard k-means steps of the codebook on
--fit-images training images' features (if these add nothing, the codebook sits where hard
k-means would put it); how many tokens change under pixel noise of sd --noise, and the
near-duplicate codes (nearest other code within 1% of the median spacing, squared) with their
share of the tokens; and the share of the K codes in use on those images: by the run's hard
tokens, by the re-fitted codebook, and by a codebook of K training features drawn at random (what
codes placed on the encoder's features reach on the same images: with few images per code no
codebook uses all of them). Prints a markdown table, one row per run.

  ddcl-vq gap runs/fashion_ddcl runs/fashion_vqp
  ddcl-vq gap runs/a runs/b --images 10000 --lloyd 0 --json gap.json
"""


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


OPTIONS = Options(GapOptions, prog="ddcl-vq gap", description=HELP,
                  rules=Rules(choices={"split": SPLITS}, positive={"images", "fit_images", "noise"},
                              non_negative={"lloyd"}))


@entry_point("ddcl-vq gap")
def main(argv: Optional[List[str]] = None) -> int:
    opts = OPTIONS.parse(argv)
    rows = [quantization_gap(r, opts.images, opts.fit_images, opts.lloyd, opts.split, noise=opts.noise, data=opts.data)
            for r in opts.runs]
    print(markdown(rows))
    if opts.json:
        Path(opts.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
