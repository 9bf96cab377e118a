"""The bench's cost model and plan: estimate each measurement's time and memory from a
calibration matmul, skip what does not fit, cut repeats to the time budget."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch

# name -> label.  ddcl-mstep is the library default (straight_through, M-step codebook: no
# gradient through the assignment); ddcl-<path> is straight_through with the codebook trained by gradient (the
# assignment's fused/chunked/reference paths), ddcl-soft-<path> the soft mode (full gradient through q to z and W).
IMPLS = {
    "matmul6": "six bare matmuls (floor of the full DDCL gradient)",
    "ddcl-mstep": "DDCL default: straight_through, M-step codebook",
    "ddcl-first": "DDCL default on its first training batch: a fresh quantizer, k-means start included",
    "ddcl-twins": "DDCL default with revive_twins (512 codes checked for a twin per batch)",
    "ddcl-reference": "DDCL straight_through (codebook by gradient), plain autograd",
    "ddcl-fused": "DDCL straight_through (codebook by gradient), fused",
    "ddcl-chunked": "DDCL straight_through (codebook by gradient), chunked",
    "ddcl-soft-reference": "DDCL soft, plain autograd", "ddcl-soft-fused": "DDCL soft, fused",
    "ddcl-soft-chunked": "DDCL soft, chunked", "hardvq": "HardVQ (argmin + straight-through)",
    "emavq": "EMAVQ (EMA codebook)", "vqp": "vector-quantize-pytorch VectorQuantize (defaults)",
    "ibq": "IBQ (index backpropagation: hard forward, softmax gradient into every code; published settings)",
}

# cost model for the estimates, fitted to runs on a 2-core EPYC: (matmuls of N×D·D×K, other N×K work counted in
# D=64-matmul equivalents, N×K float tensors alive at the peak). ddcl-first: + the k-means fit (see estimate);
# ddcl-twins: + a 512×K·K×D twin check; ibq: blocked (logits recomputed, softmax and its tempered twin both ways)
COST = {
    "matmul6": (6.0, 0.0, 0.0), "ddcl-mstep": (3.0, 4.0, 1.0), "ddcl-first": (4.0, 5.0, 1.0),
    "ddcl-twins": (3.5, 4.5, 1.0), "ddcl-reference": (3.0, 23.0, 8.0), "ddcl-fused": (3.0, 3.0, 0.0),
    "ddcl-chunked": (3.0, 3.0, 0.0), "ddcl-soft-reference": (6.0, 24.0, 9.0), "ddcl-soft-fused": (6.0, 3.5, 1.0),
    "ddcl-soft-chunked": (7.0, 3.5, 0.0), "hardvq": (1.0, 7.5, 3.0), "emavq": (1.0, 8.0, 3.0),
    "vqp": (2.0, 15.0, 6.0), "ibq": (5.0, 40.0, 0.2),
}

FLOOR_MATMULS = {"ddcl-soft-reference": 6, "ddcl-soft-fused": 6, "ddcl-soft-chunked": 6, "ddcl-mstep": 3,
                 "ddcl-first": 3, "ddcl-twins": 3, "ddcl-reference": 3, "ddcl-fused": 3, "ddcl-chunked": 3,
                 "matmul6": 6}


def calibrate(device: str = "cpu") -> float:
    """Seconds per flop of a D=64 matmul on ``device`` (median of 5 runs of 4096×64 · 64×4096)."""
    a, b = torch.randn(4096, 64, device=device), torch.randn(64, 4096, device=device)
    out = torch.empty(4096, 4096, device=device)

    def run():
        torch.mm(a, b, out=out)
        if out.device.type == "cuda":
            torch.cuda.synchronize(out.device)
    run()
    return statistics.median(time_once(run) for _ in range(5)) / (2 * 4096 * 64 * 4096)


def estimate(name: str, n: int, d: int, k: int, per_flop: float) -> Tuple[float, float]:
    """(seconds for one run, extra bytes at peak) — rough, for skipping and repeat counts."""
    units, other, tensors = COST[name]
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
    if name in ("ddcl-fused", "ddcl-chunked", "ddcl-soft-fused", "ddcl-soft-chunked"):
        from ddcl_vq.blocks import chunk_rows
        extra += 2 * 4 * chunk_rows(n, k) * k * 4   # block buffers of two workers
    if name == "matmul6":
        extra += 2 * n * k * 4                # its N×K operands live outside the probe, but must fit
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


def time_once(fn: Callable[[], None]) -> float:
    """Wall-clock seconds of one call of ``fn``."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0
