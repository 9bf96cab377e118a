"""``ddcl-vq decode MODEL TOKENS --out grid.png``: code indices -> images, as a PNG grid.

MODEL is a run directory or an exported folder; TOKENS a token file (.npy or .safetensors),
e.g. what ``ddcl-vq tokenize`` wrote or what a prior sampled: (N, h, w) or one (h, w) map of
integers in [0, K). Each map is decoded from its hard codes (``VQVAE.decode_indices``).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import numpy as np
import torch

from ddcl_vq.train.errors import entry_point
from ddcl_vq.train.settings import Options, Rules, option

from .files import TokenFileError, read_tokens

HELP = """\
Decode code indices into images and save them as one PNG grid, so you can look at what a prior
sampled (or at a tokenized dataset). MODEL is a run directory or a folder written by
`ddcl-vq export`; TOKENS is a .npy or .safetensors file holding (N, h, w) (or one (h, w)) integer
indices in [0, K).

  ddcl-vq decode runs/fashion_ddcl tokens/fashion_test.npy --out test_first64.png
  ddcl-vq decode exported/fashion_ddcl samples.npy --out samples.png --count 100 --nrow 10
"""


@dataclass(kw_only=True)
class DecodeOptions:
    model: str = option(help="a run directory or an exported model folder", positional=True)
    tokens: str = option(help="a token file (.npy or .safetensors)", positional=True)
    out: str = option(help="the PNG grid to write", metavar="FILE.png")
    start: int = option(0, "first index map to decode")
    count: int = option(64, "how many index maps to decode (0 = all)")
    nrow: int = option(8, "images per row of the grid")
    batch_size: int = option(256, "maps decoded per batch")


OPTIONS = Options(DecodeOptions, prog="ddcl-vq decode", description=HELP,
                  rules=Rules(positive={"nrow", "batch_size"}, non_negative={"start", "count"}))


def check_indices(indices: np.ndarray, num_codes: int, latent_shape: Optional[tuple] = None) -> np.ndarray:
    """(N, h, w) integer indices in [0, K), or a UserError saying what is wrong."""
    if indices.ndim == 2:
        indices = indices[None]
    if indices.ndim != 3:
        raise TokenFileError(f"expected indices of shape (N, h, w) or (h, w), got shape {tuple(indices.shape)}")
    if not np.issubdtype(indices.dtype, np.integer):
        raise TokenFileError(f"expected integer indices, got dtype {indices.dtype}")
    if indices.size and (int(indices.min()) < 0 or int(indices.max()) >= num_codes):
        raise TokenFileError(f"expected indices in [0, {num_codes}) for this model's K = {num_codes}, "
                             f"got values in [{int(indices.min())}, {int(indices.max())}]")
    return indices


@torch.no_grad()
def decode_indices(model, indices: np.ndarray, batch_size: int = 256, device="cpu") -> torch.Tensor:
    """(N, h, w) integer indices -> (N, C, H, W) float images from the hard codes, clamped to [0, 1]."""
    indices = check_indices(indices, model.quantizer.num_codes)
    out = []
    for i in range(0, len(indices), batch_size):
        chunk = torch.from_numpy(indices[i:i + batch_size].astype(np.int64)).to(device)
        out.append(model.decode_indices(chunk).float().clamp(0, 1).cpu())
    return torch.cat(out) if out else torch.empty(0)


def decode_file(model_source: str | Path, tokens: str | Path, out: str | Path, start: int = 0, count: int = 64,
                nrow: int = 8, batch_size: int = 256) -> dict:
    from torchvision.utils import save_image

    from .models import load_model

    out = Path(out)
    if out.suffix.lower() != ".png":
        raise TokenFileError(f"expected --out to end in .png, got {str(out)!r}")
    indices, _, _ = read_tokens(tokens)
    if indices.ndim == 2:
        indices = indices[None]
    model = load_model(model_source)
    stop = len(indices) if not count else min(start + count, len(indices))
    if start >= len(indices):
        raise TokenFileError(f"--start {start} is past the {len(indices)} index maps in {str(tokens)!r}")
    images = decode_indices(model, indices[start:stop], batch_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_image(images, str(out), nrow=nrow, padding=2)
    return {"out": str(out), "decoded": int(images.shape[0]), "first": start, "image_shape": list(images.shape[1:])}


@entry_point("ddcl-vq decode")
def main(argv: Optional[List[str]] = None) -> int:
    opts = OPTIONS.parse(argv)
    done = decode_file(opts.model, opts.tokens, opts.out, opts.start, opts.count, opts.nrow, opts.batch_size)
    print(f"decoded index maps {done['first']}..{done['first'] + done['decoded'] - 1} "
          f"-> {done['out']} ({done['decoded']} images of {'x'.join(map(str, done['image_shape']))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
