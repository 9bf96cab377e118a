"""The DDCL soft codebook (Deep Dual Competitive Learning) as a VQ-VAE quantizer.

Math (z_i ∈ R^D, codebook W ∈ R^{K×D}, τ the temperature, s the softmax divisor):

    d_ik  = ‖z_i − w_k‖²
    q_ik  = softmax_k(−d_ik / s),   s = τ·d̄ (default: d̄ the running mean of min_k d_ik) or τ·D
    ẑ_i   = Σ_k q_ik w_k                     soft code (convex combination of codes)
    k*_i  = argmin_k d_ik                     hard index
    L_q   = mean_i Σ_k q_ik d_ik              distortion
          = L_OLS + V,  L_OLS = mean_i ‖z_i − ẑ_i‖²,  V = mean_i Σ_k q_ik ‖w_k − ẑ_i‖² ≥ 0

The codebook (default ``codebook_update="mstep"``) is DDCL's own M-step: the codebook that
minimises L_q at fixed assignments is the soft-weighted mean Σ_i q_ik z_i / Σ_i q_ik, and the
quantizer keeps an exponential moving average (``decay``) of those two sums over batches — the
soft analogue of an EMA codebook. Every code has positive mass, so every code moves toward the
data every step; that, with a codebook started by k-means on the first batch, is what keeps the
whole codebook in use. ``codebook_update="gradient"`` trains the codebook by the gradient of
L_q instead (an optimizer at ρ × the encoder's learning rate; the project's first default).

Why the temperature is relative (``temperature_reference``): squared distances grow with D and
with the encoder's feature scale, which drifts during training. ``"data"`` (default) divides by
τ times the running mean squared distance to the nearest code, so τ = 0.03 means
"a code 3% of a typical quantization error farther than the nearest is e times less likely", at
any D and any feature scale; ``"dim"`` divides by τ·D (a per-dimension temperature, the
project's first choice, with τ = 0.01).

Loss scale: every quantizer in ddcl_vq returns ``loss`` as a per-element mean (the
sum-over-D terms divided by D), the scale of the classic VQ-VAE loss written with
``F.mse_loss``, so swapping quantizers does not change the balance with a pixel MSE.
``terms`` hold the unweighted sum-over-D values.

Layout: the assignment itself (reference, fused and chunked paths) is :mod:`ddcl_vq.assignment`,
the M-step statistics :mod:`ddcl_vq.statistics`; this module chooses the path per batch and turns
the assignment into each mode's output. The quantizer's parts live beside it: the temperature and
its schedule (:mod:`ddcl_vq.temperature`), the codebook's running state — first-batch set-up,
M-step, revival (:mod:`ddcl_vq.mstep`) — and the allowed argument values (:mod:`ddcl_vq.arguments`).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .arguments import (CODEBOOK_INITS, CODEBOOK_UPDATES, DDCL_CHOICES, ENCODER_GRADIENTS, IMPLEMENTATIONS, MODES,
                        REVIVE_CRITERIA, TEMPERATURE_REFERENCES, TEMPERATURE_SCHEDULES, check_arguments)
from .assignment import Assignment, assign
from .base import QuantizerOutput, Quantizer, batch_perplexity, compute_dtype, flatten, unflatten
from .mstep import MStepCodebook
from .statistics import SoftStatistics, soft_statistics
from .temperature import TemperatureSchedule

# the allowed values are defined in ddcl_vq.arguments and readable here too (ddcl_vq.ddcl.DDCL_CHOICES ...)
__all__ = ["DDCLQuantizer", "rotate_to", "TRUNCATE_ABOVE", "TRUNCATED_SUPPORT", "DDCL_CHOICES", "MODES",
           "CODEBOOK_UPDATES", "CODEBOOK_INITS", "TEMPERATURE_REFERENCES", "TEMPERATURE_SCHEDULES",
           "ENCODER_GRADIENTS", "REVIVE_CRITERIA", "IMPLEMENTATIONS"]

def rotate_to(z: Tensor, code: Tensor) -> Tensor:
    """The rotation trick (Fifty et al. 2024): the value of ``code``, and a gradient to ``z``
    through the rotation and rescaling that map z onto its code (instead of the identity).

    z, code: (N, D). out = sg(λ R) z with R the rotation taking z/‖z‖ to code/‖code‖ in their
    plane and λ = ‖code‖/‖z‖; as a function of z (R, λ held fixed) its Jacobian is λR.
    """
    z_norm = z.norm(dim=1, keepdim=True).clamp_min(1e-12)
    code_norm = code.norm(dim=1, keepdim=True).clamp_min(1e-12)
    u = (z / z_norm).detach()
    c = (code / code_norm).detach()
    r = u + c
    r = (r / r.norm(dim=1, keepdim=True).clamp_min(1e-12)).detach()
    rotated = z - 2 * (z * r).sum(1, keepdim=True) * r + 2 * (z * u).sum(1, keepdim=True) * c
    return rotated * (code_norm / z_norm).detach()


#: above this many codes the M-step's soft statistics use each vector's TRUNCATED_SUPPORT nearest
#: codes (see :func:`ddcl_vq.statistics.soft_statistics`); up to it, every code (exact)
TRUNCATE_ABOVE = 4096
TRUNCATED_SUPPORT = 64


class DDCLQuantizer(TemperatureSchedule, MStepCodebook, Quantizer):
    """Differentiable soft codebook (DDCL) with three output modes and its own temperature schedule.

    Args:
        num_codes: K, codebook size.
        dim: D, the channel size of the encoder features.
        temperature: τ, the schedule's start value; the softmax divisor is τ times the
            ``temperature_reference`` scale. The default is a sharp M-step (each code the mean of
            the vectors it wins and of few others); how it compares with 0.1, the previous default,
            is in docs/results.md.
        temperature_reference: ``"data"`` (default): the running mean squared distance of a
            vector to its nearest code (a buffer, ``distance_scale``, EMA over training batches);
            ``"dim"``: D (τ is then a per-dimension temperature; the first default was 0.01).
        codebook_update: ``"mstep"`` (default): the codebook is DDCL's M-step, an EMA (``decay``)
            of Σ_i q_ik z_i over an EMA of Σ_i q_ik, computed on sg(z) in training forwards; the
            codebook is a parameter with ``requires_grad=False``. ``"gradient"``: the codebook is
            trained by the gradient of L_q (give it to the optimizer, at ρ × the encoder's lr).
        decay: EMA decay of the M-step statistics and of the usage statistics revival reads.
        revive_threshold: a code whose EMA usage (``revive_criterion``) falls below
            ``revive_threshold`` × N/K (its uniform share of a batch of N vectors) is re-seeded on a
            batch vector drawn with probability ∝ its squared distance to its nearest code (k-means++
            seeding: where the distortion is); 0 turns revival off. A re-seeded code's usage starts
            at N/K, as every code's does, so it has ~33 batches to win a vector before it can be
            re-seeded. A batch re-seeds at most one code per vector, the most starved first, each on a
            different vector (what both changed at K > N: docs/results.md, "Large codebooks").
            Counted in the ``revived`` buffer.
        revive_criterion: ``"usage"`` (default): the EMA of the code's hard counts — a code that
            stops winning vectors is re-seeded even while its soft mass, fed by the softmax tails of
            its neighbours' vectors, stays above the threshold; ``"mass"``: the EMA of its soft mass
            Σ_i q_ik (the previous default; the two are compared in docs/results.md).
        revive_twins: also re-seed (when revival is on) the later code of any pair closer than the
            softmax divisor s (squared distance): the soft M-step cannot pull such a pair apart, so
            they are one code in two places and noise decides the hard index between them
            (``revived_twins`` counts them, since construction or loading; docs/prior.md). Each
            training batch checks the next 512 codes against all K (``TWIN_ROWS``·K·D work; the whole
            codebook every ⌈K/512⌉ batches). Off by default while it is measured.
        warmup_steps: quantization warm-up: during the first ``warmup_steps`` training forwards
            the decoder sees z + α·(out − z), α rising linearly from 0 to 1, where out is what the
            mode passes on (the hard code in ``straight_through`` mode); the gradient is out's
            (straight-through: the identity) and the M-step codebook follows the features from the
            first batch. It keeps the young encoder's contracting features from collapsing the
            codebook onto a few codes while the decoder learns from near-constant input (what it
            buys: docs/results.md). Counted by training forwards (not :meth:`step`), so a host loop
            that never calls ``step()`` still leaves it; evaluation always quantizes. 0 turns it off.
        encoder_gradient: what the encoder receives through the hard code in
            ``straight_through`` mode — ``"identity"`` (default; the classic straight-through
            estimator) or ``"rotation"`` (:func:`rotate_to`).
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
            readout form; prone to collapse in a VQ-VAE, see docs/results.md).
            ``"soft_straight_through"``: decoder sees w_{k*}, gradients as if it were ẑ.
        beta: commitment weight (``straight_through`` mode only).
        beta_final: the commitment weight rises linearly from ``beta`` to ``beta_final`` (default
            1.0) over ``schedule_steps`` calls of :meth:`step` (the training length), then stays
            there: a loose commitment while the autoencoder learns, a tight one at the end, which
            pulls the features onto their codes (a smaller quantization gap; what it buys:
            docs/results.md). Without ``schedule_steps`` (a host loop that does not say how long it
            trains) the weight stays at ``beta``; ``None`` turns the ramp off.
        codebook_init: ``"kmeans"`` (default: k-means on the first training batch, identical on
            every process; when the batch has fewer vectors than codes, repeated seeds are
            separated by a small deterministic jitter), ``"uniform"`` U(−1/K, 1/K) as in the
            VQ-VAE paper, or ``"normal"`` N(0, 1).
        channel_dim: 1 for (B, D, *spatial) inputs, −1 for (..., D).
        implementation: how the assignment is computed (:func:`ddcl_vq.assignment.assign`; same
            values and gradients, to float rounding) — ``"reference"``: plain autograd, several
            N×K tensors kept for backward; ``"fused"``: blocked forward and an analytic backward,
            one N×K tensor kept (none in ``straight_through`` mode); ``"chunked"``: like fused but
            recomputes per block in backward, extra memory O(chunk_size·K); ``"auto"`` (default):
            fused, or chunked when the N×K tensor fused would keep exceeds ``chunk_threshold_bytes``.
        chunk_size: rows per block for fused/chunked (default :func:`ddcl_vq.blocks.block_rows`:
            on the CPU about 2**18 / K rows, 64 to 1024; on a GPU the whole batch within a 1 GiB budget).
        chunk_threshold_bytes: the ``"auto"`` switch point, in bytes of the N×K tensor. Above it
            memory wins over speed: in ``straight_through`` mode (nothing kept for backward) the two
            paths do the same work; in the soft modes chunked recomputes the logits in backward (a
            seventh matmul), so raise the threshold to keep soft mode on the fused path at large
            N·K if the memory is there (timings: docs/performance.md).

    Schedule state lives in the ``state_dict``: the buffer ``schedule_step`` (calls of
    :meth:`step` so far) and ``schedule``, a float64 tensor [index in ``TEMPERATURE_SCHEDULES``,
    start τ, final τ, steps] that loading restores, so a loaded checkpoint resumes, and evaluates
    at, the temperature it was trained to. ``temperature`` reads the current τ; assigning it fixes
    τ (the schedule becomes constant at that value). A state_dict
    without the schedule (written before it was saved) loads with the constructor's schedule, taken
    as finished (τ = ``temperature_final``) — re-save it to silence the warning.

    Shapes: ``forward(z)`` with z (B, D, H, W) returns quantized (B, D, H, W) and indices (B, H, W).
    """

    has_soft_codes = True

    def __init__(self, num_codes: int, dim: int, *, temperature: float = 0.03,
                 temperature_final: Optional[float] = None, temperature_schedule: str = "constant",
                 schedule_steps: Optional[int] = None, temperature_reference: str = "data",
                 mode: str = "straight_through", beta: float = 0.25, beta_final: Optional[float] = 1.0,
                 codebook_update: str = "mstep", decay: float = 0.9, revive_threshold: float = 0.03,
                 revive_criterion: str = "usage", revive_twins: bool = False, restart_step: int = 0,
                 encoder_gradient: str = "identity", warmup_steps: int = 100,
                 codebook_init: str = "kmeans", channel_dim: int = 1,
                 implementation: str = "auto", chunk_size: Optional[int] = None,
                 chunk_threshold_bytes: int = 64 * 2 ** 20):
        super().__init__(num_codes, dim, channel_dim)
        check_arguments(dict(
            mode=mode, codebook_update=codebook_update, codebook_init=codebook_init,
            temperature_reference=temperature_reference, temperature_schedule=temperature_schedule,
            encoder_gradient=encoder_gradient, revive_criterion=revive_criterion, implementation=implementation,
            beta=beta, decay=decay, revive_threshold=revive_threshold, revive_twins=revive_twins, chunk_size=chunk_size,
            beta_final=beta_final,
            chunk_threshold_bytes=chunk_threshold_bytes, restart_step=restart_step, warmup_steps=warmup_steps))
        self.implementation = implementation
        self.chunk_size = chunk_size
        self.chunk_threshold_bytes = int(chunk_threshold_bytes)
        self.mode = mode
        self.beta = float(beta)
        self.beta_final = None if beta_final is None else float(beta_final)
        self.codebook_init = codebook_init
        self.temperature_reference = temperature_reference
        self.codebook_update = codebook_update
        self.decay = float(decay)
        self.revive_threshold = float(revive_threshold)
        self.revive_criterion = revive_criterion
        self.revive_twins = revive_twins
        self.restart_step = restart_step
        self.warmup_steps = warmup_steps
        self.encoder_gradient = encoder_gradient
        self.set_schedule(temperature, temperature_final, temperature_schedule, schedule_steps)
        self._last_temperature: Optional[float] = None
        self.weight = nn.Parameter(torch.empty(num_codes, dim))
        if codebook_init == "normal":
            nn.init.normal_(self.weight)
        else:
            nn.init.uniform_(self.weight, -1.0 / num_codes, 1.0 / num_codes)
        self.weight.requires_grad_(codebook_update == "gradient")
        self.register_buffer("initialized", torch.tensor(codebook_init != "kmeans"))
        self.register_buffer("schedule_step", torch.zeros((), dtype=torch.long))
        # M-step / revival state: EMA of Σ_i q_ik and Σ_i q_ik z_i, the distance scale, revivals
        self.register_buffer("cluster_mass", torch.ones(num_codes))
        self.register_buffer("cluster_usage", torch.ones(num_codes))   # EMA of hard counts
        self.register_buffer("cluster_sums", self.weight.detach().clone())
        self.register_buffer("distance_scale", torch.zeros(()))  # 0: not measured yet
        self.register_buffer("revived", torch.zeros((), dtype=torch.long))
        # of them, twins (revive_twins); for the logs only: not saved, counted from 0 after a resume
        self.register_buffer("revived_twins", torch.zeros((), dtype=torch.long), persistent=False)
        if revive_twins:  # which block of codes the next batch checks for twins (saved: a resume goes on)
            self.register_buffer("twin_position", torch.zeros((), dtype=torch.long))
        # training forwards of the warm-up so far (stops at warmup_steps); counted here, not by
        # step(), so a host's training loop that never calls step() still leaves the warm-up
        self.register_buffer("warmup_batches", torch.zeros((), dtype=torch.long))
        self._warmup_over = warmup_steps == 0  # host-side: past it, forward reads no buffer (no sync)

    def log_stats(self) -> Dict[str, float]:
        """``temperature``: the τ of the last forward in training mode (the current τ before any);
        ``softmax_scale``: the divisor it was used with; ``revived``: codes re-seeded so far;
        ``min_code_mass``: the smallest EMA soft mass (in vectors per batch); with ``revive_twins``,
        ``revived_twins``: of the revived, twins (since construction or loading)."""
        tau = self.temperature if self._last_temperature is None else self._last_temperature
        return {"temperature": tau, "softmax_scale": self.softmax_scale(tau), "revived": float(self.revived),
                "min_code_mass": float(self.cluster_mass.min()),
                **({"revived_twins": float(self.revived_twins)} if self.revive_twins else {})}

    def describe(self) -> Dict[str, Any]:
        return {"mode": self.mode, "temperature": self.temperature,
                "temperature_reference": self.temperature_reference, "codebook_update": self.codebook_update}

    @property
    def statistics_support(self) -> Optional[int]:
        """Codes per vector in the M-step's soft statistics: all (None) up to K = TRUNCATE_ABOVE,
        else each vector's TRUNCATED_SUPPORT nearest (their weights beyond are below e^-20 at the
        default temperature in trained models; the hard index stays exact)."""
        return None if self.num_codes <= TRUNCATE_ABOVE else TRUNCATED_SUPPORT

    def softmax_scale(self, temperature: Optional[float] = None) -> float:
        """The softmax divisor s for τ = ``temperature`` (default: the current τ)."""
        tau = self.temperature if temperature is None else temperature
        if self.temperature_reference == "dim":
            return tau * self.dim
        scale = float(self.distance_scale)
        # before the first training batch has measured the data's scale, fall back to τ·D
        return tau * (scale if scale > 0 else self.dim)

    def _save_to_state_dict(self, destination: Dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "schedule"] = self.schedule_tensor()

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str, local_metadata, strict: bool,
                              missing_keys: List[str], unexpected_keys: List[str], error_msgs: List[str]) -> None:
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        self._load_schedule(state_dict, prefix, unexpected_keys, error_msgs)
        self._load_without_mstep_statistics(prefix, missing_keys, error_msgs)
        # a state_dict from before the warm-up existed was trained without one: take it as done
        batches_key = prefix + "warmup_batches"
        if batches_key in missing_keys:
            missing_keys.remove(batches_key)
            self.warmup_batches.fill_(self.warmup_steps)
        self._warmup_over = self.warmup_steps == 0  # re-read the loaded position at the next forward
        self._load_without_schedule_step(prefix, missing_keys)
        if prefix + "twin_position" in missing_keys:  # saved without revive_twins: start at the first block
            missing_keys.remove(prefix + "twin_position")
            self.twin_position.zero_()

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

    def _assignment(self, x: Tensor, w: Tensor, codebook_only: bool, scale: float) -> Assignment:
        return assign(x, w, scale, codebook_only=codebook_only,
                      implementation=self.resolve_implementation(x.shape[0], x.dtype), chunk_size=self.chunk_size)

    def forward(self, z: Tensor) -> QuantizerOutput:
        flat, last_shape = flatten(z, self.dim, self.channel_dim)
        if flat.shape[0] == 0:  # an empty batch: nothing to quantize, nothing learned
            return self.empty_output(flat, last_shape, self._term_names(), soft_counts=True)
        dtype = compute_dtype(z)
        tau = self.temperature
        if self.training:
            self._last_temperature = tau
        with torch.autocast(device_type=z.device.type, enabled=False):
            x = flat.to(dtype)
            blend = self._begin_batch(x.detach()) if self.training else 1.0
            scale = self.softmax_scale(tau)
            if self.codebook_update == "mstep":
                out, loss, terms, indices, counts = self._forward_mstep(x, dtype, scale)
            else:
                out, loss, terms, indices, counts = self._forward_gradient(x, dtype, scale)
            if blend < 1.0:
                # value z + blend·(out − z); the gradient is out's (straight-through: the identity)
                out = x.detach() + blend * (out - x).detach() + (out - out.detach())
        quantized = unflatten(out.to(z.dtype), last_shape, self.channel_dim)
        return QuantizerOutput(quantized=quantized, indices=unflatten(indices, last_shape, self.channel_dim),
                               loss=loss, terms=terms, perplexity=batch_perplexity(indices, self.num_codes),
                               soft_counts=counts.detach())

    def _term_names(self) -> Tuple[str, ...]:
        return (("commitment",) if self.mode == "straight_through" else ()) + ("distortion", "ols", "variance")

    def _begin_batch(self, x: Tensor) -> float:
        """A training batch's bookkeeping before the assignment: the first batch's set-up, the
        scheduled k-means restart, the warm-up counter. Returns the code's share in what the
        decoder sees (1: quantized; below 1 during the warm-up)."""
        if not bool(self.initialized) or float(self.distance_scale) == 0:
            self._initialize(x)
        if self.restart_step and int(self.schedule_step) == self.restart_step:
            self._restart(x)
        if self._warmup_over:
            return 1.0
        seen = int(self.warmup_batches)
        if seen < self.warmup_steps:
            self.warmup_batches.add_(1)
            return seen / self.warmup_steps
        self._warmup_over = True
        return 1.0

    def _forward_mstep(self, x: Tensor, dtype: torch.dtype, scale: float):
        """``codebook_update="mstep"``: the M-step's statistics on sg(z) against the codebook before
        this batch's update (in training, then the update), and the mode's output from the codes the
        batch was assigned to. -> (out, loss, terms, indices, soft counts)."""
        w = self.weight.detach().to(dtype, copy=True)
        split = self.report_terms or not self.training
        stats = soft_statistics(x.detach(), w, scale, support=self.statistics_support, split=split)
        if self.training:
            self._update_statistics(x.detach(), stats, scale)
        if self.mode == "straight_through":
            out, loss, terms = self._straight_through(x, w, stats.indices)
        else:
            out, loss, terms = self._soft_output(w, self._assignment(x, w, False, scale))
        if split:
            terms.update(distortion=stats.distortion.detach(), ols=stats.ols.detach(), variance=stats.variance.detach())
        return out, loss, terms, stats.indices, stats.mass

    def _forward_gradient(self, x: Tensor, dtype: torch.dtype, scale: float):
        """``codebook_update="gradient"``: the assignment (on sg(z) in ``straight_through`` mode, where
        only the codebook learns from the distortion) and the mode's output; in training, the
        running statistics a data-relative τ or revival read. -> (out, loss, terms, indices, soft counts)."""
        w = self.weight.to(dtype)
        if self.mode == "straight_through":
            a = self._assignment(x, w, True, scale)
            out, loss, terms = self._straight_through(x, w, a.indices, codebook_loss=a.distortion)
        else:
            a = self._assignment(x, w, False, scale)
            out, loss, terms = self._soft_output(w, a)
        # the first recipe (τ·D, no revival) needs no running statistics: it skips them on its hot path
        if self.training and (self.temperature_reference == "data" or self.revive_threshold > 0):
            with torch.no_grad():
                nearest = (x.detach() - w.detach()[a.indices]).pow(2).sum(1)
                self._update_statistics(x.detach(), SoftStatistics(
                    indices=a.indices, nearest=nearest, mass=a.soft_counts.detach(), sums=w.detach(),
                    distortion=a.distortion.detach(), ols=a.ols.detach(), variance=a.variance.detach()), scale)
        terms.update(distortion=a.distortion.detach(), ols=a.ols.detach(), variance=a.variance.detach())
        return out, loss, terms, a.indices, a.soft_counts

    def _straight_through(self, x: Tensor, w: Tensor, indices: Tensor, codebook_loss: Optional[Tensor] = None):
        """``straight_through`` mode: the hard code's value, the encoder's gradient (identity or
        rotation), the commitment loss (plus the codebook's distortion when it is trained by gradient)."""
        hard = w.detach()[indices]
        if self.encoder_gradient == "rotation":
            out = rotate_to(x, hard)
        else:
            out = hard + (x - x.detach())  # value exactly w_{k*}, gradient identity
        commitment = (x - hard).pow(2).sum(1).mean()
        beta: Any = self.beta
        if self.beta_final is not None and self.schedule_steps:  # on the device: no host sync per forward
            progress = (self.schedule_step.to(commitment.dtype) / self.schedule_steps).clamp(max=1.0)
            beta = self.beta + (self.beta_final - self.beta) * progress
        loss = beta * commitment / self.dim
        if codebook_loss is not None:
            loss = loss + codebook_loss / self.dim
        return out, loss, {"commitment": commitment.detach()}

    def _soft_output(self, w: Tensor, a: Assignment):
        """``soft`` (the decoder sees ẑ) and ``soft_straight_through`` (w_{k*}, gradient as ẑ's)
        modes: the loss is the distortion."""
        if self.mode == "soft":
            out = a.soft
        else:
            out = w.detach()[a.indices] + (a.soft - a.soft.detach())
        return out, a.distortion / self.dim, {}

    def soft_codes(self, z: Tensor) -> Tensor:
        """The soft codes ẑ in the input layout, whatever the mode (for soft-code evaluation)."""
        flat, last_shape = flatten(z, self.dim, self.channel_dim)
        dtype = compute_dtype(z)
        with torch.autocast(device_type=z.device.type, enabled=False):
            soft = self._assignment(flat.to(dtype), self.weight.to(dtype), False, self.softmax_scale()).soft
        return unflatten(soft.to(z.dtype), last_shape, self.channel_dim)

    def extra_repr(self) -> str:
        schedule = (f"temperature={self.temperature_start:g}" if self.temperature_schedule == "constant" else
                    f"temperature={self.temperature_start:g}->{self.temperature_final:g} "
                    f"({self.temperature_schedule}, {self.schedule_steps} steps)")
        return (super().extra_repr() + f", mode={self.mode!r}, {schedule}, "
                f"temperature_reference={self.temperature_reference!r}, codebook_update={self.codebook_update!r}, "
                f"decay={self.decay:g}, revive_threshold={self.revive_threshold:g}, "
                f"revive_criterion={self.revive_criterion!r}, revive_twins={self.revive_twins}, "
                f"restart_step={self.restart_step}, warmup_steps={self.warmup_steps}, "
                f"encoder_gradient={self.encoder_gradient!r}, "
                f"beta={self.beta:g}{'' if self.beta_final is None else f'->{self.beta_final:g}'}, codebook_init={self.codebook_init!r}, "
                f"implementation={self.implementation!r}")
