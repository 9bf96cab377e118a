"""Sampling a trained prior and decoding the codes with the tokenizer's decoder."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np
import torch

from ddcl_vq.models.prior import CodePrior
from ddcl_vq.common.errors import UserError


class SampleError(UserError, ValueError):
    """Sampling cannot be done as asked."""


def sample_labels(model: CodePrior, count: int, klass: Optional[int] = None) -> Optional[torch.Tensor]:
    """The classes to sample: ``klass`` for every map, else 0, 1, …, C−1, 0, 1, … (a grid with C
    images per row shows one class per column); None for an unconditional prior."""
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
    from torchvision.utils import save_image
    from ddcl_vq.tokenizer.decode import decode_indices
    from ddcl_vq.tokenizer.tokens import check_out, index_dtype, write_tokens
    from ddcl_vq.prior.data import load_tokenizer
    from ddcl_vq.prior.train import load_prior
    out = Path(out)
    if out.suffix.lower() != ".png":
        raise SampleError(f"expected --out to end in .png, got {str(out)!r}")
    check_out(out, "--out")  # a folder in its place, or a file in the way of its folder: before sampling
    if count <= 0:
        raise SampleError(f"--count: expected a number > 0, got {count}")
    cfg, model, meta = load_prior(prior_dir, device)
    source = tokenizer or cfg.data.tokenizer
    decoder = load_tokenizer(source, device)
    if decoder.quantizer.num_codes != model.num_codes:
        raise SampleError(f"the tokenizer {source!r} has K = {decoder.quantizer.num_codes} codes, the prior "
                          f"K = {model.num_codes}")
    check_memory(model, decoder, count, device)
    labels = sample_labels(model, count, klass)
    t0 = time.perf_counter()
    codes = sample_codes(model, count, labels, temperature, top_k, seed, device=device)
    seconds = time.perf_counter() - t0
    images = decode_indices(decoder, codes.numpy(), device=device)
    out.parent.mkdir(parents=True, exist_ok=True)
    nrow = nrow or (model.num_classes if labels is not None and klass is None and count >= model.num_classes else 8)
    save_image(images, str(out), nrow=nrow, padding=2)
    tokens_path = out.with_suffix(".npy")
    write_tokens(tokens_path, codes.numpy().astype(index_dtype(model.num_codes)),
                 None if labels is None else labels.numpy().astype(np.int64))
    return {"out": str(out), "tokens": str(tokens_path), "count": count, "grid": [model.height, model.width],
            "step": meta["step"], "seconds": seconds, "tokens_per_second": count * model.length / max(seconds, 1e-9),
            "classes": None if labels is None else sorted(set(labels.tolist()))}


def check_memory(model: CodePrior, decoder, count: int, device="cpu") -> None:
    """Refuse, before sampling, a ``count`` whose codes, decoded images and PNG grid (all held at once) need
    more memory than this machine has available; the message gives both figures."""
    from ddcl_vq.tokenizer.decode import decode_indices
    from ddcl_vq.tokenizer.memory import available_bytes
    one = decode_indices(decoder, np.zeros((1, model.height, model.width), np.int64), device=device)
    per_map = 8 * model.length + 2 * 4 * one[0].numel()  # int64 codes; float32 images and their grid
    need, free = count * per_map, available_bytes(torch.device("cpu"))
    if free is not None and need > free:
        fits = max(free // per_map // 2, 1)
        raise SampleError(f"--count {count:,}: the codes, decoded images and PNG grid need about {_size(need)} of "
                          f"memory at once, this machine has {_size(free)} available; sample fewer (--count "
                          f"{fits:,} fits with room to spare; other --seed values give other samples)")


def _size(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000


def time_sampling(model: CodePrior, count: int = 64, use_cache: bool = True, repeats: int = 1,
                  device="cpu") -> Tuple[float, float]:
    """(median seconds to sample ``count`` maps, tokens per second)."""
    labels = sample_labels(model, count)
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        sample_codes(model, count, labels, seed=r, batch_size=count, device=device, use_cache=use_cache)
        times.append(time.perf_counter() - t0)
    seconds = float(np.median(times))
    return seconds, count * model.length / seconds
