"""Drop-in adapters: the DDCL codebook behind the common VQ-VAE quantizer conventions.

One import and one line put a :class:`~ddcl_vq.DDCLQuantizer` into an existing code base::

    from ddcl_vq import swap_quantizer
    swap_quantizer(model)            # in place; swap_quantizer(vq) on a bare quantizer returns its adapter

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
vector-quantize-pytorch            ``(quantized, indices, losses)``: (..., Q),  :class:`ResidualVQAdapter`,
``ResidualVQ``, its grouped form   (Q,); grouped (G, ..., Q), (G, Q)           :class:`GroupedResidualVQAdapter`
VQ-VAE notebook (Sonnet port)      ``(loss, quantized, perplexity,             :class:`NotebookQuantizerAdapter`
``VectorQuantizer``                encodings)``, NCHW in and out
VQ-VAE-2 ``Quantize``              ``(quantize, diff, embed_ind)``, (..., dim)  :class:`VQVAE2QuantizeAdapter`
EnCodec ``ResidualVector``         ``(quantized, indices (n_q, B, T), losses   :class:`EncodecRVQAdapter`
``Quantization``                   (n_q, 1))``, (B, D, T), ``n_q``
=================================  ==========================================  ==================================

What changes is the quantizer, not its interface: ``loss`` is the DDCL loss (already weighted, also in eval mode);
the codebook is a Parameter with ``requires_grad=False`` (the M-step updates it); the host's commitment weight becomes
``beta``; ``.ddcl`` is the wrapped :class:`~ddcl_vq.DDCLQuantizer`, ``.last_output`` its last output, detached;
``state_dict`` keys are the host's own. Nothing here imports the hosts: they are recognised by class name and
public attributes.
"""
from .notebook import NotebookQuantizerAdapter
from .options import DDCL_OPTIONS, DDCLOptions
from .residual import REFUSED_HOSTS, EncodecRVQAdapter, GroupedResidualVQAdapter, ResidualVQAdapter
from .swap import LOOKED_FOR, SwappedQuantizer, adapter_for, swap_quantizer
from .taming import TamingQuantizerAdapter
from .vqp import VQPAdapter
from .vqvae2 import VQVAE2QuantizeAdapter

__all__ = ["TamingQuantizerAdapter", "VQPAdapter", "NotebookQuantizerAdapter", "swap_quantizer", "SwappedQuantizer",
           "adapter_for", "DDCLOptions", "DDCL_OPTIONS", "LOOKED_FOR", "ResidualVQAdapter", "GroupedResidualVQAdapter",
           "EncodecRVQAdapter", "VQVAE2QuantizeAdapter", "REFUSED_HOSTS"]
