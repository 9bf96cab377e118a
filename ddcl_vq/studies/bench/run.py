"""Measuring a plan: warm-up, memory probe and timed repeats, round-robin within a shape; ratios. Peak memory:
in-process (VmHWM reset per probe, or the CUDA allocator's peak) or in a fresh process."""
from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import statistics
import subprocess
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ddcl_vq.ddcl.fused import release_buffers
from ddcl_vq.studies.bench.steps import (FLOOR_COPIES, FLOOR_MATMULS, VQP_BASELINE, Plan, calibrate, e2e_rows,
                                        make_inputs, make_step, plan_measurements, time_once, vqgan_rows)


def _status_kb(field: str) -> Optional[int]:
    with contextlib.suppress(OSError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    return None


class RssProbe:
    """Peak extra resident memory of a block of code, in MiB (Linux only): VmHWM, reset by ``start`` (malloc_trim,
    /proc/self/clear_refs), minus the VmRSS baseline."""

    def __init__(self):
        self._libc, self.base_kb = None, 0
        with contextlib.suppress(OSError):
            self._libc = ctypes.CDLL("libc.so.6")

    @staticmethod
    def available() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            return False
        return _status_kb("VmHWM") is not None

    def start(self) -> None:
        release_buffers()  # the fused path's held q buffer: a probed run counts it as its own
        gc.collect()
        if self._libc is not None:
            self._libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.base_kb = _status_kb("VmRSS") or 0

    def stop(self) -> float:
        return max(0, (_status_kb("VmHWM") or 0) - self.base_kb) / 1024.0


class CudaProbe:
    """Peak extra CUDA memory of a block of code, in MiB, above what was allocated at ``start``."""

    def __init__(self, device="cuda"):
        self.device, self.base = torch.device(device), 0

    def start(self) -> None:
        release_buffers()  # the fused path's held q buffer: a probed run counts it as its own
        gc.collect()
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.base = torch.cuda.memory_allocated(self.device)

    def stop(self) -> float:
        torch.cuda.synchronize(self.device)
        return max(0, torch.cuda.max_memory_allocated(self.device) - self.base) / 2**20


def available_memory_bytes(device: str = "cpu") -> int:
    """Free memory on ``device`` (:func:`~ddcl_vq.tokenizer.memory.available_bytes`); 8 GiB when unknown."""
    from ddcl_vq.tokenizer.memory import available_bytes
    return available_bytes(torch.device(device)) or 8 << 30


def probe_subprocess(name: str, shape: Tuple[int, int, int]) -> Optional[float]:
    """Peak extra memory of one run of ``name`` in a fresh interpreter (ru_maxrss growth)."""
    n, d, k = shape
    cmd = [sys.executable, "-m", "ddcl_vq", "bench", "--_probe", name, str(n), str(d), str(k)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        return float(json.loads(out.stdout.strip().splitlines()[-1])["peak_mb"])
    except (subprocess.CalledProcessError, ValueError, KeyError, IndexError):
        return None


def probe_main(name: str, n: int, d: int, k: int) -> int:
    """The child side of :func:`probe_subprocess` (``python -m ddcl_vq bench --_probe ...``)."""
    import resource
    small = make_inputs(64, d, min(k, 64))
    make_step(name, small)()                  # load kernels and lazy state on a tiny shape
    inp = make_inputs(n, d, k)
    step = make_step(name, inp)
    gc.collect()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    base = max(base, _status_kb("VmRSS") or 0)
    step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_mb": max(0, peak - base) / 1024.0}))
    return 0


def run_shape(shape: Tuple[int, int, int], plans: List[Plan], memory: str, progress, device: str = "cpu") -> List[dict]:
    """Measure every runnable plan of one shape, round-robin, on ``device``; returns result rows, updating the
    ``progress`` bar per plan. ``memory``: "rss" (CPU), "cuda" (the CUDA allocator's peak), "subprocess" or "none"."""
    n, d, k = shape
    rows = [dict(impl=p.name, N=n, D=d, K=k, ms=None, peak_mb=None, skipped=p.skip, est_s=round(p.est_s, 2))
            for p in plans if p.skip is not None]
    progress.update(len(rows))
    live = [p for p in plans if p.skip is None]
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
            if r == p.repeats - 1:
                progress.update(1)
    for p in live:
        ms = statistics.median(times[p.name]) * 1e3
        rows.append(dict(impl=p.name, N=n, D=d, K=k, ms=round(ms, 3),
                         peak_mb=None if peak[p.name] is None else round(peak[p.name], 1),
                         runs=len(times[p.name]), warmup=p.warmup, probe=p.probe, est_s=round(p.est_s, 2)))
    for name, msg in errors.items():
        rows.append(dict(impl=name, N=n, D=d, K=k, ms=None, peak_mb=None, skipped=f"error: {msg}"))
        progress.update(1)
    steps.clear()  # the steps' closures and the inputs go before the next shape
    del inp
    gc.collect()
    return rows


def run_bench(shapes: Sequence[Tuple[int, int, int]], impls: Sequence[str], *, warmup: int = 1, repeats: int = 3,
              max_seconds: float = 300.0, budget_seconds: float = 60.0, mem_budget: Optional[float] = None,
              memory: str = "rss", e2e: Optional[dict] = None, vqgan: Optional[dict] = None, progress: bool = False,
              calibration: Optional[float] = None, probe_warmup: bool = False, device: str = "cpu",
              only_at: Optional[Dict[str, Sequence[Tuple[int, int, int]]]] = None) -> List[dict]:
    """Measure ``impls`` at ``shapes`` on ``device`` (``only_at``: impl -> the only shapes it is measured at), then
    the VQ-VAE step (:func:`e2e_rows` with the keyword arguments ``e2e``) and the VQGAN-recipe step
    (:func:`vqgan_rows` with ``vqgan``) unless None; returns rows with ratios."""
    if device != "cpu" and memory != "none":
        memory = "cuda"
    if memory == "rss" and not RssProbe.available():
        memory = "subprocess"
    cal = calibrate(device) if calibration is None else calibration
    mem_budget = 0.75 * available_memory_bytes(device) if mem_budget is None else mem_budget
    plans = plan_measurements(shapes, impls, warmup=warmup, repeats=repeats, max_seconds=max_seconds,
                              budget_seconds=budget_seconds, mem_budget=mem_budget, cal=cal, probe_warmup=probe_warmup,
                              only_at=only_at)
    from tqdm import tqdm
    bar = tqdm(total=len(plans), desc="bench", unit="meas", file=sys.stderr, dynamic_ncols=True, disable=not progress)
    rows: List[dict] = []
    for shape in dict.fromkeys(p.shape for p in plans):
        bar.set_postfix_str(f"N={shape[0]} D={shape[1]} K={shape[2]}")
        rows += run_shape(shape, [p for p in plans if p.shape == shape], memory, bar, device)
    bar.close()
    add_ratios(rows)
    if e2e is not None:
        rows += e2e_rows(device=device, **e2e)
    if vqgan is not None:
        rows += vqgan_rows(device=device, **vqgan)
    for r in rows:
        r["memory_method"] = memory
        r["device"] = device
    return rows


def add_ratios(rows: List[dict]) -> None:
    by_shape: Dict[Tuple[int, int, int], Dict[str, dict]] = {}
    for r in rows:
        by_shape.setdefault((r["N"], r["D"], r["K"]), {})[r["impl"]] = r
    for group in by_shape.values():
        floor = group.get("matmul6", {}).get("ms")
        for name, r in group.items():
            if r.get("ms") is None:
                continue
            baseline = VQP_BASELINE.get(name, "vqp")  # the residual rows: against ResidualVQ
            vqp = group.get(baseline, {}).get("ms")
            r["x_vqp"] = round(r["ms"] / vqp, 3) if vqp else None
            if baseline != "vqp" and vqp:  # named where it was measured
                r["x_vqp_of"] = baseline
            # % of the rate of the six bare matmuls: 100 = as fast as the six matmuls alone (the residual rows:
            # as fast as one set of six per level)
            copies = FLOOR_COPIES.get(name, 1)
            r["pct_matmul6"] = round(100.0 * copies * floor / r["ms"], 1) if floor else None
            if name in FLOOR_MATMULS:
                r["floor_matmuls"] = FLOOR_MATMULS[name]
