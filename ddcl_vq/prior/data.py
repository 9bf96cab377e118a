"""What a prior trains on (:class:`PriorData`): token files and the tokenizer that wrote them."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from ddcl_vq.tokenizer.decode import check_indices
from ddcl_vq.tokenizer.tokens import TokenFileError, read_tokens
from ddcl_vq.prior.train import PriorDataError

#: the most classes a class-conditional prior is built for (its class embedding has one row per class)
MAX_CLASSES = 100_000


@dataclass
class Tokens:
    """One token file in memory: codes (N, h, w) long, labels (N,) long or None."""

    path: str
    codes: torch.Tensor
    labels: Optional[torch.Tensor]

    @property
    def grid(self):
        return tuple(self.codes.shape[1:])

    def fingerprint(self) -> str:
        """sha1 of the codes and labels: a resumed prior trains on the same data wherever the file is."""
        h = hashlib.sha1(str(tuple(self.codes.shape)).encode())
        h.update(self.codes.numpy().astype(np.int64).tobytes())
        if self.labels is not None:
            h.update(self.labels.numpy().astype(np.int64).tobytes())
        return h.hexdigest()


def load_tokens(path: str | Path, num_codes: int, what: str = "token file") -> Tokens:
    """A token file's codes checked against K (and its metadata's num_codes, when it has one)."""
    indices, labels, meta = read_tokens(path)
    try:
        indices = check_indices(indices, num_codes)
    except TokenFileError as err:
        raise PriorDataError(f"{what} {str(path)!r}: {err}") from None
    if "num_codes" in meta and str(meta["num_codes"]) != str(num_codes):
        raise PriorDataError(f"{what} {str(path)!r} was written for K = {meta['num_codes']} codes, the tokenizer "
                             f"has K = {num_codes}; tokenize with this tokenizer")
    if len(indices) == 0:
        raise PriorDataError(f"{what} {str(path)!r} holds no code maps")
    lab = None
    if labels is not None:
        lab = torch.from_numpy(check_labels(np.asarray(labels), len(indices), f"{what} {str(path)!r}"))
        if (lab < 0).all():  # tokenize writes -1 for every image of a dataset without labels
            lab = None
    return Tokens(str(path), torch.from_numpy(indices.astype(np.int64)), lab)


def check_labels(labels: np.ndarray, count: int, where: str) -> np.ndarray:
    """A token file's labels as int64, one per code map, in [0, MAX_CLASSES) or all -1 (no labels)."""
    labels = labels.reshape(-1)
    if labels.shape[0] != count:
        raise PriorDataError(f"{where}: {labels.shape[0]} labels for {count} code maps")
    if labels.dtype.kind == "f":
        bad = labels[~np.isfinite(labels) | (labels != np.round(labels))]
        if len(bad):
            raise PriorDataError(f"{where}: expected integer class labels, got {float(bad[0])!r} (a float label)")
    elif labels.dtype.kind not in "iub":
        raise PriorDataError(f"{where}: expected integer class labels, got dtype {labels.dtype}")
    labels = labels.astype(np.int64)
    if (labels == -1).all():
        return labels
    if labels.min() < 0:
        raise PriorDataError(f"{where}: expected class labels >= 0 (or -1 for every map: no labels), got "
                             f"{int(labels.min())}")
    if labels.max() >= MAX_CLASSES:
        raise PriorDataError(f"{where}: expected class labels below {MAX_CLASSES:,} (a class-conditional prior holds "
                             f"one embedding per class), got {int(labels.max()):,}; set "
                             "model.class_conditional=false for an unconditional prior")
    return labels


class PriorData:
    """The training (and test) tokens, checked against the tokenizer's K and each other."""

    def __init__(self, cfg):
        if not cfg.data.train_tokens:
            raise PriorDataError("expected training tokens (--tokens FILE, or data.train_tokens=FILE), got none")
        if not cfg.data.tokenizer.strip():
            raise PriorDataError("expected the tokenizer (a run directory or exported model folder), got none")
        if not Path(cfg.data.tokenizer).is_dir():
            raise PriorDataError(f"{cfg.data.tokenizer!r} is neither a run directory (config.yaml) nor an exported "
                                 "model (config.json + model.safetensors)")
        from ddcl_vq.tokenizer.tokens import load_source
        tokenizer, tokenizer_cfg, _ = load_source(cfg.data.tokenizer)
        self.num_codes, self.dataset = tokenizer.quantizer.num_codes, tokenizer_dataset(tokenizer, tokenizer_cfg)
        self.train = load_tokens(cfg.data.train_tokens, self.num_codes, "training token file")
        grid = tokenizer.latent_shape()
        if grid and self.train.grid != tuple(grid):
            raise PriorDataError(f"training token file {cfg.data.train_tokens!r} holds {self.train.grid} code maps; "
                                 f"the tokenizer {cfg.data.tokenizer!r} makes {grid[0]}x{grid[1]} ones")
        conditional = cfg.model.class_conditional and self.train.labels is not None
        self.num_classes = int(self.train.labels.max()) + 1 if conditional else 0
        self.test: List[Tokens] = []
        for path in cfg.data.test_tokens:
            tokens = load_tokens(path, self.num_codes, "test token file")
            if tokens.grid != self.train.grid:
                raise PriorDataError(f"test token file {path!r} holds {tokens.grid} code maps, the training tokens "
                                     f"{self.train.grid}")
            if self.num_classes and (tokens.labels is None or int(tokens.labels.max()) >= self.num_classes):
                raise PriorDataError(f"test token file {path!r}: a class-conditional prior needs its labels "
                                     f"in [0, {self.num_classes}) (set model.class_conditional=false for an "
                                     "unconditional prior)")
            self.test.append(tokens)

    def meta(self) -> Dict:
        return {"num_codes": self.num_codes, "grid": list(self.train.grid), "num_classes": self.num_classes,
                "train_images": len(self.train.codes), "fingerprint": self.train.fingerprint(),
                "dataset": getattr(self.dataset, "name", None), "image_size": getattr(self.dataset, "image_size", None)}


def tokenizer_dataset(model, cfg) -> Any:
    """The DataConfig a tokenizer (``load_source``'s model and config) was trained on, or None when not recorded."""
    from ddcl_vq.tokenizer.config import DataConfig
    if cfg is not None:
        return cfg.data
    d = model.config.get("data") or {}
    return DataConfig(name=d["name"], image_size=int(d["image_size"])) if "name" in d and "image_size" in d else None
