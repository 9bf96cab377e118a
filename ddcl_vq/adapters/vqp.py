"""DDCL behind vector-quantize-pytorch's ``VectorQuantize`` convention (single head)."""
from __future__ import annotations

import copy
from typing import Any, Optional, Tuple

import torch
from torch import Tensor, nn

from .common import _DDCLAdapter, masked_padding, masked_run
from .options import DDCLOptions


class VQPAdapter(_DDCLAdapter):
    """DDCL behind vector-quantize-pytorch's ``VectorQuantize`` convention (single head).

    ``forward(x, mask=None, lens=None)`` returns ``(quantized, indices, loss)`` in the peer's layouts:
    x (B, N, dim) (``channel_last``, default) or (B, dim, N) -> indices (B, N); (B, dim, H, W)
    (``accept_image_fmap``) -> (B, H, W); (B, dim, T, H, W) (``accept_3d_fmap``) -> (B, T, H, W);
    (B, dim) -> (B,); quantized in x's layout. ``mask`` (B, N) bool (or ``lens`` (B,)) marks a
    sequence's valid positions: padding stays out of the codebook and the loss and comes back as
    zeros (or the input, ``return_zeros_for_masked_padding=False``) with index −1.

    ``loss`` is the DDCL loss, in training and eval. ``codebook_dim`` ≠ ``dim`` projects by
    ``project_in``/``project_out`` as the peer. ``codebook`` is the DDCL Parameter;
    ``commitment_weight`` is ``beta``; ``**ddcl_options``: :class:`~ddcl_vq.adapters.DDCLOptions`.
    ``use_cosine_sim=True`` is refused: DDCL has no cosine mode.
    """

    _COSINE = ("expected a Euclidean VectorQuantize, got use_cosine_sim=True: DDCL has no cosine mode (its codes "
               "are soft means, not unit vectors); l2-normalise the features before the adapter instead")
    _UNSUPPORTED = ("indices", "topk", "sample_codebook_temp", "freeze_codebook", "return_loss_breakdown",
                    "codebook_transform_fn", "ema_update_weight", "accum_ema_update", "ema_update")

    def __init__(self, dim: int, codebook_size: int, codebook_dim: Optional[int] = None, *,
                 channel_last: bool = True, accept_image_fmap: bool = False, accept_3d_fmap: bool = False,
                 commitment_weight: float = 1.0, return_zeros_for_masked_padding: bool = True,
                 **ddcl_options: Any):
        super().__init__()
        if ddcl_options.pop("use_cosine_sim", False):
            raise ValueError(self._COSINE)
        if accept_image_fmap and accept_3d_fmap:
            raise ValueError("expected at most one of accept_image_fmap and accept_3d_fmap, got both")
        codebook_dim = dim if codebook_dim is None else codebook_dim
        self.dim = dim
        self.codebook_size = codebook_size
        self.codebook_dim = codebook_dim
        self.heads = 1
        self.separate_codebook_per_head = False
        self.channel_last = channel_last
        self.accept_image_fmap = accept_image_fmap
        self.accept_3d_fmap = accept_3d_fmap
        self.return_zeros_for_masked_padding = return_zeros_for_masked_padding
        self.has_projections = codebook_dim != dim
        self.project_in = nn.Linear(dim, codebook_dim) if self.has_projections else nn.Identity()
        self.project_out = nn.Linear(codebook_dim, dim) if self.has_projections else nn.Identity()
        options = DDCLOptions.from_kwargs(ddcl_options, beta=commitment_weight, beta_name="commitment_weight")
        self._attach(options.build(codebook_size, codebook_dim, channel_dim=-1))

    @property
    def commitment_weight(self) -> float:
        return self.ddcl.beta

    @commitment_weight.setter
    def commitment_weight(self, value: float) -> None:
        self.ddcl.beta = float(value)

    @property
    def codebook(self) -> Tensor:
        """(codebook_size, codebook_dim), the DDCL codebook Parameter."""
        return self.ddcl.weight

    @codebook.setter
    def codebook(self, codes: Tensor) -> None:
        with torch.no_grad():
            self.ddcl.weight.copy_(codes.reshape(self.ddcl.weight.shape))

    @classmethod
    def from_quantizer(cls, old: nn.Module, **ddcl_options: Any) -> "VQPAdapter":
        """An adapter with a single-head ``VectorQuantize`` ``old``'s sizes, flags, projections and codebook (``beta``
        defaults to its ``commitment_weight``; a codebook still waiting for k-means is k-means-initialised here)."""
        if getattr(old, "heads", 1) != 1:
            raise ValueError(f"expected a single-head VectorQuantize, got heads={old.heads}")
        if getattr(old, "use_cosine_sim", False):
            raise ValueError(cls._COSINE)
        codebook = old.codebook
        options = dict(ddcl_options)
        pending_kmeans = not bool(getattr(getattr(old, "_codebook", None), "initted", True))
        if pending_kmeans:
            options.setdefault("codebook_init", "kmeans")
        beta = options.pop("beta", getattr(old, "commitment_weight", 1.0))
        new = cls(int(old.dim), int(old.codebook_size), int(codebook.shape[-1]),
                  channel_last=bool(old.channel_last), accept_image_fmap=bool(old.accept_image_fmap),
                  accept_3d_fmap=bool(getattr(old, "accept_3d_fmap", False)),
                  commitment_weight=beta,
                  return_zeros_for_masked_padding=bool(getattr(old, "return_zeros_for_masked_padding", True)),
                  **options)
        new.project_in = copy.deepcopy(old.project_in)
        new.project_out = copy.deepcopy(old.project_out)
        return new._adopt(old, codebook)

    def _channel_first(self, ndim: int) -> bool:
        return ndim > 2 and (self.accept_image_fmap or self.accept_3d_fmap or not self.channel_last)

    def _check_input(self, x: Tensor) -> None:
        if not isinstance(x, Tensor):
            raise ValueError(f"expected a torch.Tensor, got {type(x).__name__}")
        rank = 4 if self.accept_image_fmap else 5 if self.accept_3d_fmap else None
        layout = ("(B, dim, H, W)" if rank == 4 else "(B, dim, T, H, W)" if rank == 5
                  else "(B, N, dim) or (B, dim)" if self.channel_last else "(B, dim, N) or (B, dim)")
        ok_rank = x.dim() == rank if rank else x.dim() in (2, 3)
        channel = x.shape[1] if self._channel_first(x.dim()) else x.shape[-1]
        if not ok_rank or channel != self.dim:
            raise ValueError(f"expected {layout} with dim={self.dim}, got shape {tuple(x.shape)}")

    def forward(self, x: Tensor, indices: Optional[Tensor] = None, mask: Optional[Tensor] = None,
                lens: Optional[Tensor] = None, **peer_options: Any) -> Tuple[Tensor, Tensor, Tensor]:
        peer_options["indices"] = indices
        used = sorted(k for k, v in peer_options.items() if v is not None and v is not False)
        unknown = sorted(k for k in peer_options if k not in self._UNSUPPORTED)
        if unknown:
            raise TypeError(f"VQPAdapter.forward() got unexpected keyword arguments {unknown}")
        if used:
            raise ValueError(f"expected no {used}: these VectorQuantize options have no DDCL counterpart")
        self._check_input(x)
        if mask is not None and lens is not None:
            raise ValueError("expected mask or lens, got both")
        channel_first = self._channel_first(x.dim())
        x_last = torch.movedim(x, 1, -1) if channel_first else x  # (B, ..., dim)
        if lens is not None:
            mask = torch.arange(x_last.shape[1], device=x.device)[None, :] < lens.to(x.device)[:, None]
        h = self.project_in(x_last)  # (B, ..., codebook_dim)
        codes, indices, mask, (out,) = masked_run(h, mask, lambda z: (self._run_ddcl(z),), x.shape)
        quantized = masked_padding(self.project_out(codes), x_last, mask, self.return_zeros_for_masked_padding)
        if channel_first:
            quantized = torch.movedim(quantized, -1, 1)
        return quantized, indices, out.loss

    def get_codes_from_indices(self, indices: Tensor) -> Tensor:
        """Indices (B, ...) -> codebook rows, (B, ..., codebook_dim), channel-first for channel-first layouts."""
        codes = self.codebook[indices]
        return torch.movedim(codes, -1, 1) if self._channel_first(codes.dim()) else codes

    def get_output_from_indices(self, indices: Tensor) -> Tensor:
        """Indices (B, ...) -> what ``forward`` returns as ``quantized`` for them (``project_out`` applied)."""
        out = self.project_out(self.codebook[indices])
        return torch.movedim(out, -1, 1) if self._channel_first(out.dim()) else out

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, codebook_size={self.codebook_size}, codebook_dim={self.codebook_dim}, "
                f"channel_last={self.channel_last}, accept_image_fmap={self.accept_image_fmap}, "
                f"accept_3d_fmap={self.accept_3d_fmap}")
