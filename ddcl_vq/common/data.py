"""Datasets: Fashion-MNIST (default), MNIST, CIFAR-10, any image folder, natural patches, digits; the batches a
training and an evaluation read.

Every dataset yields (image, label) with image a float tensor in [0, 1] of shape (C, S, S); labels are -1 where a
dataset has none. Every random draw has its own generator seeded from the run's seed, so a resumed run, or one with
more DataLoader workers, reads exactly the batches a straight run reads.
"""
from __future__ import annotations

import gzip
import math
import os
from pathlib import Path
from typing import Iterable, Iterator, List, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Subset

from ddcl_vq.common.config import ConfigError
from ddcl_vq.common.errors import CHECK_HINT, DataUnavailable, UnreadableImage, one_line

DEBIAN_FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
SPLITS = ("train", "test")


def generator(seed: int) -> torch.Generator:
    """A generator seeded with ``seed`` modulo 2**64 (as torch does with a negative seed), so derived seeds work."""
    return torch.Generator().manual_seed(seed % 2 ** 64)


def three_channels(x: Tensor) -> Tensor:
    """A (1, H, W) grey image (a high-bit-depth file, loaded as one float channel) as (3, H, W)."""
    return x.expand(3, -1, -1).contiguous() if x.shape[0] == 1 else x


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
    """Fashion-MNIST as uint8 images (N, 28, 28) and int64 labels (N,), from $DDCL_VQ_FASHION_DIR, the Debian
    package's files, or torchvision's copy under ``root`` (downloaded when ``download``)."""
    if split not in SPLITS:
        raise ValueError(f"expected split in {SPLITS}, got {split!r}")
    prefix = "train" if split == "train" else "t10k"
    dirs = [Path(os.environ["DDCL_VQ_FASHION_DIR"])] if os.environ.get("DDCL_VQ_FASHION_DIR") else []
    for d in dirs + [DEBIAN_FASHION_DIR]:
        img, lab = d / f"{prefix}-images-idx3-ubyte.gz", d / f"{prefix}-labels-idx1-ubyte.gz"
        if img.exists() and lab.exists():
            return _read_idx(img), _read_idx(lab).astype(np.int64)
    try:
        from torchvision.datasets import FashionMNIST
        ds = FashionMNIST(str(root), train=split == "train", download=download)
        return ds.data.numpy(), ds.targets.numpy().astype(np.int64)
    except Exception as err:  # noqa: BLE001 - any failure means: not available here
        reason = one_line(err)
        tried = (f"let torchvision download it into {Path(root) / 'FashionMNIST'} (needs internet; failed: {reason})"
                 if download else
                 f"put torchvision's copy in {Path(root) / 'FashionMNIST'} (not there: {reason}), or let torchvision "
                 "download it there with data.download=true (needs internet)")
        raise DataUnavailable(
            f"Fashion-MNIST not found: install the Debian package (apt-get install dataset-fashion-mnist, "
            f"files in {DEBIAN_FASHION_DIR}) or {tried}") from None


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

    def __getitem__(self, i):
        """One image and label for an int ``i``; a batch (B, C, S, S), (B,) for a list of indices."""
        return self.images[i].float().div_(255.0), self.labels[i]


# Photographs that scikit-image ships in its wheel (load offline)
NATURAL_TRAIN_PHOTOS = ("astronaut", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry", "retina")
NATURAL_TEST_PHOTOS = ("chelsea", "stereo_motorcycle")
#: every photograph data.train_photos / data.test_photos may name: colour ones, then grey ones (served as three
#: equal channels); ``cat`` is left out: it is ``chelsea``
COLOUR_PHOTOS = ("astronaut", "chelsea", "coffee", "hubble_deep_field", "immunohistochemistry", "retina", "rocket",
                 "stereo_motorcycle")
GREY_PHOTOS = ("brick", "camera", "cell", "clock", "coins", "grass", "gravel", "moon", "page", "text")
PHOTOGRAPHS = COLOUR_PHOTOS + GREY_PHOTOS


def check_photos(train_photos: Sequence[str], test_photos: Sequence[str]) -> None:
    """ConfigError unless both lists are non-empty, name only :data:`PHOTOGRAPHS`, each once, and share none."""
    for key, names in (("data.train_photos", train_photos), ("data.test_photos", test_photos)):
        if not names:
            raise ConfigError(f"config key {key!r}: expected at least one photograph, got []")
        unknown = [n for n in names if n not in PHOTOGRAPHS]
        if unknown:
            raise ConfigError(f"config key {key!r}: unknown photograph {unknown[0]!r}; expected names from "
                              f"{', '.join(PHOTOGRAPHS)}")
        twice = sorted({n for n in names if list(names).count(n) > 1})
        if twice:
            raise ConfigError(f"config key {key!r}: expected each photograph once, got {', '.join(twice)} twice")
    both = [n for n in train_photos if n in test_photos]
    if both:
        raise ConfigError(f"config keys 'data.train_photos' and 'data.test_photos' share {', '.join(both)}: a test "
                          "photograph must not be a training one (its patches would leak into the test)")


def natural_patches(split: str, size: int, per_image: int, seed: int = 0,
                    train_photos: Sequence[str] = NATURAL_TRAIN_PHOTOS,
                    test_photos: Sequence[str] = NATURAL_TEST_PHOTOS) -> TensorImageDataset:
    """Colour patches (3, size, size) cut at random (seeded) positions from scikit-image's photographs: ``train_photos``
    for the train split, ``test_photos`` for the test split (grey photographs as three equal channels)."""
    import skimage.data
    check_photos(train_photos, test_photos)
    names = train_photos if split == "train" else test_photos
    gen = generator(seed + (0 if split == "train" else 1))
    patches = []
    for name in names:
        img = getattr(skimage.data, name)()
        img = img[0] if isinstance(img, tuple) else img
        img = np.repeat(img[..., None], 3, axis=2) if img.ndim == 2 else img  # a grey photograph
        photo = torch.from_numpy(np.ascontiguousarray(img[..., :3])).permute(2, 0, 1)  # (3, H, W) uint8
        h, w = photo.shape[1:]
        if h < size or w < size:
            raise ConfigError(f"config key 'data.image_size': photograph {name!r} is {h}x{w}, smaller than the "
                              f"{size}x{size} patches asked")
        n = per_image if split == "train" else max(1, per_image // 4)
        ys = torch.randint(0, h - size + 1, (n,), generator=gen)
        xs = torch.randint(0, w - size + 1, (n,), generator=gen)
        patches += [photo[:, y:y + size, x:x + size] for y, x in zip(ys.tolist(), xs.tolist())]
    images = torch.stack(patches)
    return TensorImageDataset(images, torch.full((len(images),), -1), size)


def _torchvision_dataset(name: str, split: str, root: str, download: bool, image_size: int) -> TensorImageDataset:
    from torchvision import datasets
    cls = {"mnist": datasets.MNIST, "cifar10": datasets.CIFAR10}[name]
    try:
        ds = cls(root, train=split == "train", download=download)
    except Exception as err:  # noqa: BLE001
        reason = one_line(err)
        if download:
            raise DataUnavailable(f"{name}: not found under {root!r} and torchvision could not download it "
                                  f"({reason}); put the files there or run with internet") from None
        raise DataUnavailable(f"{name}: not found under {root!r} ({reason}); put the files there, or let torchvision "
                              "download them with data.download=true (needs internet)") from None
    data = torch.as_tensor(ds.data)
    images = data[:, None] if data.dim() == 3 else data.permute(0, 3, 1, 2)
    if images.shape[-1] > image_size:
        raise DataUnavailable(f"{name}: images are {images.shape[-1]}px, expected data.image_size >= that, "
                              f"got {image_size}")
    return TensorImageDataset(images.contiguous(), torch.as_tensor(ds.targets), image_size)


class UnfaithfulImage(ValueError):
    """An image whose pixel values cannot be mapped to [0, 1] without guessing (see :func:`open_image`)."""


#: 16-bit unsigned modes Pillow opens (PNG, TIFF): full scale 65535
_MODES_16BIT = ("I;16", "I;16L", "I;16B", "I;16N")


def open_image(path: str):
    """An image file as a PIL image that torchvision's transforms turn into [0, 1] faithfully: 8-bit images as ``RGB``;
    16-bit grey (÷ 65535) and float within [0, 1] as mode ``F``. Anything else is an :class:`UnfaithfulImage`."""
    from PIL import Image
    with open(path, "rb") as f:
        img = Image.open(f)
        mode = img.mode
        if mode in _MODES_16BIT:
            values = np.asarray(img, dtype=np.float64) / 65535.0
        elif mode in ("I", "F"):
            values = np.asarray(img, dtype=np.float64)
            lo, hi = (float(values.min()), float(values.max())) if values.size else (0.0, 0.0)
            if not np.isfinite(values).all():
                raise UnfaithfulImage(f"{mode} image with non-finite values; cannot map it to [0, 1]")
            if not (lo >= 0 and hi <= (65535 if mode == "I" else 1)):
                scale = "32-bit integer" if mode == "I" else "floating-point"
                expected = "0..65535 (16 bits)" if mode == "I" else "[0, 1]"
                raise UnfaithfulImage(f"{scale} image (mode {mode}) with values {lo:g}..{hi:g}, expected "
                                      f"{expected}; its scale would be a guess (save it as 8- or 16-bit)")
            values = values / 65535.0 if mode == "I" else values
        elif mode.startswith("I;16"):
            raise UnfaithfulImage(f"image mode {mode} (signed or packed 16-bit) has no known [0, 1] scale; save it "
                                  "as unsigned 8- or 16-bit")
        else:
            return img.convert("RGB")
    return Image.fromarray(values.astype(np.float32), mode="F")


class ImageFiles(Dataset):
    """torchvision's ImageFolder (``folder/<class>/<image>``, :func:`open_image`) whose read errors name the file."""

    def __init__(self, folder: Path, image_size: int):
        from torchvision import datasets, transforms
        tf = transforms.Compose([transforms.Resize(image_size), transforms.CenterCrop(image_size),
                                 transforms.ToTensor(), three_channels])
        try:
            self.folder = datasets.ImageFolder(str(folder), transform=tf, loader=open_image)
        except (FileNotFoundError, NotADirectoryError) as err:  # no class folder, or an empty one
            raise DataUnavailable(f"image_folder {str(folder)!r}: {one_line(err)} (expected class folders of "
                                  "images, as torchvision's ImageFolder reads)") from None
        self.samples = self.folder.samples

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, i: int):
        try:
            return self.folder[i]
        except Exception as err:  # noqa: BLE001 - PIL raises several types for a bad file
            raise UnreadableImage(f"image {self.samples[i][0]!r} cannot be read ({type(err).__name__}: "
                                  f"{one_line(err)}); replace or remove it ({CHECK_HINT})") from None

    def unreadable(self) -> list[tuple[str, str]]:
        """(path, reason) for every file that cannot be decoded or converted to [0, 1] faithfully (read in full)."""
        bad = []
        for path, _ in self.samples:
            try:
                self.folder.loader(path).load()
            except Exception as err:  # noqa: BLE001
                bad.append((path, f"{type(err).__name__}: {one_line(err)}"))
        return bad


def build_dataset(data_cfg, split: str, seed: int = 0) -> Dataset:
    """The dataset named by ``data_cfg.name`` for ``split`` ('train' or 'test')."""
    if split not in SPLITS:
        raise ValueError(f"expected split in {SPLITS}, got {split!r}")
    name = data_cfg.name
    if name in ("fashion_mnist", "digits"):
        if data_cfg.image_size < 28:
            raise ConfigError(f"config key 'data.image_size': {name} images are 28x28 and are padded, not shrunk; "
                              f"expected a size >= 28, got {data_cfg.image_size}")
        images, labels = (fashion_mnist_arrays(split, data_cfg.root, data_cfg.download) if name == "fashion_mnist"
                          else digits_arrays(split))
        dataset = TensorImageDataset(torch.from_numpy(images.copy())[:, None], torch.from_numpy(labels),
                                     data_cfg.image_size)
    elif name in ("mnist", "cifar10"):
        dataset = _torchvision_dataset(name, split, data_cfg.root, data_cfg.download, data_cfg.image_size)
    elif name == "image_folder":
        folder = Path(data_cfg.root) / split
        if not folder.is_dir():
            raise DataUnavailable(f"image_folder: expected a folder {str(folder)!r} (data.root with train/ and test/ "
                                  f"subfolders of class folders, as torchvision's ImageFolder reads), got none")
        dataset = ImageFiles(folder, data_cfg.image_size)
        if split == "train" and getattr(data_cfg, "augment", "none") == "crop_flip":
            dataset = CropFlip(dataset, data_cfg.image_size, seed)  # the test split: the centre crop
    elif name == "natural_patches":
        dataset = natural_patches(split, data_cfg.image_size, data_cfg.patches_per_image, seed,
                                  getattr(data_cfg, "train_photos", NATURAL_TRAIN_PHOTOS),
                                  getattr(data_cfg, "test_photos", NATURAL_TEST_PHOTOS))
    else:
        raise ValueError(f"expected data.name in fashion_mnist, mnist, cifar10, image_folder, natural_patches, "
                         f"digits, got {name!r}")
    if len(dataset) == 0:
        where = f" under {str(Path(data_cfg.root) / split)!r}" if name == "image_folder" else ""
        raise DataUnavailable(f"{name}: the {split} split has no images{where}")
    return dataset


#: digits: the first DIGITS_TRAIN of the 1,797 images are the train split, the other 500 the test split
DIGITS_TRAIN = 1297


def digits_arrays(split: str) -> Tuple[np.ndarray, np.ndarray]:
    """The UCI handwritten digits in scikit-learn's wheel (8x8, 0..16) as uint8 images (N, 28, 28), upsampled
    bilinearly, and int64 labels (N,): train the first 1,297, test the last 500."""
    import importlib.util
    if split not in SPLITS:
        raise ValueError(f"expected split in {SPLITS}, got {split!r}")
    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if path is None or not path.is_file():
        raise DataUnavailable("digits: the UCI handwritten digits ship inside scikit-learn's wheel, which is not "
                              "installed; pip install scikit-learn")
    table = np.loadtxt(path, delimiter=",")
    pixels, labels = table[:, :-1].reshape(-1, 8, 8), table[:, -1]
    part = slice(0, DIGITS_TRAIN) if split == "train" else slice(DIGITS_TRAIN, None)
    x = torch.from_numpy(np.ascontiguousarray(pixels[part], dtype=np.float32))[:, None] / 16.0
    x = F.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False)
    images = (x[:, 0] * 255.0).round().clamp_(0, 255).to(torch.uint8).numpy()
    return images, np.ascontiguousarray(labels[part], dtype=np.int64)


def check_data(data_cfg, seed: int = 0) -> tuple[list[str], list[tuple[str, str]]]:
    """Read every image of both splits -> (one line per split, (path, reason) for every unreadable file)."""
    report, bad = [], []
    for split in SPLITS:
        dataset = build_dataset(data_cfg, split, seed)
        if hasattr(dataset, "unreadable"):
            bad += dataset.unreadable()
        report.append(f"{data_cfg.name} {split}: {len(dataset)} images")
    return report, bad


def image_channels(data_cfg) -> int:
    return 1 if data_cfg.name in ("fashion_mnist", "mnist", "digits") else 3


class EpochBatches:
    """Deterministic batches of dataset indices for process ``rank`` of ``world``: epoch e's order is randperm(n)
    seeded with (seed, e), cut into global batches; ``start_step`` skips ahead without touching data."""

    def __init__(self, n: int, global_batch: int, seed: int, rank: int = 0, world: int = 1, start_step: int = 0):
        if global_batch % world:
            raise ConfigError(f"config key 'data.batch_size': expected a multiple of the number of processes "
                              f"({world}), got {global_batch}")
        if n < global_batch:
            raise DataUnavailable(f"the train split has {n} images, fewer than one batch (data.batch_size="
                                  f"{global_batch}); lower data.batch_size or add images")
        self.n, self.global_batch, self.seed = n, global_batch, seed
        self.rank, self.world, self.step = rank, world, start_step
        self.per_epoch = n // global_batch

    def __iter__(self):
        local = self.global_batch // self.world
        while True:
            epoch, offset = divmod(self.step, self.per_epoch)
            order = torch.randperm(self.n, generator=generator(self.seed * 100003 + epoch))
            for b in range(offset, self.per_epoch):
                batch = order[b * self.global_batch:(b + 1) * self.global_batch]
                self.step += 1
                yield batch[self.rank * local:(self.rank + 1) * local].tolist()


# ----------------------------------------------------------------------------- loading batches
def in_memory(dataset: Dataset) -> bool:
    """True for a :class:`TensorImageDataset` (or a Subset of one): a list of indices gathers a batch at once."""
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    return isinstance(dataset, TensorImageDataset)


def resolve_workers(data_cfg, dataset: Dataset) -> int:
    """``data.num_workers``, or when null: 0 for in-memory datasets, min(4, half the cores) for an image folder."""
    if data_cfg.num_workers is not None:
        return int(data_cfg.num_workers)
    if in_memory(dataset):
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return min(4, max(1, cores // 2))


def make_loader(dataset: Dataset, batches: Iterable[List[int]], num_workers: int = 0,
                device: torch.device | str = "cpu") -> DataLoader:
    """A DataLoader of (images (B, C, S, S), labels (B,)) batches, one per index list of ``batches``, in order
    (the same with any number of workers; pinned memory on CUDA)."""
    cuda = torch.device(device).type == "cuda"
    options = dict(num_workers=num_workers, pin_memory=cuda, persistent_workers=num_workers > 0)
    if isinstance(dataset, CropFlip):  # draws seeded by (epoch, index)
        batches = _Tagged(batches)
    if in_memory(dataset):
        return DataLoader(dataset, sampler=batches, batch_size=None, **options)
    return DataLoader(dataset, batch_sampler=batches, **options)


class SequentialBatches:
    """Index lists [0, b), [b, 2b), … over ``n`` items (the last one shorter): an evaluation pass."""

    def __init__(self, n: int, batch_size: int):
        self.n, self.batch_size = n, batch_size

    def __len__(self) -> int:
        return -(-self.n // self.batch_size)

    def __iter__(self):
        for start in range(0, self.n, self.batch_size):
            yield list(range(start, min(start + self.batch_size, self.n)))


# ----------------------------------------------------------------------------- augmentation
#: ``data.augment: crop_flip``: RandomResizedCrop's area fraction and aspect ratio ranges
SCALE, RATIO = (0.5, 1.0), (3 / 4, 4 / 3)


def crop_params(width: int, height: int, g: torch.Generator) -> Tuple[int, int, int, int]:
    """(top, left, h, w) as torchvision's RandomResizedCrop.get_params draws them (SCALE, RATIO) from ``g``."""
    area = width * height
    log_ratio = (math.log(RATIO[0]), math.log(RATIO[1]))
    for _ in range(10):
        target = area * (SCALE[0] + (SCALE[1] - SCALE[0]) * float(torch.rand((), generator=g)))
        aspect = math.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * float(torch.rand((), generator=g)))
        w, h = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, (), generator=g))
            left = int(torch.randint(0, width - w + 1, (), generator=g))
            return top, left, h, w
    in_ratio = width / height  # fallback: the central crop, as torchvision
    if in_ratio < min(RATIO):
        w, h = width, int(round(width / min(RATIO)))
    elif in_ratio > max(RATIO):
        h, w = height, int(round(height * max(RATIO)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class CropFlip(Dataset):
    """An image folder (:class:`ImageFiles`) with a random-resized crop and a horizontal flip drawn from a generator
    seeded by (run seed, epoch, image index); indexed with the ``(epoch, index)`` pairs of :class:`_Tagged`."""

    def __init__(self, base, image_size: int, seed: int = 0):
        self.base, self.image_size, self.seed = base, image_size, seed

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, key):
        from torchvision.transforms import functional as TF
        epoch, i = key if isinstance(key, tuple) else (0, key)
        path, label = self.base.samples[i]
        try:
            image = self.base.folder.loader(path)
            g = generator((self.seed * 1_000_003 + epoch) * 10_000_019 + i)
            top, left, h, w = crop_params(image.width, image.height, g)
            image = TF.resized_crop(image, top, left, h, w, [self.image_size, self.image_size], antialias=True)
            if float(torch.rand((), generator=g)) < 0.5:
                image = TF.hflip(image)
            return three_channels(TF.to_tensor(image)), label
        except Exception as err:  # noqa: BLE001 - PIL raises several types for a bad file
            raise UnreadableImage(f"image {path!r} cannot be read ({type(err).__name__}: {one_line(err)}); replace "
                                  f"or remove it ({CHECK_HINT})") from None

    def unreadable(self):
        return self.base.unreadable()


class _Tagged:
    """The loop's batches of indices (:class:`EpochBatches`) as (epoch, index) pairs, for :class:`CropFlip`."""

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
