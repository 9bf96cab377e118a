"""What the bench measures: one training step of each quantizer implementation on shared
inputs, the six-matmul floor, and one end-to-end VQ-VAE training step (the VQGAN-recipe step: ``vqgan``)."""
from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ddcl_vq.studies.bench.cost import IMPLS, time_once

@dataclass
class Inputs:
    z: torch.Tensor
    grad: torch.Tensor
    codebook: torch.Tensor


def make_inputs(n: int, d: int, k: int, seed: int = 0, device: str = "cpu") -> Inputs:
    """The same values on every device (drawn on the CPU, then moved)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, d, generator=g).to(device).requires_grad_(True)
    return Inputs(z=z, grad=torch.randn(n, d, generator=g).to(device), codebook=torch.randn(k, d, generator=g).to(device))


def synchronized(step: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """``step`` followed by a device synchronisation on CUDA (so wall clock measures the work)."""
    if device.type != "cuda":
        return step

    def run():
        step()
        torch.cuda.synchronize(device)
    return run


def make_step(name: str, inp: Inputs) -> Callable[[], None]:
    """A closure that runs one forward + backward of ``name`` on the shared inputs (on their
    device; on CUDA the closure ends with a synchronisation)."""
    (n, d), k, device = inp.z.shape, inp.codebook.shape[0], inp.z.device
    if name == "matmul6":
        z, w, gr = inp.z.detach(), inp.codebook, inp.grad
        q = torch.rand(n, k, device=device)
        p = torch.zeros(n, k, device=device)   # touched now: no page faults inside the timed run
        out_nd, out_kd = torch.zeros(n, d, device=device), torch.zeros(k, d, device=device)

        def step():
            torch.mm(z, w.t(), out=p)          # forward: logits
            torch.mm(q, w, out=out_nd)         # forward: soft codes
            torch.mm(gr, w.t(), out=p)         # backward: G·Wᵀ
            torch.mm(q, w, out=out_nd)         # backward: dd·W
            torch.mm(q.t(), z, out=out_kd)     # backward: ddᵀ·Z
            torch.mm(q.t(), gr, out=out_kd)    # backward: Qᵀ·G
        return step

    from ddcl_vq import EMAVQ, DDCLQuantizer, HardVQ, IBQQuantizer, VQPQuantizer
    one = torch.ones((), device=device)
    z, gr = inp.z, inp.grad
    if name == "ddcl-first":
        # the library default on its first training batch: every call builds a fresh quantizer, so
        # each run includes the k-means start and the first-batch set-up
        def first():
            quant = DDCLQuantizer(k, d, channel_dim=-1).to(device).train()
            out = quant(z)
            torch.autograd.backward([out.quantized, out.loss], [gr, one])
            z.grad = None
        return synchronized(first, device)
    if name in ("ddcl-mstep", "ddcl-twins"):
        # the library default in its steady state (past the warm-up's first 100 training batches)
        quant = DDCLQuantizer(k, d, codebook_init="normal", channel_dim=-1, warmup_steps=0,
                              revive_twins=name == "ddcl-twins")
    elif name.startswith("ddcl"):
        parts = name.split("-")
        mode = "soft" if parts[1] == "soft" else "straight_through"
        quant = DDCLQuantizer(k, d, mode=mode, implementation=parts[-1], codebook_init="normal", channel_dim=-1,
                              codebook_update="gradient", temperature_reference="dim", temperature=0.01)
    elif name in ("hardvq", "emavq", "vqp", "ibq"):
        quant = {"hardvq": HardVQ, "emavq": EMAVQ, "vqp": VQPQuantizer, "ibq": IBQQuantizer}[name](k, d, channel_dim=-1)
    else:
        raise ValueError(f"expected an implementation in {sorted(IMPLS)}, got {name!r}")
    if name != "vqp":  # the shared codebook (vector-quantize-pytorch keeps its own initialisation)
        (quant.embed if name == "emavq" else quant.weight.data).copy_(inp.codebook.cpu())
    quant.to(device).train()

    def step():
        out = quant(z)
        torch.autograd.backward([out.quantized, out.loss], [gr, one])
        z.grad = None
        for p in quant.parameters():
            p.grad = None
    return synchronized(step, device)


#: the configs the VQ-VAE step compares, in the repository's configs/ folder, and the same as overrides of
#: the training config's defaults (an installed copy without the repository's configs)
E2E_CONFIGS = (("ddcl", "fashion_ddcl.yaml"), ("hardvq", "fashion_hard.yaml"))
E2E_OVERRIDES = {"ddcl": [], "hardvq": ["quantizer.type=hard", "quantizer.beta=0.25", "train.codebook_lr_ratio=1.0"]}
CONFIGS_DIR = Path(__file__).resolve().parents[3] / "configs"  # the repository: ddcl_vq/studies/bench/steps.py


def e2e_models(configs: Path = CONFIGS_DIR) -> Tuple[dict, str, Optional[str]]:
    """label -> (train config, model, optimizer, lr schedule), where they came from, and why the configs'
    stand-ins were used (None when the configs were used): the configs through the training package's
    builders; without the repository's configs beside this file (an installed copy), the training
    config's defaults with the same overrides, the reason in each row."""
    from ddcl_vq.tokenizer.builders import build_model, build_optimizer, lr_lambda
    from ddcl_vq.tokenizer.config import load_config
    missing = [name for _, name in E2E_CONFIGS if not (configs / name).is_file()]
    models = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for label, cfg_name in E2E_CONFIGS:
            cfg = load_config(None, E2E_OVERRIDES[label]) if missing else load_config(configs / cfg_name)
            torch.manual_seed(0)
            model = build_model(cfg, in_channels=1)
            opt = build_optimizer(model, cfg.train, cfg.quantizer.type)
            models[label] = (cfg.train, model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.train)))
    if missing:
        return models, "the training config's defaults (" + ", ".join(
            f"{label}: {' '.join(o) or 'as they are'}" for label, o in E2E_OVERRIDES.items()) + ")", \
            f"{', '.join(missing)} not found in {configs}"
    return models, "configs/fashion_ddcl.yaml vs configs/fashion_hard.yaml via ddcl_vq.tokenizer.builders", None


def e2e_rows(repeats: int = 5, warmup: int = 2, batch: int = 128, with_reference: bool = True,
             device: str = "cpu") -> List[dict]:
    """One VQ-VAE training step with DDCL vs HardVQ: the training loop's own step
    (:func:`ddcl_vq.tokenizer.train.training_step`: forward, loss, backward, gradient clipping, AdamW, the learning-rate
    schedule and the quantizer's per-step state), on the models of configs/fashion_ddcl.yaml and
    configs/fashion_hard.yaml. ``with_reference`` adds the DDCL model on the reference path when its quantizer has one
    to choose (not the M-step default in straight_through mode, which takes no assignment path). Each row has the
    wall-clock median and ratios, and the same from process CPU time (``cpu_ms``, ``cpu_paired_ratio_vs_hardvq``): on a
    core shared with other jobs the CPU time leaves out the time the step waited for the core.
    """
    from ddcl_vq.tokenizer.train import training_step
    models, source, fallback = e2e_models()
    q_default = models["ddcl"][1].quantizer
    skip_warmup(q_default)                     # time the steady state, past the warm-up
    takes_path = assignment_path(q_default, batch * 8 * 8) != "mstep"
    if with_reference and takes_path:  # the same DDCL model on the reference path: what the fused path buys
        import copy
        t, model = models["ddcl"][:2]
        ref_model = copy.deepcopy(model)
        ref_model.quantizer.implementation = "reference"
        ref_opt = type(models["ddcl"][2])(ref_model.parameters(), lr=2e-3)
        models["ddcl-reference"] = (t, ref_model, ref_opt, torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0))
    x = torch.rand(batch, 1, 32, 32, generator=torch.Generator().manual_seed(0)).to(device)

    def make(t, model, opt, scheduler):
        model.to(device).train()
        state = {"step": 0}

        def step():
            training_step(model, x, state["step"], opt, scheduler, t)
            state["step"] += 1
        return synchronized(step, torch.device(device))

    times, cpu, faults = paired_times({label: make(*v) for label, v in models.items()}, repeats, warmup)
    n = batch * 8 * 8
    out = []
    for label in [m for m in ("ddcl", "ddcl-reference", "hardvq") if m in models]:
        impl = assignment_path(models[label][1].quantizer, n)
        out.append(dict(impl=f"vqvae-step-{label}", N=n, D=64, K=512, peak_mb=None,
                        batch=batch, runs=repeats, path=impl, source=source, fallback=fallback,
                        **ratios_vs_hardvq(label, times, cpu, faults)))
    return out


def minor_faults() -> int:
    """Minor page faults of this process so far (every thread; 0 where getrusage is not available)."""
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    except (ImportError, OSError):
        return 0


def paired_times(steps: Dict[str, Callable[[], None]], repeats: int, warmup: int
                 ) -> Tuple[Dict[str, List[float]], Dict[str, List[float]], Dict[str, List[int]]]:
    """``warmup`` calls of each step, then ``repeats`` rounds of one call each, the order alternating between rounds
    (who goes first); -> per label, the wall-clock seconds, the process CPU seconds and the minor page faults of
    every timed call. The faults show where time goes to the allocator: large temporaries that the C library hands
    back to the system after each step come back as fresh pages, each zeroed by the kernel on first touch."""
    for s in steps.values():
        for _ in range(warmup):
            s()
    times: Dict[str, List[float]] = {label: [] for label in steps}
    cpu: Dict[str, List[float]] = {label: [] for label in steps}
    faults: Dict[str, List[int]] = {label: [] for label in steps}
    for r in range(repeats):
        order = list(steps) if r % 2 == 0 else list(steps)[::-1]   # alternate who goes first
        for label in order:
            c0, f0 = time.process_time(), minor_faults()
            times[label].append(time_once(steps[label]))
            cpu[label].append(time.process_time() - c0)
            faults[label].append(minor_faults() - f0)
    return times, cpu, faults


def ratios_vs_hardvq(label: str, times: Dict[str, List[float]], cpu: Dict[str, List[float]],
                     faults: Optional[Dict[str, List[int]]] = None) -> dict:
    """``label``'s median ms and its ratios to the ``hardvq`` step of the same rounds (wall clock and CPU
    time): the ratio of the medians, and the median of the per-round ratios (robust to a neighbour's
    load changing between rounds: both steps of a round share it); with ``faults``, the median minor page
    faults of one step."""
    med, ref = statistics.median(times[label]) * 1e3, statistics.median(times["hardvq"]) * 1e3
    paired = statistics.median(a / b for a, b in zip(times[label], times["hardvq"]))
    cpu_paired = statistics.median(a / max(b, 1e-9) for a, b in zip(cpu[label], cpu["hardvq"]))
    out = dict(ms=round(med, 3), ratio_vs_hardvq=round(med / ref, 3), paired_ratio_vs_hardvq=round(paired, 3),
               cpu_ms=round(statistics.median(cpu[label]) * 1e3, 3), cpu_paired_ratio_vs_hardvq=round(cpu_paired, 3))
    if faults is not None:
        out["page_faults"] = int(statistics.median(faults[label]))
    return out


def skip_warmup(quantizer) -> None:
    """Put a DDCL quantizer past its quantization warm-up (time the steady state); others: nothing."""
    if hasattr(quantizer, "warmup_batches"):
        quantizer.warmup_batches.fill_(quantizer.warmup_steps)


def assignment_path(quantizer, n: int) -> Optional[str]:
    """The path a training step of ``quantizer`` takes on ``n`` vectors: ``"mstep"`` for the DDCL default
    (straight_through with the M-step codebook: soft statistics without autograd, no assignment path),
    else its ``resolve_implementation(n)`` (None for quantizers without one)."""
    mstep = getattr(quantizer, "codebook_update", None) == "mstep"
    if mstep and getattr(quantizer, "mode", None) == "straight_through":
        return "mstep"
    return quantizer.resolve_implementation(n) if hasattr(quantizer, "resolve_implementation") else None
