"""Datasets: Fashion-MNIST (default), MNIST, CIFAR-10, any image folder, natural patches.

Every dataset yields (image, label) with image a float tensor in [0, 1] of shape
(C, S, S); labels are -1 where a dataset has none. Train and test splits never share
images (natural patches: different photographs).
"""
from __future__ import annotations

import gzip
import os
from pathlib import Path
from typing import Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset

DEBIAN_FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
SPLITS = ("train", "test")


class DataUnavailable(RuntimeError):
    """A dataset could not be found or downloaded; the message names the ways to get it."""


def _read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    magic = int.from_bytes(data[:4], "big")
    ndim = magic & 0xFF
    if magic >> 8 != 0x08 or ndim not in (1, 3):
        raise DataUnavailable(f"{path}: expected an IDX file of unsigned bytes, got magic {magic:#x}")
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    arr = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if arr.size != int(np.prod(dims)):
        raise DataUnavailable(f"{path}: truncated IDX file (expected {int(np.prod(dims))} values, got {arr.size})")
    return arr.reshape(dims)


def fashion_mnist_arrays(split: str, root: str | os.PathLike = "data", download: bool = True
                         ) -> Tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST as uint8 images (N, 28, 28) and int64 labels (N,).

    Looks in order: $DDCL_VQ_FASHION_DIR, the Debian package's files under
    /usr/share/datasets/fashion-mnist/, torchvision's copy under ``root`` (downloading it
    when ``download``). When none works, one DataUnavailable error names both ways.
    """
    if split not in SPLITS:
        raise ValueError(f"expected split in {SPLITS}, got {split!r}")
    prefix = "train" if split == "train" else "t10k"
    dirs = [Path(os.environ["DDCL_VQ_FASHION_DIR"])] if os.environ.get("DDCL_VQ_FASHION_DIR") else []
    dirs.append(DEBIAN_FASHION_DIR)
    for d in dirs:
        img, lab = d / f"{prefix}-images-idx3-ubyte.gz", d / f"{prefix}-labels-idx1-ubyte.gz"
        if img.exists() and lab.exists():
            return _read_idx(img), _read_idx(lab).astype(np.int64)
    try:
        from torchvision.datasets import FashionMNIST
        ds = FashionMNIST(str(root), train=split == "train", download=download)
        return ds.data.numpy(), ds.targets.numpy().astype(np.int64)
    except Exception as err:  # noqa: BLE001 - any failure means: not available here
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataUnavailable(
            f"Fashion-MNIST not found: install the Debian package (apt-get install dataset-fashion-mnist, "
            f"files in {DEBIAN_FASHION_DIR}) or let torchvision download it into {Path(root) / 'FashionMNIST'} "
            f"(needs internet; failed: {reason})") from None


class TensorImageDataset(Dataset):
    """In-memory images: uint8 (N, C, H, W) stored, float [0, 1] served."""

    def __init__(self, images: Tensor, labels: Tensor, image_size: int):
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError(f"expected uint8 images (N, C, H, W), got {images.dtype} {tuple(images.shape)}")
        h, w = images.shape[-2:]
        if h > image_size or w > image_size:
            raise ValueError(f"expected images no larger than image_size={image_size}, got {h}x{w}")
        top, left = (image_size - h) // 2, (image_size - w) // 2
        self.images = F.pad(images, (left, image_size - w - left, top, image_size - h - top))
        self.labels = labels.long()

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, i: int):
        return self.images[i].float().div_(255.0), self.labels[i]
