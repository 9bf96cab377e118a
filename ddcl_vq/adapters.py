"""Drop-in adapters: the DDCL codebook behind the three common VQ-VAE quantizer conventions.

One import and one line put a :class:`~ddcl_vq.DDCLQuantizer` into an existing code base::

    from ddcl_vq import swap_quantizer
    swap_quantizer(model)            # before building the optimizer

The host keeps its training loop and its decode-from-indices path, because each adapter
speaks its family's convention exactly (argument layout, return tuple, the attribute
names the host touches):

=================================  ==========================================  ==================================
family                             forward returns                             adapter
=================================  ==========================================  ==================================
taming-transformers VQGAN,         ``(z_q, loss, (perplexity, min_encodings,   :class:`TamingQuantizerAdapter`
diffusers ``VQModel``              indices))``, NCHW in and out
vector-quantize-pytorch            ``(quantized, indices, loss)``,             :class:`VQPAdapter`
``VectorQuantize``                 (B, N, D), (B, D, N), (B, D) or feature maps
VQ-VAE notebook (Sonnet port)      ``(loss, quantized, perplexity,             :class:`NotebookQuantizerAdapter`
``VectorQuantizer``                encodings)``, NCHW in and out
=================================  ==========================================  ==================================

What changes is the quantizer, not its interface:

- ``loss`` is the DDCL quantizer's ``loss``: already weighted and on the per-element
  (``F.mse_loss``) scale of the classic VQ-VAE loss, i.e. (distortion + β·commitment) / D in
  the default ``straight_through`` mode. Add it to the reconstruction loss as before.
  It is computed in eval mode too (vector-quantize-pytorch returns 0 there).
- The codebook is a learned ``nn.Parameter`` trained by gradient (the DDCL distortion), so it
  must be in the optimizer: call :func:`swap_quantizer` before building the optimizer.
- The host's β / commitment weight becomes the DDCL commitment weight ``beta``; taming's
  ``legacy`` flag (which swapped β onto the codebook term) is kept as an attribute only.
- ``.ddcl`` is the wrapped :class:`~ddcl_vq.DDCLQuantizer` (set ``.ddcl.temperature`` from a
  schedule); ``.last_output`` is the last :class:`~ddcl_vq.QuantizerOutput`, detached, so the
  terms (``distortion``, ``ols``, ``variance``, ``commitment``) and ``soft_counts`` can be logged.
- ``state_dict`` keys are the host's own (taming/diffusers: ``embedding.weight`` [+ ``used``];
  notebook: ``_embedding.weight``): the DDCL ``initialized`` flag and temperature schedule are
  not saved, and loading a codebook marks it initialised. A checkpoint trained with the swap
  therefore loads strictly into the swapped host *and* into the plain host (which then decodes
  the same hard codes).

Nothing here imports diffusers, taming or vector_quantize_pytorch: hosts are recognised by
class name and public attributes.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from .base import QuantizerOutput
from .ddcl import DDCLQuantizer

DDCL_OPTIONS = ("temperature", "mode", "beta", "codebook_init", "implementation", "chunk_size")


def _detached(out: QuantizerOutput) -> QuantizerOutput:
    """A copy of ``out`` that holds no autograd graph (for ``last_output``)."""
    return QuantizerOutput(
        quantized=out.quantized.detach(), indices=out.indices, loss=out.loss.detach(),
        terms={k: v.detach() for k, v in out.terms.items()},
        perplexity=None if out.perplexity is None else out.perplexity.detach(),
        soft_counts=None if out.soft_counts is None else out.soft_counts.detach())


def _drop_ddcl_weight_key(module: "_DDCLAdapter", state_dict: Dict[str, Any], prefix: str,
                          local_metadata: Dict[str, Any]) -> None:
    # The codebook Parameter is registered twice (host name and ddcl.weight); save it once,
    # under the host's name, so checkpoints keep the host's keys (and safetensors accepts them).
    if module._host_codebook_key != "ddcl.weight":
        state_dict.pop(prefix + "ddcl.weight", None)
    state_dict.pop(prefix + "ddcl.schedule", None)  # the temperature schedule: the host has none


def _restore_ddcl_weight_key(module: "_DDCLAdapter", state_dict: Dict[str, Any], prefix: str,
                             local_metadata: Dict[str, Any], strict: bool, missing_keys: List[str],
                             unexpected_keys: List[str], error_msgs: List[str]) -> None:
    host_key = prefix + module._host_codebook_key
    if host_key in state_dict:
        state_dict.setdefault(prefix + "ddcl.weight", state_dict[host_key])
        module.ddcl.initialized.fill_(True)  # a loaded codebook is an initialised codebook


class _DDCLAdapter(nn.Module):
    """Shared plumbing: registers ``ddcl`` (after the host-named modules), keeps ``last_output``."""

    _host_codebook_key = "ddcl.weight"

    def _attach(self, ddcl: DDCLQuantizer) -> None:
        self.ddcl = ddcl
        # Not saved: state_dicts keep the host's keys; loading a codebook marks it initialised.
        ddcl.register_buffer("initialized", ddcl.initialized, persistent=False)
        ddcl.register_buffer("schedule_step", ddcl.schedule_step, persistent=False)
        self.last_output: Optional[QuantizerOutput] = None
        self.register_state_dict_post_hook(_drop_ddcl_weight_key)
        self.register_load_state_dict_pre_hook(_restore_ddcl_weight_key)

    def _run_ddcl(self, z: Tensor) -> QuantizerOutput:
        out = self.ddcl(z)
        self.last_output = _detached(out)
        return out

    @torch.no_grad()
    def _load_codebook(self, codebook: Tensor) -> None:
        """Make the DDCL codebook a copy of ``codebook`` (K, D): same values, device and dtype."""
        # .data keeps the Parameter object, so a host-named alias (embedding.weight) stays the same tensor.
        self.ddcl.weight.data = codebook.detach().clone()


def _ddcl_kwargs(options: Dict[str, Any], default_beta: float) -> Dict[str, Any]:
    unknown = sorted(set(options) - set(DDCL_OPTIONS))
    if unknown:
        raise ValueError(f"expected DDCL options among {DDCL_OPTIONS}, got unknown {unknown}")
    kwargs = dict(options)
    kwargs.setdefault("beta", float(default_beta))
    return kwargs


class TamingQuantizerAdapter(_DDCLAdapter):
    """DDCL behind the taming-transformers / diffusers ``VectorQuantizer(2)`` convention.

    ``forward(z)`` with z (B, C, H, W), C = ``e_dim``, returns
    ``(z_q, loss, (perplexity, min_encodings, indices))``:

    - z_q: (B, C, H, W), the hard codes (straight-through gradient in the default mode);
    - loss: scalar, the DDCL quantizer's (already weighted) loss;
    - perplexity, min_encodings: ``None`` as in ``VectorQuantizer2`` / diffusers; with
      ``taming_v1_outputs=True`` the batch perplexity (scalar) and the (B·H·W, n_e) one-hot
      matrix, as taming's original ``VectorQuantizer`` returns them;
    - indices: (B·H·W,) long in b-h-w order; (B·H·W, 1) with ``remap`` or
      ``taming_v1_outputs``; (B, H, W) with ``sane_index_shape``.

    ``embedding`` is an ``nn.Embedding`` whose ``weight`` IS the DDCL codebook Parameter
    (``embedding.weight is ddcl.weight``), so optimizers and checkpoints see one tensor.

    Args:
        n_e: number of codes K.
        e_dim: code width D (diffusers calls it ``vq_embed_dim``; both attributes exist).
        beta: commitment weight, passed to the DDCL quantizer.
        remap: as the host's ``remap``: not None turns index remapping on. The host loads the
            used-code table from this path with numpy; ddcl_vq reads no files, so pass the table
            as ``used`` (or pass the table itself as ``remap``).
        used: (n_used,) integer tensor of the codes the remapped indices refer to.
        unknown_index: ``"random"``, ``"extra"`` or an int, as in the host.
        sane_index_shape: return indices as (B, H, W) instead of flat.
        legacy: kept for the host to read; it has no effect on the DDCL loss.
        taming_v1_outputs: return perplexity, one-hot encodings and (N, 1) indices like
            taming's original ``VectorQuantizer``.
        temperature, mode, codebook_init, implementation, chunk_size: the
            :class:`~ddcl_vq.DDCLQuantizer` options.
    """

    _host_codebook_key = "embedding.weight"

    def __init__(self, n_e: int, e_dim: int, beta: float = 0.25, remap: Union[str, Tensor, None] = None,
                 unknown_index: Union[str, int] = "random", sane_index_shape: bool = False,
                 legacy: bool = True, *, used: Optional[Tensor] = None, taming_v1_outputs: bool = False,
                 temperature: float = 0.01, mode: str = "straight_through", codebook_init: str = "uniform",
                 implementation: str = "auto", chunk_size: Optional[int] = None):
        super().__init__()
        ddcl = DDCLQuantizer(n_e, e_dim, temperature=temperature, mode=mode, beta=beta,
                             codebook_init=codebook_init, channel_dim=1, implementation=implementation,
                             chunk_size=chunk_size)
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
        """An adapter with ``old``'s K, D, options, device, dtype, training flag and codebook values.

        ``old`` is a diffusers ``VectorQuantizer`` or a taming ``VectorQuantizer``/``VectorQuantizer2``.
        ``ddcl_options``: any of :data:`DDCL_OPTIONS`; ``beta`` defaults to ``old.beta``.
        """
        weight = old.embedding.weight
        e_dim = int(getattr(old, "e_dim", getattr(old, "vq_embed_dim", weight.shape[1])))
        remap = getattr(old, "remap", None)
        kwargs = _ddcl_kwargs(ddcl_options, getattr(old, "beta", 0.25))
        unknown_index = getattr(old, "unknown_index", "random")
        if remap is not None and int(old.re_embed) > old.used.shape[0]:
            unknown_index = "extra"  # the host stores "extra" resolved to an index one past `used`
        new = cls(int(old.n_e), e_dim, remap=remap, used=getattr(old, "used", None) if remap is not None else None,
                  unknown_index=unknown_index, sane_index_shape=bool(getattr(old, "sane_index_shape", False)),
                  legacy=bool(getattr(old, "legacy", True)), taming_v1_outputs=not hasattr(old, "legacy"),
                  **kwargs).to(device=weight.device)
        new._load_codebook(weight)
        return new.train(old.training)

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

    def forward(self, z: Tensor, temp: Optional[float] = None, rescale_logits: bool = False,
                return_logits: bool = False) -> Tuple[Tensor, Tensor, Tuple[Optional[Tensor], Optional[Tensor], Tensor]]:
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
        """Indices (flat or (B, H, W)) -> codes; with ``shape`` = (B, H, W, C) they come as (B, C, H, W).

        With ``shape=None`` the codes come as ``indices.shape + (C,)``.
        """
        if self.remap is not None:
            indices = self.unmap_to_all(indices.reshape(shape[0], -1)).reshape(-1)
        if shape is not None:
            indices = indices.reshape(-1)
        z_q = self.embedding(indices)
        if shape is not None:
            z_q = z_q.view(shape).permute(0, 3, 1, 2).contiguous()
        return z_q

    def extra_repr(self) -> str:
        return (f"n_e={self.n_e}, e_dim={self.e_dim}, sane_index_shape={self.sane_index_shape}, "
                f"remap={'on' if self.remap is not None else None}, taming_v1_outputs={self.taming_v1_outputs}")


class NotebookQuantizerAdapter(_DDCLAdapter):
    """DDCL behind the classic VQ-VAE notebook's ``VectorQuantizer`` (the Sonnet port).

    ``forward(inputs)`` with inputs (B, C, H, W), C = ``embedding_dim``, returns
    ``(loss, quantized, perplexity, encodings)``: the DDCL loss (scalar, already weighted),
    quantized (B, C, H, W), the batch perplexity (scalar) and the (B·H·W, K) one-hot float
    matrix of the hard indices (b-h-w order).

    ``_embedding.weight`` IS the DDCL codebook Parameter; ``_num_embeddings``, ``_embedding_dim``
    and ``_commitment_cost`` (= the DDCL ``beta``) are there for the host to read.
    """

    _host_codebook_key = "_embedding.weight"

    def __init__(self, num_embeddings: int, embedding_dim: int, commitment_cost: float = 0.25, *,
                 temperature: float = 0.01, mode: str = "straight_through", codebook_init: str = "uniform",
                 implementation: str = "auto", chunk_size: Optional[int] = None):
        super().__init__()
        ddcl = DDCLQuantizer(num_embeddings, embedding_dim, temperature=temperature, mode=mode,
                             beta=commitment_cost, codebook_init=codebook_init, channel_dim=1,
                             implementation=implementation, chunk_size=chunk_size)
        self._num_embeddings = num_embeddings
        self._embedding_dim = embedding_dim
        self._embedding = nn.Embedding(num_embeddings, embedding_dim)
        self._embedding.weight = ddcl.weight
        self._attach(ddcl)

    @property
    def _commitment_cost(self) -> float:
        return self.ddcl.beta

    @_commitment_cost.setter
    def _commitment_cost(self, value: float) -> None:
        self.ddcl.beta = float(value)

    @classmethod
    def from_quantizer(cls, old: nn.Module, **ddcl_options: Any) -> "NotebookQuantizerAdapter":
        """An adapter with ``old``'s K, D, device, dtype, training flag and codebook values.

        ``old`` is the notebook's ``VectorQuantizer`` or ``VectorQuantizerEMA``; ``beta``
        defaults to its ``_commitment_cost``.
        """
        weight = old._embedding.weight
        kwargs = _ddcl_kwargs(ddcl_options, old._commitment_cost)
        new = cls(int(old._num_embeddings), int(old._embedding_dim), kwargs.pop("beta"),
                  **kwargs).to(device=weight.device)
        new._load_codebook(weight)
        return new.train(old.training)

    def forward(self, inputs: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        if not isinstance(inputs, Tensor) or inputs.dim() != 4:
            got = tuple(inputs.shape) if isinstance(inputs, Tensor) else type(inputs).__name__
            raise ValueError(f"expected feature maps (B, C, H, W) with C={self._embedding_dim}, got {got}")
        out = self._run_ddcl(inputs)
        flat = out.indices.reshape(-1)
        encodings = torch.zeros(flat.shape[0], self._num_embeddings, device=inputs.device)
        encodings.scatter_(1, flat[:, None], 1)
        return out.loss, out.quantized, out.perplexity, encodings

    def extra_repr(self) -> str:
        return f"num_embeddings={self._num_embeddings}, embedding_dim={self._embedding_dim}"


class VQPAdapter(_DDCLAdapter):
    """DDCL behind vector-quantize-pytorch's ``VectorQuantize`` convention (single head).

    ``forward(x, mask=None, lens=None)`` returns ``(quantized, indices, loss)``; the layouts
    are the peer's:

    - ``channel_last=True`` (default): x (B, N, dim) -> quantized (B, N, dim), indices (B, N);
    - ``channel_last=False``: x (B, dim, N) -> (B, dim, N), indices (B, N);
    - ``accept_image_fmap=True``: x (B, dim, H, W) -> (B, dim, H, W), indices (B, H, W);
    - ``accept_3d_fmap=True``: x (B, dim, T, H, W) -> (B, dim, T, H, W), indices (B, T, H, W);
    - one token per row, x (B, dim) -> (B, dim), indices (B,).

    ``mask`` (B, N) bool (or ``lens`` (B,)) marks valid positions of a sequence: padded
    positions are left out of the codebook and the loss and come back as zeros (or the
    input, with ``return_zeros_for_masked_padding=False``) with index −1; ``last_output`` then
    covers the valid positions only.

    ``loss`` is the DDCL loss (scalar), in training and eval. With ``codebook_dim`` ≠ ``dim``
    the input is projected by ``project_in`` and the codes by ``project_out`` as in the peer.
    ``codebook`` is the (codebook_size, codebook_dim) DDCL Parameter.
    """

    _UNSUPPORTED = ("indices", "topk", "sample_codebook_temp", "freeze_codebook", "return_loss_breakdown",
                    "codebook_transform_fn", "ema_update_weight", "accum_ema_update", "ema_update")

    def __init__(self, dim: int, codebook_size: int, codebook_dim: Optional[int] = None, *,
                 channel_last: bool = True, accept_image_fmap: bool = False, accept_3d_fmap: bool = False,
                 commitment_weight: float = 1.0, return_zeros_for_masked_padding: bool = True,
                 temperature: float = 0.01, mode: str = "straight_through", codebook_init: str = "uniform",
                 implementation: str = "auto", chunk_size: Optional[int] = None):
        super().__init__()
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
        self._attach(DDCLQuantizer(codebook_size, codebook_dim, temperature=temperature, mode=mode,
                                   beta=commitment_weight, codebook_init=codebook_init, channel_dim=-1,
                                   implementation=implementation, chunk_size=chunk_size))

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
        """An adapter with ``old``'s sizes, layout flags, projections, device, dtype and codebook values.

        ``old`` is a single-head ``vector_quantize_pytorch.VectorQuantize``; ``beta`` defaults to its
        ``commitment_weight``. A codebook still waiting for its k-means init is not copied: the
        DDCL codebook is then k-means-initialised on the first training batch instead.
        """
        if getattr(old, "heads", 1) != 1:
            raise ValueError(f"expected a single-head VectorQuantize, got heads={old.heads}")
        codebook = old.codebook
        options = dict(ddcl_options)
        pending_kmeans = not bool(getattr(getattr(old, "_codebook", None), "initted", True))
        if pending_kmeans:
            options.setdefault("codebook_init", "kmeans")
        kwargs = _ddcl_kwargs(options, getattr(old, "commitment_weight", 1.0))
        new = cls(int(old.dim), int(old.codebook_size), int(codebook.shape[-1]),
                  channel_last=bool(old.channel_last), accept_image_fmap=bool(old.accept_image_fmap),
                  accept_3d_fmap=bool(getattr(old, "accept_3d_fmap", False)),
                  commitment_weight=kwargs.pop("beta"),
                  return_zeros_for_masked_padding=bool(getattr(old, "return_zeros_for_masked_padding", True)),
                  **kwargs).to(device=codebook.device)
        new.project_in = copy.deepcopy(old.project_in)
        new.project_out = copy.deepcopy(old.project_out)
        new._load_codebook(codebook)
        return new.train(old.training)

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
        if mask is None:
            out = self._run_ddcl(h)
            codes, indices = out.quantized, out.indices
        else:
            if x_last.dim() != 3 or tuple(mask.shape) != tuple(x_last.shape[:2]):
                raise ValueError(f"expected a (B, N) mask for a sequence of shape {tuple(x.shape)}, "
                                 f"got {tuple(mask.shape)}")
            mask = mask.bool()
            out = self._run_ddcl(h[mask])  # only valid positions reach the codebook and the loss
            codes = h.new_zeros(h.shape)
            codes[mask] = out.quantized
            indices = torch.full(mask.shape, -1, dtype=torch.long, device=x.device)
            indices[mask] = out.indices
        quantized = self.project_out(codes)
        if mask is not None:
            padding = torch.zeros_like(x_last) if self.return_zeros_for_masked_padding else x_last
            quantized = torch.where(mask[..., None], quantized, padding)
        if channel_first:
            quantized = torch.movedim(quantized, -1, 1)
        return quantized, indices, out.loss

    def get_codes_from_indices(self, indices: Tensor) -> Tensor:
        """Indices (B, ...) -> codebook rows, (B, ..., codebook_dim), channel-first for channel-first layouts."""
        codes = self.codebook[indices]
        if not self.channel_last or self.accept_image_fmap or self.accept_3d_fmap:
            codes = torch.movedim(codes, -1, 1)
        return codes

    def get_output_from_indices(self, indices: Tensor) -> Tensor:
        """Indices (B, ...) -> what ``forward`` returns as ``quantized`` for them (``project_out`` applied)."""
        out = self.project_out(self.codebook[indices])
        if not self.channel_last or self.accept_image_fmap or self.accept_3d_fmap:
            out = torch.movedim(out, -1, 1)
        return out

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, codebook_size={self.codebook_size}, codebook_dim={self.codebook_dim}, "
                f"channel_last={self.channel_last}, accept_image_fmap={self.accept_image_fmap}, "
                f"accept_3d_fmap={self.accept_3d_fmap}")


# ---------------------------------------------------------------- swap_quantizer

class SwappedQuantizer(NamedTuple):
    """One replacement made by :func:`swap_quantizer`."""

    name: str        # qualified module name in the model ("quantize", "vq", "encoder.vq", ...)
    old: nn.Module   # the host's quantizer, as it was
    new: nn.Module   # the adapter now in its place


LOOKED_FOR = (
    "diffusers/taming VectorQuantizer or VectorQuantizer2 (attributes embedding, n_e, e_dim or vq_embed_dim, beta); "
    "vector-quantize-pytorch VectorQuantize (codebook_size, dim, codebook, _codebook); "
    "the VQ-VAE notebook's VectorQuantizer or VectorQuantizerEMA "
    "(_embedding, _num_embeddings, _embedding_dim, _commitment_cost)")


def _is_taming(m: nn.Module) -> bool:
    return (type(m).__name__ in ("VectorQuantizer", "VectorQuantizer2")
            and isinstance(getattr(m, "embedding", None), nn.Embedding)
            and hasattr(m, "n_e") and hasattr(m, "beta")
            and (hasattr(m, "e_dim") or hasattr(m, "vq_embed_dim")))


def _is_vqp(m: nn.Module) -> bool:
    return (type(m).__name__ == "VectorQuantize" and hasattr(m, "codebook_size") and hasattr(m, "dim")
            and hasattr(m, "_codebook") and hasattr(m, "codebook"))


def _is_notebook(m: nn.Module) -> bool:
    return (isinstance(getattr(m, "_embedding", None), nn.Embedding) and hasattr(m, "_num_embeddings")
            and hasattr(m, "_embedding_dim") and hasattr(m, "_commitment_cost"))


_FAMILIES = ((_is_taming, TamingQuantizerAdapter), (_is_vqp, VQPAdapter), (_is_notebook, NotebookQuantizerAdapter))
_ADAPTERS = (TamingQuantizerAdapter, VQPAdapter, NotebookQuantizerAdapter)


def _from_peer_library(module: nn.Module) -> bool:
    return type(module).__module__.split(".")[0] == "vector_quantize_pytorch"


def adapter_for(module: nn.Module) -> Optional[type]:
    """The adapter class for a host quantizer module, or None when it is not one we recognise."""
    if isinstance(module, _ADAPTERS):
        return None
    for matches, adapter in _FAMILIES:
        if matches(module):
            return adapter
    return None


def swap_quantizer(model: nn.Module, **ddcl_options: Any) -> List[SwappedQuantizer]:
    """Replace every recognised quantizer in ``model`` by the matching DDCL adapter, in place.

    Recognised (by class name and public attributes; nothing is imported): diffusers'
    ``VectorQuantizer`` (``VQModel.quantize``), taming's ``VectorQuantizer`` and
    ``VectorQuantizer2``, vector-quantize-pytorch's single-head ``VectorQuantize`` (not the ones
    inside its own composites such as ``ResidualVQ``), the VQ-VAE notebook's
    ``VectorQuantizer`` / ``VectorQuantizerEMA``. Each adapter copies the old codebook (same
    K, D, device, dtype and values), the host's options and its train/eval flag.

    ``ddcl_options``: ``temperature``, ``mode``, ``beta`` (default: the host's commitment
    weight), ``codebook_init`` (``"kmeans"`` re-initialises from the first training batch),
    ``implementation``, ``chunk_size`` (see :class:`~ddcl_vq.DDCLQuantizer`).
    Call it before building the optimizer; to resume a checkpoint trained with the swap, build
    the host model, call ``swap_quantizer`` with the same options, then ``load_state_dict``.

    Returns a list of ``SwappedQuantizer(name, old, new)``. Raises ValueError when the model
    holds no recognised quantizer (naming what it looked for and any unsupported
    quantizer-like modules it saw) or when ``model`` itself is the quantizer.
    """
    _ddcl_kwargs(ddcl_options, 0.0)  # reject unknown options before touching the model
    root_adapter = adapter_for(model)
    if root_adapter is not None:
        raise ValueError(f"expected a model that contains a quantizer, got the quantizer itself "
                         f"({type(model).__name__}); use {root_adapter.__name__}.from_quantizer(quantizer)")
    found: Dict[int, Tuple[str, nn.Module, type]] = {}
    unsupported: List[str] = []
    already: List[str] = []

    def visit(parent: nn.Module, parent_name: str) -> None:
        for child_name, child in parent.named_children():
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            adapter = adapter_for(child)
            if adapter is not None:
                found.setdefault(id(child), (name, child, adapter))
            elif isinstance(child, _ADAPTERS):
                already.append(name)
            elif "quantiz" in type(child).__name__.lower() or _from_peer_library(child):
                # e.g. GumbelQuantize, or a vector-quantize-pytorch composite (ResidualVQ, ...) that
                # calls its VectorQuantize layers with options the adapter does not speak.
                unsupported.append(f"{name} ({type(child).__name__})")
            else:
                visit(child, name)

    visit(model, "")
    if not found:
        seen = f"; unsupported quantizer-like modules seen: {', '.join(unsupported)}" if unsupported else ""
        seen += f"; already DDCL adapters: {', '.join(already)}" if already else ""
        raise ValueError(f"expected a quantizer in {type(model).__name__}, found none; looked for {LOOKED_FOR}{seen}")
    replacements = {key: adapter.from_quantizer(old, **ddcl_options) for key, (_, old, adapter) in found.items()}
    # Replace every reference (a quantizer shared under two names gets one adapter in both places).
    for parent in list(model.modules()):
        for child_name, child in list(parent._modules.items()):  # every name, duplicates included
            if child is not None and id(child) in replacements:
                setattr(parent, child_name, replacements[id(child)])
    return [SwappedQuantizer(name, old, replacements[key]) for key, (name, old, _) in found.items()]
