"""What every adapter shares: the DDCL quantizer, its codebook saved under the host's key, ``last_output``."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from ..base import QuantizerOutput
from ..ddcl import STATE_BUFFERS, DDCLQuantizer


def masked_run(h: Tensor, mask: Optional[Tensor], run: Callable[[Tensor], Tuple[Any, ...]], shape: Tuple[int, ...],
               index_tail: Tuple[int, ...] = ()) -> Tuple[Tensor, Tensor, Optional[Tensor], Tuple[Any, ...]]:
    """A quantizer run on a sequence's valid positions only, as vector-quantize-pytorch's ``mask``.

    ``h`` (B, N, d) channel-last features (after ``project_in``); ``mask`` (B, N) or None (every position);
    ``run(z)`` returns a tuple whose first item is the :class:`~ddcl_vq.base.QuantizerOutput` for z (N', d);
    ``shape`` is the caller's input shape (for the error); ``index_tail`` the indices' trailing axes (residual: (Q,)).
    Returns ``(codes, indices, mask, result)``: codes (B, N, d), zeros at padding; indices mask.shape + index_tail,
    −1 at padding; the mask as bool (None when none was given); ``result`` what ``run`` returned. Without a mask,
    ``run`` sees ``h`` itself. ValueError for a mask that is not (B, N) over a (B, N, d) sequence."""
    if mask is None:
        result = run(h)
        return result[0].quantized, result[0].indices, None, result
    if h.dim() != 3 or tuple(mask.shape) != tuple(h.shape[:2]):
        raise ValueError(f"expected a (B, N) mask for a sequence of shape {tuple(shape)}, got {tuple(mask.shape)}")
    mask = mask.bool()
    result = run(h[mask])  # only valid positions reach the codebook and the loss
    out = result[0]
    codes = h.new_zeros(h.shape)
    codes[mask] = out.quantized
    indices = torch.full(tuple(mask.shape) + tuple(index_tail), -1, dtype=torch.long, device=h.device)
    indices[mask] = out.indices
    return codes, indices, mask, result


def masked_padding(quantized: Tensor, x_last: Tensor, mask: Optional[Tensor], zeros: bool) -> Tensor:
    """``quantized`` (B, N, dim) with its padding positions (``mask`` False) set to zeros (``zeros``, the host's
    ``return_zeros_for_masked_padding``) or to the input ``x_last``; unchanged without a mask."""
    if mask is None:
        return quantized
    padding = torch.zeros_like(x_last) if zeros else x_last
    return torch.where(mask[..., None], quantized, padding)


def _drop_ddcl_weight_key(module: "_DDCLAdapter", state_dict: Dict[str, Any], prefix: str,
                          local_metadata: Dict[str, Any]) -> None:
    # the codebook Parameter is registered twice (host name and ddcl.weight): save it once, under the host's name
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
        module.ddcl.warmup_batches.fill_(module.ddcl.warmup_steps)  # ... and past its warm-up


class _DDCLAdapter(nn.Module):
    """Shared plumbing: registers ``ddcl`` (after the host-named modules), keeps ``last_output``."""

    _host_codebook_key = "ddcl.weight"

    def _attach(self, ddcl: DDCLQuantizer) -> None:
        self.ddcl = ddcl
        # Not saved: state_dicts keep the host's keys; loading a codebook marks it initialised.
        for name in ("initialized",) + tuple(STATE_BUFFERS):  # schedule, M-step and warm-up state
            ddcl.register_buffer(name, getattr(ddcl, name), persistent=False)
        self.last_output: Optional[QuantizerOutput] = None
        self.register_state_dict_post_hook(_drop_ddcl_weight_key)
        self.register_load_state_dict_pre_hook(_restore_ddcl_weight_key)

    def _run_ddcl(self, z: Tensor) -> QuantizerOutput:
        out = self.ddcl(z)
        # a copy without the autograd graph (a DDCL output always has perplexity and soft_counts)
        self.last_output = QuantizerOutput(out.quantized.detach(), out.indices, out.loss.detach(),
                                           {k: v.detach() for k, v in out.terms.items()}, out.perplexity.detach(),
                                           out.soft_counts.detach())
        return out

    @torch.no_grad()
    def _adopt(self, old: nn.Module, codebook: Tensor) -> "_DDCLAdapter":
        """This adapter in ``old``'s place: on ``codebook``'s device, with a copy of ``codebook`` (K, D) (same
        values and dtype) as the DDCL codebook, and ``old``'s train/eval flag."""
        self.to(device=codebook.device)
        # .data keeps the Parameter object, so a host-named alias (embedding.weight) stays the same tensor.
        self.ddcl.weight.data = codebook.detach().clone()
        return self.train(old.training)
