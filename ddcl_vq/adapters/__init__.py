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
- The codebook is an ``nn.Parameter``. By default (``codebook_update="mstep"``) it is DDCL's
  M-step, updated inside training forwards, with ``requires_grad=False``: the host's optimizer
  leaves it alone. With ``codebook_update="gradient"`` it is trained by the gradient of the DDCL
  distortion and must be in the optimizer: call :func:`swap_quantizer` before building it.
- The host's β / commitment weight becomes the DDCL commitment weight ``beta``; taming's
  ``legacy`` flag (which swapped β onto the codebook term) is kept as an attribute only.
- ``.ddcl`` is the wrapped :class:`~ddcl_vq.DDCLQuantizer` (set ``.ddcl.temperature`` from a
  schedule); ``.last_output`` is the last :class:`~ddcl_vq.QuantizerOutput`, detached, so the
  terms (``distortion``, ``ols``, ``variance``, ``commitment``) and ``soft_counts`` can be logged.
- ``state_dict`` keys are the host's own (taming/diffusers: ``embedding.weight`` [+ ``used``];
  notebook: ``_embedding.weight``): the DDCL ``initialized`` flag, temperature schedule and
  M-step statistics are not saved (the statistics restart from the codebook at the next training
  forward), and loading a codebook marks it initialised. A checkpoint trained with the swap
  therefore loads strictly into the swapped host *and* into the plain host (which then decodes
  the same hard codes).

Nothing here imports diffusers, taming or vector_quantize_pytorch: hosts are recognised by
class name and public attributes.

Modules: ``options`` (:class:`DDCLOptions`, the DDCL options shared by every adapter), ``common``
(what every adapter does: the shared codebook Parameter, host-keyed state dicts, ``last_output``),
one module per host convention (``taming``, ``vqp``, ``notebook``) and ``swap``
(:func:`swap_quantizer`, which finds the hosts' quantizers in a model).
"""
from .notebook import NotebookQuantizerAdapter
from .options import DDCL_OPTIONS, DDCLOptions
from .swap import LOOKED_FOR, SwappedQuantizer, adapter_for, swap_quantizer
from .taming import TamingQuantizerAdapter
from .vqp import VQPAdapter

__all__ = ["TamingQuantizerAdapter", "VQPAdapter", "NotebookQuantizerAdapter", "swap_quantizer", "SwappedQuantizer",
           "adapter_for", "DDCLOptions", "DDCL_OPTIONS", "LOOKED_FOR"]
