"""Checks for what ``VQVAE.from_pretrained`` reads, and the index layouts ``decode_indices`` takes.

A model folder is two files that must belong together: ``config.json`` (constructor arguments)
and ``model.safetensors`` (weights). Either may be edited, truncated, swapped or not what
``save_pretrained`` wrote; each such case is a ``ValueError`` that says what was expected and what
came, raised before anything large is allocated (a config asking for a codebook bigger than the
weights file, or than the machine's memory, is refused with the figure). No code runs from
either file: JSON and safetensors only.

Code indices: (B, h, w) maps, or flat (B, h·w) sequences (what a prior emits), of any integer
dtype (uint8 / uint16 token files, int32, int64).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Dict, Iterable, Optional, Tuple

import torch
from torch import Tensor

#: quantizers whose weights hold a learned (K, D) codebook: the weights file is at least K·D·2 bytes
LEARNED_CODEBOOK = ("ddcl", "hard", "ema", "vqp")
#: the encoder/decoder sizes config.json may give, and their bound (a tampered 1e12 is refused, not allocated)
SIZES = ("in_channels", "out_channels", "channels", "latent_dim", "res_hidden", "num_downsamples", "num_res_blocks")
MAX_SIZE = 65536
INTEGER_DTYPES = (torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int8, torch.int16, torch.int32,
                  torch.int64)


def _size(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"  # pragma: no cover


def read_config_file(path: str | os.PathLike) -> Any:
    """The JSON in ``path``; a ValueError naming the file when it is not JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"expected {str(path)!r} to hold JSON (written by VQVAE.save_pretrained or ddcl-vq "
                         f"export), got unreadable text ({err})") from None


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_config(config: Any, where: str, quantizer_types: Iterable[str]) -> Dict[str, Any]:
    """``config`` if it has the shape ``VQVAE.from_config`` needs, else a ValueError saying what is wrong."""
    if not isinstance(config, dict):
        raise ValueError(f"expected {where} to hold a JSON object (written by VQVAE.save_pretrained or ddcl-vq "
                         f"export), got a JSON {type(config).__name__}")
    missing = [k for k in ("encoder_kwargs", "decoder_kwargs", "quantizer_type", "quantizer_kwargs") if k not in config]
    if missing:
        raise ValueError(f"expected {where} to have {', '.join(missing)} (a VQVAE config); got keys {sorted(config)}")
    for key in ("encoder_kwargs", "decoder_kwargs", "quantizer_kwargs"):
        if not isinstance(config[key], dict):
            raise ValueError(f"expected {key} in {where} to be a JSON object, got {config[key]!r}"[:300])
    types = list(quantizer_types)
    if config["quantizer_type"] not in types:
        raise ValueError(f"expected quantizer_type in {where} to be one of {', '.join(types)}, "
                         f"got {config['quantizer_type']!r}"[:300])
    q = config["quantizer_kwargs"]
    for key in ("num_codes", "dim"):
        if key in q and not _positive_int(q[key]):
            raise ValueError(f"expected quantizer_kwargs.{key} in {where} to be a positive integer, got {q[key]!r}")
    for part in ("encoder_kwargs", "decoder_kwargs"):
        for key in SIZES:
            value = config[part].get(key, 1)
            if not (isinstance(value, int) and not isinstance(value, bool)
                    and (0 if key == "num_res_blocks" else 1) <= value <= MAX_SIZE):
                raise ValueError(f"expected {part}.{key} in {where} to be an integer in "
                                 f"[{0 if key == 'num_res_blocks' else 1}, {MAX_SIZE}], got {value!r}"[:300])
    return config


def safetensors_header(path: str | os.PathLike) -> Dict[str, Any]:
    """The header of a safetensors file ({name: {dtype, shape, data_offsets}}), checked against the
    file's size; a ValueError when the file is truncated or not safetensors."""
    path = str(path)
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n <= 0 or 8 + n > size:
                raise ValueError("header cut off")
            header = json.loads(f.read(n))
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError, AttributeError):
        raise ValueError(f"expected {path!r} to be a safetensors weights file (written by VQVAE.save_pretrained "
                         f"or ddcl-vq export); it is truncated or not safetensors ({_size(size)})") from None
    if 8 + n + max(ends, default=0) > size:
        raise ValueError(f"{path!r} is truncated: its header lists {_size(max(ends))} of tensors, the file holds "
                         f"{_size(size - 8 - n)} after the header")
    return {k: v for k, v in header.items() if k != "__metadata__"}


def available_memory() -> Optional[int]:
    """Physical memory of this machine in bytes (None where the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return None


def check_size(config: Dict[str, Any], header: Dict[str, Any], weights: str) -> None:
    """Refuse, before anything is allocated, a config whose codebook alone (K·D float32) is larger
    than the weights file's tensors (the two files do not belong together) or than this machine."""
    q = config["quantizer_kwargs"]
    if config["quantizer_type"] not in LEARNED_CODEBOOK or not ("num_codes" in q and "dim" in q):
        return
    codebook = 4 * q["num_codes"] * q["dim"]
    stored = sum(math.prod(v.get("shape", [])) * 2 for v in header.values())  # >= 2 bytes per stored element
    if codebook > 2 * max(stored, 1):
        raise ValueError(f"config.json asks for K = {q['num_codes']:,} codes of D = {q['dim']} (a {_size(codebook)} "
                         f"codebook) but {weights!r} holds about {_size(stored)} of weights: config.json and "
                         "model.safetensors do not belong together")
    memory = available_memory()
    if memory is not None and codebook > memory:
        raise ValueError(f"config.json asks for K = {q['num_codes']:,} codes of D = {q['dim']}: the codebook alone "
                         f"needs {_size(codebook)}, this machine has {_size(memory)} of memory")


def load_weights(model: torch.nn.Module, weights: str, strict: bool = True, device: str = "cpu") -> None:
    """``safetensors.torch.load_model`` with a ValueError naming both files when they do not fit."""
    from safetensors import SafetensorError
    from safetensors.torch import load_model

    try:
        load_model(model, weights, strict=strict, device=device)
    except SafetensorError as err:
        raise ValueError(f"cannot read the weights {weights!r} ({str(err).strip()[:200]})") from None
    except RuntimeError as err:
        lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
        detail = "; ".join(lines[1:3] if len(lines) > 1 else lines)[:300]
        raise ValueError(f"the weights {weights!r} do not fit the model config.json describes (another number of "
                         f"codes, channels or quantizer? the two files must come from one export): {detail}") from None
    check_finite(model, weights)


def check_finite(model: torch.nn.Module, weights: str) -> None:
    """A ValueError when a floating-point weight or buffer of the loaded ``model`` is NaN or Inf (a damaged
    file, or a training that diverged): such a model would load and decode without a word."""
    bad = [(name, int((~torch.isfinite(t)).sum()), t.numel()) for name, t in model.state_dict().items()
           if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        name, count, total = bad[0]
        more = f", and {len(bad) - 1} other tensor{'s' if len(bad) > 2 else ''}" if len(bad) > 1 else ""
        raise ValueError(f"the weights {weights!r} hold values that are not finite (NaN or Inf): {count} of {total} "
                         f"in {name}{more}; the file is damaged or its training diverged: export a healthy "
                         "checkpoint")


def latent_grid(config: Optional[Dict[str, Any]]) -> Optional[Tuple[int, int]]:
    """(h, w) of the code grid the model was trained on, when its config records it (an export,
    or a run loaded by ddcl-vq: ``config["data"]["latent_size"]``)."""
    size = ((config or {}).get("data") or {}).get("latent_size")
    if isinstance(size, int) and size > 0:
        return size, size
    if isinstance(size, (list, tuple)) and len(size) == 2 and all(isinstance(s, int) and s > 0 for s in size):
        return int(size[0]), int(size[1])
    return None


def index_maps(indices: Tensor, grid: Optional[Tuple[int, int]] = None) -> Tensor:
    """(B, h, w) long index maps from (B, h, w) maps or flat (B, L) / (L,) sequences of any integer
    dtype. A flat sequence is laid out on ``grid`` (h, w) — L must be h·w — or, without a grid, on
    a square one when L is a perfect square."""
    if not isinstance(indices, Tensor):
        raise ValueError(f"expected a tensor of code indices, got {type(indices).__name__}")
    if indices.dtype not in INTEGER_DTYPES:
        raise ValueError(f"expected integer code indices, got dtype {indices.dtype}")
    if indices.ndim == 3:
        return indices.long()
    if indices.ndim not in (1, 2):
        raise ValueError(f"expected code indices of shape (B, h, w) or flat (B, h*w), got shape {tuple(indices.shape)}")
    flat = indices.reshape(1, -1) if indices.ndim == 1 else indices
    length = flat.shape[1]
    if grid is None:
        side = math.isqrt(length)
        if side * side != length:
            raise ValueError(f"expected flat sequences whose length is h*w of a known grid; got length {length}, "
                             "which is not square, and no grid: pass shape=(h, w)")
        grid = (side, side)
    h, w = grid
    if h * w != length:
        raise ValueError(f"expected flat sequences of h*w = {h}*{w} = {h * w} indices (the latent grid), "
                         f"got {length} per sequence")
    return flat.reshape(flat.shape[0], h, w).long()
