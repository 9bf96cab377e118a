"""DDCL behind the taming-transformers / diffusers ``VectorQuantizer(2)`` convention."""
from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from .common import _DDCLAdapter
from .options import DDCLOptions


class TamingQuantizerAdapter(_DDCLAdapter):
    """DDCL behind the taming-transformers / diffusers ``VectorQuantizer(2)`` convention.

    ``forward(z)`` with z (B, C, H, W), C = ``e_dim``, returns
    ``(z_q, loss, (perplexity, min_encodings, indices))``:

    z_q (B, C, H, W), the hard codes; loss, the DDCL loss; perplexity and min_encodings ``None`` as in
    ``VectorQuantizer2`` / diffusers (with ``taming_v1_outputs=True`` the batch perplexity and the
    (B·H·W, n_e) one-hot matrix of taming's original ``VectorQuantizer``); indices (B·H·W,) long in
    b-h-w order, (B·H·W, 1) with ``remap`` or ``taming_v1_outputs``, (B, H, W) with ``sane_index_shape``.
    ``embedding.weight`` IS the DDCL codebook Parameter (one tensor for optimizers and checkpoints).

    Args:
        n_e: number of codes K.
        e_dim: code width D (diffusers calls it ``vq_embed_dim``; both attributes exist).
        beta: commitment weight, passed to the DDCL quantizer.
        remap: not None turns index remapping on, as in the host; ddcl_vq reads no files, so pass the
            used-code table as ``used``, an (n_used,) integer tensor (or as ``remap`` itself).
        unknown_index: ``"random"``, ``"extra"`` or an int, as in the host.
        sane_index_shape: return indices as (B, H, W) instead of flat.
        legacy: kept for the host to read; it has no effect on the DDCL loss.
        taming_v1_outputs: the outputs of taming's original ``VectorQuantizer`` (see above).
        **ddcl_options: any other :class:`~ddcl_vq.DDCLQuantizer` keyword argument (:class:`DDCLOptions`).
    """

    _host_codebook_key = "embedding.weight"

    def __init__(self, n_e: int, e_dim: int, beta: float = 0.25, remap: Union[str, Tensor, None] = None,
                 unknown_index: Union[str, int] = "random", sane_index_shape: bool = False,
                 legacy: bool = True, *, used: Optional[Tensor] = None, taming_v1_outputs: bool = False,
                 **ddcl_options: Any):
        super().__init__()
        ddcl = DDCLOptions.from_kwargs(ddcl_options, beta=beta).build(n_e, e_dim, channel_dim=1)
        self.n_e = n_e
        self.e_dim = e_dim
        self.vq_embed_dim = e_dim
        self.legacy = legacy
        self.sane_index_shape = sane_index_shape
        self.taming_v1_outputs = taming_v1_outputs
        self.embedding = nn.Embedding(n_e, e_dim)
        self.embedding.weight = ddcl.weight
        self.remap = remap
        if remap is not None:
            if used is None and isinstance(remap, Tensor):
                used = remap
            if used is None:
                raise ValueError(f"expected the used-code table as `used` (a 1-D integer tensor) with "
                                 f"remap={remap!r}: ddcl_vq does not read files")
            if used.dim() != 1 or used.is_floating_point():
                raise ValueError(f"expected `used` as a 1-D integer tensor, got {used.dtype} {tuple(used.shape)}")
            self.register_buffer("used", used.detach().clone())
            self.re_embed = used.shape[0]
            self.unknown_index = unknown_index
            if unknown_index == "extra":
                self.unknown_index = self.re_embed
                self.re_embed += 1
            elif unknown_index != "random" and not isinstance(unknown_index, int):
                raise ValueError(f"expected unknown_index 'random', 'extra' or an int, got {unknown_index!r}")
        else:
            self.re_embed = n_e
        self._attach(ddcl)

    @property
    def beta(self) -> float:
        return self.ddcl.beta

    @beta.setter
    def beta(self, value: float) -> None:
        self.ddcl.beta = float(value)

    @classmethod
    def from_quantizer(cls, old: nn.Module, **ddcl_options: Any) -> "TamingQuantizerAdapter":
        """An adapter with a diffusers or taming ``VectorQuantizer(2)`` ``old``'s sizes, options, codebook and flags
        (``beta`` defaults to ``old.beta``)."""
        weight = old.embedding.weight
        e_dim = int(getattr(old, "e_dim", getattr(old, "vq_embed_dim", weight.shape[1])))
        remap = getattr(old, "remap", None)
        kwargs = dict(ddcl_options)
        beta = kwargs.pop("beta", getattr(old, "beta", 0.25))
        unknown_index = getattr(old, "unknown_index", "random")
        if remap is not None and int(old.re_embed) > old.used.shape[0]:
            unknown_index = "extra"  # the host stores "extra" resolved to an index one past `used`
        return cls(int(old.n_e), e_dim, remap=remap, used=getattr(old, "used", None) if remap is not None else None,
                   unknown_index=unknown_index, sane_index_shape=bool(getattr(old, "sane_index_shape", False)),
                   legacy=bool(getattr(old, "legacy", True)), taming_v1_outputs=not hasattr(old, "legacy"),
                   beta=beta, **kwargs)._adopt(old, weight)

    def remap_to_used(self, inds: Tensor) -> Tensor:
        """(B, n) code indices -> (B, n) positions in ``used`` (unknown codes -> ``unknown_index``)."""
        ishape = inds.shape
        inds = inds.reshape(ishape[0], -1)
        used = self.used.to(inds)
        match = (inds[:, :, None] == used[None, None, ...]).long()
        new = match.argmax(-1)
        unknown = match.sum(2) < 1
        if self.unknown_index == "random":
            new[unknown] = torch.randint(0, self.re_embed, size=new[unknown].shape, device=new.device)
        else:
            new[unknown] = self.unknown_index
        return new.reshape(ishape)

    def unmap_to_all(self, inds: Tensor) -> Tensor:
        """(B, n) positions in ``used`` -> (B, n) code indices (the extra token maps to ``used[0]``)."""
        ishape = inds.shape
        inds = inds.reshape(ishape[0], -1)
        used = self.used.to(inds)
        if self.re_embed > self.used.shape[0]:
            inds = inds.masked_fill(inds >= self.used.shape[0], 0)
        back = torch.gather(used[None, :].expand(inds.shape[0], -1), 1, inds)
        return back.reshape(ishape)

    def forward(self, z: Tensor, temp: Optional[float] = None, rescale_logits: bool = False, return_logits: bool = False
                ) -> Tuple[Tensor, Tensor, Tuple[Optional[Tensor], Optional[Tensor], Tensor]]:
        if not (temp is None or temp == 1.0) or rescale_logits or return_logits:
            raise ValueError("expected temp=None, rescale_logits=False, return_logits=False (Gumbel-only "
                             f"options), got temp={temp!r}, rescale_logits={rescale_logits!r}, "
                             f"return_logits={return_logits!r}")
        if not isinstance(z, Tensor) or z.dim() != 4:
            got = tuple(z.shape) if isinstance(z, Tensor) else type(z).__name__
            raise ValueError(f"expected feature maps (B, C, H, W) with C={self.e_dim}, got {got}")
        out = self._run_ddcl(z)
        batch, _, height, width = z.shape
        flat = out.indices.reshape(-1)  # b-h-w order, as the host flattens
        indices = flat
        if self.remap is not None:
            indices = self.remap_to_used(flat.reshape(batch, -1)).reshape(-1, 1)
        elif self.taming_v1_outputs:
            indices = flat.unsqueeze(1)
        if self.sane_index_shape:
            indices = indices.reshape(batch, height, width)
        perplexity = min_encodings = None
        if self.taming_v1_outputs:
            min_encodings = torch.zeros(flat.shape[0], self.n_e, device=z.device, dtype=z.dtype)
            min_encodings.scatter_(1, flat[:, None], 1)
            perplexity = out.perplexity.to(z.dtype)
        return out.quantized, out.loss, (perplexity, min_encodings, indices)

    def get_codebook_entry(self, indices: Tensor, shape: Optional[Tuple[int, ...]]) -> Tensor:
        """Indices -> codes: (B, C, H, W) with ``shape`` = (B, H, W, C), else ``indices.shape + (C,)``."""
        if self.remap is not None:
            indices = self.unmap_to_all(indices.reshape(shape[0], -1)).reshape(-1)
        if shape is None:
            return self.embedding(indices)
        return self.embedding(indices.reshape(-1)).view(shape).permute(0, 3, 1, 2).contiguous()

    def extra_repr(self) -> str:
        return (f"n_e={self.n_e}, e_dim={self.e_dim}, sane_index_shape={self.sane_index_shape}, "
                f"remap={'on' if self.remap is not None else None}, taming_v1_outputs={self.taming_v1_outputs}")
