"""ddcl-vq: a differentiable DDCL soft codebook for VQ-VAEs, with baselines and usage statistics.

Pure torch + einops: no file system, no torchvision, nothing from the rest of the repository,
so the package can be copied into another code base as it is.

Modules, each importing only those below it:

    adapters                 drop-in replacements for other code bases' quantizers
    ddcl, readout            DDCLQuantizer (chooses the assignment path, owns τ and its schedule);
                             DDCLReadout, HierarchicalCompressor
    assignment               the DDCL assignment: reference, fused and chunked paths, one result type
    cpu_pool                 the CPU worker pool the blocked paths run on (set_parallel_blocks)
    hard, ema, vqp           baseline quantizers
    base, kmeans, usage, distributed
                             the Quantizer interface and (N, D) reshapes, k-means init, codebook
                             usage statistics, torch.distributed helpers
"""
from .adapters import NotebookQuantizerAdapter, TamingQuantizerAdapter, VQPAdapter, swap_quantizer
from .assignment import Assignment, assign
from .base import Quantizer, QuantizerOutput
from .ddcl import DDCLQuantizer
from .ema import EMAVQ
from .fsq import FSQQuantizer
from .hard import HardVQ
from .lfq import LFQQuantizer
from .readout import (CompressorOutput, DDCLReadout, HierarchicalCompressor, ReadoutOutput,
                      prototype_param_groups)
from .simvq import SimVQQuantizer
from .usage import USAGE_DEFINITIONS, CodebookUsage, UsageStats
from .vqp import VQPQuantizer

__version__ = "0.1.0"

__all__ = [
    "TamingQuantizerAdapter", "VQPAdapter", "NotebookQuantizerAdapter", "swap_quantizer",
    "Quantizer", "QuantizerOutput", "DDCLQuantizer", "Assignment", "assign",
    "HardVQ", "EMAVQ", "VQPQuantizer", "FSQQuantizer", "SimVQQuantizer", "LFQQuantizer", "CodebookUsage", "UsageStats", "USAGE_DEFINITIONS",
    "DDCLReadout", "ReadoutOutput", "HierarchicalCompressor", "CompressorOutput", "prototype_param_groups",
]
