"""ddcl-vq: a differentiable DDCL soft codebook for VQ-VAEs, with baselines and usage statistics.

The library is pure torch + einops (no file system, nothing from the rest of the package), so it can
be copied into another code base as it is. Its modules, each importing only those below it:
adapters; readout; ddcl (the DDCL quantizer's subpackage: its parts and their interface are in
ddcl_vq/ddcl/__init__.py); the other quantizers, one module each (hard, ema, vqp, ibq, fvq, fsq,
simvq, lfq: the peer library imported lazily);
base, kmeans, usage, distributed, blocks. The allowed values of the quantizers' choice arguments
are tuples in their modules (``ddcl_vq.ddcl.arguments.DDCL_CHOICES``, ``ddcl_vq.hard.DISTANCES``,
``ddcl_vq.ibq.IBQ_LOGITS``).
"""
from .adapters import NotebookQuantizerAdapter, TamingQuantizerAdapter, VQPAdapter, swap_quantizer
from .base import Quantizer, QuantizerOutput
from .ddcl import DDCLQuantizer, GroupedDDCL, ResidualDDCL
from .ema import EMAVQ
from .fsq import FSQQuantizer
from .fvq import FVQQuantizer
from .hard import HardVQ
from .ibq import IBQQuantizer
from .lfq import LFQQuantizer
from .readout import DDCLReadout, HierarchicalCompressor, prototype_param_groups
from .simvq import SimVQQuantizer
from .usage import USAGE_DEFINITIONS, CodebookUsage, UsageStats
from .vqp import VQPQuantizer

__version__ = "0.2.0"

__all__ = [
    "Quantizer", "QuantizerOutput", "DDCLQuantizer", "HardVQ", "EMAVQ", "VQPQuantizer", "FSQQuantizer",
    "ResidualDDCL", "GroupedDDCL",
    "SimVQQuantizer", "LFQQuantizer", "IBQQuantizer", "FVQQuantizer",
    "CodebookUsage", "UsageStats", "USAGE_DEFINITIONS",
    "swap_quantizer", "TamingQuantizerAdapter", "VQPAdapter", "NotebookQuantizerAdapter",
    "DDCLReadout", "HierarchicalCompressor", "prototype_param_groups",
]

