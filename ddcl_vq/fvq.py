"""FVQ, "FullVQ" (Chang et al. 2025, "Scalable Training for Vector-Quantized Networks with 100% Codebook
Utilization", arXiv 2509.10140): a learned codebook seen only through VQBridge, plus learning(-rate) annealing.

Written after the authors' code (github.com/yfChang-cv/FVQ, ``qbridge_ViT.py`` and ``vq_model_qbridge_release.py``)::

    E        (K, D) parameter, U(−1/K, 1/K)             the raw codebook
    C = VQBridge(E)                                     the codes (K, D): E laid out as a D-channel h×w
             compress: p×p patches of codes -> one token (Conv2d D->H, kernel = stride = p)
             process:  depth × pre-LN ViT block (LayerNorm without affine, eps 1e-6; multi-head attention
                       with qkv bias; MLP H -> 2H -> H, tanh-GELU), no position embedding
             recover:  LayerNorm (no affine) -> Linear H -> p·p·D, zero-initialised, un-patchified
    k*_i     = argmin_k ‖z_i − C_k‖²
    z_q      = z + sg(C_{k*} − z)                      (identity straight-through)
    loss     = mean(C_{k*} − sg z)² + β·mean(sg C_{k*} − z)²,   β = 0.25

Every code depends on every bridge weight, so each step moves the whole codebook. ``codebook`` is C. The
learning annealing is the training config's ``train.lr_schedule: anneal``.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Tuple

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn
from torch.func import functional_call

from .base import QuantizerOutput, Quantizer, check_finite, check_positive_int, compute_dtype, squared_distances

__all__ = ["FVQQuantizer", "VQBridge", "bridge_grid"]

LN_EPS = 1e-6


def bridge_grid(num_codes: int, patch_size: int) -> Tuple[int, int]:
    """(h, w) with h·w = K, both multiples of ``patch_size``, h ≤ w and h largest; ValueError if there is none."""
    best = None
    for h in range(patch_size, math.isqrt(num_codes) + 1, patch_size):
        if num_codes % h == 0 and (num_codes // h) % patch_size == 0:
            best = (h, num_codes // h)
    if best is None:
        raise ValueError(f"expected num_codes = h·w with h and w multiples of patch_size={patch_size} "
                         f"(e.g. a square of a multiple of {patch_size}), got num_codes={num_codes}")
    return best


class _Attention(nn.Module):
    """timm's ``Attention(dim, num_heads, qkv_bias=True)``: (B, T, H) -> (B, T, H)."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = rearrange(self.qkv(x), "b t (three h e) -> three b h t e", three=3, h=self.num_heads)
        return self.proj(rearrange(F.scaled_dot_product_attention(q, k, v), "b h t e -> b t (h e)"))


class _Mlp(nn.Module):
    """timm's ``Mlp`` with tanh-GELU: (B, T, H) -> (B, T, H)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class _Block(nn.Module):
    """The authors' ``ViTBlock``: pre-LN (no affine) attention and MLP, each with a residual."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=LN_EPS)
        self.attn = _Attention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=LN_EPS)
        self.mlp = _Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class _FinalLayer(nn.Module):
    def __init__(self, dim: int, out: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(dim, elementwise_affine=False, eps=LN_EPS)
        self.linear = nn.Linear(dim, out)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(self.norm_final(x))


class VQBridge(nn.Module):
    """The authors' ``VQBridge`` (qbridge_ViT.py) on a (K, D) codebook -> (K, D) codes.

    Code k sits at (k // w, k % w) of an h×w grid (:func:`bridge_grid`); each p×p patch of codes is one token,
    ``depth`` ViT blocks mix the tokens, a zero-initialised linear maps each back to its p·p codes. Sub-module names
    and initialisation are the authors' (their ``quantize.qbridge.*`` weights load).
    """

    def __init__(self, num_codes: int, dim: int, *, patch_size: int = 4, hidden: int = 256, depth: int = 2,
                 num_heads: int = 4, mlp_ratio: float = 2.0):
        super().__init__()
        self.dim, self.patch_size = dim, patch_size
        self.grid = bridge_grid(num_codes, patch_size)
        self.x_embedder = nn.Module()
        self.x_embedder.proj = nn.Conv2d(dim, hidden, kernel_size=patch_size, stride=patch_size)
        self.blocks = nn.ModuleList([_Block(hidden, num_heads, mlp_ratio) for _ in range(depth)])
        self.final_layer = _FinalLayer(hidden, patch_size * patch_size * dim)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        proj = self.x_embedder.proj
        nn.init.xavier_uniform_(proj.weight.view(proj.weight.shape[0], -1))
        nn.init.zeros_(proj.bias)
        nn.init.zeros_(self.final_layer.linear.weight)
        nn.init.zeros_(self.final_layer.linear.bias)

    def forward(self, codebook: Tensor) -> Tensor:
        """(K, D) -> (K, D)."""
        h, w = self.grid
        p = self.patch_size
        image = rearrange(codebook, "(h w) d -> 1 d h w", h=h, w=w)
        x = rearrange(self.x_embedder.proj(image), "1 c gh gw -> 1 (gh gw) c")
        for block in self.blocks:
            x = block(x)
        x = self.final_layer(x)   # (1, T, p·p·D)
        return rearrange(x, "1 (gh gw) (p q d) -> (gh p gw q) d", gh=h // p, p=p, q=p)


class FVQQuantizer(Quantizer):
    """FVQ: nearest-code VQ against VQBridge(E), with the authors' loss and straight-through.

    Args:
        num_codes: K; must be h·w with both sides multiples of ``patch_size`` (:func:`bridge_grid`).
        dim: D.
        beta: weight of the commitment term mean(sg C_{k*} − z)² (the codebook term has weight 1), 0.25.
        patch_size, bridge_dim, bridge_depth, bridge_heads: the bridge's p, width H, ViT blocks and heads
            (the defaults: the authors' "QBridge-L/4").

    ``loss`` = (codebook + β·commitment) / D (``terms``: ‖C_{k*} − sg z‖² and ‖sg C_{k*} − z‖²);
    ``quantized`` has exactly the value C_{k*} and the identity gradient into z.
    """

    term_names = ("codebook", "commitment")

    def __init__(self, num_codes: int, dim: int, *, channel_dim: int = 1, beta: float = 0.25, patch_size: int = 4,
                 bridge_dim: int = 256, bridge_depth: int = 2, bridge_heads: int = 4):
        super().__init__(num_codes, dim, channel_dim)
        self.beta = check_finite("beta", beta)
        for name, value in (("patch_size", patch_size), ("bridge_dim", bridge_dim), ("bridge_depth", bridge_depth),
                            ("bridge_heads", bridge_heads)):
            check_positive_int(name, value)
        if bridge_dim % bridge_heads:
            raise ValueError(f"expected bridge_dim divisible by bridge_heads={bridge_heads}, got {bridge_dim}")
        self.patch_size, self.bridge_dim, self.bridge_depth, self.bridge_heads = (
            patch_size, bridge_dim, bridge_depth, bridge_heads)
        self.bridge = VQBridge(num_codes, dim, patch_size=patch_size, hidden=bridge_dim, depth=bridge_depth,
                               num_heads=bridge_heads)
        self.weight = nn.Parameter(torch.empty(num_codes, dim).uniform_(-1.0 / num_codes, 1.0 / num_codes))

    def codes(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """(K, D): VQBridge(E) computed in ``dtype`` whatever the parameters' dtype, autocast off (on the graph)."""
        with torch.autocast(device_type=self.weight.device.type, enabled=False):
            params = {name: p.to(dtype) for name, p in self.bridge.named_parameters()}
            return functional_call(self.bridge, params, (self.weight.to(dtype),))

    @property
    def codebook(self) -> Tensor:
        """(K, D): the codes the decoder sees, VQBridge(E)."""
        return self.codes(compute_dtype(self.weight))

    def quantize(self, x: Tensor) -> QuantizerOutput:
        codes = self.codes(x.dtype)
        with torch.no_grad():
            centre = codes.mean(0, keepdim=True)
            indices = squared_distances(x - centre, codes - centre).argmin(1)
        hard = codes[indices]
        codebook_term = (hard - x.detach()).pow(2).sum(1).mean()
        commitment = (hard.detach() - x).pow(2).sum(1).mean()
        quantized = hard.detach() + (x - x.detach())   # value C_{k*} exactly, gradient the identity
        return QuantizerOutput(quantized, indices, (codebook_term + self.beta * commitment) / self.dim,
                               {"codebook": codebook_term.detach(), "commitment": commitment.detach()})

    def describe(self) -> Dict[str, Any]:
        return {"patch_size": self.patch_size, "bridge_dim": self.bridge_dim, "bridge_depth": self.bridge_depth,
                "bridge_heads": self.bridge_heads}

    def extra_repr(self) -> str:
        return super().extra_repr() + (
            f", beta={self.beta:g}, grid={self.bridge.grid}, bridge_dim={self.bridge_dim}, "
            f"bridge_depth={self.bridge_depth}, bridge_heads={self.bridge_heads}")
