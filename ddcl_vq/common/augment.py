"""Training augmentation for image folders (``data.augment: crop_flip``): random-resized crop + horizontal flip, as
image tokenizers are trained (the test split keeps the centre crop).

The random draws come from a generator seeded by (run seed, epoch, image index), not from the global RNG or a worker's
RNG: a run sees the same crops with any number of DataLoader workers, and a resumed run sees exactly the crops a
straight run would. :class:`CropFlip` is indexed with ``(epoch, index)`` pairs; :meth:`CropFlip.tag_batches` turns the
loop's batches of indices into such pairs (``make_loader`` calls it).
"""
from __future__ import annotations

import math
from typing import Iterable, Iterator, List, Sequence, Tuple

import torch
from torch.utils.data import Dataset

#: RandomResizedCrop's area fraction and aspect ratio ranges (the area range is narrower than
#: torchvision's 0.08 default: a tokenizer reconstructs whole images, not classification crops)
SCALE, RATIO = (0.5, 1.0), (3 / 4, 4 / 3)


def crop_params(width: int, height: int, g: torch.Generator, scale: Sequence[float] = SCALE,
                ratio: Sequence[float] = RATIO) -> Tuple[int, int, int, int]:
    """(top, left, h, w) as torchvision's RandomResizedCrop.get_params draws them, from ``g``."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * (scale[0] + (scale[1] - scale[0]) * float(torch.rand((), generator=g)))
        aspect = math.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * float(torch.rand((), generator=g)))
        w, h = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, (), generator=g))
            left = int(torch.randint(0, width - w + 1, (), generator=g))
            return top, left, h, w
    in_ratio = width / height  # fallback: the central crop, as torchvision
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class CropFlip(Dataset):
    """An image folder's training split with a seeded random-resized crop to ``image_size`` and a
    horizontal flip with probability 1/2. ``base`` is :class:`~ddcl_vq.common.data.ImageFiles` (its
    samples, read by its loader; a file that cannot be read is an UnreadableImage naming it)."""

    def __init__(self, base, image_size: int, seed: int = 0):
        self.base, self.image_size, self.seed = base, image_size, seed
        self.samples = base.samples

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, key):
        from torchvision.transforms import functional as TF
        from ddcl_vq.common.dataerrors import CHECK_HINT, UnreadableImage, three_channels
        from ddcl_vq.common.errors import one_line
        epoch, i = key if isinstance(key, tuple) else (0, key)
        path, label = self.samples[i]
        try:
            image = self.base.folder.loader(path)
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) * 10_000_019 + i)
            top, left, h, w = crop_params(image.width, image.height, g)
            image = TF.resized_crop(image, top, left, h, w, [self.image_size, self.image_size], antialias=True)
            if float(torch.rand((), generator=g)) < 0.5:
                image = TF.hflip(image)
            return three_channels(TF.to_tensor(image)), label
        except Exception as err:  # noqa: BLE001 - PIL raises several types for a bad file
            raise UnreadableImage(f"image {path!r} cannot be read ({type(err).__name__}: {one_line(err)}); replace "
                                  f"or remove it ({CHECK_HINT})") from None

    def tag_batches(self, batches) -> Iterable[List[Tuple[int, int]]]:
        """The loop's batches of indices (:class:`~ddcl_vq.common.data.EpochBatches`) as (epoch, index) pairs."""
        return _Tagged(batches)

    def unreadable(self):
        return self.base.unreadable()


class _Tagged:
    def __init__(self, batches):
        self.batches = batches

    def __iter__(self) -> Iterator[List[Tuple[int, int]]]:
        per_epoch = getattr(self.batches, "per_epoch", None)
        for batch in self.batches:
            # EpochBatches counts its step before yielding: the epoch of this batch
            epoch = (self.batches.step - 1) // per_epoch if per_epoch else 0
            yield [(epoch, i) for i in batch]

    def __len__(self) -> int:
        return len(self.batches)
