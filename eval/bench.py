"""``ddcl-vq bench``: quantizer speed and memory, side by side with the peers.

What is measured, per shape (N vectors of dimension D, K codes), all in one process so
the ratios are side by side:

* one training step of the quantizer alone: forward on a leaf z (N, D) that requires
  grad, then backward of ``quantized`` (a fixed random upstream gradient) plus ``loss`` —
  for DDCL (``straight_through``, the default mode, and ``soft``, the full gradient; each
  through the ``reference``, ``fused`` and ``chunked`` paths), ``HardVQ``, ``EMAVQ`` (in
  training mode, EMA update included) and vector-quantize-pytorch's ``VectorQuantize``
  with its defaults;
* the matmul floor: the six bare matmuls the full DDCL gradient needs at these shapes
  (Z·Wᵀ and Q·W forward; G·Wᵀ, dd·W, ddᵀ·Z, Qᵀ·G backward), operands preallocated;
* with ``--e2e`` (default on): one training step (forward, backward, AdamW step) of the
  default VQ-VAE (configs/fashion_ddcl.yaml vs configs/fashion_hard.yaml), batch 128.

Timing: wall clock, median of the timed repeats after warm-up; within a shape the
implementations run round-robin (one repeat of each, then the next repeat), so a
neighbour's load spreads over all of them rather than biasing one.

Peak memory: the resident-set high-water mark (Linux VmHWM) above a baseline taken just
before the run, with inputs, parameters and upstream gradients already allocated (so it is
"extra memory above the inputs"). Before each probe freed heap memory is returned to the
OS (``malloc_trim``) and the high-water mark is reset (``/proc/self/clear_refs``), so the
figure counts every page the step touches, torch tensors and library workspaces alike.
``--memory subprocess`` instead runs each probe in a fresh Python process and reports the
``ru_maxrss`` growth (slower, independent of this process's heap); ``--memory none`` skips.

What does not fit is skipped, and said so: before running, each measurement's time and
memory are estimated from a calibration matmul and a per-implementation cost model; a
measurement whose estimate exceeds ``--max-seconds`` (one run) or the memory budget is
listed as skipped with the reason, and repeats are cut to fit ``--budget-seconds``.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime as _dt
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

FULL_N = (4096, 16384, 65536)
FULL_D = (64, 256)
FULL_K = (512, 1024, 8192, 65536)
QUICK_SHAPES = ((8192, 64, 1024), (8192, 64, 8192))

# name -> (label, mode or None).  DDCL rows: ddcl-<path> is the default straight_through
# mode, ddcl-soft-<path> the soft mode (full gradient through q to z and W).
IMPLS = {
    "matmul6": "six bare matmuls (floor of the full DDCL gradient)",
    "ddcl-reference": "DDCL straight_through, plain autograd",
    "ddcl-fused": "DDCL straight_through, fused",
    "ddcl-chunked": "DDCL straight_through, chunked",
    "ddcl-soft-reference": "DDCL soft, plain autograd",
    "ddcl-soft-fused": "DDCL soft, fused",
    "ddcl-soft-chunked": "DDCL soft, chunked",
    "hardvq": "HardVQ (argmin + straight-through)",
    "emavq": "EMAVQ (EMA codebook)",
    "vqp": "vector-quantize-pytorch VectorQuantize (defaults)",
}
# cost model for the estimates, fitted to runs on a 2-core EPYC: (matmuls of N×D·D×K, other N×K work
# counted in D=64-matmul equivalents, N×K float tensors alive at the peak)
COST = {
    "matmul6": (6.0, 0.0, 0.0),
    "ddcl-reference": (3.0, 23.0, 8.0),
    "ddcl-fused": (3.0, 3.0, 0.0),
    "ddcl-chunked": (3.0, 3.0, 0.0),
    "ddcl-soft-reference": (6.0, 24.0, 9.0),
    "ddcl-soft-fused": (6.0, 3.5, 1.0),
    "ddcl-soft-chunked": (7.0, 3.5, 0.0),
    "hardvq": (1.0, 7.5, 3.0),
    "emavq": (1.0, 8.0, 3.0),
    "vqp": (2.0, 15.0, 6.0),
}
FLOOR_MATMULS = {"ddcl-soft-reference": 6, "ddcl-soft-fused": 6, "ddcl-soft-chunked": 6,
                 "ddcl-reference": 3, "ddcl-fused": 3, "ddcl-chunked": 3, "matmul6": 6}


# ----------------------------------------------------------------------------- memory

def _status_kb(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class RssProbe:
    """Peak extra resident memory of a block of code, in MiB (Linux only).

    start(): collect garbage, give freed heap back to the OS (malloc_trim), reset the
    high-water mark (write "5" to /proc/self/clear_refs) and read VmRSS as the baseline.
    stop(): VmHWM − baseline.
    """

    def __init__(self):
        self._libc = None
        try:
            self._libc = ctypes.CDLL("libc.so.6")
        except OSError:
            pass
        self.base_kb = 0

    @staticmethod
    def available() -> bool:
        if _status_kb("VmHWM") is None:
            return False
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def start(self) -> None:
        gc.collect()
        if self._libc is not None:
            self._libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.base_kb = _status_kb("VmRSS") or 0

    def stop(self) -> float:
        return max(0, (_status_kb("VmHWM") or 0) - self.base_kb) / 1024.0


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


# ----------------------------------------------------------------------------- cases

@dataclass
class Inputs:
    z: torch.Tensor
    grad: torch.Tensor
    codebook: torch.Tensor


def make_inputs(n: int, d: int, k: int, seed: int = 0) -> Inputs:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, d, generator=g).requires_grad_(True)
    return Inputs(z=z, grad=torch.randn(n, d, generator=g), codebook=torch.randn(k, d, generator=g))


def make_step(name: str, inp: Inputs) -> Callable[[], None]:
    """A closure that runs one forward + backward of ``name`` on the shared inputs."""
    n, d = inp.z.shape
    k = inp.codebook.shape[0]
    if name == "matmul6":
        z, w, gr = inp.z.detach(), inp.codebook, inp.grad
        q = torch.rand(n, k)
        p = torch.zeros(n, k)                  # touched now: no page faults inside the timed run
        out_nd = torch.zeros(n, d)
        out_kd = torch.zeros(k, d)

        def step():
            torch.mm(z, w.t(), out=p)          # forward: logits
            torch.mm(q, w, out=out_nd)         # forward: soft codes
            torch.mm(gr, w.t(), out=p)         # backward: G·Wᵀ
            torch.mm(q, w, out=out_nd)         # backward: dd·W
            torch.mm(q.t(), z, out=out_kd)     # backward: ddᵀ·Z
            torch.mm(q.t(), gr, out=out_kd)    # backward: Qᵀ·G
        return step

    from ddcl_vq import EMAVQ, DDCLQuantizer, HardVQ, VQPQuantizer
    if name.startswith("ddcl"):
        parts = name.split("-")
        mode = "soft" if parts[1] == "soft" else "straight_through"
        impl = parts[-1]
        quant = DDCLQuantizer(k, d, mode=mode, implementation=impl, codebook_init="normal", channel_dim=-1)
        quant.weight.data.copy_(inp.codebook)
    elif name == "hardvq":
        quant = HardVQ(k, d, channel_dim=-1)
        quant.weight.data.copy_(inp.codebook)
    elif name == "emavq":
        quant = EMAVQ(k, d, channel_dim=-1)
        quant.embed.copy_(inp.codebook)
    elif name == "vqp":
        quant = VQPQuantizer(k, d, channel_dim=-1)
    else:
        raise ValueError(f"expected an implementation in {sorted(IMPLS)}, got {name!r}")
    quant.train()
    one = torch.ones(())
    z, gr = inp.z, inp.grad

    def step():
        out = quant(z)
        torch.autograd.backward([out.quantized, out.loss], [gr, one])
        z.grad = None
        for p in quant.parameters():
            p.grad = None
    return step


# ----------------------------------------------------------------------------- estimates

def calibrate() -> float:
    """Seconds per flop of a D=64 matmul (median of 5 runs of 4096×64 · 64×4096)."""
    a, b = torch.randn(4096, 64), torch.randn(64, 4096)
    out = torch.empty(4096, 4096)
    torch.mm(a, b, out=out)
    return statistics.median(_time(lambda: torch.mm(a, b, out=out)) for _ in range(5)) / (2 * 4096 * 64 * 4096)


def estimate(name: str, n: int, d: int, k: int, per_flop: float) -> Tuple[float, float]:
    """(seconds for one run, extra bytes at peak) — rough, for skipping and repeat counts."""
    units, other, tensors = COST[name]
    unit64 = 2 * n * 64 * k * per_flop            # one N×64·64×K matmul
    wide = (d / 64) * (0.8 if d > 64 else 1.0)     # wider matmuls run nearer peak
    seconds = (units * wide + other) * unit64
    extra = tensors * n * k * 4 + 8 * n * d * 4
    if name in ("ddcl-fused", "ddcl-chunked", "ddcl-soft-fused", "ddcl-soft-chunked"):
        from ddcl_vq.assignment import chunk_rows
        extra += 2 * 4 * chunk_rows(n, k) * k * 4   # block buffers of two workers
    if name == "matmul6":
        extra += 2 * n * k * 4                # its N×K operands live outside the probe, but must fit
    return seconds, extra


# ----------------------------------------------------------------------------- running

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
                      cal: float, probe_warmup: bool = False) -> List[Plan]:
    plans = []
    for shape in shapes:
        for name in impls:
            est_s, est_b = estimate(name, *shape, cal)
            p = Plan(name, shape, est_s, est_b, warmup, repeats)
            if est_b > mem_budget:
                p.skip = f"memory: needs ~{est_b / 2**30:.1f} GiB, budget {mem_budget / 2**30:.1f} GiB"
            elif est_s > max_seconds:
                p.skip = f"time: one run ~{est_s:.0f} s > --max-seconds {max_seconds:g}"
            else:
                runs = max(1, int(budget_seconds // max(est_s, 1e-6)))
                if probe_warmup and warmup > 0 and runs >= warmup + repeats:
                    p.probe = "warmup"                     # quick: the last warm-up run is probed
                elif runs >= warmup + repeats + 1:
                    pass                                   # warm-up, a probed run, timed repeats
                elif runs >= 2:                            # probe the warm-up run, time the rest
                    p.warmup, p.repeats, p.probe = 1, max(1, min(repeats, runs - 1)), "warmup"
                else:                                      # one cold run, timed and probed
                    p.warmup, p.repeats, p.probe = 0, 1, "timed"
            plans.append(p)
    return plans


def _time(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_shape(shape: Tuple[int, int, int], plans: List[Plan], memory: str, progress=None) -> List[dict]:
    """Measure every runnable plan of one shape, round-robin; returns result rows."""
    n, d, k = shape
    rows = []
    live = [p for p in plans if p.skip is None]
    for p in plans:
        if p.skip is not None:
            rows.append(dict(impl=p.name, N=n, D=d, K=k, ms=None, peak_mb=None, skipped=p.skip,
                             est_s=round(p.est_s, 2)))
            if progress is not None:
                progress.update(1)
    if not live:
        return rows
    inp = make_inputs(n, d, k)
    steps: Dict[str, Callable[[], None]] = {}
    times: Dict[str, List[float]] = {p.name: [] for p in live}
    peak: Dict[str, Optional[float]] = {p.name: None for p in live}
    errors: Dict[str, str] = {}
    probe = RssProbe() if memory == "rss" else None
    for p in live:
        try:
            steps[p.name] = make_step(p.name, inp)
        except Exception as err:  # e.g. the optional peer package is missing
            errors[p.name] = f"{type(err).__name__}: {err}"
    live = [p for p in live if p.name in steps]
    # warm-up (first calls pay one-time costs), then the memory probe, then timed rounds
    for p in live:
        for i in range(p.warmup):
            if memory == "rss" and p.probe == "warmup" and i == p.warmup - 1:
                probe.start()
                steps[p.name]()
                peak[p.name] = probe.stop()
            else:
                steps[p.name]()
        if memory == "rss" and p.probe == "separate":
            probe.start()
            steps[p.name]()
            peak[p.name] = probe.stop()
        elif memory == "subprocess":
            peak[p.name] = probe_subprocess(p.name, shape)
    for r in range(max(p.repeats for p in live)):
        for p in live:
            if r >= p.repeats:
                continue
            if memory == "rss" and p.probe == "timed":
                probe.start()                 # single cold run: time and memory from the same run
                times[p.name].append(_time(steps[p.name]))
                peak[p.name] = probe.stop()
            else:
                times[p.name].append(_time(steps[p.name]))
            if progress is not None and r == p.repeats - 1:
                progress.update(1)
    for p in live:
        ms = statistics.median(times[p.name]) * 1e3
        rows.append(dict(impl=p.name, N=n, D=d, K=k, ms=round(ms, 3),
                         peak_mb=None if peak[p.name] is None else round(peak[p.name], 1),
                         runs=len(times[p.name]), warmup=p.warmup, probe=p.probe, est_s=round(p.est_s, 2)))
    for name, msg in errors.items():
        rows.append(dict(impl=name, N=n, D=d, K=k, ms=None, peak_mb=None, skipped=f"error: {msg}"))
        if progress is not None:
            progress.update(1)
    del steps, inp
    gc.collect()
    return rows


def probe_subprocess(name: str, shape: Tuple[int, int, int]) -> Optional[float]:
    """Peak extra memory of one run of ``name`` in a fresh interpreter (ru_maxrss growth)."""
    n, d, k = shape
    cmd = [sys.executable, "-m", "ddcl_vq.eval.bench", "--_probe", name, str(n), str(d), str(k)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        return float(json.loads(out.stdout.strip().splitlines()[-1])["peak_mb"])
    except (subprocess.CalledProcessError, ValueError, KeyError, IndexError):
        return None


def _probe_main(name: str, n: int, d: int, k: int) -> int:
    import resource
    small = make_inputs(64, d, min(k, 64))
    make_step(name, small)()                  # load kernels and lazy state on a tiny shape
    inp = make_inputs(n, d, k)
    step = make_step(name, inp)
    gc.collect()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cur = _status_kb("VmRSS")
    base = max(base, cur or 0) if cur is not None else base
    step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_mb": max(0, peak - base) / 1024.0}))
    return 0


# ----------------------------------------------------------------------------- end to end

def e2e_rows(repeats: int = 5, warmup: int = 2, batch: int = 128, with_reference: bool = True) -> List[dict]:
    """One VQ-VAE training step (forward, backward, AdamW step) with DDCL vs HardVQ.

    Models: configs/fashion_ddcl.yaml and configs/fashion_hard.yaml through the training
    package's builders when it is importable, else ``VQVAE(Encoder(), Q(512, 64), Decoder())``
    with AdamW. ``with_reference`` adds the DDCL model on the reference path.
    """
    from ddcl_vq import DDCLQuantizer, HardVQ
    models = {}
    root = Path(__file__).resolve().parents[1]
    source = "ddcl_vq.models.VQVAE(Encoder(), Q(512, 64), Decoder()) + AdamW"
    try:
        from ddcl_vq.train.builders import build_model, build_optimizer
        from ddcl_vq.train.config import load_config
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for label, cfg_name in (("ddcl", "fashion_ddcl.yaml"), ("hardvq", "fashion_hard.yaml")):
                cfg = load_config(root / "configs" / cfg_name)
                torch.manual_seed(0)
                model = build_model(cfg, in_channels=1)
                opt = build_optimizer(model, cfg.train, cfg.quantizer.type)
                models[label] = (model, opt, cfg.train.quantizer_loss_weight)
        source = "configs/fashion_ddcl.yaml vs configs/fashion_hard.yaml via ddcl_vq.train.builders"
    except Exception:  # the training package is not there: the documented default model
        from ddcl_vq.models import VQVAE, Decoder, Encoder
        for label, q in (("ddcl", DDCLQuantizer(512, 64)), ("hardvq", HardVQ(512, 64))):
            torch.manual_seed(0)
            model = VQVAE(Encoder(), q, Decoder())
            models[label] = (model, torch.optim.AdamW(model.parameters(), lr=2e-3), 1.0)
    if with_reference:  # the same DDCL model on the reference path: what the fused path buys end to end
        import copy
        ref_model = copy.deepcopy(models["ddcl"][0])
        ref_model.quantizer.implementation = "reference"
        ref_opt = type(models["ddcl"][1])(ref_model.parameters(), lr=2e-3)
        models["ddcl-reference"] = (ref_model, ref_opt, models["ddcl"][2])
    x = torch.rand(batch, 1, 32, 32, generator=torch.Generator().manual_seed(0))

    def make(model, opt, weight):
        model.train()

        def step():
            out = model(x)
            loss = torch.nn.functional.mse_loss(out.reconstruction, x) + weight * out.quantizer.loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return step

    steps = {label: make(*v) for label, v in models.items()}
    for s in steps.values():
        for _ in range(warmup):
            s()
    times = {label: [] for label in steps}
    for r in range(repeats):
        order = list(steps) if r % 2 == 0 else list(steps)[::-1]   # alternate who goes first
        for label in order:
            times[label].append(_time(steps[label]))
    med = {label: statistics.median(v) * 1e3 for label, v in times.items()}
    n = batch * 8 * 8
    out = []
    for label in [m for m in ("ddcl", "ddcl-reference", "hardvq") if m in models]:
        q = models[label][0].quantizer
        impl = q.resolve_implementation(n) if hasattr(q, "resolve_implementation") else None
        # the ratio of the medians, and the median of the per-round ratios (robust to a
        # neighbour's load changing between rounds: both steps of a round share it)
        paired = statistics.median(a / b for a, b in zip(times[label], times["hardvq"]))
        out.append(dict(impl=f"vqvae-step-{label}", N=n, D=64, K=512, ms=round(med[label], 3), peak_mb=None,
                        batch=batch, runs=repeats, path=impl, source=source,
                        ratio_vs_hardvq=round(med[label] / med["hardvq"], 3),
                        paired_ratio_vs_hardvq=round(paired, 3)))
    return out


# ----------------------------------------------------------------------------- report

def machine() -> dict:
    model = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        load = [round(v, 2) for v in os.getloadavg()]
    except OSError:
        load = None
    return {"cpu": model, "cores": os.cpu_count(), "threads": torch.get_num_threads(), "loadavg": load,
            "torch": torch.__version__, "python": platform.python_version(),
            "cuda": torch.cuda.is_available(), "date": _dt.datetime.now().isoformat(timespec="seconds")}


def add_ratios(rows: List[dict]) -> None:
    by_shape: Dict[Tuple[int, int, int], Dict[str, dict]] = {}
    for r in rows:
        by_shape.setdefault((r["N"], r["D"], r["K"]), {})[r["impl"]] = r
    for group in by_shape.values():
        vqp = group.get("vqp", {}).get("ms")
        floor = group.get("matmul6", {}).get("ms")
        for name, r in group.items():
            if r.get("ms") is None:
                continue
            r["x_vqp"] = round(r["ms"] / vqp, 3) if vqp else None
            # % of the rate of the six bare matmuls: 100 = as fast as the six matmuls alone
            r["pct_matmul6"] = round(100.0 * floor / r["ms"], 1) if floor else None
            if name in FLOOR_MATMULS:
                r["floor_matmuls"] = FLOOR_MATMULS[name]


def format_table(rows: List[dict]) -> str:
    head = f"{'impl':<26} {'N':>6} {'D':>4} {'K':>6} {'ms':>10} {'peak MB':>9} {'x VQP':>7} {'% 6mm':>7}  note"
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.get("ms") is None:
            lines.append(f"{r['impl']:<26} {r['N']:>6} {r['D']:>4} {r['K']:>6} {'—':>10} {'—':>9} {'':>7} {'':>7}  "
                         f"skipped: {r.get('skipped', '')}")
            continue
        peak = "—" if r.get("peak_mb") is None else f"{r['peak_mb']:.0f}"
        xv = "" if r.get("x_vqp") is None else f"{r['x_vqp']:.2f}"
        pm = "" if r.get("pct_matmul6") is None else f"{r['pct_matmul6']:.0f}%"
        note = []
        if r.get("runs") == 1 and not r.get("warmup"):
            note.append("single cold run")
        elif r.get("probe") == "warmup":
            note.append(f"{r['runs']} run(s) after warm-up; memory from the warm-up run")
        if "ratio_vs_hardvq" in r:
            note.append(f"{r['ratio_vs_hardvq']:.2f}x HardVQ step (median of per-round ratios "
                        f"{r['paired_ratio_vs_hardvq']:.2f}x, {r['runs']} rounds)"
                        + (f", path={r['path']}" if r.get("path") else ""))
        lines.append(f"{r['impl']:<26} {r['N']:>6} {r['D']:>4} {r['K']:>6} {r['ms']:>10.1f} {peak:>9} {xv:>7} {pm:>7}  "
                     + "; ".join(note))
    return "\n".join(lines)


METHOD = """\
time: fwd+bwd wall clock, median of the timed repeats after warm-up, implementations interleaved
      round-robin within a shape; {threads} torch thread(s).
peak MB: {memory_text}
x VQP: time / vector-quantize-pytorch VectorQuantize (defaults) at the same shape.
% 6mm: rate relative to the six bare matmuls of the full DDCL gradient at the same shape
      (100% = as fast as the matmuls alone). straight_through DDCL (ddcl-*) needs only three
      of them (no gradient through q to z), so it can pass 100%.
DDCL rows: ddcl-<path> = default mode straight_through; ddcl-soft-<path> = soft mode (full gradient)."""

MEMORY_TEXT = {
    "rss": "resident-set high-water mark above the baseline with inputs allocated (malloc_trim, then\n"
           "      /proc/self/clear_refs resets VmHWM; VmHWM − VmRSS) over one probed run: a separate run after\n"
           "      warm-up unless the note says it was the warm-up run or a single cold run.",
    "subprocess": "ru_maxrss growth of one run in a fresh Python process, inputs allocated first.",
    "none": "not measured (--memory none).",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ddcl-vq bench",
        description="Quantizer forward+backward time and peak memory, side by side: DDCL (reference, fused, "
                    "chunked paths; straight_through and soft modes), HardVQ, EMAVQ, vector-quantize-pytorch "
                    "VectorQuantize (defaults) and the six-matmul floor, plus one default VQ-VAE training step "
                    "with DDCL vs HardVQ. Prints a table; --json writes the rows.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Full grid: N in {4096,16384,65536} x D in {64,256} x K in {512,1024,8192,65536}; what would not fit "
               "in memory or in --max-seconds is skipped and listed with the reason.\n"
               "Example: ddcl-vq bench --quick --json bench.json")
    p.add_argument("--quick", action="store_true",
                   help="N=8192, D=64, K in {1024, 8192} and the VQ-VAE step; under a minute on 2 cores")
    p.add_argument("--json", metavar="FILE", help="write {'meta': ..., 'rows': [{impl, N, D, K, ms, peak_mb, ...}]}")
    p.add_argument("--shapes", nargs="+", metavar="N,D,K", help="measure these shapes instead of the grid")
    p.add_argument("--impls", nargs="+", choices=sorted(IMPLS), metavar="IMPL",
                   help=f"subset of implementations (default all): {', '.join(IMPLS)}")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per measurement (default 5; quick 2)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up runs per measurement (default 1)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="skip a measurement whose single run is estimated above this (default 300; quick 20)")
    p.add_argument("--budget-seconds", type=float, default=None,
                   help="cut repeats so one measurement takes about this long (default 20; quick 5)")
    p.add_argument("--max-memory-gb", type=float, default=None,
                   help="skip what would need more than this (default: 75%% of MemAvailable)")
    p.add_argument("--memory", choices=("rss", "subprocess", "none"), default="rss",
                   help="peak-memory method (default rss: in-process VmHWM reset per probe)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    p.add_argument("--no-e2e", action="store_true", help="skip the VQ-VAE training-step comparison")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (estimated seconds and memory, runs, skips) and exit without measuring")
    p.add_argument("--_probe", nargs=4, metavar=("IMPL", "N", "D", "K"), help=argparse.SUPPRESS)
    return p


def parse_shape(text: str) -> Tuple[int, int, int]:
    try:
        n, d, k = (int(v) for v in text.split(","))
    except ValueError:
        raise SystemExit(f"ddcl-vq bench: expected a shape N,D,K like 8192,64,1024, got {text!r}")
    if min(n, d, k) <= 0:
        raise SystemExit(f"ddcl-vq bench: expected positive N,D,K, got {text!r}")
    return n, d, k


def run_bench(shapes: Sequence[Tuple[int, int, int]], impls: Sequence[str], *, warmup: int = 1, repeats: int = 3,
              max_seconds: float = 300.0, budget_seconds: float = 60.0, mem_budget: Optional[float] = None,
              memory: str = "rss", e2e: bool = False, e2e_repeats: int = 5, e2e_warmup: int = 2,
              e2e_batch: int = 128, e2e_reference: bool = True, progress: bool = False,
              calibration: Optional[float] = None, probe_warmup: bool = False) -> List[dict]:
    """Measure ``impls`` at ``shapes`` (and optionally the VQ-VAE step); returns rows with ratios."""
    if memory == "rss" and not RssProbe.available():
        memory = "subprocess"
    cal = calibrate() if calibration is None else calibration
    mem_budget = 0.75 * available_memory_bytes() if mem_budget is None else mem_budget
    plans = plan_measurements(shapes, impls, warmup=warmup, repeats=repeats, max_seconds=max_seconds,
                              budget_seconds=budget_seconds, mem_budget=mem_budget, cal=cal,
                              probe_warmup=probe_warmup)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(plans), desc="bench", unit="meas", file=sys.stderr, dynamic_ncols=True)
    rows: List[dict] = []
    for shape in dict.fromkeys(p.shape for p in plans):
        if bar is not None:
            bar.set_postfix_str(f"N={shape[0]} D={shape[1]} K={shape[2]}")
        rows += run_shape(shape, [p for p in plans if p.shape == shape], memory, bar)
    if bar is not None:
        bar.close()
    add_ratios(rows)
    if e2e:
        rows += e2e_rows(repeats=e2e_repeats, warmup=e2e_warmup, batch=e2e_batch, with_reference=e2e_reference)
    for r in rows:
        r["memory_method"] = memory
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args._probe:
        name, n, d, k = args._probe
        return _probe_main(name, int(n), int(d), int(k))
    if args.threads:
        torch.set_num_threads(args.threads)
    quick = args.quick
    if args.shapes:
        shapes = [parse_shape(s) for s in args.shapes]
    elif quick:
        shapes = list(QUICK_SHAPES)
    else:
        shapes = [(n, d, k) for n in FULL_N for d in FULL_D for k in FULL_K]
    impls = args.impls or list(IMPLS)
    warmup = args.warmup if args.warmup is not None else 1
    repeats = args.repeats if args.repeats is not None else (2 if quick else 5)
    max_seconds = args.max_seconds if args.max_seconds is not None else (20.0 if quick else 300.0)
    budget = args.budget_seconds if args.budget_seconds is not None else (5.0 if quick else 20.0)
    mem_budget = None if args.max_memory_gb is None else args.max_memory_gb * 2**30
    if args.dry_run:
        if args.threads:
            torch.set_num_threads(args.threads)
        cal = calibrate()
        mb = 0.75 * available_memory_bytes() if mem_budget is None else mem_budget
        plans = plan_measurements(shapes, impls, warmup=warmup, repeats=repeats, max_seconds=max_seconds,
                                  budget_seconds=budget, mem_budget=mb, cal=cal, probe_warmup=quick)
        total = 0.0
        for p in plans:
            runs = 0 if p.skip else p.warmup + p.repeats + (p.probe == "separate")
            total += runs * p.est_s
            print(f"{p.name:<22} N={p.shape[0]:<6} D={p.shape[1]:<4} K={p.shape[2]:<6} est {p.est_s:8.2f} s/run "
                  f"{p.est_bytes / 2**20:9.0f} MiB  " + (f"skip ({p.skip})" if p.skip else f"runs {runs}"))
        print(f"estimated total: {total / 60:.1f} min (plus the VQ-VAE step unless --no-e2e)")
        return 0
    t0 = time.perf_counter()
    meta = machine()
    rows = run_bench(shapes, impls, warmup=warmup, repeats=repeats, max_seconds=max_seconds,
                     budget_seconds=budget, mem_budget=mem_budget, memory=args.memory,
                     e2e=not args.no_e2e, e2e_repeats=3 if quick else 15, e2e_warmup=1 if quick else 2,
                     e2e_reference=not quick, progress=not args.no_progress, probe_warmup=quick)
    memory = rows[0]["memory_method"] if rows else args.memory
    meta.update(memory_method=memory, command="ddcl-vq bench " + " ".join(argv if argv is not None else sys.argv[1:]),
                seconds=round(time.perf_counter() - t0, 1))
    try:
        meta["loadavg_end"] = [round(v, 2) for v in os.getloadavg()]
    except OSError:
        pass
    print(f"ddcl-vq bench — {meta['cpu']}, {meta['cores']} cores, {meta['threads']} torch threads, "
          f"torch {meta['torch']}, {meta['date']}, load average {meta.get('loadavg')} -> {meta.get('loadavg_end')}")
    if meta.get("loadavg") and meta["cores"] and max(meta["loadavg"][0], meta.get("loadavg_end", [0])[0]) > meta["cores"]:
        print("warning: the load average exceeded the core count: other jobs shared the CPU, so absolute times are "
              "inflated; compare ratios within this run.")
    print(METHOD.format(threads=meta["threads"], memory_text=MEMORY_TEXT[memory]))
    print()
    print(format_table(rows))
    print(f"\n{len(rows)} rows in {meta['seconds']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
