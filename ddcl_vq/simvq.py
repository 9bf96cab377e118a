"""SimVQ (Zhu et al. 2024, "Addressing Representation Collapse in Vector Quantized Models with One
Linear Layer") behind ddcl_vq's interface.

The quantizer is vector-quantize-pytorch's ``SimVQ`` (imported when this class is built): a frozen random codebook C
(K x D) behind a learned linear map W; the codes are W(C), the nearest one wins, and the loss
‖sg(z) − W(c)‖² + β‖z − sg(W(c))‖² trains W and the encoder.
"""
from __future__ import annotations

from typing import Any, Dict

import torch
from torch import Tensor, nn

from .base import QuantizerOutput, Quantizer
from .distributed import all_reduce_sum_, broadcast_, is_distributed
from .vqp import peer_class, peer_output


class SimVQQuantizer(Quantizer):
    """Wraps ``vector_quantize_pytorch.SimVQ(dim, codebook_size, **simvq_kwargs)`` (the peer's defaults), with two
    options of ours: ``codebook_bias=True`` builds the map as ``nn.Linear(D_frozen, D, bias=True)`` (the authors'
    code); ``data_init=True`` (needs it) sets the map on the first training batch so the codes W(C) + b have the
    features' mean and covariance. ``codebook`` is W(C). Computes in float32.
    """

    term_names = ("commitment",)
    keeps_float64 = False
    peer = "SimVQ"  # the vector_quantize_pytorch class that takes the other keyword arguments

    def __init__(self, num_codes: int, dim: int, *, channel_dim: int = 1, codebook_bias: bool = False,
                 data_init: bool = False, **simvq_kwargs: Any):
        super().__init__(num_codes, dim, channel_dim)
        SimVQ = peer_class(self.peer, "simvq")
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

    def quantize(self, x: Tensor) -> QuantizerOutput:
        if self.training and not self._frozen_synced:
            # one frozen codebook for every process (DDP with broadcast_buffers=False would not copy it)
            if is_distributed():
                broadcast_(self.vq.frozen_codebook, 0)
            self._frozen_synced = True
        if self.training and not bool(self.initialized):
            self._init_from_data(x.detach())
        return peer_output(*self.vq(x.unsqueeze(0)), "commitment")

    @torch.no_grad()
    def _init_from_data(self, x: Tensor) -> None:
        """b = mean(x), W = √D·cov(x)^½: the codes W c + b, c ~ N(0, I/D), get the features' mean and covariance."""
        x = x.double()  # centred second moments of features far from the origin: float32 would cancel
        stats = all_reduce_sum_(torch.cat([x.new_tensor([x.shape[0]]), x.sum(0), (x.t() @ x).reshape(-1)]))
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
