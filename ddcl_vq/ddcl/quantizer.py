"""The DDCL soft codebook (Deep Dual Competitive Learning) as a VQ-VAE quantizer.

Math (z_i ∈ R^D, codebook W ∈ R^{K×D}, τ the temperature, s the softmax divisor):

    d_ik = ‖z_i − w_k‖²,  q_ik = softmax_k(−d_ik / s),  s = τ·d̄ (d̄: running mean of min_k d_ik)
    ẑ_i = Σ_k q_ik w_k (soft code),  k*_i = argmin_k d_ik (hard index)
    L_q = mean_i Σ_k q_ik d_ik = L_OLS + V,  L_OLS = mean_i ‖z_i − ẑ_i‖²,
    V = mean_i Σ_k q_ik ‖w_k − ẑ_i‖² ≥ 0

The codebook is DDCL's own M-step: an EMA (``decay``) of Σ_i q_ik z_i over an EMA of Σ_i q_ik, the
codebook that minimises L_q at fixed assignments; every code has positive mass, so every code moves
toward the data every step. ``loss`` is a per-element mean (the sum-over-D terms / D), the scale of a
VQ-VAE loss written with ``F.mse_loss``. The assignment is :mod:`ddcl_vq.ddcl.assignment`, the M-step's
statistics :mod:`ddcl_vq.ddcl.statistics`, τ :mod:`ddcl_vq.ddcl.temperature`, the codebook's running state
:mod:`ddcl_vq.ddcl.mstep`, the allowed argument values :mod:`ddcl_vq.ddcl.arguments`.
"""
from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .arguments import (CODEBOOK_INITS, DDCL_CHOICES, IMPLEMENTATIONS, MODES, TEMPERATURE_SCHEDULES,
                        check_arguments)
from .assignment import Assignment, assign
from ..base import QuantizerOutput, Quantizer, compute_dtype, flatten, unflatten
from .mstep import MStepCodebook
from .statistics import soft_statistics
from .temperature import TemperatureSchedule

# the allowed values live in ddcl_vq.ddcl.arguments and are readable here too (ddcl_vq.ddcl.DDCL_CHOICES ...)
__all__ = ["DDCLQuantizer", "TRUNCATE_ABOVE", "TRUNCATED_SUPPORT", "STATE_BUFFERS", "DDCL_CHOICES", "MODES",
           "CODEBOOK_INITS", "TEMPERATURE_SCHEDULES", "IMPLEMENTATIONS"]

#: above this many codes the M-step's soft statistics use each vector's TRUNCATED_SUPPORT nearest
#: codes (see :func:`ddcl_vq.ddcl.statistics.soft_statistics`); up to it, every code (exact)
TRUNCATE_ABOVE = 4096
TRUNCATED_SUPPORT = 64
#: the saved buffers, each with what a ddcl-vq 0.1.0 state_dict without it was saved before
STATE_BUFFERS = {"cluster_mass": "the M-step codebook", "cluster_usage": "revival by hard usage",
                 "cluster_sums": "the M-step codebook", "distance_scale": "the data-relative temperature",
                 "revived": "revival", "schedule_step": "the temperature schedule was saved",
                 "warmup_batches": "the quantization warm-up"}


class DDCLQuantizer(TemperatureSchedule, MStepCodebook, Quantizer):
    """Differentiable soft codebook (DDCL) with three output modes and its own temperature schedule.

    Args:
        num_codes: K, codebook size (or ``codebook_size=K``).
        dim: D, the channel size of the encoder features.
        temperature: τ, the schedule's start value; the softmax divisor is τ times the running mean
            squared distance of a vector to its nearest code (the buffer ``distance_scale``, an EMA
            over training batches; τ·D before the first training batch has measured it).
        temperature_schedule: ``"constant"`` (default), or ``"cosine"`` / ``"exponential"``: anneal
            from ``temperature`` to ``temperature_final`` over ``schedule_steps`` calls of
            :meth:`step` (one per training step), then stay at ``temperature_final``.
        temperature_final, schedule_steps: the anneal's end value and length (needed unless constant).
        mode: what the decoder sees — ``"straight_through"`` (default): w_{k*}, with the identity
            gradient plus ``beta``·‖z − sg(w_{k*})‖²; ``"soft"``: ẑ, L_q trains the encoder;
            ``"soft_straight_through"``: w_{k*}, with the gradient of ẑ.
        beta: commitment weight (``straight_through`` mode only).
        beta_final: the commitment weight rises linearly from ``beta`` to ``beta_final`` over
            ``schedule_steps`` calls of :meth:`step`, then stays there; without ``schedule_steps`` it
            stays at ``beta``; ``None`` turns the ramp off.
        decay: EMA decay of the M-step statistics (on sg(z), in training forwards: the codebook is a
            parameter with ``requires_grad=False``) and of the hard usage.
        revive_threshold: a code whose EMA hard usage falls below ``revive_threshold`` × N/K is
            re-seeded on a batch vector drawn uniformly, at most one code per vector, the most starved
            first; a re-seeded code's mass and usage start at N/K. 0 turns it off. Counted in the
            ``revived`` buffer.
        warmup_steps: during the first ``warmup_steps`` training forwards the decoder sees
            z + α·(out − z), α rising linearly from 0 to 1 (the gradient is out's); counted by training
            forwards, not :meth:`step`. 0 turns it off. A quantizer that had training forwards in this
            process but is evaluated, or its ``state_dict`` taken, before its warm-up ended warns once
            (``warn_inside_warmup = False`` silences it, for a caller that reports it itself).
        codebook_init: ``"kmeans"`` (default: k-means on the first training batch, identical on every
            process; repeated seeds get a small deterministic jitter), ``"uniform"`` U(−1/K, 1/K) or
            ``"normal"`` N(0, 1) (a codebook that is loaded or copied in keeps its values).
        channel_dim: 1 for (B, D, *spatial) inputs, −1 for (..., D).
        implementation: the soft modes' assignment path (:func:`ddcl_vq.ddcl.assignment.assign`); ``"auto"``
            (default): fused, or chunked when fused's N×K tensor would exceed ``chunk_threshold_bytes``.
        chunk_size: rows per block for fused/chunked (default :func:`ddcl_vq.blocks.block_rows`).

    State lives in the ``state_dict``: the M-step buffers, ``schedule_step`` and ``schedule`` (a
    float64 tensor [index in ``TEMPERATURE_SCHEDULES``, start τ, final τ, steps]), so a loaded
    checkpoint resumes, and evaluates at, the temperature it was trained to; a state_dict lacking a
    buffer (ddcl-vq 0.1.0) is refused. ``temperature`` reads the current τ; assigning it fixes τ.

    Shapes: ``forward(z)`` with z (B, D, H, W) returns quantized (B, D, H, W) and indices (B, H, W).
    """

    has_soft_codes = True
    #: warn (once) when evaluated or saved before the warm-up ended; ``ddcl-vq train`` sets it False (it warns itself)
    warn_inside_warmup = True

    def __init__(self, num_codes: int, dim: int, *, temperature: float = 0.03,
                 temperature_final: Optional[float] = None, temperature_schedule: str = "constant",
                 schedule_steps: Optional[int] = None, mode: str = "straight_through", beta: float = 0.25,
                 beta_final: Optional[float] = 1.0, decay: float = 0.9, revive_threshold: float = 0.03,
                 warmup_steps: int = 100, codebook_init: str = "kmeans", channel_dim: int = 1,
                 implementation: str = "auto", chunk_size: Optional[int] = None,
                 chunk_threshold_bytes: int = 64 * 2 ** 20):
        super().__init__(num_codes, dim, channel_dim)
        check_arguments(dict(
            mode=mode, codebook_init=codebook_init, temperature_schedule=temperature_schedule,
            implementation=implementation, beta=beta, beta_final=beta_final, decay=decay,
            revive_threshold=revive_threshold, chunk_size=chunk_size, chunk_threshold_bytes=chunk_threshold_bytes,
            warmup_steps=warmup_steps))
        self.implementation, self.chunk_size = implementation, chunk_size
        self.chunk_threshold_bytes = int(chunk_threshold_bytes)
        self.mode, self.codebook_init = mode, codebook_init
        self.beta = float(beta)
        self.beta_final = None if beta_final is None else float(beta_final)
        self.decay, self.revive_threshold = float(decay), float(revive_threshold)
        self.warmup_steps = warmup_steps
        self.set_schedule(temperature, temperature_final, temperature_schedule, schedule_steps)
        self._last_temperature: Optional[float] = None
        self.weight = nn.Parameter(torch.empty(num_codes, dim), requires_grad=False)
        if codebook_init == "normal":
            nn.init.normal_(self.weight)
        else:
            nn.init.uniform_(self.weight, -1.0 / num_codes, 1.0 / num_codes)
        self.register_buffer("initialized", torch.tensor(codebook_init != "kmeans"))
        self.register_buffer("schedule_step", torch.zeros((), dtype=torch.long))
        # M-step / revival state: EMA of Σ_i q_ik, of hard counts and of Σ_i q_ik z_i, the distance scale
        self.register_buffer("cluster_mass", torch.ones(num_codes))
        self.register_buffer("cluster_usage", torch.ones(num_codes))
        self.register_buffer("cluster_sums", self.weight.detach().clone())
        self.register_buffer("distance_scale", torch.zeros(()))  # 0: not measured yet
        self.register_buffer("revived", torch.zeros((), dtype=torch.long))
        # training forwards of the warm-up so far (stops at warmup_steps); counted here, not by
        # step(), so a host's training loop that never calls step() still leaves the warm-up
        self.register_buffer("warmup_batches", torch.zeros((), dtype=torch.long))
        self._warmup_over = warmup_steps == 0  # host-side: past it, forward reads no buffer (no sync)
        self._warmup_forwards = 0  # training forwards inside the warm-up in this instance (not loaded ones)
        self._warned_inside_warmup = False

    def log_stats(self) -> Dict[str, float]:
        """``temperature``: the τ of the last forward in training mode (the current τ before any);
        ``softmax_scale``: the divisor it was used with; ``revived``: codes re-seeded so far;
        ``min_code_mass``: the smallest EMA soft mass (in vectors per batch)."""
        tau = self.temperature if self._last_temperature is None else self._last_temperature
        return {"temperature": tau, "softmax_scale": self.softmax_scale(tau), "revived": float(self.revived),
                "min_code_mass": float(self.cluster_mass.min())}

    def describe(self) -> Dict[str, Any]:
        return {"mode": self.mode, "temperature": self.temperature}

    @property
    def statistics_support(self) -> Optional[int]:
        """Codes per vector in the M-step's soft statistics: all (None) up to K = TRUNCATE_ABOVE,
        else each vector's TRUNCATED_SUPPORT nearest (their weights beyond are below e^-20 at the
        default temperature in trained models; the hard index stays exact)."""
        return None if self.num_codes <= TRUNCATE_ABOVE else TRUNCATED_SUPPORT

    def softmax_scale(self, temperature: Optional[float] = None) -> float:
        """The softmax divisor s for τ = ``temperature`` (default: the current τ): τ times the
        measured distance scale, τ·D before the first training batch has measured it."""
        tau = self.temperature if temperature is None else temperature
        scale = float(self.distance_scale)
        return tau * (scale if scale > 0 else self.dim)

    def _warn_if_inside_warmup(self, what: str) -> None:
        """Once per instance: ``what`` (evaluated, saved) happens after some, but not all, of the warm-up's
        training forwards (none in this instance, e.g. a loaded checkpoint: no warning)."""
        if self._warmup_over or not self._warmup_forwards or self._warned_inside_warmup or not self.warn_inside_warmup:
            return
        seen = int(self.warmup_batches)
        if seen >= self.warmup_steps:
            return
        self._warned_inside_warmup = True
        warnings.warn(f"DDCLQuantizer {what} after {seen} of its {self.warmup_steps} warm-up training forwards "
                      f"(warmup_steps={self.warmup_steps}): the decoder still sees a blend of z and its code, so code "
                      "use and hard-code quality look collapsed; train past the warm-up, or pass warmup_steps=0 for "
                      "a short test", UserWarning, stacklevel=3)

    def _save_to_state_dict(self, destination: Dict[str, Any], prefix: str, keep_vars: bool) -> None:
        self._warn_if_inside_warmup("saved")
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "schedule"] = self.schedule_tensor()

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, local_metadata, strict: bool,
                              missing_keys: List[str], unexpected_keys: List[str], error_msgs: List[str]) -> None:
        old = [name for name in STATE_BUFFERS if name not in self._non_persistent_buffers_set
               and prefix + name not in state_dict]
        what = (f"before {STATE_BUFFERS[old[0]]} (no {', '.join(old)})" if old and prefix + "weight" in state_dict
                else "with revive_twins=True (retired in 0.2.0)" if prefix + "twin_position" in state_dict else None)
        if what:
            error_msgs.append(f"{prefix or 'DDCLQuantizer '}state_dict was saved by ddcl-vq 0.1.0 {what}; load it "
                              "with ddcl-vq 0.1.x or retrain")
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        self._load_schedule(state_dict, prefix, unexpected_keys, error_msgs)
        self._warmup_over = self.warmup_steps == 0  # re-read the loaded position at the next forward
        self._warmup_forwards = 0  # the loaded training is not this instance's: no warm-up warning for it

    @property
    def codebook(self) -> Tensor:
        return self.weight

    @property
    def term_names(self) -> Tuple[str, ...]:  # type: ignore[override]
        return (("commitment",) if self.mode == "straight_through" else ()) + ("distortion", "ols", "variance")

    def resolve_implementation(self, num_vectors: int, dtype: torch.dtype = torch.float32) -> str:
        """The path the soft modes' assignment takes for a batch of ``num_vectors`` vectors."""
        if self.implementation != "auto":
            return self.implementation
        itemsize = torch.finfo(dtype).bits // 8
        return "chunked" if num_vectors * self.num_codes * itemsize > self.chunk_threshold_bytes else "fused"

    def _assignment(self, x: Tensor, w: Tensor, scale: float) -> Assignment:
        return assign(x, w, scale, implementation=self.resolve_implementation(x.shape[0], x.dtype),
                      chunk_size=self.chunk_size)

    def quantize(self, x: Tensor) -> QuantizerOutput:
        """The M-step's statistics on sg(z) against the codebook before this batch's update (in
        training, then the update), and the mode's output from the codes the batch was assigned to."""
        tau = self.temperature
        if self.training:
            self._last_temperature = tau
        else:
            self._warn_if_inside_warmup("evaluated")
        blend = self._begin_batch(x.detach()) if self.training else 1.0
        scale = self.softmax_scale(tau)
        w = self.weight.detach().to(x.dtype, copy=True)
        split = self.report_terms or not self.training
        stats = soft_statistics(x.detach(), w, scale, support=self.statistics_support, split=split,
                                keep_soft=not self.training)
        if self.training:
            self._update_statistics(x.detach(), stats)
        if self.mode == "straight_through":
            hard = w[stats.indices]
            out = hard + (x - x.detach())  # value exactly w_{k*}, gradient identity
            commitment = (x - hard).pow(2).sum(1).mean()
            beta: Any = self.beta
            if self.beta_final is not None and self.schedule_steps:  # on the device: no host sync per forward
                progress = (self.schedule_step.to(commitment.dtype) / self.schedule_steps).clamp(max=1.0)
                beta = self.beta + (self.beta_final - self.beta) * progress
            loss, terms = beta * commitment / self.dim, {"commitment": commitment.detach()}
        else:
            a = self._assignment(x, w, scale)
            out = a.soft if self.mode == "soft" else w[a.indices] + (a.soft - a.soft.detach())
            loss, terms = a.distortion / self.dim, {}
        if split:
            terms.update(distortion=stats.distortion.detach(), ols=stats.ols.detach(), variance=stats.variance.detach())
        if blend < 1.0:
            # value z + blend·(out − z); the gradient is out's (straight-through: the identity)
            out = x.detach() + blend * (out - x).detach() + (out - out.detach())
        return QuantizerOutput(out, stats.indices, loss, terms, soft_counts=stats.mass.detach(), soft_codes=stats.soft)

    def _begin_batch(self, x: Tensor) -> float:
        """A training batch's bookkeeping before the assignment: the first batch's set-up, the
        warm-up counter. Returns the code's share in what the decoder sees (1: quantized; below 1
        during the warm-up)."""
        if not bool(self.initialized) or float(self.distance_scale) == 0:
            self._initialize(x)
        if not self._warmup_over:
            seen = int(self.warmup_batches)
            if seen < self.warmup_steps:
                self.warmup_batches.add_(1)
                self._warmup_forwards += 1
                return seen / self.warmup_steps
            self._warmup_over = True
        return 1.0

    def soft_codes(self, z: Tensor) -> Tensor:
        """The soft codes ẑ in the input layout, whatever the mode (for soft-code evaluation)."""
        flat, last_shape = flatten(z, self.dim, self.channel_dim)
        dtype = compute_dtype(z)
        with torch.autocast(device_type=z.device.type, enabled=False):
            soft = self._assignment(flat.to(dtype), self.weight.detach().to(dtype), self.softmax_scale()).soft
        return unflatten(soft.to(z.dtype), last_shape, self.channel_dim)

    def extra_repr(self) -> str:
        schedule = (f"temperature={self.temperature_start:g}" if self.temperature_schedule == "constant" else
                    f"temperature={self.temperature_start:g}->{self.temperature_final:g} "
                    f"({self.temperature_schedule}, {self.schedule_steps} steps)")
        return (super().extra_repr() + f", mode={self.mode!r}, {schedule}, decay={self.decay:g}, "
                f"revive_threshold={self.revive_threshold:g}, warmup_steps={self.warmup_steps}, "
                f"beta={self.beta:g}{'' if self.beta_final is None else f'->{self.beta_final:g}'}, "
                f"codebook_init={self.codebook_init!r}, implementation={self.implementation!r}")
