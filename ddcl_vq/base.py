"""The interface every quantizer in ddcl_vq speaks.

A quantizer maps encoder features to codes. Input layout is channel-first maps
(B, D, H, W) — or any (B, D, *spatial) — by default, or channel-last (..., D) with
``channel_dim=-1``. Internally every quantizer works on a flat (N, D) matrix of
vectors; :func:`flatten` and :func:`unflatten` are the two reshapes.

Code outside ``ddcl_vq`` (training loop, models, evaluation) asks a :class:`Quantizer` for
what it needs instead of testing for a concrete class: ``has_soft_codes`` / :meth:`soft_codes`,
the per-step hook :meth:`step`, extra scalars to log (:meth:`log_stats`) and settings to print
in reports (:meth:`describe`). The defaults are neutral (no soft codes, nothing to advance,
nothing extra), so a quantizer overrides only what it has.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from einops import rearrange
from torch import Tensor, nn


@dataclass
class QuantizerOutput:
    """What every quantizer's ``forward`` returns.

    quantized:   same shape and layout as the input (what the decoder sees).
    indices:     long tensor, the input's shape without the channel dimension.
    loss:        scalar to add to the task loss, already weighted.
    terms:       named scalar tensors (detached values of the loss parts; DDCL:
                 ``distortion``, ``ols``, ``variance`` (+ ``commitment``); HardVQ:
                 ``codebook``, ``commitment``). Each is a sum over D and a mean over vectors.
    perplexity:  exp(entropy) of the batch's hard-index histogram (a batch statistic).
    soft_counts: (K,) Σ_i q_ik over the batch's vectors (DDCL only), for soft perplexity.
    """

    quantized: Tensor
    indices: Tensor
    loss: Tensor
    terms: Dict[str, Tensor] = field(default_factory=dict)
    perplexity: Optional[Tensor] = None
    soft_counts: Optional[Tensor] = None


def compute_dtype(x: Tensor) -> torch.dtype:
    """float64 stays float64 (exactness tests); everything else computes in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def flatten(z: Tensor, dim: int, channel_dim: int) -> Tuple[Tensor, Tuple[int, ...]]:
    """(B, D, *S) or (..., D) -> ((N, D) float matrix, shape of the channel-last view).

    Raises ValueError for a wrong rank, a wrong channel size, a non-float input or
    NaN/Inf values, saying what was expected and what came.
    """
    if not isinstance(z, Tensor):
        raise ValueError(f"expected a torch.Tensor of encoder features, got {type(z).__name__}")
    if not z.is_floating_point():
        raise ValueError(f"expected a floating-point tensor, got dtype {z.dtype}")
    if channel_dim == 1:
        if z.dim() < 2:
            raise ValueError(
                f"expected a channel-first tensor (B, D, *spatial) with D={dim}, "
                f"got rank {z.dim()} with shape {tuple(z.shape)}")
        if z.shape[1] != dim:
            raise ValueError(
                f"expected channel size D={dim} at dim 1 of (B, D, *spatial), "
                f"got shape {tuple(z.shape)}")
        z_last = rearrange(z, "b d ... -> b ... d")
    elif channel_dim == -1:
        if z.dim() < 1 or z.shape[-1] != dim:
            raise ValueError(
                f"expected a channel-last tensor (..., D) with D={dim}, got shape {tuple(z.shape)}")
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
    # On a GPU the channel-first result is made contiguous: left channels_last-strided, torch.compile's
    # backward of a decoder whose last convolution has one output channel fails inductor's stride check
    # on CUDA (cuDNN picks another layout than the meta kernel predicts; pytorch/pytorch#171622 and
    # #197517; seen with torch 2.11 on an H200, docs/performance.md). On the CPU the view stays as it is.
    return x if x.device.type == "cpu" else x.contiguous()


def batch_perplexity(indices: Tensor, num_codes: int) -> Tensor:
    """exp(H) of the hard-index histogram of one batch (float32 scalar)."""
    counts = torch.bincount(indices.reshape(-1), minlength=num_codes).float()
    p = counts / counts.sum().clamp_min(1)
    return torch.exp(-(p * torch.log(p.clamp_min(1e-30))).sum())


def squared_distances(z: Tensor, codebook: Tensor) -> Tensor:
    """(N, D), (K, D) -> (N, K) squared Euclidean distances, clamped at 0.

    Uses ‖z‖² − 2 z·w + ‖w‖² (one matmul). Callers centre z and the codebook on
    the codebook's mean first so large common offsets do not cancel catastrophically.
    """
    d = (z * z).sum(1, keepdim=True) - 2.0 * (z @ codebook.t()) + (codebook * codebook).sum(1)[None, :]
    return d.clamp_min(0.0)


class Quantizer(nn.Module):
    """Base class: subclasses implement ``forward(z) -> QuantizerOutput`` and ``codebook``, and
    override the hooks below (soft codes, per-step hook, extra statistics) when they have them."""

    num_codes: int
    dim: int
    channel_dim: int

    def __init__(self, num_codes: int, dim: int, channel_dim: int = 1):
        super().__init__()
        if not isinstance(num_codes, int) or isinstance(num_codes, bool) or num_codes <= 0:
            raise ValueError(f"expected num_codes to be a positive int, got {num_codes!r}")
        if not isinstance(dim, int) or isinstance(dim, bool) or dim <= 0:
            raise ValueError(f"expected dim to be a positive int, got {dim!r}")
        if channel_dim not in (1, -1):
            raise ValueError(f"expected channel_dim 1 (channel-first) or -1 (channel-last), got {channel_dim!r}")
        self.num_codes = num_codes
        self.dim = dim
        self.channel_dim = channel_dim

    @property
    def codebook(self) -> Tensor:  # (K, D)
        raise NotImplementedError

    def lookup(self, indices: Tensor) -> Tensor:
        """Long indices of shape (B, *S) -> codes in the input layout ((B, D, *S) or (B, *S, D))."""
        if not isinstance(indices, Tensor) or indices.is_floating_point() or indices.is_complex():
            got = indices.dtype if isinstance(indices, Tensor) else type(indices).__name__
            raise ValueError(f"expected an integer index tensor, got {got}")
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= self.num_codes):
            raise ValueError(
                f"expected indices in [0, {self.num_codes - 1}], got values in "
                f"[{int(indices.min())}, {int(indices.max())}]")
        codes = self.codebook[indices.long()]  # (*idx, D)
        return rearrange(codes, "b ... d -> b d ...") if self.channel_dim == 1 and codes.dim() > 2 else codes

    def empty_output(self, flat: Tensor, last_shape: Tuple[int, ...], terms: Sequence[str],
                     soft_counts: bool = False) -> QuantizerOutput:
        """What every quantizer returns for an empty batch (N = 0 vectors), in training and in
        evaluation: ``quantized`` of the input's (empty) shape, empty indices, a zero ``loss`` and
        zero ``terms`` (finite), perplexity 1, and (``soft_counts``) K zeros. The loss is on the
        input's graph and on every trainable parameter's, so backward gives them zero gradients
        (DistributedDataParallel expects a gradient for every parameter on every process). The
        caller returns it before touching any state: nothing is initialised or learned.

        flat, last_shape: what :func:`flatten` returned for the input."""
        x = flat.to(compute_dtype(flat))
        zero = x.sum()                       # exactly 0 for no vectors, and on the input's graph
        for p in self.parameters():
            if p.requires_grad:
                zero = zero + p.reshape(-1)[:0].sum().to(zero.dtype)   # 0, with a zero gradient
        indices = torch.zeros(0, dtype=torch.long, device=flat.device)
        return QuantizerOutput(
            quantized=unflatten(flat, last_shape, self.channel_dim),
            indices=unflatten(indices, last_shape, self.channel_dim), loss=zero,
            terms={name: zero.detach() for name in terms}, perplexity=batch_perplexity(indices, self.num_codes),
            soft_counts=x.new_zeros(self.num_codes) if soft_counts else None)

    # ------------------------------------------------------------------ what callers may ask
    #: True when :meth:`soft_codes` returns soft codes (DDCL); callers check it before asking.
    has_soft_codes: bool = False
    #: True when the hard index is the row of ``codebook`` nearest to the input (a re-fitted
    #: codebook can then be decoded the same way); False where a projection is rounded (FSQ, LFQ).
    assigns_nearest_code: bool = True
    #: False lets a quantizer leave out, in training, the ``terms`` that cost extra work and that only
    #: reports read (DDCL's M-step path: ``distortion`` and its split into ``ols`` and ``variance``, one
    #: more N×K·K×D product and two N×K passes per batch, ~30% of its M-step's time); the training loop
    #: sets it for the steps it logs only. Every term is computed in eval mode whatever it says.
    report_terms: bool = True

    def soft_codes(self, z: Tensor) -> Optional[Tensor]:
        """Soft codes for ``z`` in the input layout, or None for a quantizer without them."""
        return None

    def step(self) -> None:
        """Per-step hook: called once after every optimizer step in training (advances schedules,
        counters). No-op by default."""

    def log_stats(self) -> Dict[str, float]:
        """Extra scalars to log beside ``loss``/``terms`` for the last training step (e.g. DDCL's
        ``temperature``). Empty by default."""
        return {}

    def describe(self) -> Dict[str, Any]:
        """Settings that identify the quantizer in reports, beside type, num_codes and dim
        (e.g. DDCL's ``mode`` and current ``temperature``). Empty by default."""
        return {}

    def extra_repr(self) -> str:
        return f"num_codes={self.num_codes}, dim={self.dim}, channel_dim={self.channel_dim}"
