"""The bench table and the method text printed above it."""
from __future__ import annotations

from typing import List

def format_table(rows: List[dict]) -> str:
    head = f"{'impl':<26} {'N':>6} {'D':>4} {'K':>6} {'ms':>10} {'peak MB':>9} {'x VQP':>7} {'% 6mm':>7}  note"
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.get("ms") is None:
            n, d, k = ("—" if r.get(key) is None else r[key] for key in ("N", "D", "K"))
            lines.append(f"{r['impl']:<26} {n:>6} {d:>4} {k:>6} {'—':>10} {'—':>9} {'':>7} {'':>7}  "
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
                        f"{r['paired_ratio_vs_hardvq']:.2f}x, {r['runs']} rounds"
                        + (f"; CPU time {r['cpu_paired_ratio_vs_hardvq']:.2f}x" if "cpu_paired_ratio_vs_hardvq" in r
                           else "") + ")"
                        + (f", {r['page_faults']} page faults a step" if r.get("page_faults") is not None else "")
                        + (f", path={r['path']}" if r.get("path") else ""))
        if r.get("input_shape"):  # the VQGAN-recipe step
            note.append(f"input {'x'.join(str(v) for v in r['input_shape'])}"
                        + (", discriminator on" if r.get("disc_on") else "")
                        + (f", LPIPS {r['perceptual_net']}" if r.get("perceptual_net") else ""))
        if r.get("fallback"):
            note.append(f"model: {r['source']} ({r['fallback']})")
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
DDCL rows: ddcl-mstep = the library default (straight_through, M-step codebook) past its first batch;
ddcl-first = the default on the first training batch of a fresh quantizer (k-means start and first-batch
set-up included, every run); ddcl-twins = the default with revive_twins (one 512-code twin check per
batch); ddcl-<path> = straight_through with the codebook trained by gradient;
ddcl-soft-<path> = soft mode (full gradient).
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
