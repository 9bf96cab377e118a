"""Residual DDCL (:class:`ResidualDDCL`): L DDCL codebooks in a chain, each quantizing what the levels before it
left, as SoundStream's / EnCodec's / DAC's residual vector quantizer, with DDCL's M-step at every level.

    r_0 = z,  c_i = level_i(r_i),  r_{i+1} = r_i − c_i,  quantized = Σ_i c_i

Each level is a :class:`~ddcl_vq.DDCLQuantizer` of its own (built with the same options), fed its residuals through
its public ``forward``: its k-means start, M-step, data-relative temperature (``distance_scale`` follows the
shrinking residual scale of its level), revival and schedules act on its own residuals only.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from ..base import QuantizerOutput, check_positive_int, compute_dtype, flatten, unflatten
from ..distributed import world_size
from .multi import MultiCodebookDDCL, check_ddcl_options
from .quantizer import DDCLQuantizer
from .statistics import soft_statistics

__all__ = ["ResidualDDCL"]


class ResidualDDCL(MultiCodebookDDCL):
    """L levels of DDCL, each quantizing the residual of the levels before it.

    Args:
        num_codes: K, codes per level (or ``codebook_size=K``).
        dim: D, the channel size of the encoder features.
        num_levels: L, the number of levels (codebooks in the chain).
        shared_codebook: one DDCLQuantizer used at every level (VAR's shared codebook). Its statistics are then
            those of the pooled residuals of every level: each training forward first builds the residual chain
            with the codebook as it stands (no gradient, no update), then makes ONE DDCL training forward on all
            levels' residuals together, so the M-step, the distance scale behind τ, revival and the warm-up advance
            once per batch (not L times) and every level's codes are soft means over residuals of all scales.
            The first training batch's k-means therefore sees a chain built with the initial codebook (its
            residuals are ≈ z at every level: a k-means on z). Per-level ``terms`` are measured on the chain.
        quantize_dropout: in training, each sample (the input's first dimension) keeps a random number of levels,
            uniform in 1..L (SoundStream, DAC); the levels beyond a sample's count add nothing to its output, get
            index −1, and are not fed its residuals: their M-step, revival and loss see only the samples that
            reach them. Under torch.distributed the first sample of every batch keeps all L levels, so that every
            level gets vectors on every process (their M-step statistics are all-reduced). Eval: all L levels.
        warmup_steps: the quantization warm-up of :class:`~ddcl_vq.DDCLQuantizer`, applied to the sum: for the
            first ``warmup_steps`` training forwards the decoder sees z + α·(Σ_i c_i − z), α rising 0 → 1 (the
            levels run without their own warm-up, so the residual chain is built from codes, never blends).
        channel_dim: 1 for (B, D, *spatial) inputs, −1 for (..., D).
        **ddcl_options: any other :class:`~ddcl_vq.DDCLQuantizer` keyword argument, given to every level (``mode``,
            ``temperature``, ``beta``, ``decay``, ``revive_threshold``, ``codebook_init``, ...).

    Gradients: in ``straight_through`` mode the decoder's gradient reaches z as the identity (the first level's
    straight-through; the later levels' codes enter the sum as constants), and each level's commitment term pulls
    z toward the sum of codes up to it (r_{i+1} = r_i − sg(c_i), as vector-quantize-pytorch's ResidualVQ); in the
    soft modes the gradient is that of the sum of the levels' soft codes. In ``soft`` mode c_i is the soft code, so
    the chain is one of soft residuals, and ``lookup`` (hard codes) is not the training output.

    ``forward(z)`` returns a :class:`~ddcl_vq.QuantizerOutput`: ``quantized`` Σ_i c_i in z's layout; ``indices`` z's
    shape without the channel dimension, plus (L,); ``loss`` the sum of the levels' losses; ``terms`` each level's
    terms prefixed ``level{i}_`` and their sums under the plain names; ``perplexity`` the mean of the levels' batch
    perplexities; ``soft_counts`` (L, K); ``soft_codes`` (eval) the sum of the levels' soft codes.
    ``forward_parts(z, dropout_seed=None, num_levels=None)`` also returns the (L,) levels' losses (shared codebook:
    the pooled loss shared out by the levels' vector counts); ``num_levels`` < L runs the first levels only (the
    others: index −1, loss 0, nothing learned), as EnCodec's ``n_q``.
    ``lookup(indices)`` decodes (..., L') indices, any prefix L' ≤ L (index −1: a level left out, adds nothing);
    ``decodes_prefixes`` (True) says so to callers (an evaluator measuring reconstruction against levels used).
    ``levels``: the L DDCLQuantizers in chain order (the same module L times with ``shared_codebook``);
    ``codebook``: (L, K, D), or the shared (K, D).
    """

    part_name = "level"
    decodes_prefixes = True

    def __init__(self, num_codes: int, dim: int, num_levels: int = 4, *, shared_codebook: bool = False,
                 quantize_dropout: bool = False, warmup_steps: int = 100, channel_dim: int = 1,
                 **ddcl_options: Any):
        super().__init__(num_codes, dim, channel_dim)
        self.num_levels = self.num_codebooks = check_positive_int("num_levels", num_levels)
        check_ddcl_options("ResidualDDCL", ddcl_options)
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"expected warmup_steps, an int >= 0 (0 = none), got {warmup_steps!r}")
        self.shared_codebook, self.quantize_dropout = bool(shared_codebook), bool(quantize_dropout)
        self.warmup_steps = warmup_steps
        build = lambda: DDCLQuantizer(num_codes, dim, channel_dim=-1, warmup_steps=0, **ddcl_options)  # noqa: E731
        self.quantizers = nn.ModuleList([build() for _ in range(1 if self.shared_codebook else num_levels)])
        self.register_buffer("warmup_batches", torch.zeros((), dtype=torch.long))
        self._warmup_over = warmup_steps == 0

    @property
    def levels(self) -> Tuple[DDCLQuantizer, ...]:
        """The L DDCLQuantizers in chain order (with ``shared_codebook``: the one quantizer, L times)."""
        return tuple(self.quantizers[0 if self.shared_codebook else i] for i in range(self.num_levels))

    @property
    def codebook(self) -> Tensor:
        if self.shared_codebook:
            return self.quantizers[0].weight
        return torch.stack([q.weight for q in self.quantizers])

    def describe(self) -> Dict[str, Any]:
        return {"mode": self.mode, "temperature": self.temperature, "num_levels": self.num_levels,
                "shared_codebook": self.shared_codebook, "quantize_dropout": self.quantize_dropout}

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", num_levels={self.num_levels}, shared_codebook={self.shared_codebook}, "
                f"quantize_dropout={self.quantize_dropout}, warmup_steps={self.warmup_steps}")

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._warmup_over = self.warmup_steps == 0  # re-read the loaded warm-up position at the next forward

    # ------------------------------------------------------------------ forward
    def _kept_levels(self, z: Tensor, n: int, dropout_seed: Optional[int] = None) -> Optional[Tensor]:
        """(N,) levels each row keeps under quantizer dropout (rows are sample-major), or None: all.
        ``dropout_seed``: draw the counts from a generator with that seed (the same counts in every group of a
        grouped host), else from torch's global generator."""
        if not (self.training and self.quantize_dropout and self.num_levels > 1):
            return None
        samples = z.shape[0] if z.dim() >= 2 else 1
        if dropout_seed is None:
            per_sample = torch.randint(1, self.num_levels + 1, (samples,), device=z.device)
        else:
            generator = torch.Generator().manual_seed(int(dropout_seed))
            per_sample = torch.randint(1, self.num_levels + 1, (samples,), generator=generator).to(z.device)
        if world_size() > 1:
            per_sample[0] = self.num_levels
        return per_sample.repeat_interleave(n // samples)

    def _blend(self) -> float:
        """The codes' share in what the decoder sees during the warm-up (1 after it); counts training forwards."""
        if not self.training or self._warmup_over:
            return 1.0
        seen = int(self.warmup_batches)
        if seen < self.warmup_steps:
            self.warmup_batches.add_(1)
            return seen / self.warmup_steps
        self._warmup_over = True
        return 1.0

    def _quantize(self, x: Tensor, z: Tensor, dropout_seed: Optional[int] = None,
                  num_levels: Optional[int] = None) -> Tuple[QuantizerOutput, Tensor]:
        n = x.shape[0]
        kept = self._kept_levels(z, n, dropout_seed)
        if num_levels is not None and num_levels < self.num_levels:  # the first num_levels levels only
            if isinstance(num_levels, bool) or not isinstance(num_levels, int) or num_levels < 1:
                raise ValueError(f"expected num_levels, an int in [1, {self.num_levels}], got {num_levels!r}")
            cap = torch.full((n,), num_levels, dtype=torch.long, device=x.device)
            kept = cap if kept is None else torch.minimum(kept, cap)
        rows = [None if kept is None else torch.nonzero(kept > i).squeeze(1) for i in range(self.num_levels)]
        blend = self._blend()
        if self.shared_codebook:
            parts, indices, codes, losses, chain_terms, mass = self._shared_levels(x, rows)
        else:
            parts, indices, codes, losses, chain_terms, mass = self._separate_levels(x, rows)
        loss = losses.sum()
        straight = self.mode == "straight_through"
        total = torch.zeros_like(x)
        soft_total = torch.zeros_like(x) if not self.training else None
        for i, (code, out) in enumerate(zip(codes, parts)):
            if code is None:
                continue
            contribution = code if (i == 0 or not straight) else code.detach()
            total = total + contribution if rows[i] is None else total.index_add(0, rows[i], contribution)
            if soft_total is not None and out.soft_codes is not None:
                soft_total = soft_total.index_add(0, rows[i], out.soft_codes) if rows[i] is not None \
                    else soft_total + out.soft_codes
        if blend < 1.0:  # value z + blend·(Σ c − z); the gradient is the sum's
            total = x.detach() + blend * (total - x).detach() + (total - total.detach())
        terms, perplexity = self._gather(chain_terms if chain_terms is not None else parts, indices)
        out = QuantizerOutput(total, indices, loss, terms, perplexity, soft_counts=mass, soft_codes=soft_total)
        return out, losses

    def _separate_levels(self, x: Tensor, rows: List[Optional[Tensor]]):
        """Each level its own DDCLQuantizer, fed r_i (the rows that reach it)."""
        n = x.shape[0]
        indices = torch.full((n, self.num_levels), -1, dtype=torch.long, device=x.device)
        mass = x.new_zeros(self.num_levels, self.num_codes)
        residual = x
        losses: List[Tensor] = []
        parts: List[Optional[QuantizerOutput]] = []
        codes: List[Optional[Tensor]] = []
        for i, level in enumerate(self.quantizers):
            r = residual if rows[i] is None else residual[rows[i]]
            if r.shape[0] == 0:
                parts.append(None)
                codes.append(None)
                losses.append(x.new_zeros(()))
                continue
            out = level(r)
            code = out.quantized
            losses.append(out.loss.to(x.dtype))
            if rows[i] is None:
                indices[:, i] = out.indices
                residual = residual - code.detach()
            else:
                indices[rows[i], i] = out.indices
                residual = residual.index_add(0, rows[i], -code.detach())
            mass[i] = out.soft_counts.to(mass.dtype)
            parts.append(out)
            codes.append(code)
        return parts, indices, codes, torch.stack(losses), None, mass

    def _shared_levels(self, x: Tensor, rows: List[Optional[Tensor]]):
        """One DDCLQuantizer for every level: the chain first (no gradient, no update), then one forward on the
        pooled residuals of all levels (one M-step per batch)."""
        shared = self.quantizers[0]
        n = x.shape[0]
        soft_mode = self.mode == "soft"
        w = shared.weight.detach().to(x.dtype, copy=True)
        scale = shared.softmax_scale()
        names = shared.term_names
        residual = x.detach()
        inputs: List[Tensor] = []
        chain_terms: List[Optional[QuantizerOutput]] = []
        mass = x.new_zeros(self.num_levels, self.num_codes)
        for i in range(self.num_levels):
            r = residual if rows[i] is None else residual[rows[i]]
            if r.shape[0] == 0:
                chain_terms.append(None)
                inputs.append(r)
                continue
            stats = soft_statistics(r, w, scale, support=shared.statistics_support, keep_soft=soft_mode)
            code = stats.soft if soft_mode else w[stats.indices]
            mass[i] = stats.mass.to(mass.dtype)
            terms = {"distortion": stats.distortion, "ols": stats.ols, "variance": stats.variance}
            if "commitment" in names:
                terms["commitment"] = (r - w[stats.indices]).pow(2).sum(1).mean()
            chain_terms.append(QuantizerOutput(code, stats.indices, x.new_zeros(()), terms))
            xi = x if rows[i] is None else x[rows[i]]
            inputs.append(xi - (xi.detach() - r))  # value r_i, gradient to z the identity
            residual = residual - code if rows[i] is None else residual.index_add(0, rows[i], -code)
        sizes = [t.shape[0] for t in inputs]
        out = shared(torch.cat(inputs))
        used = sum(1 for s in sizes if s > 0)
        # the pooled mean × the levels that ran (the scale of a sum of the levels' losses), shared out by the
        # levels' vector counts
        share = torch.tensor([s / max(sum(sizes), 1) for s in sizes], dtype=x.dtype, device=x.device)
        losses = out.loss.to(x.dtype) * used * share
        indices = torch.full((n, self.num_levels), -1, dtype=torch.long, device=x.device)
        parts: List[Optional[QuantizerOutput]] = []
        codes: List[Optional[Tensor]] = []
        start = 0
        for i, size in enumerate(sizes):
            if size == 0:
                parts.append(None)
                codes.append(None)
                continue
            piece = slice(start, start + size)
            start += size
            idx = out.indices[piece]
            if rows[i] is None:
                indices[:, i] = idx
            else:
                indices[rows[i], i] = idx
            soft = None if out.soft_codes is None else out.soft_codes[piece]
            parts.append(QuantizerOutput(out.quantized[piece], idx, losses[i], {}, soft_codes=soft))
            codes.append(out.quantized[piece])
        return parts, indices, codes, losses, chain_terms, mass

    # ------------------------------------------------------------------ decode, soft codes
    def lookup(self, indices: Tensor) -> Tensor:
        """Indices (B, *S, L') for any prefix L' ≤ L of the levels -> Σ_{i<L'} codebook_i[indices[..., i]] in the
        input layout ((B, D, *S) or (B, *S, D)); index −1 adds nothing (a level left out by quantizer dropout)."""
        self._check_indices(indices, allow_prefix=True, allow_dropped=True)
        indices = indices.long()
        levels = self.levels
        codes = None
        for i in range(indices.shape[-1]):
            idx = indices[..., i]
            w = levels[i].weight
            code = w[idx.clamp_min(0)] * (idx >= 0).unsqueeze(-1).to(w.dtype)
            codes = code if codes is None else codes + code
        return self._layout(codes)

    @torch.no_grad()
    def soft_codes(self, z: Tensor) -> Tensor:
        """The sum of the levels' soft codes along the hard residual chain (soft mode: the soft chain), in z's
        layout; nothing is updated."""
        flat, last_shape = flatten(z, self.dim, self.channel_dim)
        with torch.autocast(device_type=z.device.type, enabled=False):
            r = flat.to(compute_dtype(flat))
            total = torch.zeros_like(r)
            for level in self.levels:
                if r.shape[0] == 0:
                    break
                w = level.weight.detach().to(r.dtype)
                stats = soft_statistics(r, w, level.softmax_scale(), support=level.statistics_support,
                                        keep_soft=True)
                total += stats.soft
                r = r - (stats.soft if self.mode == "soft" else w[stats.indices])
        return unflatten(total.to(z.dtype), last_shape, self.channel_dim)
