"""Real Fashion-MNIST as patch tokens for the readout study."""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def load_patches(split: str, size: int, patch: int, seed: int):
    """uint8 patch tokens (N, T, patch*patch) and int64 labels (N,); a fixed random subset if size < N."""
    from ddcl_vq.train.data import fashion_mnist_arrays

    images, labels = fashion_mnist_arrays(split)
    if size < len(images):
        pick = np.random.default_rng(seed).permutation(len(images))[:size]
        pick.sort()
        images, labels = images[pick], labels[pick]
    x = torch.from_numpy(np.array(images, copy=True))
    n, h, w = x.shape
    x = x.reshape(n, h // patch, patch, w // patch, patch).permute(0, 1, 3, 2, 4)
    return x.reshape(n, (h // patch) * (w // patch), patch * patch).contiguous(), torch.from_numpy(labels)


def to_float(tokens_u8: Tensor) -> Tensor:
    return tokens_u8.float().div_(255.0).sub_(0.5).div_(0.5)
