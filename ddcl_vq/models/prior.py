"""A small autoregressive transformer over a VQ-VAE's code indices (nanoGPT-style, plain torch).

The (h, w) code map is read in raster order as L = h·w codes in [0, K). Input position 0 is the start (class) token,
position p ≥ 1 the embedding of code p − 1; output position p gives the logits of code p. Sampling with
``use_cache=True`` keeps every layer's keys and values (a KV cache); both paths give the same codes.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float = 0.0):
        super().__init__()
        if dim % heads:
            raise ValueError(f"expected dim divisible by heads, got dim={dim}, heads={heads}")
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.heads, self.dropout = heads, dropout
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: Tensor, cache: Optional[Dict[str, Tensor]] = None) -> Tensor:
        """x (B, T, C); ``cache``: this layer's keys/values of earlier positions (updated in place), or None."""
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (u.view(b, t, self.heads, c // self.heads).transpose(1, 2) for u in (q, k, v))
        past = 0
        if cache is not None:
            if "k" in cache:
                past = cache["k"].shape[2]
                k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
            cache["k"], cache["v"] = k, v
        mask = None  # several new positions after cached ones: causal with an offset (one new one sees them all)
        if past and t > 1:
            mask = torch.ones(t, past + t, dtype=torch.bool, device=x.device).tril(diagonal=past)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=past == 0 and t > 1)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float = 0.0, mlp_ratio: int = 4):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, dropout)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(), nn.Linear(mlp_ratio * dim, dim),
                                 nn.Dropout(dropout))

    def forward(self, x: Tensor, cache: Optional[Dict[str, Tensor]] = None) -> Tensor:
        x = x + self.attn(self.ln1(x), cache)
        return x + self.mlp(self.ln2(x))


class CodePrior(nn.Module):
    """p(codes | class) = Π_t p(code_t | class, code_<t) over the raster-ordered (h, w) code map.

    ``num_classes`` = 0: unconditional (labels are ignored and may be None)."""

    def __init__(self, num_codes: int, height: int, width: int, num_classes: int = 0, dim: int = 128,
                 layers: int = 4, heads: int = 4, dropout: float = 0.0, mlp_ratio: int = 4):
        super().__init__()
        self.config = dict(num_codes=num_codes, height=height, width=width, num_classes=num_classes, dim=dim,
                           layers=layers, heads=heads, dropout=dropout, mlp_ratio=mlp_ratio)
        for name in ("num_codes", "height", "width", "dim", "layers", "heads"):
            if self.config[name] <= 0:
                raise ValueError(f"expected {name} > 0, got {self.config[name]}")
        if num_classes < 0:
            raise ValueError(f"expected num_classes >= 0, got {num_classes}")
        self.num_codes, self.height, self.width, self.num_classes = num_codes, height, width, num_classes
        self.length = height * width
        self.code_emb = nn.Embedding(num_codes, dim)
        self.start_emb = nn.Embedding(max(num_classes, 1), dim)   # the class token (or the one start token)
        self.pos_emb = nn.Embedding(self.length, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout, mlp_ratio) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_codes, bias=False)
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2: residual projections scaled by depth
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, 0.0, 0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    # ------------------------------------------------------------------ inputs
    def _labels(self, labels: Optional[Tensor], batch: int, device) -> Tensor:
        if self.num_classes == 0:
            return torch.zeros(batch, dtype=torch.long, device=device)
        if labels is None:
            raise ValueError(f"expected labels (B,) for this class-conditional prior ({self.num_classes} classes), "
                             "got None")
        labels = torch.as_tensor(labels, device=device).long().reshape(-1)
        if labels.numel() == 1 and batch > 1:
            labels = labels.expand(batch)
        if labels.shape != (batch,):
            raise ValueError(f"expected labels of shape ({batch},), got {tuple(labels.shape)}")
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= self.num_classes):
            raise ValueError(f"expected labels in [0, {self.num_classes}), got values in "
                             f"[{int(labels.min())}, {int(labels.max())}]")
        return labels

    def flatten(self, codes: Tensor) -> Tensor:
        """(B, h, w) or (B, L) integer codes -> (B, L) long, checked against K and the grid."""
        if codes.dim() == 3:
            if tuple(codes.shape[1:]) != (self.height, self.width):
                raise ValueError(f"expected code maps of shape (B, {self.height}, {self.width}), got "
                                 f"{tuple(codes.shape)}")
            codes = codes.reshape(codes.shape[0], -1)
        if codes.dim() != 2 or codes.shape[1] != self.length:
            raise ValueError(f"expected codes of shape (B, {self.length}) or (B, {self.height}, {self.width}), got "
                             f"{tuple(codes.shape)}")
        codes = codes.long()
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.num_codes):
            raise ValueError(f"expected codes in [0, {self.num_codes}), got values in "
                             f"[{int(codes.min())}, {int(codes.max())}]")
        return codes

    def _input(self, labels: Tensor, codes: Tensor, begin: int, end: int) -> Tensor:
        """Embeddings of input positions [begin, end): 0 is the start/class token, p ≥ 1 is code p − 1."""
        parts = [self.start_emb(labels)[:, None]] if begin == 0 else []
        parts.append(self.code_emb(codes[:, max(begin, 1) - 1:end - 1]))  # empty for position 0 alone
        return self.drop(torch.cat(parts, 1) + self.pos_emb.weight[begin:end])

    def _trunk(self, x: Tensor, caches: Optional[List[Dict[str, Tensor]]] = None) -> Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x, None if caches is None else caches[i])
        return self.ln_f(x)

    # ------------------------------------------------------------------ training
    def forward(self, codes: Tensor, labels: Optional[Tensor] = None) -> Tensor:
        """codes (B, h, w) or (B, L) -> logits (B, L, K); logits[:, t] predicts code t from code_<t."""
        codes = self.flatten(codes)
        labels = self._labels(labels, codes.shape[0], codes.device)
        return self.head(self._trunk(self._input(labels, codes, 0, self.length)))

    def loss(self, codes: Tensor, labels: Optional[Tensor] = None) -> Tensor:
        """Mean negative log-likelihood per code, in nats (÷ ln 2: bits per token)."""
        codes = self.flatten(codes)
        logits = self(codes, labels)
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # the log-softmax in float32 under autocast
        return F.cross_entropy(logits.reshape(-1, self.num_codes), codes.reshape(-1))

    # ------------------------------------------------------------------ sampling
    @staticmethod
    def _pick(logits: Tensor, temperature: float, top_k: int, generator: Optional[torch.Generator]) -> Tensor:
        if temperature == 0:
            return logits.argmax(-1)
        logits = logits.float() / temperature
        if top_k and top_k < logits.shape[-1]:
            kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator).squeeze(1)

    @torch.no_grad()
    def sample(self, count: int, labels: Optional[Tensor] = None, temperature: float = 1.0, top_k: int = 0,
               generator: Optional[torch.Generator] = None, use_cache: bool = True) -> Tensor:
        """Draw ``count`` code maps -> (count, h, w) long in [0, K). ``labels``: (count,) classes (or one for all);
        ``temperature`` 0 is greedy; ``top_k`` > 0 keeps the k most likely codes at each step."""
        if temperature < 0:
            raise ValueError(f"expected temperature >= 0, got {temperature}")
        if top_k < 0:
            raise ValueError(f"expected top_k >= 0, got {top_k}")
        device = self.pos_emb.weight.device
        labels = self._labels(labels, count, device)
        was_training = self.training
        self.eval()
        try:
            codes = torch.zeros(count, self.length, dtype=torch.long, device=device)
            caches: Optional[List[Dict[str, Tensor]]] = [{} for _ in self.blocks] if use_cache else None
            for t in range(self.length):  # with the cache only position t goes in, else positions 0..t
                h = self._trunk(self._input(labels, codes, t if use_cache else 0, t + 1), caches)
                codes[:, t] = self._pick(self.head(h[:, -1]), temperature, top_k, generator)
        finally:
            self.train(was_training)
        return codes.view(count, self.height, self.width)
