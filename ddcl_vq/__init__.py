"""ddcl-vq: a differentiable DDCL soft codebook for VQ-VAEs, with baselines and usage statistics.

Pure torch + einops: no file system, no torchvision, nothing from the rest of the repository,
so the package can be copied into another code base as it is.
"""
from .adapters import NotebookQuantizerAdapter, TamingQuantizerAdapter, VQPAdapter, swap_quantizer
from .base import Quantizer, QuantizerOutput
from .ddcl import DDCLQuantizer, SoftAssignment, soft_assignment
from .ema import EMAVQ
from .fused import FastAssignment, ddcl_assign
from .hard import HardVQ
from .readout import (CompressorOutput, DDCLReadout, HierarchicalCompressor, ReadoutOutput,
                      prototype_param_groups)
from .usage import USAGE_DEFINITIONS, CodebookUsage, UsageStats
from .vqp import VQPQuantizer

__version__ = "0.1.0"

__all__ = [
    "TamingQuantizerAdapter", "VQPAdapter", "NotebookQuantizerAdapter", "swap_quantizer",
    "Quantizer", "QuantizerOutput", "DDCLQuantizer", "SoftAssignment", "soft_assignment",
    "ddcl_assign", "FastAssignment",
    "HardVQ", "EMAVQ", "VQPQuantizer", "CodebookUsage", "UsageStats", "USAGE_DEFINITIONS",
    "DDCLReadout", "ReadoutOutput", "HierarchicalCompressor", "CompressorOutput", "prototype_param_groups",
]
