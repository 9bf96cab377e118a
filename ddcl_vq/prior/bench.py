"""The prior row of ``ddcl-vq bench``: how fast the default prior samples 64 images at 8x8 tokens.

Speed does not depend on the weights, so the prior is the default config's architecture
(configs/prior_fashion.yaml: dim 128, 4 layers, 4 heads), class-conditional over 10 classes, freshly
initialised; sampling with the KV cache and, for comparison, re-running the whole prefix each step.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from ddcl_vq.models.prior import CodePrior

from ddcl_vq.prior.config import PriorConfig
from ddcl_vq.prior.sampling import time_sampling


def bench_prior(device: str = "cpu", count: int = 64, num_codes: int = 1024, grid: int = 8, repeats: int = 3,
                no_cache: bool = True) -> Tuple[List[Dict], str]:
    """-> (rows {impl, images, tokens, K, dim, layers, seconds, tokens_per_s}, a few lines of text)."""
    m = PriorConfig().model
    torch.manual_seed(0)
    model = CodePrior(num_codes, grid, grid, 10, dim=m.dim, layers=m.layers, heads=m.heads, mlp_ratio=m.mlp_ratio,
                      dropout=m.dropout).to(device).eval()
    rows = []
    for name, cache in (("prior-sample-kvcache", True), ("prior-sample-nocache", False)):
        if not cache and not no_cache:
            continue
        runs = repeats if cache else 1  # without the cache it is O(L^3): one run says enough
        time_sampling(model, min(count, 8), cache, 1, device)  # warm-up
        seconds, rate = time_sampling(model, count, cache, runs, device)
        rows.append({"impl": name, "images": count, "tokens": count * grid * grid, "K": num_codes, "dim": m.dim,
                     "layers": m.layers, "seconds": round(seconds, 4), "tokens_per_s": round(rate, 1), "repeats": runs})
    text = [f"prior sampling (default prior: dim {m.dim}, {m.layers} layers, {m.heads} heads; K = {num_codes}, "
            f"{grid}x{grid} tokens, class-conditional; {torch.get_num_threads()} thread(s)):"]
    text += [f"  {r['impl']:<22} {r['images']} images in {r['seconds']:.2f} s  ({r['tokens_per_s']:,.0f} tokens/s, "
             f"median of {r['repeats']})" for r in rows]
    return rows, "\n".join(text)
