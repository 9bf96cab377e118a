"""An offline sample-quality figure: a small classifier trained here, and the Fréchet distance in its feature space.

No package ships Inception weights on these machines, so FID proper cannot be computed offline. Instead a small CNN is
trained on the training split of the tokenizer's own dataset (with its labels); its penultimate layer (128 features
after a ReLU) is the feature space, and

    FD = ||mu_a − mu_b||² + Tr(S_a + S_b − 2 (S_a S_b)^½)

between the features of real test images and of samples. It is NOT Inception FID and is not comparable to published
FIDs; it compares samples of priors measured with the same classifier (same dataset, settings and seed: the cache key)
at the same sample counts (FD is biased upward at small counts). The classifier's accuracy on samples of a requested
class says whether a class-conditional prior draws that class.

The trained classifier is cached (``--cache-dir``; default ``$DDCL_VQ_CACHE`` or ``~/.cache/ddcl-vq``) under a name made
of the dataset, image size and training settings.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from ddcl_vq.models.classifier import SmallClassifier
from ddcl_vq.common.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ddcl_vq.prior.classifier_train import ClassifierUnavailable, dataset_tensors, predict, train_classifier  # noqa: F401

ARCH = "cnn3-16-32-64-v1"   # bump when the architecture or training recipe changes: old caches are not reused


def default_cache_dir() -> Path:
    return Path(os.environ.get("DDCL_VQ_CACHE") or Path.home() / ".cache" / "ddcl-vq")


def frechet_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Fréchet distance between Gaussians fitted to two feature sets (N, F) and (M, F), in float64.
    Tr((S_a S_b)^½) is computed as Σ √eig(S_a^½ S_b S_a^½) (symmetric, so eigh is exact and stable)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"expected two (N, F) feature arrays with the same F, got {a.shape} and {b.shape}")
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"expected at least 2 vectors per set, got {len(a)} and {len(b)}")
    mu_a, mu_b = a.mean(0), b.mean(0)
    s_a, s_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    w, v = np.linalg.eigh(s_a)
    root_a = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    m = root_a @ s_b @ root_a
    trace_root = np.sqrt(np.clip(np.linalg.eigvalsh((m + m.T) / 2), 0, None)).sum()
    fd = float(((mu_a - mu_b) ** 2).sum() + np.trace(s_a) + np.trace(s_b) - 2 * trace_root)
    return max(fd, 0.0)


def _key(data_cfg, steps: int, seed: int) -> Tuple[str, Dict]:
    spec = {"arch": ARCH, "dataset": data_cfg.name, "image_size": data_cfg.image_size, "steps": steps, "seed": seed,
            "batch_size": 128, "lr": 2e-3}
    digest = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    return f"classifier_{data_cfg.name}_{data_cfg.image_size}_{digest}.pt", spec


def real_images(data_cfg, split: str = "test", max_images: int = 0, seed: int = 0) -> Tuple[Tensor, Tensor]:
    """The first ``max_images`` images (0 = all) of a split and their labels."""
    from ddcl_vq.common.data import build_dataset
    return dataset_tensors(build_dataset(data_cfg, split, seed), max_images)


def get_classifier(data_cfg, cache_dir: Optional[str | Path] = None, steps: int = 1000, seed: int = 0,
                   device="cpu", progress: bool = False) -> Tuple[SmallClassifier, Dict]:
    """The cached classifier for this dataset and settings, trained (and cached) when missing."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    name, spec = _key(data_cfg, steps, seed)
    path = cache / name
    if path.is_file():
        try:
            state = load_checkpoint(path)
            info = state["info"]
            model = SmallClassifier(info["channels"], info["classes"], data_cfg.image_size)
            model.load_state_dict(state["model"])
            return model.to(device).eval(), {**info, "cache": str(path), "cached": True}
        except (CheckpointError, KeyError, RuntimeError):
            pass  # an unreadable or stale cache entry: train again and replace it
    model, info = train_classifier(data_cfg, steps, seed, device, progress)
    info = {**info, **spec}
    save_checkpoint({"model": model.state_dict(), "step": steps, "info": info}, path)
    return model, {**info, "cache": str(path), "cached": False}


@torch.no_grad()
def features(model: SmallClassifier, images: Tensor, batch_size: int = 500, device="cpu") -> np.ndarray:
    return torch.cat([model.features(images[i:i + batch_size].to(device)).cpu()
                      for i in range(0, len(images), batch_size)]).double().numpy()
