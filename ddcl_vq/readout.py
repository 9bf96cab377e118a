"""DDCL readout layer for transformer encoders, and a hierarchical compressor built from it.

DDCL-Attention (arXiv 2604.03850) uses the soft prototype assignment in two more places, built here
on :func:`ddcl_vq.ddcl.assignment.assign` (the quantizer's assignment and decomposition code):

1. :class:`DDCLReadout` replaces mean pooling or a class token. With K global prototypes W, every
   real token t of sequence b gets q_btk = softmax_k(−‖x_bt − w_k‖² / (τ·D)) and the soft summary
   s_bt = Σ_k q_btk w_k; pooled_b = mean_{t real} s_bt = Σ_k h_bk w_k with h_b = mean_{t real} q_bt.
   The loss is the DDCL distortion over the real tokens, L_q = L_OLS + V.
2. :class:`HierarchicalCompressor` replaces consecutive windows of ``windows[s]`` tokens by their
   readout, stage after stage, and reports each stage's compression ratio and reconstruction error.

Masking: ``mask`` (B, T) bool is True for real tokens (for a PyTorch ``key_padding_mask`` pass ``~kpm``); masked
tokens take no part in assignments, losses, statistics or pooling.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from .ddcl.assignment import assign
from .base import batch_perplexity, check_finite, check_positive_int, compute_dtype
from .kmeans import kmeans_init_
from .ddcl.temperature import check_temperature

PROTOTYPE_INITS = ("normal", "kmeans")
READOUT_MODES = ("soft", "straight_through")

# the readout's defaults, measured with `ddcl-vq readout-study`
DEFAULT_TEMPERATURE = 0.1
DEFAULT_PROTOTYPE_LR_RATIO = 10.0


@dataclass
class ReadoutOutput:
    """What :meth:`DDCLReadout.forward` returns (B sequences of T tokens, K prototypes).

    pooled (B, D): the masked mean of the soft summaries = histogram @ prototypes; soft (B, T, D): the
    soft summaries s_bt (zeros at masked tokens); assignments (B, T, K): q (rows of masked tokens 0);
    indices (B, T): hard argmin (−1 at masked tokens); mask (B, T) bool, True for real tokens;
    histogram (B, K): the mean assignment h_b; loss: ``loss_weight`` · distortion / D; distortion, ols,
    variance: scalars over the real tokens (with gradients); soft_counts (K,): Σ q over the real
    tokens; perplexity: of the real tokens' hard indices.
    """

    pooled: Tensor
    soft: Tensor
    assignments: Tensor
    indices: Tensor
    mask: Tensor
    histogram: Tensor
    loss: Tensor
    distortion: Tensor
    ols: Tensor
    variance: Tensor
    soft_counts: Tensor
    perplexity: Tensor

    @property
    def usage_indices(self) -> Tensor:
        """(N,) hard indices of the real tokens only: ``usage.update(out.usage_indices, out.soft_counts)``."""
        return self.indices[self.mask]


def validate_tokens(tokens: Tensor, mask: Optional[Tensor], dim: int) -> Tensor:
    """Check (B, T, D) ``tokens`` and an optional (B, T) bool ``mask``; return the mask (all True if None).
    ValueError saying what was expected and what came."""
    if not isinstance(tokens, Tensor):
        raise ValueError(f"expected tokens as a torch.Tensor (B, T, D), got {type(tokens).__name__}")
    if not tokens.is_floating_point():
        raise ValueError(f"expected floating-point tokens (B, T, D), got dtype {tokens.dtype}")
    if tokens.dim() != 3:
        raise ValueError(f"expected tokens of rank 3 (B, T, D) with D={dim}, got rank {tokens.dim()} "
                         f"with shape {tuple(tokens.shape)}")
    b, t, d = tokens.shape
    if d != dim:
        raise ValueError(f"expected token dimension D={dim} in (B, T, D), got shape {tuple(tokens.shape)}")
    if b == 0 or t == 0:
        raise ValueError(f"expected at least one sequence and one token, got shape {tuple(tokens.shape)}")
    if mask is None:
        mask = torch.ones(b, t, dtype=torch.bool, device=tokens.device)
    else:
        if not isinstance(mask, Tensor):
            raise ValueError(f"expected mask as a bool torch.Tensor (B, T)={b, t}, got {type(mask).__name__}")
        if mask.dtype != torch.bool:
            raise ValueError(
                f"expected a bool mask (B, T), True for real tokens, got dtype {mask.dtype} (for a 0/1 "
                f"attention_mask pass mask.bool(); for a PyTorch key_padding_mask pass ~key_padding_mask)")
        if tuple(mask.shape) != (b, t):
            raise ValueError(f"expected mask of shape (B, T)={(b, t)} to match tokens {tuple(tokens.shape)}, "
                             f"got {tuple(mask.shape)}")
        if mask.device != tokens.device:
            raise ValueError(f"expected mask on the tokens' device {tokens.device}, got {mask.device}")
        empty = (~mask.any(1)).nonzero().flatten()
        if empty.numel():
            rows = empty[:8].tolist()
            more = f" (and {empty.numel() - 8} more)" if empty.numel() > 8 else ""
            raise ValueError(f"expected at least one real token (mask True) in every sequence, got all-masked "
                             f"rows {rows}{more} of {b}")
    real = tokens[mask]
    if not torch.isfinite(real).all():
        bad = int((~torch.isfinite(real)).sum())
        raise ValueError(f"expected finite values in the real (unmasked) tokens, got {bad} NaN/Inf value(s)")
    return mask


class DDCLReadout(nn.Module):
    """DDCL prototype readout: replaces mean pooling / a class token (DDCL-Attention, use 1).

    Args:
        dim: D, the token dimension.
        num_prototypes: K, the size of the global prototype bank.
        temperature: τ relative to D (softmax over −d/(τ·D)); settable between steps.
        loss_weight: λ in ``loss = λ · distortion / D`` (per-element scale, as the quantizers).
        distortion_to_tokens: False (default): the distortion is computed on sg(tokens) (it trains the
            prototypes only); True: the paper's joint form.
        task_grad_to_prototypes: True (default): the task loss also moves the prototypes; False: the
            outputs use sg(prototypes).
        mode: ``"straight_through"`` (default): ``soft``/``pooled`` have the soft summaries' values and
            also carry the tokens' own gradient (s + x − sg(x)); ``"soft"`` (the paper's): the task
            gradient reaches the tokens only through q.
        prototype_init: ``"kmeans"`` (default: on the real tokens of the first training forward) or
            ``"normal"`` N(0, 1).

    Build the optimizer with :func:`prototype_param_groups` (prototypes at ρ × lr, ρ > 1).

    ``forward(tokens, mask=None)``: tokens (B, T, D) float, mask (B, T) bool, True = real token.
    Returns a :class:`ReadoutOutput`. float64 inputs compute in float64; everything else in
    float32 (autocast disabled inside), outputs ``soft``/``pooled`` in the tokens' dtype.
    """

    def __init__(self, dim: int, num_prototypes: int, *, temperature: float = DEFAULT_TEMPERATURE,
                 loss_weight: float = 1.0, distortion_to_tokens: bool = False,
                 task_grad_to_prototypes: bool = True, prototype_init: str = "kmeans",
                 mode: str = "straight_through"):
        super().__init__()
        if mode not in READOUT_MODES:
            raise ValueError(f"expected mode in {READOUT_MODES}, got {mode!r}")
        self.mode = mode
        self.dim = check_positive_int("dim", dim)
        self.num_prototypes = check_positive_int("num_prototypes", num_prototypes)
        if prototype_init not in PROTOTYPE_INITS:
            raise ValueError(f"expected prototype_init in {PROTOTYPE_INITS}, got {prototype_init!r}")
        self.temperature = temperature
        self.loss_weight = check_finite("loss_weight", loss_weight)
        self.distortion_to_tokens = bool(distortion_to_tokens)
        self.task_grad_to_prototypes = bool(task_grad_to_prototypes)
        self.prototype_init = prototype_init
        self.prototypes = nn.Parameter(torch.randn(num_prototypes, dim))
        self.register_buffer("initialized", torch.tensor(prototype_init != "kmeans"))

    @property
    def temperature(self) -> float:
        return self._temperature

    @temperature.setter
    def temperature(self, value: float) -> None:
        self._temperature = check_temperature(value)

    def forward(self, tokens: Tensor, mask: Optional[Tensor] = None) -> ReadoutOutput:
        mask = validate_tokens(tokens, mask, self.dim)
        b, t, _ = tokens.shape
        k = self.num_prototypes
        dtype = compute_dtype(tokens)
        with torch.autocast(device_type=tokens.device.type, enabled=False):
            x = tokens[mask].to(dtype)                                   # (N, D) real tokens only
            if self.training and not bool(self.initialized):
                kmeans_init_(self.prototypes.data, x)
                self.initialized.fill_(True)
            w = self.prototypes.to(dtype)
            scale = self.temperature * self.dim
            a = assign(x, w if self.task_grad_to_prototypes else w.detach(), scale)
            if self.distortion_to_tokens and self.task_grad_to_prototypes:
                terms = a
            else:  # the loss terms come from a second assignment with their own gradient paths
                terms = assign(x if self.distortion_to_tokens else x.detach(), w, scale)
            counts = mask.sum(1)                                         # (B,) real tokens per row
            row = torch.repeat_interleave(torch.arange(b, device=tokens.device), counts)
            denom = counts.to(dtype)[:, None]
            summaries = a.soft
            if self.mode == "straight_through":  # value: the soft summary; token gradient: identity + via q
                summaries = summaries + (x - x.detach())
            pooled = x.new_zeros(b, self.dim).index_add_(0, row, summaries) / denom
            histogram = x.new_zeros(b, k).index_add_(0, row, a.q) / denom
            soft = x.new_zeros(b, t, self.dim).index_put((mask,), summaries)
            assignments = x.new_zeros(b, t, k).index_put((mask,), a.q)
            indices = torch.full((b, t), -1, dtype=torch.long, device=tokens.device).index_put((mask,), a.indices)
            loss = self.loss_weight * terms.distortion / self.dim
        return ReadoutOutput(
            pooled=pooled.to(tokens.dtype), soft=soft.to(tokens.dtype), assignments=assignments, indices=indices,
            mask=mask, histogram=histogram, loss=loss, distortion=terms.distortion, ols=terms.ols,
            variance=terms.variance, soft_counts=a.soft_counts,
            perplexity=batch_perplexity(a.indices, k))

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_prototypes={self.num_prototypes}, temperature={self.temperature:g}, "
                f"loss_weight={self.loss_weight:g}, distortion_to_tokens={self.distortion_to_tokens}, "
                f"task_grad_to_prototypes={self.task_grad_to_prototypes}, mode={self.mode!r}, "
                f"prototype_init={self.prototype_init!r}")


@dataclass
class CompressorOutput:
    """What :meth:`HierarchicalCompressor.forward` returns (S stages).

    summaries:  (B, T_S, D) the last stage's summary tokens; ``mask`` (B, T_S) marks the real ones.
    levels, masks: per stage s, its summary tokens (B, T_{s+1}, D) and their mask.
    stages:     per stage, the :class:`ReadoutOutput` over that stage's windows (rows = windows
                holding at least one real token).
    ratios:     (S,) float64, real tokens into stage s / real summaries out of it.
    cumulative_ratios: (S,) real input tokens / real summaries after stage s.
    errors:     (S,) Σ‖x − x̂‖² / Σ‖x − μ‖² of stage s, each real input token x reconstructed by its
                window's summary (μ: the stage input's mean real token): the share of variance lost.
    cumulative_errors: (S,) the same for the original tokens, each by its ancestor summary.
    loss:       Σ over stages of the stage readout's loss (weighted), to add to a task loss.
    """

    summaries: Tensor
    mask: Tensor
    levels: List[Tensor]
    masks: List[Tensor]
    stages: List[ReadoutOutput]
    ratios: Tensor
    cumulative_ratios: Tensor
    errors: Tensor
    cumulative_errors: Tensor
    loss: Tensor


def _relative_error(x: Tensor, recon: Tensor, mask: Tensor) -> Tensor:
    real, rec = x[mask].double(), recon[mask].double()
    total = (real - real.mean(0)).pow(2).sum()
    return (real - rec).pow(2).sum() / total.clamp_min(torch.finfo(torch.float64).tiny)


class HierarchicalCompressor(nn.Module):
    """Stages of DDCL readouts over windows (DDCL-Attention, use 3: hierarchical compression).

    Stage s replaces each window of ``windows[s]`` consecutive tokens by the pooled readout of its real tokens,
    with the stage's own ``num_prototypes[s]`` prototypes: T tokens become ceil(T / w_0) summaries, and so on.

    Args:
        dim: D.
        windows: window size per stage (each ≥ 1), e.g. ``(8, 8)`` for tokens → sentences → paragraphs.
        num_prototypes: K per stage (one int for all stages, or one per stage).
        temperature, loss_weight, distortion_to_tokens, task_grad_to_prototypes, prototype_init: as
            :class:`DDCLReadout`, for every stage.

    The reconstruction errors are computed without gradient; train with ``out.loss``.
    """

    def __init__(self, dim: int, windows: Sequence[int], num_prototypes: Union[int, Sequence[int]] = 64, *,
                 temperature: float = DEFAULT_TEMPERATURE, loss_weight: float = 1.0,
                 distortion_to_tokens: bool = False, task_grad_to_prototypes: bool = True,
                 prototype_init: str = "kmeans"):
        super().__init__()
        self.dim = check_positive_int("dim", dim)
        if isinstance(windows, (str, bytes)) or not isinstance(windows, Iterable):
            raise ValueError(f"expected windows as a sequence of positive ints, got {windows!r}")
        windows = list(windows)
        if not windows:
            raise ValueError("expected at least one stage in windows, got an empty sequence")
        for w in windows:
            check_positive_int("every window size", w)
        if isinstance(num_prototypes, int) and not isinstance(num_prototypes, bool):
            ks = [num_prototypes] * len(windows)
        else:
            ks = list(num_prototypes)
            if len(ks) != len(windows):
                raise ValueError(f"expected one num_prototypes per stage ({len(windows)}), got {len(ks)}")
        self.windows = windows
        self.stages = nn.ModuleList(
            DDCLReadout(dim, k, temperature=temperature, loss_weight=loss_weight,
                        distortion_to_tokens=distortion_to_tokens, task_grad_to_prototypes=task_grad_to_prototypes,
                        prototype_init=prototype_init) for k in ks)

    def forward(self, tokens: Tensor, mask: Optional[Tensor] = None) -> CompressorOutput:
        mask = validate_tokens(tokens, mask, self.dim)
        b, t0, d = tokens.shape
        x, m = tokens, mask
        # position of every original token in the current stage's sequence (for cumulative errors)
        pos = torch.arange(t0, device=tokens.device).expand(b, t0)
        levels, masks, stages, ratios, cum_ratios, errors, cum_errors = [], [], [], [], [], [], []
        n0 = mask.sum()
        for w, readout in zip(self.windows, self.stages):
            t = x.shape[1]
            n_win = -(-t // w)
            pad = n_win * w - t
            xw = torch.nn.functional.pad(x, (0, 0, 0, pad)).reshape(b * n_win, w, d)
            mw = torch.nn.functional.pad(m, (0, pad), value=False).reshape(b * n_win, w)
            keep = mw.any(1)
            out = readout(xw[keep], mw[keep])
            summ = out.pooled.new_zeros(b * n_win, d).index_put((keep,), out.pooled).reshape(b, n_win, d)
            new_m = keep.reshape(b, n_win)
            with torch.no_grad():
                recon = summ.detach().repeat_interleave(w, dim=1)[:, :t]
                errors.append(_relative_error(x.detach(), recon, m))
                pos = torch.div(pos, w, rounding_mode="floor")
                recon0 = torch.gather(summ.detach(), 1, pos[..., None].expand(b, t0, d))
                cum_errors.append(_relative_error(tokens.detach(), recon0, mask))
                ratios.append(m.sum().double() / new_m.sum().double())
                cum_ratios.append(n0.double() / new_m.sum().double())
            levels.append(summ)
            masks.append(new_m)
            stages.append(out)
            x, m = summ, new_m
        return CompressorOutput(summaries=x, mask=m, levels=levels, masks=masks, stages=stages,
                                ratios=torch.stack(ratios), cumulative_ratios=torch.stack(cum_ratios),
                                errors=torch.stack(errors), cumulative_errors=torch.stack(cum_errors),
                                loss=sum(stage.loss for stage in stages))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, windows={self.windows}"


def prototype_param_groups(model: nn.Module, lr: float, prototype_lr_ratio: float = DEFAULT_PROTOTYPE_LR_RATIO
                           ) -> List[dict]:
    """Optimizer parameter groups with DDCL prototypes at ``prototype_lr_ratio`` × ``lr``.

    Collects the ``prototypes`` of every :class:`DDCLReadout` inside ``model``; every other parameter gets ``lr``.
    Warns when the ratio is ≤ 1. Use: ``torch.optim.Adam(prototype_param_groups(m, 1e-3))``.
    """
    check_finite("prototype_lr_ratio", prototype_lr_ratio, positive=True)
    if prototype_lr_ratio <= 1:
        warnings.warn(f"prototype_lr_ratio={prototype_lr_ratio:g} <= 1: DDCL-Attention's timescale condition "
                      "asks the prototypes to learn faster than the encoder (ratio > 1)", stacklevel=2)
    protos = {id(mod.prototypes): mod.prototypes for mod in model.modules() if isinstance(mod, DDCLReadout)}
    if not protos:
        raise ValueError("expected a model containing at least one DDCLReadout, found none")
    rest = [p for p in model.parameters() if id(p) not in protos]
    groups = [{"params": rest, "lr": lr}] if rest else []
    groups.append({"params": list(protos.values()), "lr": lr * prototype_lr_ratio})
    return groups
