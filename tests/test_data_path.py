"""The data path: the same batches with 0 and 2 DataLoader workers, in-memory datasets gathered a
batch at a time (equal to per-image loading), and the automatic number of workers."""
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Subset

from ddcl_vq.tokenizer.config import load_config
from ddcl_vq.common.data import (EpochBatches, SequentialBatches, build_dataset, in_memory, make_loader,
                                resolve_workers)

# pinned to one core, torch suggests at most one worker: two are asked for on purpose
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def image_folder(root, n=24):
    from PIL import Image
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        for cls in ("a", "b"):
            (root / split / cls).mkdir(parents=True, exist_ok=True)
            for i in range(n // 2):
                Image.fromarray(rng.integers(0, 255, (20, 24, 3), dtype=np.uint8)).save(root / split / cls / f"{i}.png")
    return root


def batches_of(loader, steps):
    out = []
    for images, labels in loader:
        out.append((images.clone(), labels.clone()))
        if len(out) == steps:
            break
    return out


def assert_same(a, b):
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


@pytest.fixture(scope="module")
def fashion():
    return build_dataset(load_config().data, "train")


def test_image_folder_batches_are_the_same_with_0_and_2_workers(tmp_path):
    cfg = load_config(overrides=[f"data.root={image_folder(tmp_path)}", "data.name=image_folder",
                                 "data.image_size=16"]).data
    dataset = build_dataset(cfg, "train")
    assert not in_memory(dataset) and resolve_workers(cfg, dataset) >= 1
    runs = [batches_of(make_loader(dataset, EpochBatches(len(dataset), 8, seed=3), workers), steps=7)
            for workers in (0, 2)]                          # 7 steps of 3 per epoch: crosses two epochs
    assert_same(*runs)
    assert runs[0][0][0].shape == (8, 3, 16, 16)


def test_in_memory_batches_equal_per_image_loading_with_0_and_2_workers(fashion):
    assert in_memory(fashion) and in_memory(Subset(fashion, [0, 1]))
    per_image = batches_of(DataLoader(fashion, batch_sampler=EpochBatches(len(fashion), 64, seed=1)), steps=4)
    for workers in (0, 2):
        assert_same(per_image, batches_of(make_loader(fashion, EpochBatches(len(fashion), 64, seed=1), workers),
                                          steps=4))


def test_evaluation_batches_cover_a_subset_in_order(fashion):
    part = Subset(fashion, list(range(5, 75, 2)))          # what shard() gives a process
    loader = make_loader(part, SequentialBatches(len(part), 16))
    assert len(loader) == 3
    images = torch.cat([x for x, _ in loader])
    assert torch.equal(images, torch.stack([part[i][0] for i in range(len(part))]))


def test_workers_setting():
    cfg = load_config().data
    assert cfg.num_workers is None                          # auto
    assert resolve_workers(cfg, build_dataset(cfg, "test")) == 0
    cfg.num_workers = 3
    assert resolve_workers(cfg, build_dataset(cfg, "test")) == 3
