"""How much memory a training configuration needs at least, estimated on PyTorch's ``meta`` device before anything is
allocated; :func:`check_fits` refuses what exceeds the memory available."""
from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from ddcl_vq.tokenizer.config import Config
from ddcl_vq.common.errors import UserError

GIB = float(1 << 30)


class NotEnoughMemory(UserError, MemoryError):
    """A configuration needs more memory than the device has; the message gives both figures."""


@dataclass
class Estimate:
    """Bytes: ``state`` (parameters and buffers), ``training`` (gradients and AdamW's moments), ``step`` (the
    quantizer's working set in one step)."""

    state: int
    training: int
    step: int

    @property
    def total(self) -> int:
        return self.state + self.training + self.step


def estimate(cfg: Config, in_channels: int, device: torch.device, world: int = 1) -> Estimate:
    """A lower bound of the memory one training process needs for ``cfg`` on ``device``."""
    from ddcl_vq.blocks import BLOCK_LIVE_TENSORS, block_rows
    from ddcl_vq.tokenizer.config import build_model
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what the model's build warns about, the real build says (once)
        model = build_model(cfg, in_channels)  # shapes only: nothing is allocated
    state = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    k, d = cfg.quantizer['num_codes'], cfg.model['latent_dim']
    halvings = (len(cfg.model['ch_mult']) - 1 if cfg.model['arch'] == "vqgan"
                else cfg.model['num_downsamples'])
    side = max(cfg.data.image_size // 2 ** halvings, 1)
    rows = max(cfg.data.batch_size // max(world, 1), 1) * side * side  # latent vectors per process and step
    if cfg.quantizer['type'] == "ddcl":
        # one block of rows × K (its live tensors); the M-step's per-code sums and the new codebook (K × D)
        step = block_rows(device.type, rows, k) * k * 4 * BLOCK_LIVE_TENSORS + 2 * k * d * 4
    else:
        # the nearest code by a full (rows × K) distance matrix, and a codebook-sized update
        step = rows * k * 4 + k * d * 4
    return Estimate(state=state, training=3 * trainable, step=step)


def available_bytes(device: torch.device) -> Optional[int]:
    """Memory free on ``device``: the GPU's; on the CPU MemAvailable or a cgroup's free share, if lower; or None."""
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except Exception:  # noqa: BLE001 - no figure, no check
            return None
    if device.type != "cpu":
        return None
    found = []
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                used = int(f.read().strip())
            if limit.isdigit() and int(limit) < (1 << 60):
                found.append(max(int(limit) - used, 0))
        except (OSError, ValueError):
            continue
    return min(found) if found else None


def _gib(n: float) -> str:
    return f"{n / GIB:,.1f} GiB" if n >= GIB / 10 else f"{n / (1 << 20):,.0f} MiB"


def check_fits(cfg: Config, in_channels: int, device: torch.device, world: int = 1) -> Optional[Estimate]:
    """NotEnoughMemory when ``cfg``'s estimate exceeds what ``device`` has; -> the estimate (None without one).
    ``DDCL_VQ_SKIP_MEMORY_CHECK=1`` skips the check."""
    if os.environ.get("DDCL_VQ_SKIP_MEMORY_CHECK", "") not in ("", "0"):
        return None
    try:
        need = estimate(cfg, in_channels, device, world)
    except UserError:
        raise  # a setting the model refuses: the same error the real build would give
    except Exception:  # noqa: BLE001 - a model that cannot be built on the meta device: no estimate, no check
        return None
    free = available_bytes(device)
    # processes of one machine share its memory; on GPUs each process has its own device
    total = need.total * (world if device.type == "cpu" else 1)
    if free is None or total <= free:
        return need
    parts = {"parameters and buffers": need.state, "gradients and optimizer state": need.training,
             "one step's codebook distances and statistics": need.step}
    biggest = max(parts.items(), key=lambda item: item[1])
    where = "the GPU has" if device.type == "cuda" else "this machine has"
    per = f" ({world} processes × {_gib(need.total)})" if total != need.total else ""
    raise NotEnoughMemory(
        f"this configuration needs at least {_gib(total)} of memory{per}, {where} {_gib(free)} available; most of it "
        f"{biggest[0]} ({_gib(biggest[1])}, quantizer.num_codes={cfg.quantizer['num_codes']:,} × model.latent_dim="
        f"{cfg.model['latent_dim']}). Lower quantizer.num_codes (or model.latent_dim, data.batch_size)")
