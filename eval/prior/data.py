"""What a prior trains on: token files (read by :mod:`ddcl_vq.eval.tokens.files`) and the tokenizer
that wrote them (a run directory or an exported folder, loaded by :mod:`ddcl_vq.eval.tokens.models`)."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np
import torch

from ddcl_vq.eval.tokens.decode import check_indices
from ddcl_vq.eval.tokens.files import TokenFileError, read_tokens
from ddcl_vq.train.errors import UserError


class PriorDataError(UserError, ValueError):
    """Token files or tokenizer that a prior cannot use as asked."""


@dataclass
class Tokens:
    """One token file in memory: codes (N, h, w) long, labels (N,) long or None."""

    path: str
    codes: torch.Tensor
    labels: Optional[torch.Tensor]
    metadata: Dict[str, str]

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
        labels = np.asarray(labels).astype(np.int64).reshape(-1)
        if labels.shape[0] != len(indices):
            raise PriorDataError(f"{what} {str(path)!r}: {labels.shape[0]} labels for {len(indices)} code maps")
        if (labels >= 0).all():
            lab = torch.from_numpy(labels)
    return Tokens(str(path), torch.from_numpy(indices.astype(np.int64)), lab, meta)


def tokenizer_info(source: str | Path) -> Dict[str, Any]:
    """-> {num_codes, data (a DataConfig for the tokenizer's dataset, or None), latent, source}: what a
    prior needs to know about the model that tokenized its data. K is the loaded quantizer's
    ``num_codes`` (what its indices range over), not the config's request."""
    from ddcl_vq.train.config import DataConfig, load_config

    if not str(source).strip():
        raise PriorDataError("expected the tokenizer (a run directory or exported model folder), got none")
    source = Path(source)
    if (source / "config.yaml").is_file():
        cfg = load_config(source / "config.yaml", migrate=True)
        return {"source": str(source), "num_codes": load_tokenizer(source).quantizer.num_codes, "data": cfg.data,
                "latent": cfg.data.image_size // 2 ** cfg.model.num_downsamples}
    if (source / "config.json").is_file():
        try:
            config = json.loads((source / "config.json").read_text())
            d = config.get("data") or {}
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise PriorDataError(f"cannot read the exported model's config {str(source / 'config.json')!r}: "
                                 f"{err}") from None
        data = DataConfig(name=d["name"], image_size=int(d["image_size"])) if "name" in d and "image_size" in d \
            else None
        return {"source": str(source), "num_codes": load_tokenizer(source).quantizer.num_codes, "data": data,
                "latent": d.get("latent_size")}
    raise PriorDataError(f"{str(source)!r} is neither a run directory (config.yaml) nor an exported model "
                         "(config.json + model.safetensors)")


def load_tokenizer(source: str | Path, device="cpu"):
    from ddcl_vq.eval.tokens.models import load_model
    return load_model(source, device)
