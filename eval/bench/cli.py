"""``ddcl-vq bench`` / ``python -m ddcl_vq.eval.bench``: the command and its options."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from ddcl_vq.eval.machine import machine_info

from .cost import IMPLS, calibrate, plan_measurements
from .memory import available_memory_bytes, probe_main
from .report import MEMORY_TEXT, METHOD, format_table
from .run import run_bench

FULL_N = (4096, 16384, 65536)
FULL_D = (64, 256)
FULL_K = (512, 1024, 8192, 65536)
QUICK_SHAPES = ((8192, 64, 1024), (8192, 64, 8192))


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


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args._probe:
        name, n, d, k = args._probe
        return probe_main(name, int(n), int(d), int(k))
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
    meta = machine_info()
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
