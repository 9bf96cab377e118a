"""DDCL behind the VQ-VAE-2 ``Quantize`` convention (rosinality/vq-vae-2-pytorch, vqvae.py): channel-last input,
the codebook in a buffer ``embed`` (dim, n_embed), EMA buffers ``cluster_size`` and ``embed_avg``."""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .common import _DDCLAdapter
from .options import DDCLOptions

__all__ = ["VQVAE2QuantizeAdapter"]


def _save_vqvae2_keys(module: "VQVAE2QuantizeAdapter", state_dict: Dict[str, Any], prefix: str,
                      local_metadata: Dict[str, Any]) -> None:
    """The host's keys: ``embed`` (dim, n_embed) the codebook, ``cluster_size`` (n_embed,) and ``embed_avg``
    (dim, n_embed) the M-step's soft masses and sums (the EMA statistics the host keeps under those names)."""
    state_dict.pop(prefix + "ddcl.weight", None)
    q = module.ddcl
    state_dict[prefix + "embed"] = q.weight.detach().t().clone()
    state_dict[prefix + "cluster_size"] = q.cluster_mass.detach().clone()
    state_dict[prefix + "embed_avg"] = q.cluster_sums.detach().t().clone()


def _load_vqvae2_keys(module: "VQVAE2QuantizeAdapter", state_dict: Dict[str, Any], prefix: str, *args: Any) -> None:
    if prefix + "embed" in state_dict:
        state_dict[prefix + "ddcl.weight"] = state_dict.pop(prefix + "embed").t()
        module.ddcl.initialized.fill_(True)               # a loaded codebook: initialised, past its warm-up
        module.ddcl.warmup_batches.fill_(module.ddcl.warmup_steps)
    state_dict.pop(prefix + "cluster_size", None)
    state_dict.pop(prefix + "embed_avg", None)


class VQVAE2QuantizeAdapter(_DDCLAdapter):
    """DDCL behind VQ-VAE-2's ``Quantize(dim, n_embed, decay, eps)``.

    ``forward(input)`` with input (..., dim) returns ``(quantize, diff, embed_ind)``: quantize (..., dim) the hard codes
    (straight-through), diff the DDCL loss (with the default β = 1 the host's own commitment mean, which the host
    weights by its ``latent_loss_weight``; also in eval), embed_ind (...) long. ``embed_code(embed_id)`` decodes;
    ``embed`` reads the codebook as (dim, n_embed). ``state_dict`` keys are the host's (``embed``, ``cluster_size``,
    ``embed_avg``): a host checkpoint loads into the adapter and back, both strict. ``decay`` and ``eps`` are kept
    for the host to read; the M-step has its own ``decay`` (a DDCL option).
    """

    def __init__(self, dim: int, n_embed: int, decay: float = 0.99, eps: float = 1e-5, **ddcl_options: Any):
        super().__init__()
        options = DDCLOptions.from_kwargs({"beta": 1.0, **ddcl_options})
        self.dim, self.n_embed, self.decay, self.eps = dim, n_embed, decay, eps
        self._attach(options.build(n_embed, dim, channel_dim=-1))
        self.register_state_dict_post_hook(_save_vqvae2_keys)
        self.register_load_state_dict_pre_hook(_load_vqvae2_keys)

    @property
    def embed(self) -> Tensor:
        """(dim, n_embed): the DDCL codebook, transposed as the host stores it."""
        return self.ddcl.weight.t()

    @classmethod
    def from_quantizer(cls, old: nn.Module, **ddcl_options: Any) -> "VQVAE2QuantizeAdapter":
        """An adapter with VQ-VAE-2 ``Quantize`` ``old``'s sizes and codebook."""
        new = cls(int(old.dim), int(old.n_embed), float(getattr(old, "decay", 0.99)), float(getattr(old, "eps", 1e-5)),
                  **ddcl_options)
        return new._adopt(old, old.embed.t().contiguous())

    def forward(self, input: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        if not isinstance(input, Tensor) or input.dim() < 1 or input.shape[-1] != self.dim:
            got = tuple(input.shape) if isinstance(input, Tensor) else type(input).__name__
            raise ValueError(f"expected channel-last features (..., {self.dim}), got {got}")
        out = self._run_ddcl(input)
        return out.quantized, out.loss, out.indices

    def embed_code(self, embed_id: Tensor) -> Tensor:
        return F.embedding(embed_id, self.ddcl.weight)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, n_embed={self.n_embed}"
