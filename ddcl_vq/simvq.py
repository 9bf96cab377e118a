"""SimVQ (Zhu et al. 2024, "Addressing Representation Collapse in Vector Quantized Models with One
Linear Layer") behind ddcl_vq's interface.

The quantizer is vector-quantize-pytorch's ``SimVQ`` (an optional dependency, imported only when
this class is built): a frozen random codebook C (K x D, entries N(0, 1/D)) behind a learned linear
map W; the codes are W(C), the nearest one wins, and the loss ‖sg(z) − W(c)‖² + β‖z − sg(W(c))‖²
(each a mean over elements) trains W and the encoder. Every code moves whenever W moves, which is
the paper's answer to codebook collapse.
"""
from __future__ import annotations

from typing import Any, Dict

import torch
from torch import Tensor, nn

from .base import QuantizerOutput, Quantizer, flatten
from .distributed import all_reduce_sum_, broadcast_, is_distributed
from .vqp import peer_class, peer_output


class SimVQQuantizer(Quantizer):
    """Wraps ``vector_quantize_pytorch.SimVQ(dim, codebook_size, **simvq_kwargs)``.

    The peer runs unchanged (its defaults: rotation trick on, commitment weight 1, input-to-code
    weight β = 0.25, a bias-free linear map); ``simvq_kwargs`` are passed as they are, except
    ``codebook_bias`` (ours, default False): True builds the map as ``nn.Linear(D_frozen, D, bias=True)``,
    as the authors' reference code (youngsheen/SimVQ) does; ``data_init`` (ours, default False, needs
    ``codebook_bias``): on the first training batch set the map so the codes W(C) + b have the batch
    features' mean and covariance (b = mean, W = √D·cov^½; C has N(0, 1/D) entries) — the moment-
    matched start that plays the part k-means initialisation plays for a learned codebook (statistics
    summed over processes under torch.distributed, so every replica starts alike). The peer's loss is ``loss`` and
    ``terms["commitment"]``; ``codebook`` is W(C), so ``lookup(indices)`` gives the codes the
    decoder sees (with the rotation trick the forward value equals the code up to float rounding).
    The frozen codebook is a buffer (saved in the state_dict); the map is the only parameter. Under
    torch.distributed the first training step broadcasts rank 0's frozen codebook (processes seeded
    differently would otherwise quantize against different codebooks); after that nothing is shared
    but gradients. Computes in float32 whatever the input's dtype (autocast
    off), returns the input's dtype.
    """

    def __init__(self, num_codes: int, dim: int, *, channel_dim: int = 1, codebook_bias: bool = False,
                 data_init: bool = False, **simvq_kwargs: Any):
        super().__init__(num_codes, dim, channel_dim)
        SimVQ = peer_class("SimVQ", "simvq")
        if "channel_first" in simvq_kwargs:
            raise ValueError("expected no channel_first option (the layout is set by channel_dim), got "
                             f"channel_first={simvq_kwargs['channel_first']!r}")
        if codebook_bias and "codebook_transform" in simvq_kwargs:
            raise ValueError("expected codebook_bias=True or a codebook_transform, got both")
        frozen_dim = simvq_kwargs.get("frozen_codebook_dim") or dim
        if data_init and not (codebook_bias and frozen_dim == dim):
            raise ValueError("expected data_init=True together with codebook_bias=True (the codes' mean moves to the "
                             f"features' mean) and frozen_codebook_dim = dim, got codebook_bias={codebook_bias!r}, "
                             f"frozen_codebook_dim={frozen_dim}")
        self.data_init = bool(data_init)
        self.register_buffer("initialized", torch.tensor(not data_init))
        self.simvq_kwargs = dict(simvq_kwargs)
        self.codebook_bias = bool(codebook_bias)
        if codebook_bias:
            simvq_kwargs = dict(simvq_kwargs, codebook_transform=nn.Linear(frozen_dim, dim, bias=True))
        self.vq = SimVQ(dim=dim, codebook_size=num_codes, **simvq_kwargs)
        self._frozen_synced = False

    @property
    def codebook(self) -> Tensor:
        """(K, D): the frozen codebook through the learned map."""
        with torch.autocast(device_type=self.vq.frozen_codebook.device.type, enabled=False):
            return self.vq.codebook

    def forward(self, z: Tensor) -> QuantizerOutput:
        flat, last_shape = flatten(z, self.dim, self.channel_dim)
        if flat.shape[0] == 0:  # an empty batch: nothing to quantize, nothing learned
            return self.empty_output(flat, last_shape, ("commitment",))
        with torch.autocast(device_type=z.device.type, enabled=False):
            if self.training and not self._frozen_synced:
                # one frozen codebook for every process, whatever each was seeded with (the first
                # training step, on the training device; DDP with broadcast_buffers=False would not)
                if is_distributed():
                    broadcast_(self.vq.frozen_codebook, 0)
                self._frozen_synced = True
            if self.training and not bool(self.initialized):
                self._init_from_data(flat.detach().float())
            quantized, indices, loss = self.vq(flat.float().unsqueeze(0))
        return peer_output(self, z, last_shape, quantized, indices, loss, "commitment")

    @torch.no_grad()
    def _init_from_data(self, x: Tensor) -> None:
        """b = mean(x), W = √D·cov(x)^½ (symmetric square root; negative eigenvalues from rounding clamped
        at 0): the codes W c + b, c ~ N(0, I/D), then have the features' mean and covariance."""
        x = x.double()  # centred second moments of features far from the origin: float32 would cancel
        stats = torch.cat([x.new_tensor([x.shape[0]]), x.sum(0), (x.t() @ x).reshape(-1)])
        stats = all_reduce_sum_(stats)
        n, d = stats[0], self.dim
        mean = stats[1:1 + d] / n
        cov = stats[1 + d:].reshape(d, d) / n - torch.outer(mean, mean)
        evals, evecs = torch.linalg.eigh((cov + cov.t()) / 2)
        root = (evecs * evals.clamp_min(0).sqrt()) @ evecs.t()
        linear = self.vq.code_transform
        linear.weight.copy_((root * d ** 0.5).to(linear.weight.dtype))
        linear.bias.copy_(mean.to(linear.bias.dtype))
        self.initialized.fill_(True)

    def describe(self) -> Dict[str, Any]:
        return {"rotation_trick": bool(self.vq.rotation_trick), "codebook_bias": self.codebook_bias,
                "data_init": self.data_init}

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", codebook_bias={self.codebook_bias}, data_init={self.data_init}, "
                                       f"simvq_kwargs={self.simvq_kwargs}")
