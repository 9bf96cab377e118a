"""Sampling a trained prior and decoding the codes with the tokenizer's decoder."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from ddcl_vq.models.prior import CodePrior
from ddcl_vq.models.vqvae import byte_size
from ddcl_vq.common.errors import UserError


class SampleError(UserError, ValueError):
    """Sampling cannot be done as asked."""


def sample_labels(model: CodePrior, count: int, klass: Optional[int] = None) -> Optional[torch.Tensor]:
    """The classes to sample: ``klass`` for every map, else 0, 1, …, C−1, 0, 1, …; None for an unconditional prior."""
    if not model.num_classes:
        if klass is not None:
            raise SampleError("--class: this prior is unconditional (its tokens had no labels)")
        return None
    if klass is not None:
        if not 0 <= klass < model.num_classes:
            raise SampleError(f"--class: expected a class in [0, {model.num_classes}), got {klass}")
        return torch.full((count,), klass, dtype=torch.long)
    return torch.arange(count) % model.num_classes


def sample_codes(model: CodePrior, count: int, labels: Optional[torch.Tensor] = None, temperature: float = 1.0,
                 top_k: int = 0, seed: int = 0, batch_size: int = 256, device="cpu",
                 use_cache: bool = True) -> torch.Tensor:
    """``count`` code maps (count, h, w) long, drawn in batches from one generator seeded with ``seed``."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for i in range(0, count, batch_size):
        n = min(batch_size, count - i)
        lab = None if labels is None else labels[i:i + n].to(device)
        out.append(model.sample(n, lab, temperature, top_k, generator=gen, use_cache=use_cache).cpu())
    return torch.cat(out) if out else torch.empty(0, model.height, model.width, dtype=torch.long)


def sample_to_files(prior_dir: str | Path, count: int, out: str | Path, klass: Optional[int] = None,
                    temperature: float = 1.0, top_k: int = 0, seed: int = 0, nrow: Optional[int] = None,
                    tokenizer: Optional[str] = None, device: str = "cpu") -> Dict:
    """Sample ``count`` maps, write their codes (OUT.npy, labels in OUT.labels.npy) and decoded grid (OUT)."""
    from ddcl_vq.tokenizer.decode import decode_indices, save_png
    from ddcl_vq.tokenizer.tokens import check_out, index_dtype, load_model, write_tokens
    from ddcl_vq.prior.train import load_prior
    out = check_out(out, "--out", suffix=".png")  # a folder in its place, or a file in the way of its folder
    cfg, model, meta = load_prior(prior_dir, device)
    source = tokenizer or cfg.data.tokenizer
    decoder = load_model(source, device)
    if decoder.quantizer.num_codes != model.num_codes:
        raise SampleError(f"the tokenizer {source!r} has K = {decoder.quantizer.num_codes} codes, the prior "
                          f"K = {model.num_codes}")
    check_memory(model, decoder, count, device)
    labels = sample_labels(model, count, klass)
    t0 = time.perf_counter()
    codes = sample_codes(model, count, labels, temperature, top_k, seed, device=device)
    seconds = time.perf_counter() - t0
    images = decode_indices(decoder, codes.numpy(), device=device)
    nrow = nrow or (model.num_classes if labels is not None and klass is None and count >= model.num_classes else 8)
    save_png(images, out, nrow)
    tokens_path = out.with_suffix(".npy")
    write_tokens(tokens_path, codes.numpy().astype(index_dtype(model.num_codes)),
                 None if labels is None else labels.numpy().astype(np.int64))
    return {"out": str(out), "tokens": str(tokens_path), "count": count, "grid": [model.height, model.width],
            "step": meta["step"], "seconds": seconds, "tokens_per_second": count * model.length / max(seconds, 1e-9),
            "classes": None if labels is None else sorted(set(labels.tolist()))}


def check_memory(model: CodePrior, decoder, count: int, device="cpu") -> None:
    """Refuse, before sampling, a ``count`` whose codes, images and grid need more memory than is available."""
    from ddcl_vq.tokenizer.decode import decode_indices
    from ddcl_vq.tokenizer.memory import available_bytes
    one = decode_indices(decoder, np.zeros((1, model.height, model.width), np.int64), device=device)
    per_map = 8 * model.length + 2 * 4 * one[0].numel()  # int64 codes; float32 images and their grid
    need, free = count * per_map, available_bytes(torch.device("cpu"))
    if free is not None and need > free:
        fits = max(free // per_map // 2, 1)
        raise SampleError(f"--count {count:,}: the codes, decoded images and PNG grid need about {byte_size(need)} of "
                          f"memory at once, this machine has {byte_size(free)} available; sample fewer (--count "
                          f"{fits:,} fits with room to spare; other --seed values give other samples)")


def bench_prior(device: str = "cpu", count: int = 64, num_codes: int = 1024, grid: int = 8, repeats: int = 3,
                no_cache: bool = True) -> Tuple[List[Dict], str]:
    """The prior row of ``ddcl-vq bench``: how fast the default prior (freshly initialised, 10 classes) samples
    ``count`` maps of ``grid`` x ``grid`` tokens, with and without the KV cache -> (rows, a few lines of text)."""
    from ddcl_vq.prior.train import PriorConfig
    m = PriorConfig().model
    torch.manual_seed(0)
    model = CodePrior(num_codes, grid, grid, 10, dim=m.dim, layers=m.layers, heads=m.heads, mlp_ratio=m.mlp_ratio,
                      dropout=m.dropout).to(device).eval()
    labels, rows = sample_labels(model, count), []
    for name, cache in (("prior-sample-kvcache", True), ("prior-sample-nocache", False))[:2 if no_cache else 1]:
        runs = repeats if cache else 1  # without the cache it is O(L^3): one run says enough
        sample_codes(model, min(count, 8), labels[:8], batch_size=8, device=device, use_cache=cache)  # warm-up
        times = []
        for r in range(runs):
            t0 = time.perf_counter()
            sample_codes(model, count, labels, seed=r, batch_size=count, device=device, use_cache=cache)
            times.append(time.perf_counter() - t0)
        seconds = float(np.median(times))
        rows.append({"impl": name, "images": count, "tokens": count * grid * grid, "K": num_codes, "dim": m.dim,
                     "layers": m.layers, "seconds": round(seconds, 4),
                     "tokens_per_s": round(count * model.length / seconds, 1), "repeats": runs})
    text = [f"prior sampling (default prior: dim {m.dim}, {m.layers} layers, {m.heads} heads; K = {num_codes}, "
            f"{grid}x{grid} tokens, class-conditional; {torch.get_num_threads()} thread(s)):"]
    text += [f"  {r['impl']:<22} {r['images']} images in {r['seconds']:.2f} s  ({r['tokens_per_s']:,.0f} tokens/s, "
             f"median of {r['repeats']})" for r in rows]
    return rows, "\n".join(text)
