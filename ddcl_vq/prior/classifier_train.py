"""The prior evaluation's feature classifier, trained on a dataset's training split."""
from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ddcl_vq.models.classifier import SmallClassifier

from ddcl_vq.common.errors import UserError
from ddcl_vq.common.skeleton import lr_schedule


class ClassifierUnavailable(UserError, RuntimeError):
    """No classifier can be trained for this dataset (no labels)."""


def train_classifier(data_cfg, steps: int = 1000, seed: int = 0, device="cpu", progress: bool = False
                     ) -> Tuple[SmallClassifier, Dict]:
    """-> (the feature classifier in eval mode, info with its test-split accuracy)."""
    from ddcl_vq.common.data import EpochBatches, build_dataset, image_channels, make_loader
    from ddcl_vq.common.progress import Progress
    train_set = build_dataset(data_cfg, "train", seed)
    test_set = build_dataset(data_cfg, "test", seed)
    labels = torch.as_tensor(train_set.labels if hasattr(train_set, "labels") else
                             [int(train_set[i][1]) for i in range(len(train_set))])
    if (labels < 0).any():
        raise ClassifierUnavailable(f"{data_cfg.name} has no labels: the feature classifier (Fréchet distance, "
                                    "class accuracy) cannot be trained")
    classes = int(labels.max()) + 1
    torch.manual_seed(seed)
    model = SmallClassifier(image_channels(data_cfg), classes, data_cfg.image_size).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_schedule(steps, "cosine", floor=0.0))
    loader = make_loader(train_set, EpochBatches(len(train_set), 128, seed), 0)
    bar = Progress(steps, f"classifier ({data_cfg.name})", unit="step", every=max(steps // 10, 1), off=not progress)
    model.train()
    for _, (x, y) in zip(range(steps), loader):
        loss = F.cross_entropy(model(x.to(device)), torch.as_tensor(y).to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        bar.update(1)
    bar.close()
    model.eval()
    x_test, y_test = dataset_tensors(test_set)
    accuracy = float((batched(lambda x: model(x).argmax(1), x_test, device) == y_test).float().mean())
    return model, {"classes": classes, "channels": image_channels(data_cfg), "test_accuracy": accuracy,
                   "test_images": len(y_test)}


def dataset_tensors(dataset, max_images: int = 0) -> Tuple[Tensor, Tensor]:
    n = len(dataset) if not max_images else min(max_images, len(dataset))
    if hasattr(dataset, "images"):  # TensorImageDataset: one indexing op
        x, y = dataset[list(range(n))]
        return x, torch.as_tensor(y)
    items = [dataset[i] for i in range(n)]
    return torch.stack([a for a, _ in items]), torch.as_tensor([int(b) for _, b in items])


@torch.no_grad()
def batched(fn: Callable[[Tensor], Tensor], images: Tensor, device="cpu", batch_size: int = 500) -> Tensor:
    """``fn`` over ``images`` in batches on ``device``, its outputs concatenated on the CPU."""
    return torch.cat([fn(images[i:i + batch_size].to(device)).cpu() for i in range(0, len(images), batch_size)])
