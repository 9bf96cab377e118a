"""The DDCL soft codebook (Deep Dual Competitive Learning) as a VQ-VAE quantizer.

Math (z_i ∈ R^D, codebook W ∈ R^{K×D}, τ the temperature relative to D):

    d_ik  = ‖z_i − w_k‖²
    q_ik  = softmax_k(−d_ik / (τ·D))
    ẑ_i   = Σ_k q_ik w_k                     soft code (convex combination of codes)
    k*_i  = argmin_k d_ik                     hard index
    L_q   = mean_i Σ_k q_ik d_ik              distortion
          = L_OLS + V,  L_OLS = mean_i ‖z_i − ẑ_i‖²,  V = mean_i Σ_k q_ik ‖w_k − ẑ_i‖² ≥ 0

Why τ is relative to D: squared distances grow linearly with D, so a fixed τ would
mean a sharper softmax for wider latents. Dividing by τ·D makes τ a per-dimension
temperature: τ = 0.01 means "a distance gap of 0.01 per latent dimension is worth
one nat of assignment log-odds", whatever D is.

Loss scale: every quantizer in ddcl_vq returns ``loss`` as a per-element mean (the
sum-over-D terms divided by D), the scale of the classic VQ-VAE loss written with
``F.mse_loss``, so swapping quantizers does not change the balance with a pixel MSE.
``terms`` hold the unweighted sum-over-D values.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

from .base import (QuantizerOutput, Quantizer, batch_perplexity, compute_dtype, flatten,
                   squared_distances, unflatten)
from .fused import IMPLEMENTATIONS, ddcl_assign
from .kmeans import kmeans_init_

MODES = ("soft", "straight_through", "soft_straight_through")
INITS = ("uniform", "normal", "kmeans")


@dataclass
class SoftAssignment:
    """Per-batch result of the DDCL assignment on (N, D) vectors and a (K, D) codebook.

    q: (N, K) assignments; soft: (N, D) soft codes ẑ; indices: (N,) hard argmin;
    distortion, ols, variance: scalars (sum over D, mean over N), distortion = ols + variance.
    """

    q: Tensor
    soft: Tensor
    indices: Tensor
    distortion: Tensor
    ols: Tensor
    variance: Tensor


def soft_assignment(z: Tensor, codebook: Tensor, scale: float) -> SoftAssignment:
    """Reference (plain autograd) DDCL assignment.

    z: (N, D); codebook: (K, D); scale: softmax divisor τ·D (> 0).
    Both are centred on the codebook mean (distances are translation invariant) so that
    large common offsets do not cancel in ‖z‖² − 2 z·w + ‖w‖².
    """
    center = codebook.detach().mean(0)
    zc, wc = z - center, codebook - center
    d = squared_distances(zc, wc)                       # (N, K)
    q = torch.softmax(-d / scale, dim=1)                # (N, K), stable (max-subtracted)
    soft_c = q @ wc                                     # (N, D)
    distortion = (q * d).sum(1).mean()
    ols = (zc - soft_c).pow(2).sum(1).mean()
    # V_i = Σ_k q_ik ‖w_k‖² − ‖ẑ_i‖² (parallel-axis form, centred); ≥ 0 in exact arithmetic.
    variance = (q @ wc.pow(2).sum(1) - soft_c.pow(2).sum(1)).clamp_min(0).mean()
    return SoftAssignment(q=q, soft=soft_c + center, indices=d.argmin(1), distortion=distortion,
                          ols=ols, variance=variance)


class DDCLQuantizer(Quantizer):
    """Differentiable soft codebook (DDCL) with three output modes.

    Args:
        num_codes: K, codebook size.
        dim: D, the channel size of the encoder features.
        temperature: τ relative to D (softmax over −d/(τ·D)); may be changed between steps
            (``quantizer.temperature = ...``) by a schedule.
        mode: what the decoder sees and where gradients go —
            ``"straight_through"`` (default): decoder sees the hard code w_{k*}; the encoder
            gets the straight-through gradient plus ``beta``·‖z − sg(w_{k*})‖²; the codebook
            learns from the DDCL distortion on sg(z) (every code moves toward the data in
            proportion to q_ik, so no code dies). Training and inference decode the same codes.
            ``"soft"``: decoder sees ẑ; L_q trains encoder and codebook jointly (the papers'
            readout form; prone to collapse in a VQ-VAE, see the README).
            ``"soft_straight_through"``: decoder sees w_{k*}, gradients as if it were ẑ.
        beta: commitment weight (``straight_through`` mode only).
        codebook_init: ``"uniform"`` U(−1/K, 1/K) as in the VQ-VAE paper, ``"normal"`` N(0, 1),
            or ``"kmeans"`` (k-means on the first training batch, identical on every process).
        channel_dim: 1 for (B, D, *spatial) inputs, −1 for (..., D).
        implementation: how the assignment is computed (same values and gradients, to float
            rounding) — ``"reference"``: plain autograd (:func:`soft_assignment`), several N×K
            tensors kept for backward; ``"fused"``: blocked forward and an analytic backward
            (:mod:`ddcl_vq.fused`), one N×K tensor kept (none in ``straight_through`` mode);
            ``"chunked"``: like fused but recomputes per block in backward, extra memory
            O(chunk_size·K); ``"auto"`` (default): fused, or chunked when the N×K tensor fused
            would keep exceeds ``chunk_threshold_bytes``.
        chunk_size: rows per block for fused/chunked (default: about 2**18 / K rows, 64 to 1024).
        chunk_threshold_bytes: the ``"auto"`` switch point (default 64 MiB, e.g. N·K = 16M in
            float32). Measured on a 2-core CPU: at D = 64 recomputing the logits per block is
            about as fast as keeping them; at D = 256 keeping them is ~15% faster; above the
            threshold memory wins.

    Shapes: ``forward(z)`` with z (B, D, H, W) returns quantized (B, D, H, W) and indices (B, H, W).
    """

    def __init__(self, num_codes: int, dim: int, *, temperature: float = 0.01,
                 mode: str = "straight_through", beta: float = 0.25,
                 codebook_init: str = "uniform", channel_dim: int = 1,
                 implementation: str = "auto", chunk_size: Optional[int] = None,
                 chunk_threshold_bytes: int = 64 * 2 ** 20):
        super().__init__(num_codes, dim, channel_dim)
        if mode not in MODES:
            raise ValueError(f"expected mode in {MODES}, got {mode!r}")
        if codebook_init not in INITS:
            raise ValueError(f"expected codebook_init in {INITS}, got {codebook_init!r}")
        if not beta >= 0:
            raise ValueError(f"expected beta >= 0, got {beta!r}")
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"expected implementation in {IMPLEMENTATIONS}, got {implementation!r}")
        if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool)
                                       or chunk_size <= 0):
            raise ValueError(f"expected chunk_size to be a positive int or None, got {chunk_size!r}")
        if not chunk_threshold_bytes >= 0:
            raise ValueError(f"expected chunk_threshold_bytes >= 0, got {chunk_threshold_bytes!r}")
        self.implementation = implementation
        self.chunk_size = chunk_size
        self.chunk_threshold_bytes = int(chunk_threshold_bytes)
        self.mode = mode
        self.beta = float(beta)
        self.codebook_init = codebook_init
        self.temperature = temperature
        self.weight = nn.Parameter(torch.empty(num_codes, dim))
        if codebook_init == "normal":
            nn.init.normal_(self.weight)
        else:
            nn.init.uniform_(self.weight, -1.0 / num_codes, 1.0 / num_codes)
        self.register_buffer("initialized", torch.tensor(codebook_init != "kmeans"))

    @property
    def temperature(self) -> float:
        return self._temperature

    @temperature.setter
    def temperature(self, value: float) -> None:
        if not isinstance(value, (int, float)) or not value > 0 or value != value or value == float("inf"):
            raise ValueError(f"expected a finite temperature > 0, got {value!r}")
        self._temperature = float(value)

    @property
    def codebook(self) -> Tensor:
        return self.weight

    def assign(self, flat: Tensor, codebook: Tensor) -> SoftAssignment:
        """(N, D), (K, D) -> :class:`SoftAssignment` at the current temperature (reference path)."""
        return soft_assignment(flat, codebook, self.temperature * self.dim)

    def resolve_implementation(self, num_vectors: int, dtype: torch.dtype = torch.float32) -> str:
        """The path ``forward`` takes for a batch of ``num_vectors`` vectors."""
        if self.implementation != "auto":
            return self.implementation
        itemsize = torch.finfo(dtype).bits // 8
        return "chunked" if num_vectors * self.num_codes * itemsize > self.chunk_threshold_bytes else "fused"

    def _assign(self, x: Tensor, w: Tensor, codebook_only: bool):
        """-> (soft, indices, distortion, ols, variance, soft_counts) by the configured path."""
        impl = self.resolve_implementation(x.shape[0], x.dtype)
        scale = self.temperature * self.dim
        if impl == "reference":
            a = soft_assignment(x.detach() if codebook_only else x, w, scale)
            return a.soft, a.indices, a.distortion, a.ols, a.variance, a.q.detach().sum(0)
        f = ddcl_assign(x, w, scale, codebook_only=codebook_only, implementation=impl,
                        chunk_size=self.chunk_size)
        return f.soft, f.indices, f.distortion, f.ols, f.variance, f.soft_counts

    def forward(self, z: Tensor) -> QuantizerOutput:
        flat, last_shape = flatten(z, self.dim, self.channel_dim)
        dtype = compute_dtype(z)
        with torch.autocast(device_type=z.device.type, enabled=False):
            x = flat.to(dtype)
            if self.training and not bool(self.initialized):
                kmeans_init_(self.weight.data, x)
                self.initialized.fill_(True)
            w = self.weight.to(dtype)
            terms = {}
            if self.mode == "straight_through":
                # assignment on sg(z): only the codebook learns from the distortion
                soft, idx, distortion, ols, variance, counts = self._assign(x, w, codebook_only=True)
                hard = w.detach()[idx]
                out = hard + (x - x.detach())  # value exactly w_{k*}, gradient identity
                commitment = (x - hard).pow(2).sum(1).mean()
                loss = (distortion + self.beta * commitment) / self.dim
                terms["commitment"] = commitment.detach()
            else:
                soft, idx, distortion, ols, variance, counts = self._assign(x, w, codebook_only=False)
                if self.mode == "soft":
                    out = soft
                else:
                    out = w.detach()[idx] + (soft - soft.detach())
                loss = distortion / self.dim
            terms.update(distortion=distortion.detach(), ols=ols.detach(), variance=variance.detach())
        quantized = unflatten(out.to(z.dtype), last_shape, self.channel_dim)
        indices = unflatten(idx, last_shape, self.channel_dim)
        return QuantizerOutput(quantized=quantized, indices=indices, loss=loss, terms=terms,
                               perplexity=batch_perplexity(idx, self.num_codes),
                               soft_counts=counts.detach())

    def soft_codes(self, z: Tensor) -> Tensor:
        """The soft codes ẑ in the input layout, whatever the mode (for soft-code evaluation)."""
        flat, last_shape = flatten(z, self.dim, self.channel_dim)
        with torch.autocast(device_type=z.device.type, enabled=False):
            soft = self._assign(flat.to(compute_dtype(z)), self.weight.to(compute_dtype(z)),
                                codebook_only=False)[0]
        return unflatten(soft.to(z.dtype), last_shape, self.channel_dim)

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", mode={self.mode!r}, temperature={self.temperature:g}, "
                f"beta={self.beta:g}, codebook_init={self.codebook_init!r}, "
                f"implementation={self.implementation!r}")
