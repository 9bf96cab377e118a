"""ddcl-vq: a differentiable DDCL soft codebook for VQ-VAEs, with baselines and usage statistics.

Pure torch + einops: no file system, no torchvision, nothing from the rest of the repository,
so the package can be copied into another code base as it is.

Modules, each importing only those below it:

    adapters                 drop-in replacements for other code bases' quantizers
    ddcl, readout            DDCLQuantizer (chooses the assignment path, each mode's output);
                             DDCLReadout, HierarchicalCompressor
    temperature, mstep       DDCLQuantizer's parts: τ and its schedule; the codebook's running state
                             (first-batch set-up, M-step, revival)
    arguments                DDCLQuantizer's allowed argument values (MODES, ..., DDCL_CHOICES)
    assignment, statistics   the DDCL assignment (assign: reference path, one result type); the
                             M-step's soft statistics
    fused                    the fused and chunked assignment paths (autograd function, CPU q buffer)
    cpu_pool                 the CPU worker pool the blocked paths run on (set_parallel_blocks)
    hard, ema, vqp           baseline quantizers
    ibq                      index backpropagation quantization (IBQ, a peer written after its authors' code)
    fsq, simvq, lfq          newer peers from vector-quantize-pytorch (FSQ, SimVQ, LFQ; imported lazily)
    base, kmeans, usage, distributed
                             the Quantizer interface and (N, D) reshapes, k-means init, codebook
                             usage statistics, torch.distributed helpers
    blocks                   block policy, exact first minimum/maximum, blocked nearest code
"""
from .adapters import NotebookQuantizerAdapter, TamingQuantizerAdapter, VQPAdapter, swap_quantizer
from .arguments import (CODEBOOK_INITS, CODEBOOK_UPDATES, DDCL_CHOICES, ENCODER_GRADIENTS, IMPLEMENTATIONS, MODES,
                        REVIVE_CRITERIA, TEMPERATURE_REFERENCES, TEMPERATURE_SCHEDULES)
from .assignment import Assignment, assign
from .base import Quantizer, QuantizerOutput
from .ddcl import DDCLQuantizer
from .ema import EMAVQ
from .fsq import FSQQuantizer
from .fvq import FVQQuantizer
from .hard import DISTANCES, HARDVQ_CHOICES, HardVQ
from .ibq import IBQ_LOGITS, IBQQuantizer
from .lfq import LFQQuantizer
from .readout import (CompressorOutput, DDCLReadout, HierarchicalCompressor, ReadoutOutput,
                      prototype_param_groups)
from .simvq import SimVQQuantizer
from .usage import QUEUE_LENGTH, USAGE_DEFINITIONS, CodebookUsage, RecentUsage, UsageStats, uniform_ceiling
from .vqp import VQPQuantizer

__version__ = "0.1.0"

__all__ = [
    "TamingQuantizerAdapter", "VQPAdapter", "NotebookQuantizerAdapter", "swap_quantizer",
    "Quantizer", "QuantizerOutput", "DDCLQuantizer", "Assignment", "assign",
    "HardVQ", "EMAVQ", "VQPQuantizer", "FSQQuantizer", "SimVQQuantizer", "LFQQuantizer", "IBQQuantizer", "FVQQuantizer", "CodebookUsage", "UsageStats", "USAGE_DEFINITIONS", "RecentUsage", "QUEUE_LENGTH", "uniform_ceiling",
    "DDCLReadout", "ReadoutOutput", "HierarchicalCompressor", "CompressorOutput", "prototype_param_groups",
    # allowed values of the quantizers' choice arguments (their defaults: the constructors' signatures)
    "MODES", "CODEBOOK_UPDATES", "CODEBOOK_INITS", "TEMPERATURE_REFERENCES", "TEMPERATURE_SCHEDULES",
    "ENCODER_GRADIENTS", "REVIVE_CRITERIA", "IMPLEMENTATIONS", "DDCL_CHOICES", "DISTANCES", "HARDVQ_CHOICES", "IBQ_LOGITS",
]
