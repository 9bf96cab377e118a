"""DDCL, the soft-codebook quantizer, in one place: its parts and the one internal interface between them.

    quantizer.py    DDCLQuantizer: the module users build (modes, loss, warm-up, the Quantizer interface)
    arguments.py    the allowed values of its choice arguments and their checks (DDCL_CHOICES)
    temperature.py  TemperatureSchedule: τ and the data-relative divisor s = τ·d̄, advanced by step()
    assignment.py   assign(z, codebook, divisor, ...) -> Assignment: q, soft code, hard index, L_q = L_OLS + V
    fused.py        the fused CPU/CUDA autograd path behind assign (blocks of rows, q never kept whole)
    cpu_pool.py     the thread pool fused.py runs its row blocks on
    statistics.py   soft_statistics(z, codebook, divisor) -> SoftStatistics: Σ_i q_ik z_i, Σ_i q_ik, usage
    mstep.py        MStepCodebook: the codebook as an EMA of those statistics, k-means start, revival
    multi.py        MultiCodebookDDCL: the base of the quantizers made of several DDCLQuantizers
    residual.py     ResidualDDCL: L levels, each a DDCLQuantizer fed the residual of the levels before it
    grouped.py      GroupedDDCL: G DDCLQuantizers over G channel groups

The interface: quantizer.py calls ``assign`` for what the decoder and the loss see, ``soft_statistics`` on
sg(z) for the M-step, and hands the result to ``MStepCodebook.update``; the temperature object gives the
divisor both use. Nothing here imports anything but torch, einops and the library's shared modules
(``ddcl_vq.base``, ``blocks``, ``kmeans``, ``distributed``).
"""
from .quantizer import (CODEBOOK_INITS, DDCL_CHOICES, IMPLEMENTATIONS, MODES, STATE_BUFFERS, TEMPERATURE_SCHEDULES,
                        TRUNCATE_ABOVE, TRUNCATED_SUPPORT, DDCLQuantizer)
from .grouped import GroupedDDCL
from .residual import ResidualDDCL

__all__ = ["DDCLQuantizer", "ResidualDDCL", "GroupedDDCL", "TRUNCATE_ABOVE", "TRUNCATED_SUPPORT", "STATE_BUFFERS",
           "DDCL_CHOICES", "MODES", "CODEBOOK_INITS", "TEMPERATURE_SCHEDULES", "IMPLEMENTATIONS"]
