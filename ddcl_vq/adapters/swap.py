"""``swap_quantizer``: find the hosts' quantizers in a model and put the matching adapter in place."""
from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from torch import nn

from .notebook import NotebookQuantizerAdapter
from .options import DDCLOptions
from .taming import TamingQuantizerAdapter
from .vqp import VQPAdapter


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

    ``ddcl_options``: any :class:`~ddcl_vq.adapters.DDCLOptions`, i.e. a
    :class:`~ddcl_vq.DDCLQuantizer` keyword argument: ``temperature``, ``mode``, ``beta``
    (default: the host's commitment weight), ``codebook_init`` (``"kmeans"`` re-initialises from
    the first training batch), ``implementation``, ``chunk_size``, ...
    Call it before building the optimizer; to resume a checkpoint trained with the swap, build
    the host model, call ``swap_quantizer`` with the same options, then ``load_state_dict``.

    Returns a list of ``SwappedQuantizer(name, old, new)``. Raises ValueError when the model
    holds no recognised quantizer (naming what it looked for and any unsupported
    quantizer-like modules it saw) or when ``model`` itself is the quantizer.
    """
    DDCLOptions.from_kwargs(ddcl_options)  # reject unknown options before touching the model
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
