"""The interface every quantizer in ddcl_vq speaks.

Input: channel-first maps (B, D, *spatial) by default, or channel-last (..., D) with ``channel_dim=-1``; inside, a
flat (N, D) matrix. Code outside ``ddcl_vq`` asks a :class:`Quantizer` for what it needs instead of testing for a
concrete class; the defaults are neutral.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import torch
from einops import rearrange
from torch import Tensor, nn


@dataclass
class QuantizerOutput:
    """What every quantizer's ``forward`` returns.

    quantized:   same shape and layout as the input (what the decoder sees).
    indices:     long tensor, the input's shape without the channel dimension.
    loss:        scalar to add to the task loss, already weighted.
    terms:       named scalar tensors, the detached loss parts (DDCL: ``distortion``, ``ols``,
                 ``variance`` (+ ``commitment``)), each a sum over D and a mean over vectors.
    perplexity:  exp(entropy) of the batch's hard-index histogram (a batch statistic).
    soft_counts: (K,) Σ_i q_ik over the batch's vectors (DDCL only), for soft perplexity.
    soft_codes:  the soft codes ẑ, laid out as ``quantized`` (DDCL in eval mode, else None).
    """

    quantized: Tensor
    indices: Tensor
    loss: Tensor
    terms: Dict[str, Tensor] = field(default_factory=dict)
    perplexity: Optional[Tensor] = None
    soft_counts: Optional[Tensor] = None
    soft_codes: Optional[Tensor] = None


def compute_dtype(x: Tensor) -> torch.dtype:
    """float64 stays float64 (exactness tests); everything else computes in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def flatten(z: Tensor, dim: int, channel_dim: int) -> Tuple[Tensor, Tuple[int, ...]]:
    """(B, D, *S) or (..., D) -> ((N, D) float matrix, shape of the channel-last view); ValueError
    for a wrong rank or channel size, a non-float input or NaN/Inf values."""
    if not isinstance(z, Tensor):
        raise ValueError(f"expected a torch.Tensor of encoder features, got {type(z).__name__}")
    if not z.is_floating_point():
        raise ValueError(f"expected a floating-point tensor, got dtype {z.dtype}")
    if channel_dim == 1:
        if z.dim() < 2:
            raise ValueError(f"expected a channel-first tensor (B, D, *spatial) with D={dim}, "
                             f"got rank {z.dim()} with shape {tuple(z.shape)}")
        if z.shape[1] != dim:
            raise ValueError(f"expected channel size D={dim} at dim 1 of (B, D, *spatial), got shape {tuple(z.shape)}")
        z_last = rearrange(z, "b d ... -> b ... d")
    elif channel_dim == -1:
        if z.dim() < 1 or z.shape[-1] != dim:
            raise ValueError(f"expected a channel-last tensor (..., D) with D={dim}, got shape {tuple(z.shape)}")
        z_last = z
    else:
        raise ValueError(f"expected channel_dim 1 or -1, got {channel_dim}")
    if not torch.isfinite(z).all():
        bad = (~torch.isfinite(z)).sum().item()
        raise ValueError(f"expected finite encoder features, got {bad} NaN/Inf value(s)")
    return rearrange(z_last, "... d -> (...) d"), tuple(z_last.shape)


def unflatten(x: Tensor, last_shape: Tuple[int, ...], channel_dim: int) -> Tensor:
    """Inverse of :func:`flatten` for (N, D) -> input layout, or (N,) -> index layout."""
    if x.dim() == 1:
        return x.reshape(last_shape[:-1])
    x = x.reshape(last_shape)
    if channel_dim != 1:
        return x
    x = rearrange(x, "b ... d -> b d ...")
    # contiguous on a GPU: a channels_last-strided result fails inductor's stride check (pytorch/pytorch#171622)
    return x if x.device.type == "cpu" else x.contiguous()


def batch_perplexity(indices: Tensor, num_codes: int) -> Tensor:
    """exp(H) of the hard-index histogram of one batch (float32 scalar)."""
    counts = torch.bincount(indices.reshape(-1), minlength=num_codes).float()
    p = counts / counts.sum().clamp_min(1)
    return torch.exp(-(p * torch.log(p.clamp_min(1e-30))).sum())


def squared_distances(z: Tensor, codebook: Tensor) -> Tensor:
    """(N, D), (K, D) -> (N, K) squared Euclidean distances ‖z‖² − 2 z·w + ‖w‖², clamped at 0 (callers centre
    both on the codebook's mean first)."""
    d = (z * z).sum(1, keepdim=True) - 2.0 * (z @ codebook.t()) + (codebook * codebook).sum(1)[None, :]
    return d.clamp_min(0.0)


def check_positive_int(name: str, value: Any) -> int:
    """``value``, or ValueError unless it is an int > 0 (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"expected {name} to be a positive int, got {value!r}")
    return value


def check_finite(name: str, value: Any, positive: bool = False) -> float:
    """``value`` as a float, or ValueError unless it is a finite number >= 0 (> 0 if ``positive``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isinf(value) \
            or not (value > 0 if positive else value >= 0):
        raise ValueError(f"expected a finite {name} {'>' if positive else '>='} 0, got {value!r}")
    return float(value)


def _codebook_size_alias(init):
    """``init`` also accepting ``codebook_size=K`` (vector-quantize-pytorch's name) for ``num_codes``."""
    @functools.wraps(init)
    def wrapper(self, *args: Any, **kwargs: Any) -> None:
        if "codebook_size" in kwargs:
            if args or "num_codes" in kwargs:
                raise ValueError(f"expected the codebook size once, as num_codes or codebook_size, got both "
                                 f"(codebook_size={kwargs['codebook_size']!r})")
            kwargs["num_codes"] = kwargs.pop("codebook_size")
        init(self, *args, **kwargs)
    return wrapper


class Quantizer(nn.Module):
    """Base class: subclasses implement ``quantize(x)`` (or ``forward(z)``) and ``codebook``, and the
    hooks below they have. Every subclass's constructor takes the codebook size as ``num_codes``
    (positional) or as vector-quantize-pytorch's keyword ``codebook_size=``; both at once is a ValueError."""

    num_codes: int
    dim: int
    channel_dim: int
    #: the names of ``terms`` (what an empty batch reports as zeros)
    term_names: Tuple[str, ...] = ()
    #: float64 inputs are quantized in float64 (exactness tests); False: always float32 (the wrapped peers)
    keeps_float64: bool = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:
            cls.__init__ = _codebook_size_alias(cls.__dict__["__init__"])

    def __init__(self, num_codes: int, dim: int, channel_dim: int = 1):
        super().__init__()
        self.num_codes = check_positive_int("num_codes", num_codes)
        self.dim = check_positive_int("dim", dim)
        if channel_dim not in (1, -1):
            raise ValueError(f"expected channel_dim 1 (channel-first) or -1 (channel-last), got {channel_dim!r}")
        self.channel_dim = channel_dim

    @property
    def codebook(self) -> Tensor:  # (K, D)
        raise NotImplementedError

    def quantize(self, x: Tensor) -> QuantizerOutput:
        """(N, D) vectors (N > 0, float32 or float64, autocast off) -> the output for them: quantized
        (N, D), indices (N,), loss, terms (and soft_counts); ``forward`` puts them in the input's layout
        and dtype and adds the batch perplexity."""
        raise NotImplementedError

    def forward(self, z: Tensor) -> QuantizerOutput:
        flat, last_shape = flatten(z, self.dim, self.channel_dim)
        if flat.shape[0] == 0:  # an empty batch: nothing to quantize, nothing learned
            return self.empty_output(flat, last_shape)
        dtype = compute_dtype(flat) if self.keeps_float64 else torch.float32
        with torch.autocast(device_type=z.device.type, enabled=False):
            out = self.quantize(flat.to(dtype))
        indices = out.indices.reshape(-1).long()
        out.quantized = unflatten(out.quantized.reshape(-1, self.dim).to(z.dtype), last_shape, self.channel_dim)
        out.indices = unflatten(indices, last_shape, self.channel_dim)
        if out.soft_codes is not None:
            out.soft_codes = unflatten(out.soft_codes.to(z.dtype), last_shape, self.channel_dim)
        out.perplexity = batch_perplexity(indices, self.num_codes)
        return out

    def lookup(self, indices: Tensor) -> Tensor:
        """Long indices of shape (B, *S) -> codes in the input layout ((B, D, *S) or (B, *S, D))."""
        if not isinstance(indices, Tensor) or indices.is_floating_point() or indices.is_complex():
            got = indices.dtype if isinstance(indices, Tensor) else type(indices).__name__
            raise ValueError(f"expected an integer index tensor, got {got}")
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= self.num_codes):
            raise ValueError(f"expected indices in [0, {self.num_codes - 1}], got values in "
                             f"[{int(indices.min())}, {int(indices.max())}]")
        codes = self.codebook[indices.long()]  # (*idx, D)
        return rearrange(codes, "b ... d -> b d ...") if self.channel_dim == 1 and codes.dim() > 2 else codes

    def empty_output(self, flat: Tensor, last_shape: Tuple[int, ...]) -> QuantizerOutput:
        """The output for an empty batch (N = 0), no state touched: a zero ``loss`` on the graph of the input and
        of every trainable parameter (each gets a zero gradient, as DDP expects)."""
        x = flat.to(compute_dtype(flat))
        zero = x.sum()                       # exactly 0 for no vectors, and on the input's graph
        for p in self.parameters():
            if p.requires_grad:
                zero = zero + p.reshape(-1)[:0].sum().to(zero.dtype)   # 0, with a zero gradient
        indices = torch.zeros(0, dtype=torch.long, device=flat.device)
        return QuantizerOutput(
            quantized=unflatten(flat, last_shape, self.channel_dim),
            indices=unflatten(indices, last_shape, self.channel_dim), loss=zero,
            terms={name: zero.detach() for name in self.term_names},
            perplexity=batch_perplexity(indices, self.num_codes),
            soft_counts=x.new_zeros(self.num_codes) if self.has_soft_codes else None)

    # ------------------------------------------------------------------ what callers may ask
    #: True when :meth:`soft_codes` returns soft codes (DDCL); callers check it before asking.
    has_soft_codes: bool = False
    #: True when the hard index is the row of ``codebook`` nearest to the input; False for FSQ, LFQ.
    assigns_nearest_code: bool = True
    #: False lets a quantizer leave out, in training, the ``terms`` only reports read (the loop logs those steps)
    report_terms: bool = True

    def soft_codes(self, z: Tensor) -> Optional[Tensor]:
        """Soft codes for ``z`` in the input layout, or None for a quantizer without them."""
        return None

    def step(self) -> None:
        """Called once after every optimizer step in training (advances schedules). No-op by default."""

    def log_stats(self) -> Dict[str, float]:
        """Extra scalars to log for the last training step (e.g. DDCL's ``temperature``)."""
        return {}

    def describe(self) -> Dict[str, Any]:
        """Settings that identify the quantizer in reports, beside type, num_codes and dim."""
        return {}

    def extra_repr(self) -> str:
        return f"num_codes={self.num_codes}, dim={self.dim}, channel_dim={self.channel_dim}"
