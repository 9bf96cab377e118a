"""Residual DDCL behind vector-quantize-pytorch's ``ResidualVQ`` and ``GroupedResidualVQ`` conventions and EnCodec's
``ResidualVectorQuantization``, and the refusals for residual hosts whose codes are not learned (``ResidualFSQ``,
``ResidualLFQ``) or are l2-normalised (cosine ``ResidualVQ``, DAC's ``ResidualVectorQuantize``)."""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from ..ddcl import STATE_BUFFERS, ResidualDDCL
from .common import masked_padding, masked_run
from .options import DDCLOptions

__all__ = ["ResidualVQAdapter", "GroupedResidualVQAdapter", "EncodecRVQAdapter", "REFUSED_HOSTS", "refusal_for",
           "dac_refusal"]

#: host class name -> why it cannot be swapped (a one-line ValueError from swap_quantizer)
REFUSED_HOSTS = {
    "ResidualFSQ": "its codes are a fixed scalar grid (finite scalar quantization), not learned: DDCL learns codes",
    "GroupedResidualFSQ": "its codes are a fixed scalar grid (finite scalar quantization), not learned: DDCL learns "
                          "codes",
    "ResidualLFQ": "its codes are fixed sign patterns (lookup-free quantization), not learned: DDCL learns codes",
    "GroupedResidualLFQ": "its codes are fixed sign patterns (lookup-free quantization), not learned: DDCL learns "
                          "codes",
}
_COSINE = ("its codes are l2-normalised (use_cosine_sim=True, a cosine lookup): DDCL has no cosine mode (its codes "
           "are soft means, not unit vectors)")
#: VectorQuantize options of the host's levels that add loss terms DDCL does not have: refused by name
_EXTRA_LOSSES = ("orthogonal_reg_weight", "codebook_diversity_loss_weight")


def refusal_for(module: nn.Module) -> Optional[str]:
    """The one-line reason a residual host cannot be swapped, or None."""
    name = type(module).__name__
    if name in REFUSED_HOSTS:
        return f"cannot swap {name}: {REFUSED_HOSTS[name]}"
    return dac_refusal(module)


def _level_options(host: nn.Module) -> Tuple[nn.Module, Dict[str, Any]]:
    """ResidualVQ ``host``'s first level and what the adapter takes from it; ValueError for what it cannot keep."""
    name = type(host).__name__
    levels = list(host.layers)
    first = levels[0]
    if any(getattr(level, "use_cosine_sim", False) for level in levels):
        raise ValueError(f"cannot swap {name}: {_COSINE}; l2-normalise the features before the adapter instead")
    refused = {
        "implicit_neural_codebook": bool(getattr(host, "implicit_neural_codebook", False)),
        "diveq": bool(getattr(host, "diveq", False)),
        "beam_size": getattr(host, "beam_size", None) is not None,
        "quant_grad_frac": float(getattr(host, "quant_grad_frac", 0.0)) != 0.0,
        "quantize_dropout_cutoff_index": int(getattr(host, "quantize_dropout_cutoff_index", 0)) != 0,
        "quantize_dropout_multiple_of": int(getattr(host, "quantize_dropout_multiple_of", 1)) != 1,
        "codebook_size per level": not bool(getattr(host, "uniform_codebook_size", True)),
    }
    for option in _EXTRA_LOSSES:
        refused[option] = any(float(getattr(level, option, 0.0) or 0.0) > 0 for level in levels)
    used = sorted(k for k, v in refused.items() if v)
    if used:
        raise ValueError(f"cannot swap {name} with {', '.join(used)}: these have no DDCL counterpart")
    return first, dict(commitment_weight=float(getattr(first, "commitment_weight", 1.0)))


def _save_host_keys(module: "ResidualVQAdapter", state_dict: Dict[str, Any], prefix: str,
                    local_metadata: Dict[str, Any]) -> None:
    """The host's keys: ``layers.{i}._codebook.{embed, embed_avg, cluster_size, initted}`` (embed (1, K, d): the
    level's codebook; embed_avg and cluster_size: its M-step's soft sums and masses, the EMA statistics the host
    keeps under those names), not the DDCL buffers."""
    for key in [k for k in state_dict if k.startswith(prefix + "ddcl.")]:
        del state_dict[key]
    for i, level in enumerate(module.ddcl.levels):
        base = f"{prefix}layers.{i}._codebook."
        state_dict[base + "initted"] = level.initialized.detach().clone().reshape(1)
        state_dict[base + "cluster_size"] = level.cluster_mass.detach().clone()[None]
        state_dict[base + "embed_avg"] = level.cluster_sums.detach().clone()[None]
        state_dict[base + "embed"] = level.weight.detach().clone()[None]


def _load_host_keys(module: "ResidualVQAdapter", state_dict: Dict[str, Any], prefix: str, local_metadata, strict,
                    missing_keys: List[str], unexpected_keys: List[str], error_msgs: List[str]) -> None:
    """A host (or adapter) state_dict: each level's ``embed`` becomes its codebook (initialised, past the warm-up:
    the M-step statistics restart from it at the next training batch); the host's EMA statistics are dropped."""
    for i, level in enumerate(module.ddcl.levels):
        base = f"{prefix}layers.{i}._codebook."
        if base + "embed" in state_dict:
            embed = state_dict.pop(base + "embed")
            state_dict[f"{prefix}ddcl.quantizers.{0 if module.ddcl.shared_codebook else i}.weight"] = \
                embed.reshape(level.weight.shape)
            level.initialized.fill_(True)
            module.ddcl.warmup_batches.fill_(module.ddcl.warmup_steps)
        for name in ("initted", "cluster_size", "embed_avg"):
            state_dict.pop(base + name, None)



def _unsaved_ddcl_state(ddcl: ResidualDDCL) -> None:
    """Every level's DDCL buffers and the warm-up counter kept out of the state_dict: it keeps the host's keys."""
    for level in ddcl.quantizers:
        for name in ("initialized",) + tuple(STATE_BUFFERS):
            level.register_buffer(name, getattr(level, name), persistent=False)
    ddcl.register_buffer("warmup_batches", ddcl.warmup_batches, persistent=False)

class ResidualVQAdapter(nn.Module):
    """:class:`~ddcl_vq.ResidualDDCL` behind vector-quantize-pytorch's ``ResidualVQ`` convention.

    ``forward(x, mask=None, ..., return_all_codes=False)`` returns ``(quantized, indices, losses)`` (and
    ``all_codes`` with ``return_all_codes``) as the host: x (B, N, dim) (or (..., dim)) -> indices (B, N, Q),
    losses (Q,) the levels' DDCL losses (also in eval); with ``accept_image_fmap`` x (B, dim, H, W) -> indices
    (B, H, W, Q); all_codes (Q, B, ..., codebook_dim). ``mask`` (B, N) keeps padding out of the codebooks and the
    losses (index −1, quantized zeros or, ``return_zeros_for_masked_padding=False``, the input).
    ``get_codes_from_indices`` / ``get_output_from_indices`` decode (..., q) indices, q ≤ Q (the coarse prefix; −1:
    no code); ``codebooks`` is (Q, K, codebook_dim). ``quantize_dropout`` is per sample (the host draws one cut for the
    batch). ``state_dict`` keys are the host's (``layers.{i}._codebook.embed`` ..., ``project_in``/``project_out``):
    a host checkpoint loads into the adapter and back (strict). ``.ddcl`` is the ResidualDDCL, ``.last_output`` its
    last output, detached. ``**ddcl_options``: :class:`~ddcl_vq.adapters.DDCLOptions`.
    """

    def __init__(self, *, dim: int, num_quantizers: int, codebook_size: int, codebook_dim: Optional[int] = None,
                 shared_codebook: bool = False, quantize_dropout: bool = False, accept_image_fmap: bool = False,
                 commitment_weight: float = 1.0, return_zeros_for_masked_padding: bool = True, **ddcl_options: Any):
        super().__init__()
        if ddcl_options.pop("use_cosine_sim", False):
            raise ValueError(f"cannot build a ResidualVQ adapter: {_COSINE}")
        options = DDCLOptions.from_kwargs(ddcl_options, beta=commitment_weight, beta_name="commitment_weight")
        codebook_dim = dim if codebook_dim is None else codebook_dim
        self.dim, self.codebook_dim, self.num_quantizers = dim, codebook_dim, num_quantizers
        self.codebook_size = codebook_size
        self.codebook_sizes = (codebook_size,) * num_quantizers
        self.uniform_codebook_size = True
        self.shared_codebook, self.accept_image_fmap = bool(shared_codebook), bool(accept_image_fmap)
        self.quantize_dropout = bool(quantize_dropout) and num_quantizers > 1
        self.return_zeros_for_masked_padding = return_zeros_for_masked_padding
        self.has_projections = codebook_dim != dim
        self.project_in = nn.Linear(dim, codebook_dim) if self.has_projections else nn.Identity()
        self.project_out = nn.Linear(codebook_dim, dim) if self.has_projections else nn.Identity()
        self.ddcl = ResidualDDCL(codebook_size, codebook_dim, num_quantizers, shared_codebook=shared_codebook,
                                 quantize_dropout=self.quantize_dropout, channel_dim=-1, **options.as_kwargs())
        _unsaved_ddcl_state(self.ddcl)
        self.last_output = None
        self.register_state_dict_post_hook(_save_host_keys)
        self.register_load_state_dict_pre_hook(_load_host_keys)

    @classmethod
    def from_quantizer(cls, old: nn.Module, **ddcl_options: Any) -> "ResidualVQAdapter":
        """An adapter with ResidualVQ ``old``'s sizes, flags, projections and codebooks (``beta`` defaults to its
        levels' ``commitment_weight``); ValueError naming what it cannot keep (cosine codes, beam search, ...)."""
        first, taken = _level_options(old)
        options = dict(ddcl_options)
        if not bool(getattr(first._codebook, "initted", True)):
            options.setdefault("codebook_init", "kmeans")
        beta = options.pop("beta", taken["commitment_weight"])
        new = cls(dim=int(first.dim) if not old.has_projections else int(old.project_in.in_features),
                  num_quantizers=int(old.num_quantizers), codebook_size=int(old.codebook_size),
                  codebook_dim=int(old.codebook_dim), shared_codebook=bool(old.shared_codebook),
                  quantize_dropout=bool(old.quantize_dropout), accept_image_fmap=bool(old.accept_image_fmap),
                  commitment_weight=beta,
                  return_zeros_for_masked_padding=bool(getattr(old, "return_zeros_for_masked_padding", True)),
                  **options)
        new.project_in = copy.deepcopy(old.project_in)
        new.project_out = copy.deepcopy(old.project_out)
        codebooks = old.codebooks  # (Q, K, d)
        new.to(device=codebooks.device)
        with torch.no_grad():
            for i, level in enumerate(new.ddcl.quantizers):
                level.weight.data = codebooks[i].detach().clone()
        return new.train(old.training)

    @property
    def codebooks(self) -> Tensor:
        """(Q, K, codebook_dim): every level's codebook (the shared one Q times)."""
        return torch.stack([level.weight for level in self.ddcl.levels])

    def forward(self, x: Tensor, mask: Optional[Tensor] = None, indices: Any = None, return_all_codes: bool = False,
                sample_codebook_temp: Optional[float] = None, freeze_codebook: bool = False,
                beam_size: Optional[int] = None, rand_quantize_dropout_fixed_seed: Optional[int] = None):
        used = [name for name, value in (("indices", indices), ("sample_codebook_temp", sample_codebook_temp),
                                         ("freeze_codebook", freeze_codebook), ("beam_size", beam_size))
                if value is not None and value is not False]
        if used:
            raise ValueError(f"expected no {used}: these ResidualVQ options have no DDCL counterpart")
        if not isinstance(x, Tensor) or x.dim() < 2:
            raise ValueError(f"expected (B, N, {self.dim}) features, got "
                             f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
        channel_first = self.accept_image_fmap
        x_last = torch.movedim(x, 1, -1) if channel_first else x
        if x_last.shape[-1] != self.dim:
            layout = f"(B, {self.dim}, H, W)" if channel_first else f"(..., {self.dim})"
            raise ValueError(f"expected {layout} features, got shape {tuple(x.shape)}")
        h = self.project_in(x_last)
        seed = rand_quantize_dropout_fixed_seed
        codes, all_indices, mask, (out, losses) = masked_run(
            h, mask, lambda z: self.ddcl.forward_parts(z, dropout_seed=seed), x.shape, (self.num_quantizers,))
        self.last_output = type(out)(out.quantized.detach(), out.indices, out.loss.detach(),
                                     {k: v.detach() for k, v in out.terms.items()}, out.perplexity.detach(),
                                     out.soft_counts.detach())
        quantized = masked_padding(self.project_out(codes), x_last, mask, self.return_zeros_for_masked_padding)
        if channel_first:
            quantized = torch.movedim(quantized, -1, 1)
        result = (quantized, all_indices, losses)
        return result + (self.get_codes_from_indices(all_indices),) if return_all_codes else result

    def get_codes_from_indices(self, indices: Tensor) -> Tensor:
        """Indices (B, ..., q), q ≤ Q (−1: no code) -> (Q, B, ..., codebook_dim), the levels past q as zeros."""
        q = indices.shape[-1]
        if not 1 <= q <= self.num_quantizers:
            raise ValueError(f"expected indices (..., q) with 1 <= q <= {self.num_quantizers}, got shape "
                             f"{tuple(indices.shape)}")
        if q < self.num_quantizers:
            pad = indices.new_full(indices.shape[:-1] + (self.num_quantizers - q,), -1)
            indices = torch.cat([indices, pad], -1)
        codes = []
        for i, level in enumerate(self.ddcl.levels):
            idx = indices[..., i].long()
            codes.append(level.weight[idx.clamp_min(0)] * (idx >= 0).unsqueeze(-1).to(level.weight.dtype))
        return torch.stack(codes)

    def get_output_from_indices(self, indices: Tensor) -> Tensor:
        """Indices (B, ..., q) -> project_out(Σ of the levels' codes), (B, ..., dim) (channel-last, as the host)."""
        return self.project_out(self.get_codes_from_indices(indices).sum(0))

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, num_quantizers={self.num_quantizers}, codebook_size={self.codebook_size}, "
                f"codebook_dim={self.codebook_dim}, shared_codebook={self.shared_codebook}, "
                f"quantize_dropout={self.quantize_dropout}, accept_image_fmap={self.accept_image_fmap}")


class GroupedResidualVQAdapter(nn.Module):
    """G :class:`ResidualVQAdapter` over G channel groups, behind vector-quantize-pytorch's ``GroupedResidualVQ``
    convention: ``forward(x, ...)`` returns ``(quantized, indices (G, B, N, Q), losses (G, Q))`` (and all_codes
    (G, Q, B, N, d)); ``get_codes_from_indices`` / ``get_output_from_indices`` take (G, B, ..., q) indices; keys
    ``rvqs.{g}.layers.{i}._codebook.embed`` ... as the host. The groups share one quantizer-dropout draw per batch."""

    def __init__(self, *, dim: int, groups: int = 1, accept_image_fmap: bool = False, **kwargs: Any):
        super().__init__()
        if dim % groups:
            raise ValueError(f"expected dim divisible by groups, got dim={dim} and groups={groups}")
        self.dim, self.groups, self.accept_image_fmap = dim, groups, accept_image_fmap
        self.rvqs = nn.ModuleList([ResidualVQAdapter(dim=dim // groups, accept_image_fmap=accept_image_fmap, **kwargs)
                                   for _ in range(groups)])

    @classmethod
    def from_quantizer(cls, old: nn.Module, **ddcl_options: Any) -> "GroupedResidualVQAdapter":
        """An adapter with GroupedResidualVQ ``old``'s groups, each from its ResidualVQ."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.dim, new.groups, new.accept_image_fmap = int(old.dim), int(old.groups), bool(old.accept_image_fmap)
        new.rvqs = nn.ModuleList([ResidualVQAdapter.from_quantizer(rvq, **ddcl_options) for rvq in old.rvqs])
        return new.train(old.training)

    @property
    def split_dim(self) -> int:
        return 1 if self.accept_image_fmap else -1

    @property
    def codebooks(self) -> Tensor:
        return torch.stack([rvq.codebooks for rvq in self.rvqs])

    @property
    def last_output(self):
        """Each group's last output (a list)."""
        return [rvq.last_output for rvq in self.rvqs]

    def forward(self, x: Tensor, indices: Any = None, return_all_codes: bool = False,
                sample_codebook_temp: Optional[float] = None, freeze_codebook: bool = False,
                mask: Optional[Tensor] = None):
        if not isinstance(x, Tensor) or x.dim() < 2 or x.shape[self.split_dim] != self.dim:
            raise ValueError(f"expected features with dim={self.dim} at dim {self.split_dim}, got "
                             f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
        seed = int(torch.randint(0, 10_000, ())) if self.training else None
        outs = [rvq(chunk, mask=mask, indices=indices, return_all_codes=return_all_codes,
                    sample_codebook_temp=sample_codebook_temp, freeze_codebook=freeze_codebook,
                    rand_quantize_dropout_fixed_seed=seed)
                for rvq, chunk in zip(self.rvqs, x.chunk(self.groups, dim=self.split_dim))]
        quantized, all_indices, losses, *codes = zip(*outs)
        result = (torch.cat(quantized, dim=self.split_dim), torch.stack(all_indices), torch.stack(losses))
        return result + (torch.stack(codes[0]),) if codes else result

    def get_codes_from_indices(self, indices: Tensor) -> Tensor:
        return torch.stack([rvq.get_codes_from_indices(i) for rvq, i in zip(self.rvqs, indices)])

    def get_output_from_indices(self, indices: Tensor) -> Tensor:
        return torch.cat([rvq.get_output_from_indices(i) for rvq, i in zip(self.rvqs, indices)], dim=self.split_dim)


# ---------------------------------------------------------------- EnCodec's ResidualVectorQuantization

def _save_encodec_keys(module: "EncodecRVQAdapter", state_dict: Dict[str, Any], prefix: str,
                       local_metadata: Dict[str, Any]) -> None:
    """EnCodec's keys: ``layers.{i}._codebook.{inited (1,), cluster_size (K,), embed (K, D), embed_avg (K, D)}``."""
    for key in [k for k in state_dict if k.startswith(prefix + "ddcl.")]:
        del state_dict[key]
    for i, level in enumerate(module.ddcl.levels):
        base = f"{prefix}layers.{i}._codebook."
        state_dict[base + "inited"] = level.initialized.detach().to(torch.float32).reshape(1)
        state_dict[base + "cluster_size"] = level.cluster_mass.detach().clone()
        state_dict[base + "embed"] = level.weight.detach().clone()
        state_dict[base + "embed_avg"] = level.cluster_sums.detach().clone()


def _load_encodec_keys(module: "EncodecRVQAdapter", state_dict: Dict[str, Any], prefix: str, *args: Any) -> None:
    for i, level in enumerate(module.ddcl.levels):
        base = f"{prefix}layers.{i}._codebook."
        if base + "embed" in state_dict:
            state_dict[f"{prefix}ddcl.quantizers.{i}.weight"] = state_dict.pop(base + "embed")
            if bool(state_dict.get(base + "inited", torch.ones(1)).reshape(-1)[0]):
                level.initialized.fill_(True)
            module.ddcl.warmup_batches.fill_(module.ddcl.warmup_steps)
        for name in ("inited", "cluster_size", "embed_avg"):
            state_dict.pop(base + name, None)


class EncodecRVQAdapter(nn.Module):
    """:class:`~ddcl_vq.ResidualDDCL` behind EnCodec's ``ResidualVectorQuantization`` convention (encodec/
    quantization/core_vq.py; the ``vq`` inside its ``ResidualVectorQuantizer``, which keeps working around it).

    ``forward(x, n_q=None)`` with x (B, D, T) returns ``(quantized (B, D, T), indices (n_q, B, T), losses (n_q, 1))``,
    the first ``n_q`` levels only (default all); ``encode(x, n_q=None)`` -> (n_q, B, T); ``decode(indices)`` takes
    (n_q', B, T), any n_q' ≤ the levels. The losses are the levels' DDCL losses (EnCodec's are commitment only, and
    zero in eval). ``state_dict`` keys are EnCodec's (``layers.{i}._codebook.embed`` (K, D) ...). EnCodec's k-means
    start, EMA decay and dead-code expiry become DDCL's k-means start, M-step and revival.
    """

    def __init__(self, *, num_quantizers: int, dim: int, codebook_size: int, commitment_weight: float = 1.0,
                 **ddcl_options: Any):
        super().__init__()
        options = DDCLOptions.from_kwargs(ddcl_options, beta=commitment_weight, beta_name="commitment_weight")
        self.num_quantizers, self.dim, self.codebook_size = num_quantizers, dim, codebook_size
        self.ddcl = ResidualDDCL(codebook_size, dim, num_quantizers, channel_dim=1, **options.as_kwargs())
        _unsaved_ddcl_state(self.ddcl)
        self.last_output = None
        self.register_state_dict_post_hook(_save_encodec_keys)
        self.register_load_state_dict_pre_hook(_load_encodec_keys)

    @classmethod
    def from_quantizer(cls, old: nn.Module, **ddcl_options: Any) -> "EncodecRVQAdapter":
        """An adapter with EnCodec ``ResidualVectorQuantization`` ``old``'s levels, sizes and codebooks."""
        layers = list(old.layers)
        if any(not isinstance(layer.project_in, nn.Identity) for layer in layers):
            raise ValueError("cannot swap ResidualVectorQuantization with codebook_dim != dim: its per-level "
                             "projections have no ResidualDDCL counterpart")
        embed = layers[0]._codebook.embed
        options = dict(ddcl_options)
        if not bool(layers[0]._codebook.inited.reshape(-1)[0]):
            options.setdefault("codebook_init", "kmeans")
        beta = options.pop("beta", float(getattr(layers[0], "commitment_weight", 1.0)))
        new = cls(num_quantizers=len(layers), dim=int(embed.shape[1]), codebook_size=int(embed.shape[0]),
                  commitment_weight=beta, **options).to(embed.device)
        with torch.no_grad():
            for level, layer in zip(new.ddcl.quantizers, layers):
                level.weight.data = layer._codebook.embed.detach().clone().float()
        return new.train(old.training)

    def _check(self, x: Tensor) -> None:
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[1] != self.dim:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"expected (B, {self.dim}, T) features, got {got}")

    def forward(self, x: Tensor, n_q: Optional[int] = None) -> Tuple[Tensor, Tensor, Tensor]:
        self._check(x)
        n_q = n_q or self.num_quantizers
        out, losses = self.ddcl.forward_parts(x, num_levels=n_q)
        self.last_output = type(out)(out.quantized.detach(), out.indices, out.loss.detach(),
                                     {k: v.detach() for k, v in out.terms.items()}, out.perplexity.detach(),
                                     out.soft_counts.detach())
        indices = out.indices[..., :n_q].movedim(-1, 0)  # (n_q, B, T)
        return out.quantized, indices, losses[:n_q, None]

    @torch.no_grad()
    def encode(self, x: Tensor, n_q: Optional[int] = None) -> Tensor:
        """(B, D, T) -> (n_q, B, T) indices (no update: as an eval forward)."""
        was = self.training
        self.eval()
        try:
            return self.forward(x, n_q)[1]
        finally:
            self.train(was)

    def decode(self, q_indices: Tensor) -> Tensor:
        """(n_q', B, T) indices -> (B, D, T), the sum of the first n_q' levels' codes."""
        return self.ddcl.lookup(q_indices.movedim(0, -1))


# ---------------------------------------------------------------- DAC: refused (l2-normalised codes)

def dac_refusal(module: nn.Module) -> Optional[str]:
    """DAC's ``ResidualVectorQuantize`` / ``VectorQuantize`` (weight-normed in/out projections, an ``nn.Embedding``
    codebook looked up after l2-normalising codes and inputs): the one-line reason it is refused, or None."""
    name = type(module).__name__
    levels = list(getattr(module, "quantizers", [])) if name == "ResidualVectorQuantize" else \
        [module] if name == "VectorQuantize" else []
    if levels and all(isinstance(getattr(q, "codebook", None), nn.Embedding) and hasattr(q, "in_proj")
                      and hasattr(q, "out_proj") for q in levels):
        return (f"cannot swap {name} (DAC): its codes are l2-normalised (a cosine lookup of factorised codes): DDCL "
                "has no cosine mode (its codes are soft means, not unit vectors)")
    return None
