"""What every adapter shares: the DDCL quantizer, its codebook saved under the host's key, ``last_output``."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch import Tensor, nn

from ..base import QuantizerOutput
from ..ddcl import STATE_BUFFERS, DDCLQuantizer


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
