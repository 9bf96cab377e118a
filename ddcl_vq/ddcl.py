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
τ times the running mean squared distance to the nearest code, so τ = 0.03 (the default) means
"a code 3% of a typical quantization error farther than the nearest is e times less likely", at
any D and any feature scale; ``"dim"`` divides by τ·D (a per-dimension temperature, the
project's first default, τ = 0.01).

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
                   squared_distances, unflatten)
from .distributed import all_reduce_sum_, broadcast_, world_size
from .kmeans import kmeans_init_
from .statistics import SoftStatistics, soft_statistics

MODES = ("soft", "straight_through", "soft_straight_through")
CODEBOOK_UPDATES = ("mstep", "gradient")
TEMPERATURE_REFERENCES = ("data", "dim")
ENCODER_GRADIENTS = ("identity", "rotation")
REVIVE_CRITERIA = ("usage", "mass")
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


class DDCLQuantizer(Quantizer):
    """Differentiable soft codebook (DDCL) with three output modes and its own temperature schedule.

    Args:
        num_codes: K, codebook size.
        dim: D, the channel size of the encoder features.
        temperature: τ, the schedule's start value; the softmax divisor is τ times the
            ``temperature_reference`` scale. Default 0.03: a sharp M-step (each code the mean of
            the vectors it wins and of few others). Measured against 0.1, the previous default, on
            every headline setting (README, fourth round): hard-code PSNR 24.24 ± 0.29 dB against
            24.20 ± 0.37 over seven seeds at K = 256, +0.07 dB and more codes in use on photographs,
            level at K = 1024, −0.05 dB at K = 4096.
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
            seeding: where the distortion is); 0 turns revival off. Counted in the ``revived`` buffer.
        revive_criterion: ``"usage"`` (default): the EMA of the code's hard counts — a code that
            stops winning vectors is re-seeded even while its soft mass, fed by the softmax tails of
            its neighbours' vectors, stays above the threshold; ``"mass"``: the EMA of its soft mass
            Σ_i q_ik (the previous default; measured with the warm-up: 97.4% / 98.7% of codes used at
            K = 4096 and 92% on natural_patches, against 99.95% and 97.0% by usage; README).
        warmup_steps: quantization warm-up (default 100): during the first ``warmup_steps``
            training forwards the decoder sees z + α·(out − z), α rising linearly from 0 to 1, where
            out is what the mode passes on (the hard code in ``straight_through`` mode); the gradient
            is out's (straight-through: the identity) and the M-step codebook follows the features
            from the first batch. Measured: quantizing from the first step collapses the codebook
            onto 1–3 codes while the young encoder's features contract, and the decoder learns from
            near-constant input until revival spreads the codes again (perplexity 2–11 at step 25);
            with the warm-up the autoencoder learns from the start and hard-code PSNR rose by
            0.2–0.7 dB on every seed at K = 256 and 1024 (README). Counted by training forwards (not :meth:`step`),
            so a host loop that never calls ``step()`` still leaves it; evaluation always quantizes.
            0 turns it off.
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
            readout form; prone to collapse in a VQ-VAE, see the README).
            ``"soft_straight_through"``: decoder sees w_{k*}, gradients as if it were ẑ.
        beta: commitment weight (``straight_through`` mode only).
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
        chunk_threshold_bytes: the ``"auto"`` switch point (default 64 MiB, e.g. N·K = 16M in
            float32). Above it memory wins over speed. Measured on a 2-core CPU at N = 8192,
            D = 64: in ``straight_through`` mode (nothing kept for backward) the two are equally
            fast; in the soft modes fused keeps q and runs at 84–88% of six bare matmuls against
            66–70% for chunked (recomputing the logits is a seventh matmul) — raise the threshold
            to keep soft mode on the fused path at large N·K if the memory is there.

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

    def __init__(self, num_codes: int, dim: int, *, temperature: float = 0.03,
                 temperature_final: Optional[float] = None, temperature_schedule: str = "constant",
                 schedule_steps: Optional[int] = None, temperature_reference: str = "data",
                 mode: str = "straight_through", beta: float = 0.25,
                 codebook_update: str = "mstep", decay: float = 0.9, revive_threshold: float = 0.03,
                 revive_criterion: str = "usage", restart_step: int = 0,
                 encoder_gradient: str = "identity", warmup_steps: int = 100,
                 codebook_init: str = "kmeans", channel_dim: int = 1,
                 implementation: str = "auto", chunk_size: Optional[int] = None,
                 chunk_threshold_bytes: int = 64 * 2 ** 20):
        super().__init__(num_codes, dim, channel_dim)
        if mode not in MODES:
            raise ValueError(f"expected mode in {MODES}, got {mode!r}")
        if codebook_init not in INITS:
            raise ValueError(f"expected codebook_init in {INITS}, got {codebook_init!r}")
        if not beta >= 0:
            raise ValueError(f"expected beta >= 0, got {beta!r}")
        if temperature_reference not in TEMPERATURE_REFERENCES:
            raise ValueError(f"expected temperature_reference in {TEMPERATURE_REFERENCES}, "
                             f"got {temperature_reference!r}")
        if codebook_update not in CODEBOOK_UPDATES:
            raise ValueError(f"expected codebook_update in {CODEBOOK_UPDATES}, got {codebook_update!r}")
        if revive_criterion not in REVIVE_CRITERIA:
            raise ValueError(f"expected revive_criterion in {REVIVE_CRITERIA}, got {revive_criterion!r}")
        if encoder_gradient not in ENCODER_GRADIENTS:
            raise ValueError(f"expected encoder_gradient in {ENCODER_GRADIENTS}, got {encoder_gradient!r}")
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 <= decay < 1:
            raise ValueError(f"expected 0 <= decay < 1, got {decay!r}")
        if isinstance(revive_threshold, bool) or not isinstance(revive_threshold, (int, float)) \
                or not 0 <= revive_threshold < 1:
            raise ValueError(f"expected 0 <= revive_threshold < 1, got {revive_threshold!r}")
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
        self.temperature_reference = temperature_reference
        self.codebook_update = codebook_update
        self.decay = float(decay)
        self.revive_threshold = float(revive_threshold)
        self.revive_criterion = revive_criterion
        if isinstance(restart_step, bool) or not isinstance(restart_step, int) or restart_step < 0:
            raise ValueError(f"expected restart_step, an int >= 0 (0 = never), got {restart_step!r}")
        self.restart_step = restart_step
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"expected warmup_steps, an int >= 0 (0 = none), got {warmup_steps!r}")
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
        # training forwards of the warm-up so far (stops at warmup_steps); counted here, not by
        # step(), so a host's training loop that never calls step() still leaves the warm-up
        self.register_buffer("warmup_batches", torch.zeros((), dtype=torch.long))
        self._warmup_over = warmup_steps == 0  # host-side: past it, forward reads no buffer (no sync)

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
        """``temperature``: the τ of the last forward in training mode (the current τ before any);
        ``softmax_scale``: the divisor it was used with; ``revived``: codes re-seeded so far;
        ``min_code_mass``: the smallest EMA soft mass (in vectors per batch)."""
        tau = self.temperature if self._last_temperature is None else self._last_temperature
        return {"temperature": tau, "softmax_scale": self.softmax_scale(tau), "revived": float(self.revived),
                "min_code_mass": float(self.cluster_mass.min())}

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
        # a state_dict from before the M-step existed (codebook trained by gradient): keep the
        # constructor's neutral values for the M-step buffers it lacks
        legacy = [prefix + name for name in ("cluster_mass", "cluster_usage", "cluster_sums", "distance_scale",
                                             "revived")]
        if all(key in missing_keys for key in legacy):
            if self.codebook_update != "gradient" or self.temperature_reference != "dim":
                error_msgs.append(
                    f"{prefix or 'DDCLQuantizer '}state_dict was saved before the M-step codebook existed; "
                    "load it into DDCLQuantizer(..., codebook_update='gradient', temperature_reference='dim')")
            for key in legacy:
                missing_keys.remove(key)
        # a state_dict from before the warm-up existed was trained without one: take it as done
        batches_key = prefix + "warmup_batches"
        if batches_key in missing_keys:
            missing_keys.remove(batches_key)
            self.warmup_batches.fill_(self.warmup_steps)
        self._warmup_over = self.warmup_steps == 0  # re-read the loaded position at the next forward
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

    def _assignment(self, x: Tensor, w: Tensor, codebook_only: bool, scale: float) -> Assignment:
        return assign(x, w, scale, codebook_only=codebook_only,
                      implementation=self.resolve_implementation(x.shape[0], x.dtype), chunk_size=self.chunk_size)

    @torch.no_grad()
    def _initialize(self, x: Tensor) -> None:
        """First training batch: k-means codebook (if asked), the distance scale, the M-step sums."""
        if not bool(self.initialized):
            kmeans_init_(self.weight.data, x)
            if x.shape[0] * world_size() < self.num_codes:
                # k-means seeded with repeats: identical codes would share every update forever
                jitter = torch.randn(self.weight.shape, generator=torch.Generator().manual_seed(0))
                spread = self.weight.data.std(0, keepdim=True).clamp_min(1e-6)
                self.weight.data += 0.01 * spread * jitter.to(self.weight.device, self.weight.dtype)
            self.initialized.fill_(True)
        # The running mean starts at the first batch's distance to its nearest code (in-sample:
        # k-means was fitted on this very batch; 0 when codes outnumber vectors, then a hundredth
        # of the batch's variance).
        xc = x - x.mean(0)
        nearest = squared_distances(x, self.weight.data.to(x.dtype)).min(1).values
        totals = torch.stack([nearest.sum(), xc.pow(2).sum(), torch.tensor(float(x.shape[0]), device=x.device)
                              ]).to(torch.float64)
        all_reduce_sum_(totals)
        mean_nearest, variance = float(totals[0] / totals[2].clamp_min(1)), float(totals[1] / totals[2].clamp_min(1))
        self.distance_scale.fill_(mean_nearest if mean_nearest > 1e-6 * variance else max(0.01 * variance, 1e-12))
        self._restart_statistics(x.shape[0])

    @torch.no_grad()
    def _restart_statistics(self, batch_vectors: int) -> None:
        """M-step statistics consistent with the current codes: every code holds its uniform
        share of a batch (over all processes) and sits at its own mean."""
        share = batch_vectors * world_size() / self.num_codes
        self.cluster_mass.fill_(share)
        self.cluster_usage.fill_(share)
        self.cluster_sums.copy_(self.weight.data * self.cluster_mass[:, None])

    @torch.no_grad()
    def _restart(self, x: Tensor) -> None:
        """Re-fit the codebook by k-means on this batch (the encoder has left its random start):
        codes and M-step statistics restart; the distance scale and counters go on."""
        kmeans_init_(self.weight.data, x)
        self._restart_statistics(x.shape[0])

    @torch.no_grad()
    def _update_statistics(self, x: Tensor, stats: SoftStatistics) -> None:
        """One training batch: EMA of the distance scale and of the soft mass (and, for the M-step,
        of the soft sums, and the new codebook); revival of starved codes. All-reduced: identical
        on every process."""
        g = self.decay
        k = self.num_codes
        hits = torch.bincount(stats.indices, minlength=k).to(stats.mass.dtype)
        totals = torch.cat([stats.mass, hits, stats.nearest.sum()[None],
                            torch.tensor([float(x.shape[0])], device=x.device)]).to(torch.float64)
        all_reduce_sum_(totals)
        mass, hits, nearest_sum, count = totals[:k], totals[k:2 * k], totals[-2], totals[-1]
        # A slow running mean (time constant ~100 steps). Measured: early in training, while the
        # encoder's features contract several-fold, the lagging scale keeps the assignment soft;
        # codes merge where the data left them and are re-seeded where the distortion is — a
        # second, better-placed start of the codebook (README: "what each part buys").
        # (the batch's mean in float64 on the device, rounded once as a Python float would be: no host sync)
        batch_mean = (0.01 * (nearest_sum / count.clamp_min(1))).to(self.distance_scale.dtype)
        self.distance_scale.mul_(0.99).add_(batch_mean)
        self.cluster_mass.mul_(g).add_(mass.to(self.cluster_mass.dtype), alpha=1 - g)
        self.cluster_usage.mul_(g).add_(hits.to(self.cluster_usage.dtype), alpha=1 - g)
        if self.codebook_update == "mstep":
            sums = stats.sums.to(self.cluster_sums.dtype)
            all_reduce_sum_(sums)
            self.cluster_sums.mul_(g).add_(sums, alpha=1 - g)
            self.weight.data.copy_(self.cluster_sums / self.cluster_mass.clamp_min(1e-12)[:, None])
        if self.revive_threshold > 0:
            self._revive(x, stats.nearest, count)

    @torch.no_grad()
    def _revive(self, x: Tensor, nearest: Tensor, batch_vectors: Tensor) -> None:
        """Re-seed codes whose EMA hard usage (or soft mass) is below the threshold on batch vectors
        drawn with probability ∝ their distance to the nearest code (where the distortion is).
        ``batch_vectors``: the (all-reduced, float64) batch size as a tensor; the one host sync is
        the number of starved codes."""
        # rounded to the buffers' dtype: what comparing with (and writing) a Python float does
        threshold = (self.revive_threshold * batch_vectors / self.num_codes).to(self.cluster_mass.dtype)
        measure = self.cluster_usage if self.revive_criterion == "usage" else self.cluster_mass
        starved = measure < threshold  # identical on every process (all-reduced statistics)
        count = int(starved.sum())
        if count == 0:
            return
        per_rank = -(-count // world_size())
        weights = nearest.clamp_min(0) + 1e-12
        pick = torch.multinomial(weights, per_rank, replacement=per_rank > x.shape[0])
        seeds = x[pick].to(self.weight.dtype).contiguous()
        if world_size() > 1:
            parts = [torch.empty_like(seeds) for _ in range(world_size())]
            torch.distributed.all_gather(parts, seeds)
            seeds = torch.cat(parts, 0)
        seeds = seeds[:count]
        broadcast_(seeds)
        self.weight.data[starved] = seeds
        self.cluster_mass[starved] = threshold
        self.cluster_usage[starved] = threshold
        self.cluster_sums[starved] = seeds * threshold
        self.revived += count

    def forward(self, z: Tensor) -> QuantizerOutput:
        flat, last_shape = flatten(z, self.dim, self.channel_dim)
        dtype = compute_dtype(z)
        tau = self.temperature
        if self.training:
            self._last_temperature = tau
        with torch.autocast(device_type=z.device.type, enabled=False):
            x = flat.to(dtype)
            learn = self.training and x.shape[0] > 0  # an empty batch teaches nothing
            if learn and (not bool(self.initialized) or float(self.distance_scale) == 0):
                self._initialize(x.detach())
            if learn and self.restart_step and int(self.schedule_step) == self.restart_step:
                self._restart(x.detach())
            blend = 1.0  # the code's share in what the decoder sees (1: quantized)
            if learn and not self._warmup_over:
                seen = int(self.warmup_batches)
                if seen < self.warmup_steps:
                    blend = seen / self.warmup_steps
                    self.warmup_batches.add_(1)
                else:
                    self._warmup_over = True
            scale = self.softmax_scale(tau)
            if self.codebook_update == "mstep":
                # the M-step's statistics on sg(z) with the codebook before this batch's update
                # the batch decodes the codes it was assigned to (the codebook before its update)
                w = self.weight.detach().to(dtype, copy=True)
                stats = soft_statistics(x.detach(), w, scale, support=self.statistics_support)
                if learn:
                    self._update_statistics(x.detach(), stats)
                indices, counts = stats.indices, stats.mass
                distortion, ols, variance = stats.distortion, stats.ols, stats.variance
                codebook_loss = None
            else:
                w = self.weight.to(dtype)
            if self.mode == "straight_through":
                if self.codebook_update == "gradient":
                    # assignment on sg(z): only the codebook learns from the distortion
                    a = self._assignment(x, w, True, scale)
                    indices, counts = a.indices, a.soft_counts
                    distortion, ols, variance, codebook_loss = a.distortion, a.ols, a.variance, a.distortion
                hard = w.detach()[indices]
                if self.encoder_gradient == "rotation":
                    out = rotate_to(x, hard)
                else:
                    out = hard + (x - x.detach())  # value exactly w_{k*}, gradient identity
                commitment = (x - hard).pow(2).sum(1).mean()
                loss = self.beta * commitment / self.dim
                if codebook_loss is not None:
                    loss = loss + codebook_loss / self.dim
                terms = {"commitment": commitment.detach()}
            else:
                a = self._assignment(x, w, False, scale)
                if self.codebook_update == "gradient":
                    indices, counts = a.indices, a.soft_counts
                    distortion, ols, variance = a.distortion, a.ols, a.variance
                if self.mode == "soft":
                    out = a.soft
                else:
                    out = w.detach()[a.indices] + (a.soft - a.soft.detach())
                loss = a.distortion / self.dim
                terms = {}
            # a gradient-trained codebook needs the running statistics only for a data-relative
            # τ or for revival; the first recipe (τ·D, no revival) skips them on its hot path
            if learn and self.codebook_update == "gradient" and (
                    self.temperature_reference == "data" or self.revive_threshold > 0):
                with torch.no_grad():
                    nearest = (x.detach() - w.detach()[indices]).pow(2).sum(1)
                    self._update_statistics(x.detach(), SoftStatistics(
                        indices=indices, nearest=nearest, mass=counts.detach(), sums=w.detach(),
                        distortion=distortion.detach(), ols=ols.detach(), variance=variance.detach()))
            if blend < 1.0:
                # value z + blend·(out − z); the gradient is out's (straight-through: the identity)
                out = x.detach() + blend * (out - x).detach() + (out - out.detach())
            terms.update(distortion=distortion.detach(), ols=ols.detach(), variance=variance.detach())
        quantized = unflatten(out.to(z.dtype), last_shape, self.channel_dim)
        return QuantizerOutput(quantized=quantized, indices=unflatten(indices, last_shape, self.channel_dim),
                               loss=loss, terms=terms, perplexity=batch_perplexity(indices, self.num_codes),
                               soft_counts=counts.detach())

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
                f"revive_criterion={self.revive_criterion!r}, restart_step={self.restart_step}, "
                f"warmup_steps={self.warmup_steps}, "
                f"encoder_gradient={self.encoder_gradient!r}, "
                f"beta={self.beta:g}, codebook_init={self.codebook_init!r}, "
                f"implementation={self.implementation!r}")
