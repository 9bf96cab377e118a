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

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np
import torch

from ddcl_vq.models.vqvae import index_maps

from ddcl_vq.common.checkpoint import write_file
from ddcl_vq.common.config import Options, Rules, option
from ddcl_vq.common.errors import entry_point
from ddcl_vq.tokenizer.evaluate import EVAL_BATCH_SIZE
from ddcl_vq.tokenizer.tokens import TokenFileError, check_out, load_model, read_tokens

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


OPTIONS = Options(DecodeOptions, prog="ddcl-vq decode", description=__doc__,
                  rules=Rules(positive={"nrow", "batch_size", "shape"}, non_negative={"start", "count"}))


def as_maps(indices: np.ndarray, grid: Optional[Tuple[int, int]] = None,
            shape: Optional[Tuple[int, int]] = None) -> np.ndarray:
    """(N, h, w) index maps from (N, h, w), one (h, w) map, or flat (N, h·w) / (h·w,) sequences laid out on ``shape``,
    else ``grid``, else a square; a TokenFileError saying what does not fit."""
    if not isinstance(indices, np.ndarray) or not np.issubdtype(indices.dtype, np.integer):
        raise TokenFileError(f"expected integer indices, got dtype {getattr(indices, 'dtype', type(indices).__name__)}")
    if indices.ndim == 2 and shape is None and (grid is None or tuple(indices.shape) == tuple(grid)):
        indices = indices[None]
    if indices.ndim == 3 and shape is not None and tuple(indices.shape[1:]) != tuple(shape):
        raise TokenFileError(f"expected index maps of the --shape {shape[0]}x{shape[1]}, got maps of "
                             f"{indices.shape[1]}x{indices.shape[2]}")
    try:
        return index_maps(torch.from_numpy(indices.astype(np.int64)), shape or grid).numpy()
    except ValueError as err:
        raise TokenFileError(f"{err} (token file shape {tuple(indices.shape)})"
                             + ("; pass --shape H W for another grid" if shape is None else "")) from None


def check_indices(indices: np.ndarray, num_codes: int, latent_shape: Optional[tuple] = None,
                  shape: Optional[Tuple[int, int]] = None) -> np.ndarray:
    """(N, h, w) integer indices in [0, K) (layouts, grid and ``shape`` as :func:`as_maps`), or a UserError."""
    indices = as_maps(indices, latent_shape, shape)
    if 0 in indices.shape[1:]:
        raise TokenFileError(f"expected index maps of at least 1x1 codes, got maps of {indices.shape[1]}x"
                             f"{indices.shape[2]} (shape {tuple(indices.shape)})")
    if indices.size and (int(indices.min()) < 0 or int(indices.max()) >= num_codes):
        raise TokenFileError(f"expected indices in [0, {num_codes}) for this model's K = {num_codes}, "
                             f"got values in [{int(indices.min())}, {int(indices.max())}]")
    return indices


def check_metadata(metadata: dict, model, tokens, source) -> Optional[str]:
    """Refuse tokens of another K; -> a note when another run of the same K made them, else None."""
    k = metadata.get("num_codes")
    try:
        k = None if k is None else int(k)
    except ValueError:
        raise TokenFileError(f"token file {str(tokens)!r}: its metadata num_codes is {k!r}, not a number") from None
    made = metadata.get("run")
    if k is not None and k != model.quantizer.num_codes:
        raise TokenFileError(f"token file {str(tokens)!r} holds indices of a K = {k} codebook"
                             f"{f' (made by {made})' if made else ''}, this model has K = {model.quantizer.num_codes}: "
                             "decode them with the model that made them")
    ours = {Path(str(source)).resolve()} | {Path(run).resolve() for run in [(model.config or {}).get("source", {})
                                                                             .get("run")] if run}
    if made and Path(made).resolve() not in ours:
        return (f"the tokens were made by {made} (step {metadata.get('step', '?')}), not by {str(source)!r}: decoding "
                f"them with this model's codebook of the same K = {model.quantizer.num_codes}")
    return None


@torch.no_grad()
def decode_indices(model, indices: np.ndarray, batch_size: int = EVAL_BATCH_SIZE, device="cpu",
                   shape: Optional[Tuple[int, int]] = None) -> torch.Tensor:
    """(N, h, w) integer indices (or flat (N, h·w) sequences) -> (N, C, H, W) images in [0, 1] from the hard codes."""
    indices = check_indices(np.asarray(indices), model.quantizer.num_codes, model.latent_shape(), shape)
    chunks = (torch.from_numpy(indices[i:i + batch_size].astype(np.int64)).to(device)
              for i in range(0, len(indices), batch_size))
    out = [model.decode_indices(chunk).float().clamp(0, 1).cpu() for chunk in chunks]
    return torch.cat(out) if out else torch.empty(0)


def save_png(images: torch.Tensor, out: Path, nrow: int) -> None:
    """The PNG grid, written atomically."""
    from torchvision.utils import save_image
    write_file(out, lambda tmp: save_image(images, str(tmp), nrow=nrow, padding=2, format="png"), TokenFileError,
               shared=True)


def decode_file(model_source: str | Path, tokens: str | Path, out: str | Path, start: int = 0, count: int = 64,
                nrow: int = 8, batch_size: int = EVAL_BATCH_SIZE, shape: Optional[Tuple[int, int]] = None) -> dict:
    out = check_out(out, "--out", suffix=".png")  # a folder in its place, or a file in the way of its folder
    indices, _, metadata = read_tokens(tokens)
    model = load_model(model_source)
    notes = [check_metadata(metadata, model, tokens, model_source)]
    grid = model.latent_shape()
    indices = check_indices(indices, model.quantizer.num_codes, grid, tuple(shape) if shape else None)
    if grid is not None and tuple(indices.shape[1:]) != tuple(grid):
        notes.append(f"the maps are {indices.shape[1]}x{indices.shape[2]} codes, the model was trained on "
                     f"{grid[0]}x{grid[1]}: decoding them anyway (a convolutional decoder takes any grid)")
    stop = len(indices) if not count else min(start + count, len(indices))
    if start >= len(indices):
        raise TokenFileError(f"--start {start} is past the {len(indices)} index maps in {str(tokens)!r}")
    images = decode_indices(model, indices[start:stop], batch_size)
    save_png(images, out, nrow)
    return {"out": str(out), "decoded": int(images.shape[0]), "first": start, "image_shape": list(images.shape[1:]),
            "notes": [n for n in notes if n]}


@entry_point("ddcl-vq decode")
def main(argv: Optional[List[str]] = None) -> int:
    opts = OPTIONS.parse(argv)
    done = decode_file(opts.model, opts.tokens, opts.out, opts.start, opts.count, opts.nrow, opts.batch_size,
                       opts.shape)
    for note in done["notes"]:
        print(f"note: {note}", file=sys.stderr)
    print(f"decoded index maps {done['first']}..{done['first'] + done['decoded'] - 1} "
          f"-> {done['out']} ({done['decoded']} images of {'x'.join(map(str, done['image_shape']))})")
    return 0
