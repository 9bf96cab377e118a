"""What the bench measures and what each measurement costs (estimated from a calibration matmul: what does not fit
is skipped, repeats are cut to the time budget): one training step of each quantizer implementation on shared inputs,
the six-matmul floor, and one VQ-VAE and one VQGAN-recipe training step (the loop's own
:func:`ddcl_vq.tokenizer.train.training_step`) with DDCL vs HardVQ.
"""
from __future__ import annotations

import itertools
import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch


# ----------------------------------------------------------------------------- what each costs, the plan
# name -> (label, cost model, matmuls of the floor); the cost model: (matmuls of N×D·D×K, other N×K work in
# D=64-matmul equivalents, N×K float tensors alive at the peak: matmul6's are its operands, made outside the probe)
IMPLEMENTATIONS = {
    "matmul6": ("six bare matmuls (floor of the full DDCL gradient)", (6.0, 0.0, 2.0), 6),
    "ddcl-mstep": ("DDCL default: straight_through, M-step codebook", (3.0, 4.0, 1.0), 3),
    "ddcl-first": ("DDCL default on its first training batch: a fresh quantizer, k-means start included",
                   (4.0, 5.0, 1.0), 3),
    "ddcl-soft-reference": ("DDCL soft, plain autograd", (6.0, 24.0, 9.0), 6),
    "ddcl-soft-fused": ("DDCL soft, fused", (6.0, 3.5, 1.0), 6),
    "ddcl-soft-chunked": ("DDCL soft, chunked", (7.0, 3.5, 0.0), 6),
    "hardvq": ("HardVQ (argmin + straight-through)", (1.0, 7.5, 3.0), None),
    "emavq": ("EMAVQ (EMA codebook)", (1.0, 8.0, 3.0), None),
    "vqp": ("vector-quantize-pytorch VectorQuantize (defaults)", (2.0, 15.0, 6.0), None),
    "ibq": ("IBQ (index backpropagation: hard forward, softmax gradient into every code; published settings)",
            (5.0, 40.0, 0.2), None),
    # residual quantizers, L = RESIDUAL_LEVELS levels of K codes each (one level's cost model, L times)
    "ddcl-residual4": ("ResidualDDCL, 4 levels (each the DDCL default: straight_through, M-step codebook)",
                       (12.0, 16.0, 1.0), 12),
    "vqp-residual4": ("vector-quantize-pytorch ResidualVQ, num_quantizers=4 (defaults)", (8.0, 60.0, 6.0), None),
    # evaluation (no gradient): what ``ddcl-vq evaluate`` asks of each batch
    "ddcl-eval": ("DDCL evaluation: hard indices and soft codes in one pass (no gradient)", (2.0, 6.0, 1.0), None),
    "simvq-eval": ("SimVQ (fair settings) evaluation: hard indices (no gradient)", (1.0, 6.0, 2.0), None),
}
IMPLS = {name: label for name, (label, _, _) in IMPLEMENTATIONS.items()}
FLOOR_MATMULS = {name: floor for name, (_, _, floor) in IMPLEMENTATIONS.items() if floor}
#: the levels of the residual rows; their ``x VQP`` is against vector-quantize-pytorch's ResidualVQ with as many
RESIDUAL_LEVELS = 4
RESIDUAL_IMPLS = ("ddcl-residual4", "vqp-residual4")
#: impl -> the vector-quantize-pytorch row its ``x VQP`` divides by (the rest: ``vqp``, VectorQuantize)
VQP_BASELINE = {name: "vqp-residual4" for name in RESIDUAL_IMPLS}
#: impl -> how many single-codebook floors its ``% 6mm`` is against (the residual rows: one per level)
FLOOR_COPIES = {name: RESIDUAL_LEVELS for name in RESIDUAL_IMPLS}


def calibrate(device: str = "cpu") -> float:
    """Seconds per flop of a D=64 matmul on ``device`` (median of 5 runs of 4096×64 · 64×4096)."""
    a, b = torch.randn(4096, 64, device=device), torch.randn(64, 4096, device=device)
    out = torch.empty(4096, 4096, device=device)
    run = synchronized(lambda: torch.mm(a, b, out=out), out.device)
    run()
    return statistics.median(time_once(run) for _ in range(5)) / (2 * 4096 * 64 * 4096)


def estimate(name: str, n: int, d: int, k: int, per_flop: float) -> Tuple[float, float]:
    """(seconds for one run, extra bytes at peak) — rough, for skipping and repeat counts."""
    units, other, tensors = IMPLEMENTATIONS[name][1]
    unit64 = 2 * n * 64 * k * per_flop            # one N×64·64×K matmul
    wide = (d / 64) * (0.8 if d > 64 else 1.0)     # wider matmuls run nearer peak
    seconds = (units * wide + other) * unit64
    extra = tensors * n * k * 4 + 8 * n * d * 4
    if name == "ddcl-first":               # the k-means fit: its Lloyd iterations over the sampled points
        import inspect
        from ddcl_vq.kmeans import kmeans_budget, kmeans_init_
        defaults = {p.name: p.default for p in inspect.signature(kmeans_init_).parameters.values()}
        points, iters = kmeans_budget(min(n, defaults["max_points"]), k, defaults["iters"])
        seconds += 2.0 * iters * points * k / (n * k) * unit64
    if name in ("ddcl-soft-fused", "ddcl-soft-chunked"):
        from ddcl_vq.blocks import chunk_rows
        extra += 2 * 4 * chunk_rows(n, k) * k * 4   # block buffers of two workers
    return seconds, extra


@dataclass
class Plan:
    name: str
    shape: Tuple[int, int, int]
    est_s: float
    est_bytes: float
    warmup: int
    repeats: int
    skip: Optional[str] = None
    probe: str = "separate"      # "separate" run after warm-up, "warmup" (the probed warm-up run), "timed"


def plan_measurements(shapes: Sequence[Tuple[int, int, int]], impls: Sequence[str], *, warmup: int,
                      repeats: int, max_seconds: float, budget_seconds: float, mem_budget: float,
                      cal: float, probe_warmup: bool = False,
                      only_at: Optional[Dict[str, Sequence[Tuple[int, int, int]]]] = None) -> List[Plan]:
    """A plan per (shape, impl); ``only_at``: impl -> the only shapes it is planned at (quick: the residual rows at
    the smaller K)."""
    plans = []
    for shape, name in itertools.product(shapes, impls):
        if only_at and name in only_at and tuple(shape) not in {tuple(s) for s in only_at[name]}:
            continue
        est_s, est_b = estimate(name, *shape, cal)
        p = Plan(name, shape, est_s, est_b, warmup, repeats)  # as asked: warm-up, a probed run, timed repeats
        runs = max(1, int(budget_seconds // max(est_s, 1e-6)))  # what the time budget allows
        if est_b > mem_budget:
            p.skip = f"memory: needs ~{est_b / 2**30:.1f} GiB, budget {mem_budget / 2**30:.1f} GiB"
        elif est_s > max_seconds:
            p.skip = f"time: one run ~{est_s:.0f} s > --max-seconds {max_seconds:g}"
        elif probe_warmup and warmup > 0 and runs >= warmup + repeats:
            p.probe = "warmup"                     # quick: the last warm-up run is probed
        elif runs < 2:                             # one cold run, timed and probed
            p.warmup, p.repeats, p.probe = 0, 1, "timed"
        elif runs < warmup + repeats + 1:          # probe the warm-up run, time the rest
            p.warmup, p.repeats, p.probe = 1, max(1, min(repeats, runs - 1)), "warmup"
        plans.append(p)
    return plans


def time_once(fn: Callable[[], None]) -> float:
    """Wall-clock seconds of one call of ``fn``."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- the steps
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
    """A closure that runs one forward + backward of ``name`` on the shared inputs (synchronised on CUDA)."""
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
        return synchronized(step, device)

    from ddcl_vq import EMAVQ, DDCLQuantizer, HardVQ, IBQQuantizer, SimVQQuantizer, VQPQuantizer
    one = torch.ones((), device=device)
    z, gr = inp.z, inp.grad
    if name == "ddcl-first":
        # every call builds a fresh quantizer: each run includes the k-means start and the first-batch set-up
        def first():
            quant = DDCLQuantizer(k, d, channel_dim=-1).to(device).train()
            out = quant(z)
            torch.autograd.backward([out.quantized, out.loss], [gr, one])
            z.grad = None
        return synchronized(first, device)
    if name == "ddcl-residual4":
        # past its warm-up; the shared codebook at every level stands for the levels' k-means starts
        from ddcl_vq import ResidualDDCL
        quant = ResidualDDCL(k, d, RESIDUAL_LEVELS, channel_dim=-1, warmup_steps=0)
        for level in quant.levels:
            level.initialized.fill_(True)
            level.weight.data.copy_(inp.codebook.cpu())
    elif name == "vqp-residual4":  # the peer keeps its own initialisation, as the vqp row
        from ddcl_vq.vqp import peer_class
        rvq = peer_class("ResidualVQ", "vqp")(dim=d, num_quantizers=RESIDUAL_LEVELS, codebook_size=k)
        rvq.to(device).train()

        def residual_step():
            quantized, _, losses = rvq(z[None])
            torch.autograd.backward([quantized, losses.sum()], [gr[None], one])
            z.grad = None
            for p in rvq.parameters():
                p.grad = None
        return synchronized(residual_step, device)
    elif name.startswith("ddcl"):
        # past its warm-up; the shared codebook stands for the k-means start
        soft = name.startswith("ddcl-soft")
        quant = DDCLQuantizer(k, d, channel_dim=-1, warmup_steps=0, **(dict(
            mode="soft", implementation=name.split("-")[-1], temperature=0.01) if soft else {}))
        quant.initialized.fill_(True)
    elif name in ("hardvq", "emavq", "vqp", "ibq"):
        quant = {"hardvq": HardVQ, "emavq": EMAVQ, "vqp": VQPQuantizer, "ibq": IBQQuantizer}[name](k, d, channel_dim=-1)
    elif name == "simvq-eval":
        quant = SimVQQuantizer(k, d, channel_dim=-1, codebook_bias=True, data_init=True, rotation_trick=False)
    else:
        raise ValueError(f"expected an implementation in {sorted(IMPLS)}, got {name!r}")
    # the shared codebook (the wrapped peers keep their own initialisation; ddcl-residual4 has it at every level)
    if name not in ("vqp", "simvq-eval", "ddcl-residual4"):
        (quant.embed if name == "emavq" else quant.weight.data).copy_(inp.codebook.cpu())
    if name.endswith("-eval"):  # what ``ddcl-vq evaluate`` asks of a batch: no gradient (DDCL: hard and soft codes)
        quant.to(device).eval()

        def evaluate():
            with torch.no_grad():
                quant(z)
        return synchronized(evaluate, device)
    quant.to(device).train()

    def step():
        out = quant(z)
        torch.autograd.backward([out.quantized, out.loss], [gr, one])
        z.grad = None
        for p in quant.parameters():
            p.grad = None
    return synchronized(step, device)


#: the configs the VQ-VAE step compares, and the same as overrides of the defaults (for an installed copy)
E2E_CONFIGS = (("ddcl", "fashion_ddcl.yaml"), ("hardvq", "fashion_hard.yaml"))
E2E_OVERRIDES = {"ddcl": [], "hardvq": ["quantizer.type=hard", "quantizer.beta=0.25", "train.codebook_lr_ratio=1.0"]}
CONFIGS_DIR = Path(__file__).resolve().parents[3] / "configs"  # the repository: ddcl_vq/studies/bench/steps.py


def e2e_models(configs: Path = CONFIGS_DIR) -> Tuple[dict, str, Optional[str]]:
    """-> (label -> (train config, model, optimizer, lr schedule), where they came from, why the configs' stand-ins
    (the defaults with E2E_OVERRIDES) were used, or None)."""
    from ddcl_vq.tokenizer.config import build_model, build_optimizer, lr_lambda
    from ddcl_vq.tokenizer.config import load_config
    missing = [name for _, name in E2E_CONFIGS if not (configs / name).is_file()]
    models = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for label, cfg_name in E2E_CONFIGS:
            cfg = load_config(None, E2E_OVERRIDES[label]) if missing else load_config(configs / cfg_name)
            torch.manual_seed(0)
            model = build_model(cfg, in_channels=1)
            opt = build_optimizer(model, cfg.train, cfg.quantizer['type'])
            models[label] = (cfg.train, model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.train)))
    if missing:
        return models, "the training config's defaults (" + ", ".join(
            f"{label}: {' '.join(o) or 'as they are'}" for label, o in E2E_OVERRIDES.items()) + ")", \
            f"{', '.join(missing)} not found in {configs}"
    return models, "configs/fashion_ddcl.yaml vs configs/fashion_hard.yaml via ddcl_vq.tokenizer.config", None


def e2e_rows(repeats: int = 5, warmup: int = 2, batch: int = 128, device: str = "cpu") -> List[dict]:
    """One VQ-VAE training step (the loop's own) with DDCL vs HardVQ: the wall-clock median, its ratios, and the
    same from process CPU time (``cpu_ms``, ``cpu_paired_ratio_vs_hardvq``)."""
    from ddcl_vq.tokenizer.train import training_step
    models, source, fallback = e2e_models()
    skip_warmup(models["ddcl"][1].quantizer)   # time the steady state, past the warm-up
    x = torch.rand(batch, 1, 32, 32, generator=torch.Generator().manual_seed(0)).to(device)

    def make(t, model, opt, scheduler):
        model.to(device).train()
        steps = itertools.count()  # optimizer steps done before each call
        return synchronized(lambda: training_step(model, x, next(steps), opt, scheduler, t), torch.device(device))

    times, cpu, faults = paired_times({label: make(*v) for label, v in models.items()}, repeats, warmup)
    n = batch * 8 * 8
    return [dict(impl=f"vqvae-step-{label}", N=n, D=64, K=512, peak_mb=None, batch=batch, runs=repeats,
                 path=assignment_path(models[label][1].quantizer, n), source=source, fallback=fallback,
                 **ratios_vs_hardvq(label, times, cpu, faults)) for label in ("ddcl", "hardvq")]


def minor_faults() -> int:
    """Minor page faults of this process so far (every thread; 0 where getrusage is not available)."""
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    except (ImportError, OSError):
        return 0


def paired_times(steps: Dict[str, Callable[[], None]], repeats: int, warmup: int
                 ) -> Tuple[Dict[str, List[float]], Dict[str, List[float]], Dict[str, List[int]]]:
    """``warmup`` calls of each step, then ``repeats`` rounds of one call each, alternating who goes first;
    -> per label, the wall-clock seconds, the process CPU seconds and the minor page faults of every timed call."""
    for s in steps.values():
        for _ in range(warmup):
            s()
    times, cpu, faults = ({label: [] for label in steps} for _ in range(3))
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
    """``label``'s median ms, its ratios to ``hardvq`` (of the medians, and the median of the per-round ratios; wall
    clock and CPU time) and, with ``faults``, the median minor page faults of one step."""
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
    """``"mstep"`` for straight_through DDCL, else ``quantizer.resolve_implementation(n)`` (None without one)."""
    if getattr(quantizer, "mode", None) == "straight_through":
        return "mstep"
    return quantizer.resolve_implementation(n) if hasattr(quantizer, "resolve_implementation") else None


VQGAN_CONFIG = "vqgan_photos64.yaml"
#: label -> overrides of configs/vqgan_photos64.yaml; "hardvq" is configs/study_vqgan.yaml's "hard" arm
VQGAN_ARMS = (("ddcl", ("quantizer.type=ddcl",)),
              ("hardvq", ("quantizer.type=hard", "quantizer.beta=0.25", "train.codebook_lr_ratio=1.0")))


def vqgan_setups(configs: Path = CONFIGS_DIR, device: str = "cpu"):
    """-> ((label -> (cfg, model, optimizer, scheduler, gan, autocast, scaler), the training set), None) as the
    training loop builds them, or (None, the reason) when the recipe cannot be built here."""
    from ddcl_vq.common.config import ConfigError
    from ddcl_vq.common.data import build_dataset, image_channels
    from ddcl_vq.tokenizer.config import build_model, build_optimizer, lr_lambda
    from ddcl_vq.tokenizer.config import load_config
    from ddcl_vq.tokenizer.losses import GANStep
    from ddcl_vq.tokenizer.train import mixed_precision
    path = configs / VQGAN_CONFIG
    if not path.is_file():
        return None, f"{VQGAN_CONFIG} not found in {configs}"
    dev = torch.device(device)
    setups = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for label, overrides in VQGAN_ARMS:
            cfg = load_config(path, overrides)
            channels = image_channels(cfg.data)
            torch.manual_seed(cfg.run.seed)                     # as the loop: seed, then build
            model = build_model(cfg, channels).to(dev)
            optimizer = build_optimizer(model, cfg.train, cfg.quantizer['type'])
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.train))
            try:
                gan = GANStep.from_config(cfg, model, channels, dev, 1)
            except ConfigError as err:                          # e.g. no LPIPS weights here
                return None, str(err)
            autocast, scaler = mixed_precision(cfg.train.amp, dev)
            if gan is not None:
                gan.autocast = autocast
            setups[label] = (cfg, model, optimizer, scheduler, gan, autocast, scaler)
    cfg = setups["ddcl"][0]
    return (setups, build_dataset(cfg.data, "train", cfg.run.seed)), None


def vqgan_rows(repeats: int = 5, warmup: int = 2, batch: int = 16, device: str = "cpu",
               configs: Path = CONFIGS_DIR) -> List[dict]:
    """Rows ``vqgan-step-ddcl`` and ``vqgan-step-hardvq``: one generator + discriminator step on ``batch`` training
    crops, as :func:`e2e_rows`; skipped, with the reason, when the recipe cannot be built here."""
    built, reason = vqgan_setups(configs, device)
    if built is None:
        return [dict(impl=f"vqgan-step-{label}", N=None, D=None, K=None, ms=None, peak_mb=None,
                     skipped=f"VQGAN-recipe step: {reason}") for label, _ in VQGAN_ARMS]
    setups, train_set = built
    from ddcl_vq.tokenizer.train import training_step
    perm = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(0))[:batch]
    x = torch.stack([train_set[int(i)][0] for i in perm]).to(device)
    skip_warmup(setups["ddcl"][1].quantizer)   # time the steady state, past the quantization warm-up
    n_vectors = {}

    def make(label: str, cfg, model, optimizer, scheduler, gan, autocast, scaler):
        model.train()
        steps = itertools.count(cfg.loss.disc_start)       # the discriminator is on from here

        def step():
            _, _, out = training_step(model, x, next(steps), optimizer, scheduler, cfg.train, autocast=autocast,
                                      scaler=scaler, gan=gan)
            n_vectors[label] = out.quantizer.indices.numel()
        return synchronized(step, torch.device(device))

    times, cpu, faults = paired_times({label: make(label, *setups[label]) for label, _ in VQGAN_ARMS}, repeats, warmup)
    rows = []
    for label, overrides in VQGAN_ARMS:
        cfg, model, _, _, gan = setups[label][:5]
        rows.append(dict(impl=f"vqgan-step-{label}", N=n_vectors[label], D=cfg.model['latent_dim'],
                         K=cfg.quantizer['num_codes'], peak_mb=None, batch=batch, input_shape=list(x.shape),
                         runs=repeats, path=assignment_path(model.quantizer, n_vectors[label]),
                         source=f"configs/{VQGAN_CONFIG} " + " ".join(overrides),
                         disc_on=bool(gan is not None and gan.disc_active(cfg.loss.disc_start)),
                         perceptual_net=cfg.loss.perceptual_net if cfg.loss.perceptual_weight > 0 else None,
                         **ratios_vs_hardvq(label, times, cpu, faults)))
    return rows
