"""DDCL readout layer for transformer encoders, and a hierarchical compressor built from it.

DDCL-Attention (arXiv 2604.03850) uses the quantizer's soft prototype assignment in two
more places, both implemented here on top of :func:`ddcl_vq.assignment.assign` (the
same assignment and decomposition code as :class:`~ddcl_vq.DDCLQuantizer`, no second copy):

1. :class:`DDCLReadout` replaces mean pooling or a class token at the end of an encoder.
   One global bank of K prototypes W ∈ R^{K×D}; every real token t of sequence b gets

       q_btk = softmax_k(−‖x_bt − w_k‖² / (τ·D))          (τ relative to D, as in the quantizer)
       s_bt  = Σ_k q_btk w_k                               (soft summary: a convex combination)
       pooled_b = mean_{t real} s_bt = Σ_k h_bk w_k,  h_b = mean_{t real} q_bt

   so the pooled vector is itself a convex combination of prototypes, weighted by the
   sequence's prototype histogram h_b (a bag-of-prototypes readout). Cost is O(T·K·D) per
   sequence — linear in T, no T×T term. The loss is the DDCL distortion over the batch's
   real tokens, L_q = mean Σ_k q d = L_OLS + V (exact), reported with its two parts.
   Defaults chosen by measurement (``ddcl-vq readout-study``; docs/readout.md, "Design decisions"
   and "Results"): the distortion is computed on sg(tokens) (it trains the
   prototypes; the encoder learns from the task), the outputs carry a straight-through token gradient (values stay the soft summaries),
   prototypes start from k-means on the first batch, τ = 0.1, prototype lr ratio ρ = 10.

2. :class:`HierarchicalCompressor` summarises a long sequence in stages: stage s cuts its
   input (B, T_s, D) into consecutive windows of ``windows[s]`` tokens and replaces every
   window by its DDCL readout (``pooled``) with the stage's own prototype bank, so
   T_{s+1} = ceil(T_s / windows[s]) (tokens → sentences → paragraphs → document in the
   paper's document-compression use). It reports the compression ratio and the
   reconstruction error of every stage.

Masking: ``mask`` is (B, T) bool, True for real tokens (the ``attention_mask`` convention of
transformers libraries; PyTorch's ``key_padding_mask`` is the opposite, pass ``~kpm``).
Masked tokens are removed *before* the assignment (the real tokens are gathered into one
(N, D) matrix), so they take no part in assignments, losses, statistics or pooling, their
values (even NaN) never matter, and no gradient reaches them.

Pure torch; nothing from outside ``ddcl_vq``.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from .assignment import assign
from .base import batch_perplexity, compute_dtype
from .kmeans import kmeans_init_

PROTOTYPE_INITS = ("normal", "kmeans")
READOUT_MODES = ("soft", "straight_through")

# Measured with `ddcl-vq readout-study` (docs/readout.md): the default
# temperature and prototype learning-rate ratio of the readout.
DEFAULT_TEMPERATURE = 0.1
DEFAULT_PROTOTYPE_LR_RATIO = 10.0


@dataclass
class ReadoutOutput:
    """What :meth:`DDCLReadout.forward` returns (B sequences of T tokens, K prototypes).

    pooled:       (B, D) what a classification head consumes: the masked mean of the soft
                  summaries, = histogram @ prototypes (a convex combination of prototypes).
    soft:         (B, T, D) per-token soft summaries s_bt = Σ_k q_btk w_k; zeros at masked tokens.
    assignments:  (B, T, K) q_btk; rows of real tokens sum to 1, rows of masked tokens are 0.
    indices:      (B, T) long hard argmin prototype per token; −1 at masked tokens.
    mask:         (B, T) bool, True for real tokens (all True when no mask was given).
    histogram:    (B, K) per-sequence mean assignment h_b (the pooled vector's weights).
    loss:         scalar to add to the task loss: ``loss_weight`` · distortion / D.
    distortion, ols, variance: scalars over the batch's real tokens (sum over D, mean over
                  tokens), distortion = ols + variance; they carry gradients (detach to log).
    soft_counts:  (K,) Σ q over the batch's real tokens (for :class:`CodebookUsage`).
    perplexity:   batch perplexity of the real tokens' hard indices.
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


def _check_positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"expected {name} to be a positive int, got {value!r}")
    return value


def _check_temperature(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
        raise ValueError(f"expected a finite temperature > 0, got {value!r}")
    return float(value)


def validate_tokens(tokens: Tensor, mask: Optional[Tensor], dim: int) -> Tensor:
    """Check (B, T, D) ``tokens`` and an optional (B, T) bool ``mask``; return the mask (all True if None).

    Raises ValueError saying what was expected and what came: not a float tensor, wrong rank,
    wrong D, empty batch or sequence, mask of the wrong type/dtype/shape/device, a sequence whose
    tokens are all masked, NaN/Inf in a real token.
    """
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
        distortion_to_tokens: False (default): the distortion is computed on sg(tokens) (the
            quantizer's ``straight_through`` codebook rule): it trains the prototypes, and the
            encoder learns from the task loss alone (through q). True: the paper's joint form, the
            distortion also pulls the encoder's tokens toward the prototypes. Measured on
            Fashion-MNIST (docs/readout.md): the joint form trains the classifier slower
            (its V term sharpens q, which cuts the task gradient through q) and at τ = 1 collapses
            (every token on one prototype).
        task_grad_to_prototypes: True (default): the task loss also moves the prototypes (through
            ``pooled``/``soft``). False: the outputs use sg(prototypes), so the prototypes learn from
            the DDCL distortion alone (competitive learning); measured worse.
        mode: ``"straight_through"`` (default): ``soft``/``pooled`` have the values of the soft
            summaries (convex combinations of prototypes) and carry the tokens' own gradient as well
            as the gradient through q (s + x − sg(x)), as the quantizer's straight-through mode.
            ``"soft"`` (the paper's readout): the task gradient reaches the tokens only through q,
            whose sensitivity ∝ Cov_q(w)/(τ·D) fades as assignments sharpen. Measured: the
            straight-through form classifies better (docs/readout.md).
        Unless both flags are True, the loss terms come from a second
        :func:`~ddcl_vq.assignment.assign` call with their own gradient paths (same values; the
        readout's O(N·K·D) cost doubles, still small next to an encoder layer).
        prototype_init: ``"kmeans"`` (default: k-means on the real tokens of the first forward in
            training mode) or ``"normal"`` N(0, 1). Measured: with N(0, 1) prototypes the winner
            of the first steps moves to the token cloud and takes every token (q_ik of the far
            prototypes is exponentially small, so they get no gradient): 3% utilization.

    Timescale: the paper's stability condition asks prototypes to move faster than the
    encoder; build the optimizer with :func:`prototype_param_groups` (ratio ρ, default
    ``DEFAULT_PROTOTYPE_LR_RATIO``; it warns when ρ ≤ 1).

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
        self.dim = _check_positive_int("dim", dim)
        self.num_prototypes = _check_positive_int("num_prototypes", num_prototypes)
        if prototype_init not in PROTOTYPE_INITS:
            raise ValueError(f"expected prototype_init in {PROTOTYPE_INITS}, got {prototype_init!r}")
        if isinstance(loss_weight, bool) or not isinstance(loss_weight, (int, float)) or not loss_weight >= 0 \
                or math.isinf(loss_weight):
            raise ValueError(f"expected a finite loss_weight >= 0, got {loss_weight!r}")
        self.temperature = temperature
        self.loss_weight = float(loss_weight)
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
        self._temperature = _check_temperature(value)

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
        out_dtype = tokens.dtype
        return ReadoutOutput(
            pooled=pooled.to(out_dtype), soft=soft.to(out_dtype), assignments=assignments, indices=indices,
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
    errors:     (S,) relative reconstruction error of stage s: every real input token of the stage is
                reconstructed by its window's summary; Σ‖x − x̂‖² / Σ‖x − μ‖² (μ = mean real token of
                that stage's input), i.e. the fraction of variance the summaries lose (0 = perfect,
                1 = no better than the mean token).
    cumulative_errors: (S,) the same for the original input tokens, each reconstructed by its
                ancestor summary after stage s.
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

    Stage s groups its input tokens into consecutive windows of ``windows[s]`` (the last window of
    a row may be short; windows holding only masked tokens become masked summaries) and replaces
    each window by the pooled DDCL readout of its real tokens, using the stage's own prototype bank
    of ``num_prototypes[s]`` prototypes. T tokens become ceil(T / w_0) summaries, then
    ceil(ceil(T / w_0) / w_1), ... — linear cost in T at every stage.

    Args:
        dim: D.
        windows: window size per stage (each ≥ 1), e.g. ``(8, 8)`` for tokens → sentences → paragraphs.
        num_prototypes: K per stage (one int for all stages, or one per stage).
        temperature, loss_weight, distortion_to_tokens, task_grad_to_prototypes, prototype_init: as
            :class:`DDCLReadout`, for every stage.

    Every summary is a convex combination of its stage's prototypes. The reconstruction errors
    (see :class:`CompressorOutput`) are computed without gradient; train the compressor with
    ``out.loss`` (the stages' DDCL distortions) alone or added to a task loss.
    """

    def __init__(self, dim: int, windows: Sequence[int], num_prototypes: Union[int, Sequence[int]] = 64, *,
                 temperature: float = DEFAULT_TEMPERATURE, loss_weight: float = 1.0,
                 distortion_to_tokens: bool = False, task_grad_to_prototypes: bool = True,
                 prototype_init: str = "kmeans"):
        super().__init__()
        _check_positive_int("dim", dim)
        if isinstance(windows, (str, bytes)) or not isinstance(windows, Iterable):
            raise ValueError(f"expected windows as a sequence of positive ints, got {windows!r}")
        windows = list(windows)
        if not windows:
            raise ValueError("expected at least one stage in windows, got an empty sequence")
        for w in windows:
            _check_positive_int("every window size", w)
        if isinstance(num_prototypes, int) and not isinstance(num_prototypes, bool):
            ks = [num_prototypes] * len(windows)
        else:
            ks = list(num_prototypes)
            if len(ks) != len(windows):
                raise ValueError(f"expected one num_prototypes per stage ({len(windows)}), got {len(ks)}")
        self.dim = dim
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
        loss = tokens.new_zeros((), dtype=compute_dtype(tokens))
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
            loss = loss + out.loss
            levels.append(summ)
            masks.append(new_m)
            stages.append(out)
            x, m = summ, new_m
        return CompressorOutput(summaries=x, mask=m, levels=levels, masks=masks, stages=stages,
                                ratios=torch.stack(ratios), cumulative_ratios=torch.stack(cum_ratios),
                                errors=torch.stack(errors), cumulative_errors=torch.stack(cum_errors), loss=loss)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, windows={self.windows}"


def prototype_param_groups(model: nn.Module, lr: float, prototype_lr_ratio: float = DEFAULT_PROTOTYPE_LR_RATIO
                           ) -> List[dict]:
    """Optimizer parameter groups with DDCL prototypes at ``prototype_lr_ratio`` × ``lr``.

    Collects the ``prototypes`` of every :class:`DDCLReadout` inside ``model`` (also inside a
    :class:`HierarchicalCompressor`); every other parameter gets ``lr``. Warns when the ratio is
    ≤ 1: DDCL-Attention's stability argument (Tikhonov singular perturbation) needs the
    prototypes to move faster than the encoder. Use: ``torch.optim.Adam(prototype_param_groups(m, 1e-3))``.
    """
    if isinstance(prototype_lr_ratio, bool) or not isinstance(prototype_lr_ratio, (int, float)) \
            or not prototype_lr_ratio > 0 or math.isinf(prototype_lr_ratio):
        raise ValueError(f"expected a finite prototype_lr_ratio > 0, got {prototype_lr_ratio!r}")
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
