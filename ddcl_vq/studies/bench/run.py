"""Measuring a plan: warm-up, memory probe and timed repeats, round-robin within a shape; ratios."""
from __future__ import annotations

import gc
import statistics
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ddcl_vq.studies.bench.cost import FLOOR_MATMULS, Plan, calibrate, plan_measurements, time_once
from ddcl_vq.studies.bench.memory import CudaProbe, RssProbe, available_memory_bytes, probe_subprocess
from ddcl_vq.studies.bench.steps import e2e_rows, make_inputs, make_step

def run_shape(shape: Tuple[int, int, int], plans: List[Plan], memory: str, progress=None,
              device: str = "cpu") -> List[dict]:
    """Measure every runnable plan of one shape, round-robin, on ``device``; returns result rows.
    ``memory``: "rss" (CPU), "cuda" (the CUDA allocator's peak), "subprocess" or "none"."""
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
    inp = make_inputs(n, d, k, device=device)
    steps: Dict[str, Callable[[], None]] = {}
    times: Dict[str, List[float]] = {p.name: [] for p in live}
    peak: Dict[str, Optional[float]] = {p.name: None for p in live}
    errors: Dict[str, str] = {}
    probe = RssProbe() if memory == "rss" else CudaProbe(device) if memory == "cuda" else None
    probed = probe is not None
    for p in live:
        try:
            steps[p.name] = make_step(p.name, inp)
        except Exception as err:  # e.g. the optional peer package is missing
            errors[p.name] = f"{type(err).__name__}: {err}"
    live = [p for p in live if p.name in steps]

    def call(p: Plan, probed_now: bool) -> float:
        """One run of ``p``'s step: its seconds, and its peak memory when ``probed_now``."""
        if probed_now:
            probe.start()
        seconds = time_once(steps[p.name])
        if probed_now:
            peak[p.name] = probe.stop()
        return seconds
    # warm-up (first calls pay one-time costs), then the memory probe, then timed rounds
    for p in live:
        for i in range(p.warmup):
            call(p, probed and p.probe == "warmup" and i == p.warmup - 1)
        if probed and p.probe == "separate":
            call(p, True)
        elif memory == "subprocess":
            peak[p.name] = probe_subprocess(p.name, shape)
    for r in range(max(p.repeats for p in live)):
        for p in live:
            if r < p.repeats:  # "timed": a single cold run, time and memory from the same run
                times[p.name].append(call(p, probed and p.probe == "timed"))
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
    steps.clear()  # the steps' closures and the inputs go before the next shape
    del inp
    gc.collect()
    return rows


def run_bench(shapes: Sequence[Tuple[int, int, int]], impls: Sequence[str], *, warmup: int = 1, repeats: int = 3,
              max_seconds: float = 300.0, budget_seconds: float = 60.0, mem_budget: Optional[float] = None,
              memory: str = "rss", e2e: bool = False, e2e_repeats: int = 5, e2e_warmup: int = 2,
              e2e_batch: int = 128, e2e_reference: bool = True, vqgan: bool = False, vqgan_repeats: int = 5,
              vqgan_warmup: int = 2, vqgan_batch: int = 16, progress: bool = False,
              calibration: Optional[float] = None, probe_warmup: bool = False, device: str = "cpu") -> List[dict]:
    """Measure ``impls`` at ``shapes`` (and optionally the VQ-VAE step, ``e2e``, and the VQGAN-recipe
    step, ``vqgan``) on ``device`` ("cpu" or "cuda"); returns rows with ratios. On CUDA memory is the allocator's peak (method "cuda")."""
    if device != "cpu" and memory != "none":
        memory = "cuda"
    if memory == "rss" and not RssProbe.available():
        memory = "subprocess"
    cal = calibrate(device) if calibration is None else calibration
    mem_budget = 0.75 * available_memory_bytes(device) if mem_budget is None else mem_budget
    plans = plan_measurements(shapes, impls, warmup=warmup, repeats=repeats, max_seconds=max_seconds,
                              budget_seconds=budget_seconds, mem_budget=mem_budget, cal=cal, probe_warmup=probe_warmup)
    from tqdm import tqdm
    bar = tqdm(total=len(plans), desc="bench", unit="meas", file=sys.stderr, dynamic_ncols=True, disable=not progress)
    rows: List[dict] = []
    for shape in dict.fromkeys(p.shape for p in plans):
        bar.set_postfix_str(f"N={shape[0]} D={shape[1]} K={shape[2]}")
        rows += run_shape(shape, [p for p in plans if p.shape == shape], memory, bar, device)
    bar.close()
    add_ratios(rows)
    if e2e:
        rows += e2e_rows(repeats=e2e_repeats, warmup=e2e_warmup, batch=e2e_batch, with_reference=e2e_reference,
                         device=device)
    if vqgan:
        from ddcl_vq.studies.bench.vqgan import vqgan_rows
        rows += vqgan_rows(repeats=vqgan_repeats, warmup=vqgan_warmup, batch=vqgan_batch, device=device)
    for r in rows:
        r["memory_method"] = memory
        r["device"] = device
    return rows


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
