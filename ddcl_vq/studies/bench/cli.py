"""``ddcl-vq bench`` / ``python -m ddcl_vq bench``: the command and its options."""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

import torch

from ddcl_vq.common.machine import load_average, machine_info
from ddcl_vq.common.errors import entry_point
from ddcl_vq.common.progress import fmt
from ddcl_vq.common.config import ConfigError, Options, Rules, option

from ddcl_vq.studies.bench.steps import IMPLS, RESIDUAL_IMPLS, calibrate, plan_measurements
from ddcl_vq.studies.bench.run import available_memory_bytes, probe_main, run_bench

FULL_N = (4096, 16384, 65536)
FULL_D = (64, 256)
FULL_K = (512, 1024, 8192, 65536)
QUICK_SHAPES = ((8192, 64, 1024), (8192, 64, 8192))
#: quick: the residual rows (4 levels: about four single-codebook steps each) at the smaller K only
QUICK_ONLY_AT = {name: QUICK_SHAPES[:1] for name in RESIDUAL_IMPLS}


def format_table(rows: List[dict]) -> str:
    head = f"{'impl':<26} {'N':>6} {'D':>4} {'K':>6} {'ms':>10} {'peak MB':>9} {'x VQP':>7} {'% 6mm':>7}  note"
    lines = [head, "-" * len(head)]
    for r in rows:  # a skipped row: '—' for what it lacks, and why it was skipped
        n, d, k, ms, peak = (fmt(r.get(key), spec) for key, spec in (("N", ""), ("D", ""), ("K", ""), ("ms", ".1f"),
                                                                     ("peak_mb", ".0f")))
        xv = "" if r.get("x_vqp") is None else f"{r['x_vqp']:.2f}"
        pm = "" if r.get("pct_matmul6") is None else f"{r['pct_matmul6']:.0f}%"
        note = [f"skipped: {r.get('skipped', '')}"] if r.get("ms") is None else []
        if r.get("runs") == 1 and not r.get("warmup"):
            note.append("single cold run")
        elif r.get("probe") == "warmup":
            note.append(f"{r['runs']} run(s) after warm-up; memory from the warm-up run")
        if "ratio_vs_hardvq" in r:
            note.append(f"{r['ratio_vs_hardvq']:.2f}x HardVQ step (median of per-round ratios "
                        f"{r['paired_ratio_vs_hardvq']:.2f}x, {r['runs']} rounds"
                        + (f"; CPU time {r['cpu_paired_ratio_vs_hardvq']:.2f}x" if "cpu_paired_ratio_vs_hardvq" in r
                           else "") + ")"
                        + (f", {r['page_faults']} page faults a step" if r.get("page_faults") is not None else "")
                        + (f", path={r['path']}" if r.get("path") else ""))
        if r.get("input_shape"):  # the VQGAN-recipe step
            note.append(f"input {'x'.join(str(v) for v in r['input_shape'])}"
                        + (", discriminator on" if r.get("disc_on") else "")
                        + (f", LPIPS {r['perceptual_net']}" if r.get("perceptual_net") else ""))
        if r.get("x_vqp_of"):
            note.append(f"x VQP against {r['x_vqp_of']}")
        if r.get("fallback"):
            note.append(f"model: {r['source']} ({r['fallback']})")
        lines.append(f"{r['impl']:<26} {n:>6} {d:>4} {k:>6} {ms:>10} {peak:>9} {xv:>7} {pm:>7}  " + "; ".join(note))
    return "\n".join(lines)


METHOD = """\
time: fwd+bwd wall clock, median of the timed repeats after warm-up, implementations interleaved
      round-robin within a shape; {threads} torch thread(s).
peak MB: {memory_text}
x VQP: time / vector-quantize-pytorch VectorQuantize (defaults) at the same shape; the residual rows
      (ddcl-residual4, vqp-residual4: 4 levels of K codes each): time / its ResidualVQ(num_quantizers=4).
% 6mm: rate relative to the six bare matmuls of the full DDCL gradient at the same shape
      (100% = as fast as the matmuls alone; the residual rows: four times the six, one set per level).
      straight_through DDCL (ddcl-mstep, ddcl-first, ddcl-residual4) needs only three of them (no
      gradient through q to z), so it can pass 100%.
DDCL rows: ddcl-mstep = the library default (straight_through, M-step codebook) past its first batch;
ddcl-first = the default on the first training batch of a fresh quantizer (k-means start and first-batch
set-up included, every run); ddcl-soft-<path> = soft mode (full gradient) on the reference, fused or
chunked assignment path; ddcl-residual4 = ResidualDDCL(num_levels=4), every level the default, past its
first batch.
Whole training steps, DDCL and HardVQ alternating round by round (ratios: to the HardVQ step of the same rounds):
vqvae-step-* = configs/fashion_ddcl.yaml vs fashion_hard.yaml; vqgan-step-* = configs/vqgan_photos64.yaml
(generator + discriminator, past disc_start) vs its HardVQ arm in configs/study_vqgan.yaml."""


MEMORY_TEXT = {
    "rss": "resident-set high-water mark above the baseline with inputs allocated (malloc_trim, then\n"
           "      /proc/self/clear_refs resets VmHWM; VmHWM − VmRSS) over one probed run: a separate run after\n"
           "      warm-up unless the note says it was the warm-up run or a single cold run.",
    "subprocess": "ru_maxrss growth of one run in a fresh Python process, inputs allocated first.",
    "none": "not measured (--memory none).",
    "cuda": "CUDA allocator high-water mark (torch.cuda.max_memory_allocated, reset per probe) above what was\n"
            "      allocated before the run (inputs, parameters, upstream gradients); one probed run as for rss.",
}


@dataclass(kw_only=True)
class BenchOptions:
    quick: bool = option(False, "N=8192, D=64, K in {1024, 8192} (the residual rows at K=1024 only), the VQ-VAE "
                                "and VQGAN steps with few repeats; about a minute on 2 cores")
    json: Optional[str] = option(None, "write {'meta': ..., 'rows': [{impl, N, D, K, ms, peak_mb, ...}]}",
                                 metavar="FILE")
    shapes: Optional[List[str]] = option(None, "measure these shapes instead of the grid", nargs="+", metavar="N,D,K")
    impls: Optional[List[str]] = option(None, f"subset of implementations: {', '.join(IMPLS)}", nargs="+",
                                        metavar="IMPL", default_text="all")
    repeats: int = option(5, "timed repeats per measurement")
    warmup: int = option(1, "warm-up runs per measurement")
    max_seconds: float = option(300.0, "skip a measurement whose single run is estimated above this")
    budget_seconds: float = option(20.0, "cut repeats so one measurement takes about this long")
    max_memory_gb: Optional[float] = option(None, "skip what would need more than this",
                                            default_text="75% of MemAvailable")
    memory: str = option("rss", "peak-memory method (rss: in-process VmHWM reset per probe)")
    threads: Optional[int] = option(None, "torch threads", default_text="torch's default")
    device: str = option("cpu", "measure on this device: cpu, or cuda (the current GPU; memory is then the CUDA "
                                "allocator's peak above the inputs)")
    no_e2e: bool = option(False, "skip the VQ-VAE training-step comparison")
    no_vqgan: bool = option(False, "skip the VQGAN-recipe training-step comparison (configs/vqgan_photos64.yaml, "
                                   "generator + discriminator, batch 16 of 3x64x64, DDCL vs HardVQ)")
    no_prior: bool = option(False, "skip the prior row (sampling 64 images at 8x8 tokens; also skipped with --shapes)")
    no_progress: bool = option(False, "no progress bar")
    dry_run: bool = option(False, "print the plan (estimated seconds and memory, runs, skips) and exit without "
                                  "measuring")
    probe: Optional[List[str]] = option(None, flag="--_probe", nargs=4, hidden=True)  # the child of --memory subprocess


OPTIONS = Options(
    BenchOptions, prog="ddcl-vq bench",
    description="Quantizer forward+backward time and peak memory, side by side: DDCL (the default, straight_through "
                "with the M-step codebook; soft mode on the reference, fused and chunked paths), HardVQ, EMAVQ, IBQ, "
                "vector-quantize-pytorch VectorQuantize (defaults), "
                "ResidualDDCL with 4 levels against vector-quantize-pytorch ResidualVQ (num_quantizers=4) "
                "and the six-matmul floor, plus one default VQ-VAE training step and one VQGAN-recipe training step "
                "(generator + discriminator) with DDCL vs HardVQ. Prints a table; --json writes the rows.",
    epilog="Full grid: N in {4096,16384,65536} x D in {64,256} x K in {512,1024,8192,65536}; what would not fit "
           "in memory or in --max-seconds is skipped and listed with the reason.\n"
           "Example: ddcl-vq bench --quick --json bench.json",
    rules=Rules(choices={"impls": tuple(IMPLS), "memory": ("rss", "subprocess", "none"), "device": ("cpu", "cuda")},
                positive={"repeats", "max_seconds", "budget_seconds", "max_memory_gb"},
                non_negative={"warmup", "threads"}),
    presets={"quick": {"repeats": 2, "max_seconds": 20.0, "budget_seconds": 5.0}})


def parse_shape(text: str) -> Tuple[int, int, int]:
    try:
        n, d, k = (int(v) for v in text.split(","))
    except ValueError:
        raise ConfigError(f"option --shapes: expected N,D,K like 8192,64,1024, got {text!r}") from None
    if min(n, d, k) <= 0:
        raise ConfigError(f"option --shapes: expected positive N,D,K, got {text!r}")
    return n, d, k


@entry_point("ddcl-vq bench")
def main(argv: Optional[List[str]] = None) -> int:
    args = OPTIONS.parse(argv)
    if args.probe:
        name, n, d, k = args.probe
        return probe_main(name, int(n), int(d), int(k))
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("option --device cuda: no CUDA device is available here (torch.cuda.is_available() is "
                          "False); use --device cpu")
    if device == "cuda" and args.memory == "subprocess":
        raise ConfigError("option --memory subprocess measures host memory; with --device cuda use rss (the CUDA "
                          "allocator's peak is then measured) or none")
    quick = args.quick
    shapes = ([parse_shape(s) for s in args.shapes] if args.shapes else list(QUICK_SHAPES) if quick
              else [(n, d, k) for n in FULL_N for d in FULL_D for k in FULL_K])
    impls = args.impls or list(IMPLS)
    plan = dict(warmup=args.warmup, repeats=args.repeats, max_seconds=args.max_seconds,
                budget_seconds=args.budget_seconds, probe_warmup=quick,
                only_at=QUICK_ONLY_AT if quick and not args.shapes else None)
    mem_budget = None if args.max_memory_gb is None else args.max_memory_gb * 2**30
    if args.dry_run:
        mb = 0.75 * available_memory_bytes(device) if mem_budget is None else mem_budget
        plans = plan_measurements(shapes, impls, mem_budget=mb, cal=calibrate(device), **plan)
        total = 0.0
        for p in plans:
            runs = 0 if p.skip else p.warmup + p.repeats + (p.probe == "separate")
            total += runs * p.est_s
            print(f"{p.name:<22} N={p.shape[0]:<6} D={p.shape[1]:<4} K={p.shape[2]:<6} est {p.est_s:8.2f} s/run "
                  f"{p.est_bytes / 2**20:9.0f} MiB  " + (f"skip ({p.skip})" if p.skip else f"runs {runs}"))
        print(f"estimated total: {total / 60:.1f} min (plus the VQ-VAE step unless --no-e2e and the VQGAN step "
              "unless --no-vqgan)")
        return 0
    t0 = time.perf_counter()
    meta = machine_info()
    rows = run_bench(shapes, impls, mem_budget=mem_budget, memory=args.memory, progress=not args.no_progress,
                     e2e=None if args.no_e2e else dict(repeats=31 if quick else 41, warmup=10),
                     vqgan=None if args.no_vqgan else dict(repeats=5 if quick else 11, warmup=1 if quick else 2),
                     device=device, **plan)
    prior_rows, prior_text = [], ""
    if not (args.no_prior or args.shapes):  # the prior's sampling speed
        from ddcl_vq.prior.sampling import bench_prior
        prior_rows, prior_text = bench_prior(device, repeats=1 if quick else 3, no_cache=not quick)
    memory = rows[0]["memory_method"] if rows else args.memory
    meta.update(memory_method=memory, command="ddcl-vq bench " + " ".join(argv if argv is not None else sys.argv[1:]),
                seconds=round(time.perf_counter() - t0, 1), device=device)
    if (end_load := load_average()) is not None:
        meta["loadavg_end"] = end_load
    on = f"{meta['gpu']} (CUDA), host " if device == "cuda" else ""
    print(f"ddcl-vq bench — {on}{meta['cpu']}, {meta['cores']} cores, {meta['threads']} torch threads, "
          f"torch {meta['torch']}, {meta['date']}, load average {meta.get('loadavg')} -> {meta.get('loadavg_end')}")
    load = max(meta["loadavg"][0], meta.get("loadavg_end", [0])[0]) if meta.get("loadavg") else 0
    if meta["cores"] and load > meta["cores"]:
        print("warning: the load average exceeded the core count: other jobs shared the CPU, so absolute times are "
              "inflated; compare ratios within this run.")
    print(METHOD.format(threads=meta["threads"], memory_text=MEMORY_TEXT[memory]) + "\n")
    print(format_table(rows))
    if prior_text:
        print("\n" + prior_text)
    print(f"\n{len(rows)} rows in {meta['seconds']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows, "prior": prior_rows}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
