"""``swap_quantizer``: find the hosts' quantizers in a model and put the matching adapter in place."""
from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Tuple, Union

import torch
from torch import nn

from .notebook import NotebookQuantizerAdapter
from .options import DDCLOptions
from .residual import EncodecRVQAdapter, GroupedResidualVQAdapter, ResidualVQAdapter, refusal_for
from .taming import TamingQuantizerAdapter
from .vqp import VQPAdapter
from .vqvae2 import VQVAE2QuantizeAdapter


class SwappedQuantizer(NamedTuple):
    """One replacement made by :func:`swap_quantizer`."""

    name: str        # qualified module name in the model ("quantize", "vq", "encoder.vq", ...)
    old: nn.Module   # the host's quantizer, as it was
    new: nn.Module   # the adapter now in its place


LOOKED_FOR = (
    "diffusers/taming VectorQuantizer or VectorQuantizer2 (attributes embedding, n_e, e_dim or vq_embed_dim, beta); "
    "vector-quantize-pytorch VectorQuantize (codebook_size, dim, codebook, _codebook), "
    "ResidualVQ (layers, num_quantizers, codebooks) and GroupedResidualVQ (rvqs, groups); "
    "the VQ-VAE notebook's VectorQuantizer or VectorQuantizerEMA "
    "(_embedding, _num_embeddings, _embedding_dim, _commitment_cost); "
    "VQ-VAE-2's Quantize (buffers embed (dim, n_embed), cluster_size, embed_avg); "
    "EnCodec's ResidualVectorQuantization (layers of VectorQuantization with _codebook.embed)")


def _is_taming(m: nn.Module) -> bool:
    return (type(m).__name__ in ("VectorQuantizer", "VectorQuantizer2")
            and isinstance(getattr(m, "embedding", None), nn.Embedding)
            and hasattr(m, "n_e") and hasattr(m, "beta")
            and (hasattr(m, "e_dim") or hasattr(m, "vq_embed_dim")))


def _is_vqp(m: nn.Module) -> bool:
    return (type(m).__name__ == "VectorQuantize" and hasattr(m, "codebook_size") and hasattr(m, "dim")
            and hasattr(m, "_codebook") and hasattr(m, "codebook"))


def _is_residual_vqp(m: nn.Module) -> bool:
    return (type(m).__name__ == "ResidualVQ" and isinstance(getattr(m, "layers", None), nn.ModuleList)
            and hasattr(m, "num_quantizers") and hasattr(m, "codebooks"))


def _is_grouped_residual_vqp(m: nn.Module) -> bool:
    return (type(m).__name__ == "GroupedResidualVQ" and isinstance(getattr(m, "rvqs", None), nn.ModuleList)
            and hasattr(m, "groups"))


def _is_vqvae2(m: nn.Module) -> bool:
    embed = getattr(m, "embed", None)
    return (type(m).__name__ == "Quantize" and isinstance(embed, torch.Tensor) and embed.dim() == 2
            and hasattr(m, "cluster_size") and hasattr(m, "embed_avg") and hasattr(m, "dim")
            and hasattr(m, "n_embed") and tuple(embed.shape) == (m.dim, m.n_embed))


def _is_encodec_rvq(m: nn.Module) -> bool:
    layers = getattr(m, "layers", None)
    return (type(m).__name__ == "ResidualVectorQuantization" and isinstance(layers, nn.ModuleList) and len(layers) > 0
            and all(hasattr(getattr(layer, "_codebook", None), "embed") for layer in layers)
            and all(hasattr(layer._codebook, "inited") for layer in layers))


def _is_notebook(m: nn.Module) -> bool:
    return (isinstance(getattr(m, "_embedding", None), nn.Embedding) and hasattr(m, "_num_embeddings")
            and hasattr(m, "_embedding_dim") and hasattr(m, "_commitment_cost"))


_FAMILIES = ((_is_taming, TamingQuantizerAdapter), (_is_vqp, VQPAdapter), (_is_residual_vqp, ResidualVQAdapter),
             (_is_grouped_residual_vqp, GroupedResidualVQAdapter), (_is_notebook, NotebookQuantizerAdapter),
             (_is_vqvae2, VQVAE2QuantizeAdapter), (_is_encodec_rvq, EncodecRVQAdapter))
_ADAPTERS = tuple(adapter for _, adapter in _FAMILIES)


def adapter_for(module: nn.Module) -> Optional[type]:
    """The adapter class for a host quantizer module, or None when it is not one we recognise."""
    if isinstance(module, _ADAPTERS):
        return None
    return next((adapter for matches, adapter in _FAMILIES if matches(module)), None)


def swap_quantizer(model: nn.Module, **ddcl_options: Any) -> Union[List[SwappedQuantizer], nn.Module]:
    """Replace every recognised quantizer in ``model`` by the matching DDCL adapter, in place; or, when
    ``model`` is itself a recognised quantizer (e.g. a bare ``VectorQuantize``), return its adapter
    (``vq = swap_quantizer(vq)``, the same as ``VQPAdapter.from_quantizer(vq)``).

    Recognised by class name and public attributes (:data:`LOOKED_FOR`), not inside vector-quantize-pytorch's
    composites. Each adapter copies the old codebook, the host's options and its train/eval flag.
    ``ddcl_options``: :class:`~ddcl_vq.adapters.DDCLOptions` (``beta`` defaults to the host's commitment weight).
    Call it before building the optimizer.

    Returns a list of ``SwappedQuantizer(name, old, new)`` (for a bare quantizer: the adapter); ValueError when
    the model holds no recognised quantizer, or holds a host whose codes are not learned (``ResidualFSQ``,
    ``ResidualLFQ``: :data:`~ddcl_vq.adapters.residual.REFUSED_HOSTS`) or are l2-normalised (cosine).
    """
    DDCLOptions.from_kwargs(ddcl_options)  # reject unknown options before touching the model
    for name, module in model.named_modules():  # hosts whose codes DDCL cannot take over: refused, never skipped
        reason = refusal_for(module)
        if reason:
            raise ValueError(f"{reason} (at {name or 'the root'})")
    root_adapter = adapter_for(model)
    if root_adapter is not None:
        return root_adapter.from_quantizer(model, **ddcl_options)
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
            elif type(child).__module__.split(".")[0] == "vector_quantize_pytorch":
                # a vector-quantize-pytorch composite without an adapter (ResidualSimVQ, ...): not entered
                unsupported.append(f"{name} ({type(child).__name__})")
            elif "quantiz" in type(child).__name__.lower():
                # e.g. GumbelQuantize; or a wrapper around a recognised one (EnCodec's ResidualVectorQuantizer)
                before = len(found)
                visit(child, name)
                if len(found) == before:
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
