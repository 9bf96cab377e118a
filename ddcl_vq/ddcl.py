"""The DDCL soft codebook (Deep Dual Competitive Learning) as a VQ-VAE quantizer.

Math (z_i ∈ R^D, codebook W ∈ R^{K×D}, τ the temperature relative to D):

    d_ik  = ‖z_i − w_k‖²
    q_ik  = softmax_k(−d_ik / (τ·D))
    ẑ_i   = Σ_k q_ik w_k                     soft code (convex combination of codes)
    k*_i  = argmin_k d_ik                     hard index
    L_q   = mean_i Σ_k q_ik d_ik              distortion
          = L_OLS + V,  L_OLS = mean_i ‖z_i − ẑ_i‖²,  V = mean_i Σ_k q_ik ‖w_k − ẑ_i‖² ≥ 0

Why τ is relative to D: squared distances grow linearly with D, so a fixed τ would
mean a sharper softmax for wider latents. Dividing by τ·D makes τ a per-dimension
temperature: τ = 0.01 means "a distance gap of 0.01 per latent dimension is worth
one nat of assignment log-odds", whatever D is.

Loss scale: every quantizer in ddcl_vq returns ``loss`` as a per-element mean (the
sum-over-D terms divided by D), the scale of the classic VQ-VAE loss written with
``F.mse_loss``, so swapping quantizers does not change the balance with a pixel MSE.
``terms`` hold the unweighted sum-over-D values.

Layout: the assignment itself (reference, fused and chunked paths) is
:mod:`ddcl_vq.assignment`; this module chooses the path per batch and owns the temperature and
its schedule (state in the ``state_dict``, advanced by :meth:`DDCLQuantizer.step`).
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Dict, List, Optional

import torch
from torch import Tensor, nn

from .assignment import IMPLEMENTATIONS as _PATHS
from .assignment import Assignment, assign
from .base import (QuantizerOutput, Quantizer, batch_perplexity, compute_dtype, flatten,
                   unflatten)
from .kmeans import kmeans_init_

MODES = ("soft", "straight_through", "soft_straight_through")
INITS = ("uniform", "normal", "kmeans")
IMPLEMENTATIONS = ("auto",) + _PATHS
SCHEDULES = ("constant", "cosine", "exponential")


def scheduled_temperature(step: int, start: float, final: float, schedule: str, steps: int) -> float:
    """τ after ``step`` of ``steps`` steps: ``"constant"`` (start), ``"cosine"`` or ``"exponential"``
    anneal from ``start`` to ``final``; past ``steps`` it stays at ``final``."""
    if schedule == "constant":
        return start
    frac = min(step, steps) / steps
    if schedule == "cosine":
        return final + (start - final) * 0.5 * (1 + math.cos(math.pi * frac))
    return start * (final / start) ** frac


def _check_temperature(value: Any, name: str = "temperature") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
        raise ValueError(f"expected a finite {name} > 0, got {value!r}")
    return float(value)


class DDCLQuantizer(Quantizer):
    """Differentiable soft codebook (DDCL) with three output modes and its own temperature schedule.

    Args:
        num_codes: K, codebook size.
        dim: D, the channel size of the encoder features.
        temperature: τ relative to D (softmax over −d/(τ·D)); the schedule's start value.
        temperature_schedule: ``"constant"`` (default), or ``"cosine"`` / ``"exponential"``: anneal
            from ``temperature`` to ``temperature_final`` over ``schedule_steps`` calls of
            :meth:`step` (one per training step), then stay at ``temperature_final``.
        temperature_final, schedule_steps: the anneal's end value and length (needed unless constant).
        mode: what the decoder sees and where gradients go —
            ``"straight_through"`` (default): decoder sees the hard code w_{k*}; the encoder
            gets the straight-through gradient plus ``beta``·‖z − sg(w_{k*})‖²; the codebook
            learns from the DDCL distortion on sg(z) (every code moves toward the data in
            proportion to q_ik, so no code dies). Training and inference decode the same codes.
            ``"soft"``: decoder sees ẑ; L_q trains encoder and codebook jointly (the papers'
            readout form; prone to collapse in a VQ-VAE, see the README).
            ``"soft_straight_through"``: decoder sees w_{k*}, gradients as if it were ẑ.
        beta: commitment weight (``straight_through`` mode only).
        codebook_init: ``"uniform"`` U(−1/K, 1/K) as in the VQ-VAE paper, ``"normal"`` N(0, 1),
            or ``"kmeans"`` (k-means on the first training batch, identical on every process).
        channel_dim: 1 for (B, D, *spatial) inputs, −1 for (..., D).
        implementation: how the assignment is computed (:func:`ddcl_vq.assignment.assign`; same
            values and gradients, to float rounding) — ``"reference"``: plain autograd, several
            N×K tensors kept for backward; ``"fused"``: blocked forward and an analytic backward,
            one N×K tensor kept (none in ``straight_through`` mode); ``"chunked"``: like fused but
            recomputes per block in backward, extra memory O(chunk_size·K); ``"auto"`` (default):
            fused, or chunked when the N×K tensor fused would keep exceeds ``chunk_threshold_bytes``.
        chunk_size: rows per block for fused/chunked (default: about 2**18 / K rows, 64 to 1024).
        chunk_threshold_bytes: the ``"auto"`` switch point (default 64 MiB, e.g. N·K = 16M in
            float32). Measured on a 2-core CPU: at D = 64 recomputing the logits per block is
            about as fast as keeping them; at D = 256 keeping them is ~15% faster; above the
            threshold memory wins.

    Schedule state lives in the ``state_dict``: the buffer ``schedule_step`` (calls of
    :meth:`step` so far) and ``schedule``, a float64 tensor [index in ``SCHEDULES``, start τ,
    final τ, steps] that loading restores, so a loaded checkpoint resumes, and evaluates at, the
    temperature it was trained to. ``temperature`` reads the
    current τ; assigning it fixes τ (the schedule becomes constant at that value). A state_dict
    without the schedule (written before it was saved) loads with the constructor's schedule, taken
    as finished (τ = ``temperature_final``) — re-save it to silence the warning.

    Shapes: ``forward(z)`` with z (B, D, H, W) returns quantized (B, D, H, W) and indices (B, H, W).
    """

    has_soft_codes = True

    def __init__(self, num_codes: int, dim: int, *, temperature: float = 0.01,
                 temperature_final: Optional[float] = None, temperature_schedule: str = "constant",
                 schedule_steps: Optional[int] = None, mode: str = "straight_through", beta: float = 0.25,
                 codebook_init: str = "uniform", channel_dim: int = 1,
                 implementation: str = "auto", chunk_size: Optional[int] = None,
                 chunk_threshold_bytes: int = 64 * 2 ** 20):
        super().__init__(num_codes, dim, channel_dim)
        if mode not in MODES:
            raise ValueError(f"expected mode in {MODES}, got {mode!r}")
        if codebook_init not in INITS:
            raise ValueError(f"expected codebook_init in {INITS}, got {codebook_init!r}")
        if not beta >= 0:
            raise ValueError(f"expected beta >= 0, got {beta!r}")
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"expected implementation in {IMPLEMENTATIONS}, got {implementation!r}")
        if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool)
                                       or chunk_size <= 0):
            raise ValueError(f"expected chunk_size to be a positive int or None, got {chunk_size!r}")
        if not chunk_threshold_bytes >= 0:
            raise ValueError(f"expected chunk_threshold_bytes >= 0, got {chunk_threshold_bytes!r}")
        self.implementation = implementation
        self.chunk_size = chunk_size
        self.chunk_threshold_bytes = int(chunk_threshold_bytes)
        self.mode = mode
        self.beta = float(beta)
        self.codebook_init = codebook_init
        self.set_schedule(temperature, temperature_final, temperature_schedule, schedule_steps)
        self._last_temperature: Optional[float] = None
        self.weight = nn.Parameter(torch.empty(num_codes, dim))
        if codebook_init == "normal":
            nn.init.normal_(self.weight)
        else:
            nn.init.uniform_(self.weight, -1.0 / num_codes, 1.0 / num_codes)
        self.register_buffer("initialized", torch.tensor(codebook_init != "kmeans"))
        self.register_buffer("schedule_step", torch.zeros((), dtype=torch.long))

    # ------------------------------------------------------------------ temperature schedule
    def set_schedule(self, temperature: float, temperature_final: Optional[float] = None,
                     temperature_schedule: str = "constant", schedule_steps: Optional[int] = None) -> None:
        """Replace the schedule (start τ, final τ, shape, length); the step counter is kept."""
        start = _check_temperature(temperature)
        if temperature_schedule not in SCHEDULES:
            raise ValueError(f"expected temperature_schedule in {SCHEDULES}, got {temperature_schedule!r}")
        if temperature_schedule == "constant":
            final, steps = start, schedule_steps
        else:
            final = _check_temperature(temperature_final, f"temperature_final for a {temperature_schedule} schedule")
            steps = schedule_steps
            if isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0:
                raise ValueError(f"expected schedule_steps, a positive int, for a {temperature_schedule} "
                                 f"temperature schedule, got {steps!r}")
        self.temperature_start, self.temperature_final = start, final
        self.temperature_schedule, self.schedule_steps = temperature_schedule, steps

    @property
    def temperature(self) -> float:
        """τ now: the schedule's value after ``schedule_step`` steps."""
        if self.temperature_schedule == "constant":
            return self.temperature_start
        return scheduled_temperature(int(self.schedule_step), self.temperature_start, self.temperature_final,
                                     self.temperature_schedule, self.schedule_steps)

    @temperature.setter
    def temperature(self, value: float) -> None:
        self.set_schedule(value)

    def step(self) -> None:
        """Advance the temperature schedule by one training step."""
        self.schedule_step.add_(1)

    def log_stats(self) -> Dict[str, float]:
        """``temperature``: the τ of the last forward in training mode (the current τ before any)."""
        return {"temperature": self.temperature if self._last_temperature is None else self._last_temperature}

    def describe(self) -> Dict[str, Any]:
        return {"mode": self.mode, "temperature": self.temperature}

    def _save_to_state_dict(self, destination: Dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        # the schedule's settings as one float64 tensor (not a buffer: module dtype casts leave it exact)
        destination[prefix + "schedule"] = torch.tensor(
            [SCHEDULES.index(self.temperature_schedule), self.temperature_start, self.temperature_final,
             self.schedule_steps or 0], dtype=torch.float64)

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, local_metadata, strict: bool,
                              missing_keys: List[str], unexpected_keys: List[str], error_msgs: List[str]) -> None:
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        key = prefix + "schedule"
        if key in unexpected_keys:
            unexpected_keys.remove(key)
        if key in state_dict:
            try:
                kind, start, final, steps = state_dict[key].tolist()
                self.set_schedule(start, final, SCHEDULES[int(kind)], int(steps) or None)
            except (ValueError, IndexError, TypeError) as err:
                error_msgs.append(f"{key}: expected [schedule index, start τ, final τ, steps], got "
                                  f"{state_dict[key]!r} ({err})")
        # a state_dict from before the schedule was saved: keep the constructor's schedule
        step_key = prefix + "schedule_step"
        if step_key in missing_keys:
            missing_keys.remove(step_key)
            if self.temperature_schedule != "constant":
                self.schedule_step.fill_(self.schedule_steps)
                warnings.warn(f"{prefix or 'DDCLQuantizer '}state_dict has no temperature-schedule step; "
                              f"taking the {self.temperature_schedule} schedule as finished "
                              f"(τ = {self.temperature_final:g})", stacklevel=3)

    # ------------------------------------------------------------------ assignment
    @property
    def codebook(self) -> Tensor:
        return self.weight

    def resolve_implementation(self, num_vectors: int, dtype: torch.dtype = torch.float32) -> str:
        """The path ``forward`` takes for a batch of ``num_vectors`` vectors."""
        if self.implementation != "auto":
            return self.implementation
        itemsize = torch.finfo(dtype).bits // 8
        return "chunked" if num_vectors * self.num_codes * itemsize > self.chunk_threshold_bytes else "fused"

    def _assignment(self, x: Tensor, w: Tensor, codebook_only: bool, temperature: float) -> Assignment:
        return assign(x, w, temperature * self.dim, codebook_only=codebook_only,
                      implementation=self.resolve_implementation(x.shape[0], x.dtype), chunk_size=self.chunk_size)

    def forward(self, z: Tensor) -> QuantizerOutput:
        flat, last_shape = flatten(z, self.dim, self.channel_dim)
        dtype = compute_dtype(z)
        tau = self.temperature
        if self.training:
            self._last_temperature = tau
        with torch.autocast(device_type=z.device.type, enabled=False):
            x = flat.to(dtype)
            if self.training and not bool(self.initialized):
                kmeans_init_(self.weight.data, x)
                self.initialized.fill_(True)
            w = self.weight.to(dtype)
            terms = {}
            if self.mode == "straight_through":
                # assignment on sg(z): only the codebook learns from the distortion
                a = self._assignment(x, w, True, tau)
                hard = w.detach()[a.indices]
                out = hard + (x - x.detach())  # value exactly w_{k*}, gradient identity
                commitment = (x - hard).pow(2).sum(1).mean()
                loss = (a.distortion + self.beta * commitment) / self.dim
                terms["commitment"] = commitment.detach()
            else:
                a = self._assignment(x, w, False, tau)
                if self.mode == "soft":
                    out = a.soft
                else:
                    out = w.detach()[a.indices] + (a.soft - a.soft.detach())
                loss = a.distortion / self.dim
            terms.update(distortion=a.distortion.detach(), ols=a.ols.detach(), variance=a.variance.detach())
        quantized = unflatten(out.to(z.dtype), last_shape, self.channel_dim)
        indices = unflatten(a.indices, last_shape, self.channel_dim)
        return QuantizerOutput(quantized=quantized, indices=indices, loss=loss, terms=terms,
                               perplexity=batch_perplexity(a.indices, self.num_codes),
                               soft_counts=a.soft_counts)

    def soft_codes(self, z: Tensor) -> Tensor:
        """The soft codes ẑ in the input layout, whatever the mode (for soft-code evaluation)."""
        flat, last_shape = flatten(z, self.dim, self.channel_dim)
        dtype = compute_dtype(z)
        with torch.autocast(device_type=z.device.type, enabled=False):
            soft = self._assignment(flat.to(dtype), self.weight.to(dtype), False, self.temperature).soft
        return unflatten(soft.to(z.dtype), last_shape, self.channel_dim)

    def extra_repr(self) -> str:
        schedule = (f"temperature={self.temperature_start:g}" if self.temperature_schedule == "constant" else
                    f"temperature={self.temperature_start:g}->{self.temperature_final:g} "
                    f"({self.temperature_schedule}, {self.schedule_steps} steps)")
        return (super().extra_repr() + f", mode={self.mode!r}, {schedule}, "
                f"beta={self.beta:g}, codebook_init={self.codebook_init!r}, "
                f"implementation={self.implementation!r}")
