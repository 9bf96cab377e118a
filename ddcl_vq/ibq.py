"""IBQ, index backpropagation quantization (Shi et al. 2024, "Taming Scalable Visual Tokenizer for
Autoregressive Image Generation", arXiv 2412.02692), behind ddcl_vq's interface.

Written after the authors' code (TencentARC/SEED-Voken, ``IndexPropagationQuantize``):

    logits_ik = z_i · w_k                    (the paper's inner product; ``logits="distance"``: −‖z_i − w_k‖²)
    p_i       = softmax_k(logits_i)
    k*_i      = argmax_k logits_ik
    one_hot_i = onehot(k*_i) − sg(p_i) + p_i  (straight-through on the categorical distribution)
    z_q_i     = Σ_k one_hot_ik w_k            (value: the hard code w_{k*}; gradient: through p into
                                              every code and into z)
    loss      = mean(z_q − z)² + mean(sg(w_{k*}) − z)² + β·mean(w_{k*} − sg(z))²
                + entropy_weight·(mean_i H(p'_i) − H(mean_i p'_i)),  p' = softmax(logits / entropy_temperature)

β sits on the codebook term, as in the authors' code; the encoder's only gradient from the task is
through the softmax (no identity straight-through). The defaults are the published ones. Every N×K
quantity is computed in row blocks, forward and backward (recomputed), so extra memory is O(rows·K).
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch import Tensor, nn

from .base import QuantizerOutput, Quantizer, check_finite

#: IBQ's allowed logits
IBQ_LOGITS = ("dot", "distance")
#: rows per block: a block's N×K work tensors hold about this many elements
BLOCK_ELEMENTS = 1 << 22
ENTROPY_EPS = 1e-5  # the authors' eps inside log(mean p)


def _logits(x: Tensor, w: Tensor, w_sq: Optional[Tensor]) -> Tensor:
    """(n, D), (K, D) -> (n, K): x·w (dot), or 2x·w − ‖w‖² (distance: −‖x − w‖² up to a per-row constant)."""
    dots = x @ w.t()
    return dots if w_sq is None else 2.0 * dots - w_sq[None, :]


def _block_rows(num_codes: int, n: int) -> int:
    return max(1, min(n, BLOCK_ELEMENTS // max(1, num_codes)))


class _IBQFunction(torch.autograd.Function):
    """(x (N, D), w (K, D)) -> (z_q (N, D): the hard codes; entropy: a scalar, 0 without it; indices (N,)),
    with IBQ's gradients; each row block's logits are recomputed in backward."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, distance: bool, entropy_temperature: float, with_entropy: bool):
        n, k = x.shape[0], w.shape[0]
        w_sq = (w * w).sum(1) if distance else None
        rows = _block_rows(k, n)
        indices = torch.empty(n, dtype=torch.long, device=x.device)
        mean_p = x.new_zeros(k)
        sample_entropy = x.new_zeros(())
        for start in range(0, n, rows):
            logits = _logits(x[start:start + rows], w, w_sq)
            indices[start:start + rows] = logits.argmax(1)
            if with_entropy:
                log_p = torch.log_softmax(logits.div_(entropy_temperature), 1)
                p = torch.exp(log_p)
                sample_entropy -= torch.vdot(p.view(-1), log_p.view(-1))
                mean_p += p.sum(0)
        z_q = w[indices]
        entropy = x.new_zeros(())
        if with_entropy:
            mean_p /= n
            entropy = sample_entropy / n + (mean_p * torch.log(mean_p + ENTROPY_EPS)).sum()
        ctx.save_for_backward(x, w, indices, mean_p)
        ctx.distance, ctx.temperature, ctx.with_entropy = distance, entropy_temperature, with_entropy
        ctx.mark_non_differentiable(indices)
        return z_q, entropy, indices

    @staticmethod
    def backward(ctx, grad_zq: Tensor, grad_entropy: Tensor, _grad_indices):
        x, w, indices, mean_p = ctx.saved_tensors
        n, k = x.shape[0], w.shape[0]
        distance, temperature = ctx.distance, ctx.temperature
        w_sq = (w * w).sum(1) if distance else None
        grad_x = torch.zeros_like(x)
        grad_w = torch.zeros_like(w)
        grad_zq = grad_zq.contiguous() if grad_zq is not None else torch.zeros_like(x)
        grad_w.index_add_(0, indices, grad_zq)  # the value's path: the chosen code, like any hard code
        g_ent = float(grad_entropy) if ctx.with_entropy and grad_entropy is not None else 0.0
        if g_ent:
            # d/d mean_p of Σ_k mean_p log(mean_p + eps) (the batch term, with its sign in the loss)
            batch_grad = torch.log(mean_p + ENTROPY_EPS) + mean_p / (mean_p + ENTROPY_EPS)
        rows = _block_rows(k, n)
        scale = 2.0 if distance else 1.0
        code_mass = x.new_zeros(k) if distance else None
        for start in range(0, n, rows):
            xb = x[start:start + rows]
            logits = _logits(xb, w, w_sq)
            p = torch.softmax(logits, 1)
            g_logits = grad_zq[start:start + rows] @ w.t()                       # d z_q / d p, through Σ_k p_k w_k
            g_logits.sub_((p * g_logits).sum(1, keepdim=True)).mul_(p)  # through the softmax's Jacobian
            if g_ent:
                # mean_i H(p'_i): dH_i/dl = −p'(log p' + H_i)/T; the batch term: p'(g − Σ p' g)/T, g = batch_grad;
                # together p'(u − Σ p' u)/T with u = g − log p'
                log_pt = torch.log_softmax(logits.div_(temperature), 1)
                pt = torch.exp(log_pt)
                u = log_pt.neg_().add_(batch_grad[None, :])
                u.sub_((pt * u).sum(1, keepdim=True)).mul_(pt)
                g_logits.add_(u, alpha=g_ent / (n * temperature))
            grad_x[start:start + rows] = g_logits @ w
            grad_w.addmm_(g_logits.t(), xb, alpha=scale)
            if distance:
                code_mass += g_logits.sum(0)
        if distance:  # logits = 2x·w − ‖w‖²: d/dx = 2w, d/dw = 2x − 2w
            grad_x.mul_(2.0)
            grad_w.sub_(2.0 * code_mass[:, None] * w)
        return grad_x, grad_w, None, None, None


class IBQQuantizer(Quantizer):
    """Index backpropagation quantization: the hard code forward, the softmax's gradient backward (module docstring).

    Args:
        beta: weight of the codebook term mean(w_{k*} − sg(z))² (the commitment term has weight 1).
        logits: ``"dot"`` (default, the paper: z·w) or ``"distance"`` (−‖z − w‖²: the nearest code).
        entropy_weight: weight of the entropy term (mean per-vector entropy minus the batch's entropy of
            softmax(logits / entropy_temperature)); 0 turns it off.
        entropy_temperature: the entropy term's temperature.

    The codebook is a parameter trained by the task's optimizer. ``loss`` = (double + commitment +
    β·codebook) / D + entropy_weight·entropy; ``terms``: those four (sums over D, means over vectors).
    """

    term_names = ("double", "commitment", "codebook", "entropy")

    def __init__(self, num_codes: int, dim: int, *, beta: float = 0.25, logits: str = "dot",
                 entropy_weight: float = 0.05, entropy_temperature: float = 0.01, channel_dim: int = 1):
        super().__init__(num_codes, dim, channel_dim)
        if logits not in IBQ_LOGITS:
            raise ValueError(f"expected logits 'dot' or 'distance', got {logits!r}")
        self.beta, self.entropy_weight = check_finite("beta", beta), check_finite("entropy_weight", entropy_weight)
        self.entropy_temperature = check_finite("entropy_temperature", entropy_temperature, positive=True)
        self.logits = logits
        self.weight = nn.Parameter(torch.randn(num_codes, dim))  # nn.Embedding's N(0, 1), as published

    @property
    def assigns_nearest_code(self) -> bool:  # type: ignore[override]
        return self.logits == "distance"

    @property
    def codebook(self) -> Tensor:
        return self.weight

    def quantize(self, x: Tensor) -> QuantizerOutput:
        w = self.weight.to(x.dtype)
        with_entropy = self.training and self.entropy_weight > 0
        z_q, entropy, indices = _IBQFunction.apply(x, w, self.logits == "distance", self.entropy_temperature,
                                                   with_entropy)
        hard = w[indices]
        double = (z_q - x).pow(2).sum(1).mean()
        commitment = (hard.detach() - x).pow(2).sum(1).mean()
        codebook_term = (hard - x.detach()).pow(2).sum(1).mean()
        loss = (double + commitment + self.beta * codebook_term) / self.dim + self.entropy_weight * entropy
        return QuantizerOutput(z_q, indices, loss, {"double": double.detach(), "commitment": commitment.detach(),
                                                    "codebook": codebook_term.detach(), "entropy": entropy.detach()})

    def describe(self) -> Dict[str, Any]:
        return {"logits": self.logits, "entropy_weight": self.entropy_weight}

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", beta={self.beta:g}, logits={self.logits!r}, "
                                       f"entropy_weight={self.entropy_weight:g}, "
                                       f"entropy_temperature={self.entropy_temperature:g}")

