"""Decode code indices into images and save them as one PNG grid, so you can look at what a prior
sampled (or at a tokenized dataset). MODEL is a run directory, a folder written by
`ddcl-vq export` or its Hub id (user/name); TOKENS is a .npy or .safetensors file holding integer
indices in [0, K) of any integer dtype: (N, h, w) maps, one (h, w) map, or flat (N, h*w)
sequences (what a prior emits), laid out on the model's latent grid or on --shape H W.

  ddcl-vq decode runs/fashion_ddcl tokens/fashion_test.npy --out test_first64.png
  ddcl-vq decode exported/fashion_ddcl samples.npy --out samples.png --count 100 --nrow 10
  ddcl-vq decode exported/fashion_ddcl prior_flat.npy --shape 8 8 --out samples.png
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np
import torch

from ddcl_vq.common.errors import entry_point
from ddcl_vq.common.config import Options, Rules, option
from ddcl_vq.tokenizer.testset import EVAL_BATCH_SIZE

from ddcl_vq.tokenizer.tokens import TokenFileError, check_out, read_tokens

HELP = __doc__  # the module docstring is the --help text


@dataclass(kw_only=True)
class DecodeOptions:
    model: str = option(help="a run directory, an exported model folder or its Hub id", positional=True)
    tokens: str = option(help="a token file (.npy or .safetensors)", positional=True)
    out: str = option(help="the PNG grid to write", metavar="FILE.png")
    start: int = option(0, "first index map to decode")
    count: int = option(64, "how many index maps to decode (0 = all)")
    nrow: int = option(8, "images per row of the grid")
    batch_size: int = option(EVAL_BATCH_SIZE, "maps decoded per batch")
    shape: Optional[List[int]] = option(None, "the grid of flat (N, H*W) token sequences (default: the model's "
                                              "latent grid)", nargs=2, metavar=("H", "W"))


OPTIONS = Options(DecodeOptions, prog="ddcl-vq decode", description=HELP,
                  rules=Rules(positive={"nrow", "batch_size", "shape"}, non_negative={"start", "count"}))


def as_maps(indices: np.ndarray, grid: Optional[Tuple[int, int]] = None,
            shape: Optional[Tuple[int, int]] = None) -> np.ndarray:
    """(N, h, w) index maps from (N, h, w), one (h, w) map, or flat (N, h·w) / (h·w,) sequences.

    A 2-D array is one map unless ``shape`` is given or its rows have the length of the model's ``grid`` (h·w) while the
    array is not that grid itself; a flat length that fits neither is a TokenFileError naming both."""
    if not isinstance(indices, np.ndarray) or not (np.issubdtype(indices.dtype, np.integer)):
        raise TokenFileError(f"expected integer indices, got dtype {getattr(indices, 'dtype', type(indices).__name__)}")
    if indices.ndim == 3:
        if shape is not None and tuple(indices.shape[1:]) != tuple(shape):
            raise TokenFileError(f"expected index maps of the --shape {shape[0]}x{shape[1]}, got maps of "
                                 f"{indices.shape[1]}x{indices.shape[2]}")
        return indices
    if indices.ndim == 2 and shape is None and (grid is None or tuple(indices.shape) == tuple(grid)):
        return indices[None]  # one (h, w) map
    if indices.ndim not in (1, 2):
        raise TokenFileError(f"expected indices of shape (N, h, w), (h, w) or flat (N, h*w), got shape "
                             f"{tuple(indices.shape)}")
    flat = indices.reshape(1, -1) if indices.ndim == 1 else indices
    h, w = shape if shape is not None else (grid if grid is not None else (None, None))
    if h is None:  # no grid known (a model saved without data): one square map per row, if square
        side = int(np.sqrt(flat.shape[1]))
        if side * side != flat.shape[1]:
            raise TokenFileError(f"flat token sequences of length {flat.shape[1]}: the model does not record its "
                                 "latent grid; pass --shape H W")
        h = w = side
    if h * w != flat.shape[1]:
        where = "--shape" if shape is not None else "the model's latent grid"
        raise TokenFileError(f"expected flat token sequences of H*W = {h}*{w} = {h * w} codes ({where}), got "
                             f"{flat.shape[1]} per sequence (shape {tuple(indices.shape)})"
                             + ("; pass --shape H W for another grid" if shape is None else ""))
    return flat.reshape(len(flat), h, w)


def check_indices(indices: np.ndarray, num_codes: int, latent_shape: Optional[tuple] = None) -> np.ndarray:
    """(N, h, w) integer indices in [0, K) (layouts as :func:`as_maps`), or a UserError saying what is wrong."""
    indices = as_maps(indices, latent_shape)
    if 0 in indices.shape[1:]:
        raise TokenFileError(f"expected index maps of at least 1x1 codes, got maps of {indices.shape[1]}x"
                             f"{indices.shape[2]} (shape {tuple(indices.shape)})")
    if indices.size and (int(indices.min()) < 0 or int(indices.max()) >= num_codes):
        raise TokenFileError(f"expected indices in [0, {num_codes}) for this model's K = {num_codes}, "
                             f"got values in [{int(indices.min())}, {int(indices.max())}]")
    return indices


def check_metadata(metadata: dict, model, tokens) -> None:
    """Tokens whose metadata names another K were made by another model: refused."""
    k = metadata.get("num_codes")
    if k is None:
        return
    try:
        k = int(k)
    except ValueError:
        raise TokenFileError(f"token file {str(tokens)!r}: its metadata num_codes is {k!r}, not a number") from None
    if k != model.quantizer.num_codes:
        made = f" (made by {metadata['run']})" if metadata.get("run") else ""
        raise TokenFileError(f"token file {str(tokens)!r} holds indices of a K = {k} codebook{made}, this model has "
                             f"K = {model.quantizer.num_codes}: decode them with the model that made them")


@torch.no_grad()
def decode_indices(model, indices: np.ndarray, batch_size: int = EVAL_BATCH_SIZE, device="cpu",
                   shape: Optional[Tuple[int, int]] = None) -> torch.Tensor:
    """(N, h, w) integer indices of any integer dtype (or flat (N, h·w) sequences on the model's
    latent grid or ``shape``) -> (N, C, H, W) float images from the hard codes, clamped to [0, 1]."""
    indices = as_maps(np.asarray(indices), model.latent_shape() if hasattr(model, "latent_shape") else None, shape)
    indices = check_indices(indices, model.quantizer.num_codes)
    chunks = (torch.from_numpy(indices[i:i + batch_size].astype(np.int64)).to(device)
              for i in range(0, len(indices), batch_size))
    out = [model.decode_indices(chunk).float().clamp(0, 1).cpu() for chunk in chunks]
    return torch.cat(out) if out else torch.empty(0)


def save_png(images: torch.Tensor, out: Path, nrow: int) -> None:
    """The PNG grid, written to a temporary file and renamed (never a partial file at ``out``)."""
    from torchvision.utils import save_image
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        save_image(images, str(tmp), nrow=nrow, padding=2, format="png")
        os.replace(tmp, out)
    except OSError as err:
        raise TokenFileError(f"could not write {str(out)!r} ({err.strerror or err}); "
                             f"{'the earlier file is unchanged' if out.exists() else 'nothing was written'}") from None
    finally:
        tmp.unlink(missing_ok=True)


def decode_file(model_source: str | Path, tokens: str | Path, out: str | Path, start: int = 0, count: int = 64,
                nrow: int = 8, batch_size: int = EVAL_BATCH_SIZE, shape: Optional[Tuple[int, int]] = None) -> dict:
    from ddcl_vq.tokenizer.loaded import load_model
    out = Path(out)
    if out.suffix.lower() != ".png":
        raise TokenFileError(f"expected --out to end in .png, got {str(out)!r}")
    check_out(out, "--out")  # a folder in its place, or a file in the way of its folder: before any work
    indices, _, metadata = read_tokens(tokens)
    model = load_model(model_source)
    check_metadata(metadata, model, tokens)
    grid = model.latent_shape()
    indices = check_indices(as_maps(indices, grid, tuple(shape) if shape else None), model.quantizer.num_codes)
    note = (f"the maps are {indices.shape[1]}x{indices.shape[2]} codes, the model was trained on {grid[0]}x{grid[1]}: "
            "decoding them anyway (a convolutional decoder takes any grid)"
            if grid is not None and tuple(indices.shape[1:]) != tuple(grid) else None)
    stop = len(indices) if not count else min(start + count, len(indices))
    if start >= len(indices):
        raise TokenFileError(f"--start {start} is past the {len(indices)} index maps in {str(tokens)!r}")
    images = decode_indices(model, indices[start:stop], batch_size)
    save_png(images, out, nrow)
    return {"out": str(out), "decoded": int(images.shape[0]), "first": start, "image_shape": list(images.shape[1:]),
            "note": note}


@entry_point("ddcl-vq decode")
def main(argv: Optional[List[str]] = None) -> int:
    opts = OPTIONS.parse(argv)
    done = decode_file(opts.model, opts.tokens, opts.out, opts.start, opts.count, opts.nrow, opts.batch_size,
                       opts.shape)
    if done["note"]:
        print(f"note: {done['note']}", file=sys.stderr)
    print(f"decoded index maps {done['first']}..{done['first'] + done['decoded'] - 1} "
          f"-> {done['out']} ({done['decoded']} images of {'x'.join(map(str, done['image_shape']))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
