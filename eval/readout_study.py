"""``ddcl-vq readout-study``: DDCL readout vs mean pooling vs a class token, plus the compressor.

One small patch transformer on real Fashion-MNIST, trained once per readout arm at the same
budget (same steps, batch, learning rate, seed, data order and encoder initialisation); then
the hierarchical compressor on the DDCL arm's frozen token features. Writes ``results.json``,
``report.md`` and PNG plots to ``--out``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ddcl_vq import USAGE_DEFINITIONS, CodebookUsage, DDCLReadout, HierarchicalCompressor
from ddcl_vq.readout import DEFAULT_PROTOTYPE_LR_RATIO, DEFAULT_TEMPERATURE, prototype_param_groups

# arm name -> (readout kind, overrides of the DDCL settings)
ARMS = {
    "mean": ("mean", {}),
    "cls": ("cls", {}),
    "ddcl": ("ddcl", {}),
    "ddcl_soft": ("ddcl", {"mode": "soft"}),
    "ddcl_joint": ("ddcl", {"mode": "soft", "distortion_to_tokens": True}),
    # ablations (not run by default): the timescale ratio, gradient routing, temperature
    "ddcl_rho1": ("ddcl", {"prototype_lr_ratio": 1.0}),
    "ddcl_ponly": ("ddcl", {"task_grad_to_prototypes": False}),
    "ddcl_joint_rho1": ("ddcl", {"mode": "soft", "distortion_to_tokens": True, "prototype_lr_ratio": 1.0}),
    "ddcl_tau0.03": ("ddcl", {"temperature": 0.03}),
    "ddcl_tau0.3": ("ddcl", {"temperature": 0.3}),
}
ARM_TEXT = {
    "mean": "masked mean of the final tokens",
    "cls": "a learned class token prepended, its final state",
}

DEFAULTS = dict(steps=1000, batch_size=128, lr=1e-3, eval_every=200, train_size=60000, test_size=10000,
                compressor_steps=300, compressor_train=8192, compressor_test=2000)
QUICK = dict(steps=80, batch_size=64, lr=2e-3, eval_every=40, train_size=4096, test_size=1000,
             compressor_steps=10, compressor_train=256, compressor_test=128)

HELP = """\
Train a small transformer encoder over 4x4 image patches of real Fashion-MNIST (49 tokens,
dim 64, 2 layers, 4 heads) once per readout arm, at the same budget (steps, batch, lr, seed,
data order, encoder initialisation):

  mean  - mean pooling of the final tokens
  cls   - a class token
  ddcl  - the DDCL readout (ddcl_vq.DDCLReadout, library defaults): pooled = mean of the
          tokens' soft summaries (straight-through token gradient), loss = cross-entropy +
          readout.loss, the distortion computed on stop-gradient tokens (it trains the
          prototypes only); prototypes at --prototype-lr-ratio x lr

and reports test accuracy, wall time, and for DDCL the prototype utilization and perplexity
(dataset-level over the test tokens, ddcl_vq.CodebookUsage) and the decomposition identity
max |distortion - ols - variance| / distortion along training. Ablation arms (not default):
ddcl_soft (task gradient to the tokens only through q, the paper's readout), ddcl_joint
(ddcl_soft + the distortion also trains the encoder: the paper's joint form), ddcl_rho1 (prototype lr ratio 1), ddcl_ponly (the task
loss does not move the prototypes), ddcl_joint_rho1, ddcl_tau0.03, ddcl_tau0.3.

Then trains ddcl_vq.HierarchicalCompressor on the DDCL arm's frozen tokens (windows
--windows) and reports reconstruction error vs compression ratio, next to plain
window-mean pooling over the same windows.

Writes OUT/results.json, OUT/report.md, OUT/accuracy.png, OUT/ddcl_terms.png, OUT/compressor.png.
The default budget (3 arms x 1,000 steps, 1 thread) takes about 6-7 minutes on a 2-core CPU;
--quick takes seconds (for tests).
"""


# ----------------------------------------------------------------------------- data

def load_patches(split: str, size: int, patch: int, seed: int):
    """uint8 patch tokens (N, T, patch*patch) and int64 labels (N,); a fixed random subset if size < N."""
    from ddcl_vq.train.data import fashion_mnist_arrays

    images, labels = fashion_mnist_arrays(split)
    if size < len(images):
        pick = np.random.default_rng(seed).permutation(len(images))[:size]
        pick.sort()
        images, labels = images[pick], labels[pick]
    x = torch.from_numpy(np.array(images, copy=True))
    n, h, w = x.shape
    x = x.reshape(n, h // patch, patch, w // patch, patch).permute(0, 1, 3, 2, 4)
    return x.reshape(n, (h // patch) * (w // patch), patch * patch).contiguous(), torch.from_numpy(labels)


def to_float(tokens_u8: Tensor) -> Tensor:
    return tokens_u8.float().div_(255.0).sub_(0.5).div_(0.5)


# ----------------------------------------------------------------------------- model

class PatchTransformer(nn.Module):
    """Linear patch embedding + learned positions + pre-LN TransformerEncoder + final LayerNorm + readout."""

    def __init__(self, readout: str, num_tokens: int, patch_dim: int, dim: int, layers: int, heads: int,
                 num_classes: int, num_prototypes: int, temperature: float, loss_weight: float,
                 distortion_to_tokens: bool, prototype_init: str = "kmeans", task_grad_to_prototypes: bool = True,
                 mode: str = "straight_through"):
        super().__init__()
        self.kind = readout
        # shared parts first, so every arm starts from the same encoder weights for the same seed
        self.embed = nn.Linear(patch_dim, dim)
        self.pos = nn.Parameter(0.02 * torch.randn(1, num_tokens, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)
        self.cls = nn.Parameter(0.02 * torch.randn(1, 1, dim)) if readout == "cls" else None
        self.readout = (DDCLReadout(dim, num_prototypes, temperature=temperature, loss_weight=loss_weight,
                                    distortion_to_tokens=distortion_to_tokens, prototype_init=prototype_init,
                                    task_grad_to_prototypes=task_grad_to_prototypes, mode=mode)
                        if readout == "ddcl" else None)

    def tokens(self, x: Tensor) -> Tensor:
        h = self.embed(x) + self.pos
        if self.cls is not None:
            h = torch.cat([self.cls.expand(h.shape[0], -1, -1), h], 1)
        return self.norm(self.encoder(h))

    def forward(self, x: Tensor):
        h = self.tokens(x)
        if self.kind == "mean":
            return self.head(h.mean(1)), None
        if self.kind == "cls":
            return self.head(h[:, 0]), None
        out = self.readout(h)
        return self.head(out.pooled), out


# ----------------------------------------------------------------------------- training

def lr_factor(step: int, steps: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


@torch.no_grad()
def evaluate(model: PatchTransformer, tokens_u8: Tensor, labels: Tensor, batch: int = 1000):
    model.eval()
    correct = 0
    usage = CodebookUsage(model.readout.num_prototypes) if model.readout is not None else None
    for i in range(0, len(labels), batch):
        logits, out = model(to_float(tokens_u8[i:i + batch]))
        correct += int((logits.argmax(1) == labels[i:i + batch]).sum())
        if usage is not None:
            usage.update(out.usage_indices, out.soft_counts)
    model.train()
    return correct / len(labels), (usage.compute() if usage is not None else None)


def train_arm(name: str, args, train_data, test_data, show_progress: bool) -> Dict:
    kind, over = ARMS[name]
    temperature = over.get("temperature", args.temperature)
    ratio = over.get("prototype_lr_ratio", args.prototype_lr_ratio)
    to_tokens = over.get("distortion_to_tokens", False)
    task_to_protos = over.get("task_grad_to_prototypes", True)
    xtr, ytr = train_data
    xte, yte = test_data
    torch.manual_seed(args.seed)
    model = PatchTransformer(kind, xtr.shape[1], xtr.shape[2], args.dim, args.layers, args.heads, 10,
                             args.num_prototypes, temperature, args.loss_weight, to_tokens,
                             over.get("prototype_init", args.prototype_init),
                             task_to_protos, over.get("mode", "straight_through"))
    if kind == "ddcl":
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the rho = 1 ablation is deliberate
            groups = prototype_param_groups(model, args.lr, ratio)
    else:
        groups = [{"params": list(model.parameters()), "lr": args.lr}]
    for g in groups:
        g["base_lr"] = g["lr"]
    opt = torch.optim.Adam(groups)
    gen = torch.Generator().manual_seed(args.seed)  # same data order for every arm
    warmup = max(1, args.steps // 20)
    log: List[Dict] = []
    curve: List[Dict] = []
    identity_max = 0.0
    order, pos = torch.randperm(len(ytr), generator=gen), 0
    from tqdm.auto import tqdm
    bar = tqdm(range(args.steps), desc=f"{name:>12}", disable=not show_progress, leave=True, mininterval=1.0)
    t_train, t0 = 0.0, time.perf_counter()
    window = {"ce": [], "acc": [], "distortion": [], "ols": [], "variance": [], "perplexity": []}
    for step in bar:
        if pos + args.batch_size > len(order):
            order, pos = torch.randperm(len(ytr), generator=gen), 0
        idx = order[pos:pos + args.batch_size]
        pos += args.batch_size
        x, y = to_float(xtr[idx]), ytr[idx]
        f = lr_factor(step, args.steps, warmup)
        for g in opt.param_groups:
            g["lr"] = g["base_lr"] * f
        logits, out = model(x)
        ce = F.cross_entropy(logits, y)
        loss = ce if out is None else ce + out.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        window["ce"].append(float(ce.detach()))
        window["acc"].append(float((logits.argmax(1) == y).float().mean()))
        if out is not None:
            d, o, v = (float(t.detach()) for t in (out.distortion, out.ols, out.variance))
            identity_max = max(identity_max, abs(d - o - v) / max(d, 1e-30))
            window["distortion"].append(d)
            window["ols"].append(o)
            window["variance"].append(v)
            window["perplexity"].append(float(out.perplexity))
        last = step + 1 == args.steps
        if (step + 1) % args.log_every == 0 or last or step == 0:
            rec = {"step": step + 1, **{k: float(np.mean(v)) for k, v in window.items() if v}}
            if out is not None:
                rec["identity_max_so_far"] = identity_max
            log.append(rec)
            window = {k: [] for k in window}
            bar.set_postfix(ce=f"{rec['ce']:.3f}", acc=f"{rec['acc']:.3f}")
        if (step + 1) % args.eval_every == 0 or last:
            t_train += time.perf_counter() - t0
            acc, _ = evaluate(model, xte, yte)
            curve.append({"step": step + 1, "test_accuracy": acc})
            t0 = time.perf_counter()
    bar.close()
    t_eval = time.perf_counter()
    acc, usage = evaluate(model, xte, yte)
    t_eval = time.perf_counter() - t_eval
    result = {
        "arm": name, "readout": kind, "test_accuracy": acc, "train_wall_s": t_train, "eval_wall_s": t_eval,
        "params": sum(p.numel() for p in model.parameters()), "curve": curve, "train_log": log,
    }
    if kind == "ddcl":
        stats = usage.to_dict()
        result.update(temperature=temperature, prototype_lr_ratio=ratio, distortion_to_tokens=to_tokens,
                      task_grad_to_prototypes=task_to_protos, mode=over.get("mode", "straight_through"),
                      loss_weight=args.loss_weight, usage=stats, identity_max=identity_max)
    return result, model


# ----------------------------------------------------------------------------- compressor

@torch.no_grad()
def features(model: PatchTransformer, tokens_u8: Tensor, batch: int = 1000) -> Tensor:
    model.eval()
    outs = []
    for i in range(0, len(tokens_u8), batch):
        h = model.tokens(to_float(tokens_u8[i:i + batch]))
        outs.append(h[:, 1:] if model.cls is not None else h)
    return torch.cat(outs)


@torch.no_grad()
def window_mean_errors(tokens: Tensor, windows: List[int]) -> List[float]:
    """Cumulative relative error of plain window-mean pooling over the same windows (no masks)."""
    b, t0, d = tokens.shape
    x, pos, errs = tokens, torch.arange(t0).expand(b, t0), []
    total = (tokens - tokens.reshape(-1, d).mean(0)).pow(2).sum().double()
    for w in windows:
        t = x.shape[1]
        n = -(-t // w)
        pad = n * w - t
        xw = F.pad(x, (0, 0, 0, pad)).reshape(b, n, w, d)
        cnt = F.pad(torch.ones(b, t), (0, pad)).reshape(b, n, w).sum(2, keepdim=True)
        x = xw.sum(2) / cnt
        pos = torch.div(pos, w, rounding_mode="floor")
        rec = torch.gather(x, 1, pos[..., None].expand(b, t0, d))
        errs.append(float((tokens - rec).pow(2).sum().double() / total))
    return errs


def run_compressor(args, model: PatchTransformer, train_u8: Tensor, test_u8: Tensor, show_progress: bool) -> Dict:
    ftr = features(model, train_u8[:args.compressor_train])
    fte = features(model, test_u8[:args.compressor_test])
    torch.manual_seed(args.seed)
    comp = HierarchicalCompressor(ftr.shape[-1], args.windows, args.compressor_prototypes,
                                  temperature=args.temperature, distortion_to_tokens=False, prototype_init="kmeans")
    opt = torch.optim.Adam(comp.parameters(), lr=args.compressor_lr)
    gen = torch.Generator().manual_seed(args.seed)
    from tqdm.auto import tqdm
    t0 = time.perf_counter()
    batch = min(256, len(ftr))
    first_loss = last_loss = None
    for step in tqdm(range(args.compressor_steps), desc="  compressor", disable=not show_progress, mininterval=1.0):
        idx = torch.randint(len(ftr), (batch,), generator=gen)
        out = comp(ftr[idx])
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        last_loss = float(out.loss.detach())
        first_loss = last_loss if first_loss is None else first_loss
    wall = time.perf_counter() - t0
    comp.eval()
    with torch.no_grad():
        out = comp(fte)
        per_stage_usage = []
        for st, readout in zip(out.stages, comp.stages):
            u = CodebookUsage(readout.num_prototypes)
            u.update(st.usage_indices, st.soft_counts)
            s = u.compute()
            per_stage_usage.append({"utilization": s.utilization, "perplexity": s.perplexity})
    mean_errs = window_mean_errors(fte, args.windows)
    stages = []
    for s, w in enumerate(args.windows):
        stages.append({
            "stage": s + 1, "window": w, "num_prototypes": comp.stages[s].num_prototypes,
            "tokens_out_per_sequence": int(out.masks[s][0].sum()),
            "ratio": float(out.ratios[s]), "cumulative_ratio": float(out.cumulative_ratios[s]),
            "stage_error": float(out.errors[s]), "cumulative_error": float(out.cumulative_errors[s]),
            "window_mean_cumulative_error": mean_errs[s],
            "distortion": float(out.stages[s].distortion), "ols": float(out.stages[s].ols),
            "variance": float(out.stages[s].variance), **per_stage_usage[s],
        })
    return {"source_arm": model.kind, "tokens_per_sequence": int(fte.shape[1]), "windows": args.windows,
            "train_sequences": len(ftr), "test_sequences": len(fte), "steps": args.compressor_steps,
            "train_loss_first": first_loss, "train_loss_last": last_loss, "train_wall_s": wall, "stages": stages}


# ----------------------------------------------------------------------------- report

def plots(results: Dict, out: Path) -> List[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for arm in results["arms"].values():
        steps = [c["step"] for c in arm["curve"]]
        ax.plot(steps, [100 * c["test_accuracy"] for c in arm["curve"]], marker="o", label=arm["arm"])
    ax.set_xlabel("training step")
    ax.set_ylabel(f"test accuracy (%), {results['config']['test_size']} images")
    ax.set_title("Fashion-MNIST, patch transformer: readout arms")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "accuracy.png", dpi=120)
    plt.close(fig)
    files.append("accuracy.png")

    ddcl = [a for a in results["arms"].values() if a["readout"] == "ddcl"]
    if ddcl:
        fig, ax = plt.subplots(figsize=(6, 4))
        for arm in ddcl:
            steps = [r["step"] for r in arm["train_log"]]
            for key, style in (("distortion", "-"), ("ols", "--"), ("variance", ":")):
                ax.plot(steps, [r[key] for r in arm["train_log"]], style,
                        label=f"{arm['arm']} {key}" if len(ddcl) > 1 else key)
        ax.set_yscale("log")
        ax.set_xlabel("training step")
        ax.set_ylabel("sum over D, mean over tokens")
        ax.set_title("DDCL readout: distortion = OLS + variance (train batches)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "ddcl_terms.png", dpi=120)
        plt.close(fig)
        files.append("ddcl_terms.png")

    comp = results.get("compressor")
    if comp:
        st = comp["stages"]
        fig, ax = plt.subplots(figsize=(6, 4))
        ratios = [s["cumulative_ratio"] for s in st]
        ax.plot(ratios, [s["cumulative_error"] for s in st], "o-", label="HierarchicalCompressor (DDCL)")
        ax.plot(ratios, [s["window_mean_cumulative_error"] for s in st], "s--", label="window mean pooling")
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks(ratios)
        ax.set_xticklabels([f"{r:.3g}" for r in ratios])
        ax.set_xlabel("compression ratio (tokens in / summaries out)")
        ax.set_ylabel("relative reconstruction error")
        ax.set_title("compressor: error vs ratio (test tokens)")
        ax.grid(alpha=0.3, which="both")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "compressor.png", dpi=120)
        plt.close(fig)
        files.append("compressor.png")
    return files


def fmt(x, spec=".3f"):
    return "—" if x is None else format(x, spec)


def report(results: Dict) -> str:
    cfg = results["config"]
    meta = results["meta"]
    lines = ["# Readout study: DDCL readout vs mean pooling vs class token", "",
             f"Command: `{meta['command']}`  ", f"Date: {meta['date']}  ",
             f"Machine: {meta['machine']}", "",
             f"Fashion-MNIST, {cfg['patch']}x{cfg['patch']} patches ({results['num_tokens']} tokens), transformer "
             f"dim {cfg['dim']}, {cfg['layers']} layers, {cfg['heads']} heads; every arm: {cfg['steps']} steps, "
             f"batch {cfg['batch_size']}, Adam lr {cfg['lr']:g} (warmup + cosine), seed {cfg['seed']}, "
             f"{cfg['train_size']} training images, test accuracy on {cfg['test_size']} test images "
             f"({'the full test set' if cfg['test_size'] >= 10000 else 'a fixed random subset'}). "
             f"DDCL: K = {cfg['num_prototypes']} prototypes, τ relative to D, loss = CE + "
             f"{cfg['loss_weight']:g}·distortion/D, prototype lr = ratio × lr.", "",
             "| arm | readout | test acc | utilization | perplexity | soft perplexity | max \\|L−OLS−V\\|/L | "
             "train wall s | params |", "|---|---|---|---|---|---|---|---|---|"]
    for a in results["arms"].values():
        u = a.get("usage") or {}
        what = ARM_TEXT.get(a["arm"], "")
        if a["readout"] == "ddcl":
            what = (f"DDCL pooled; τ={a['temperature']:g}, ρ={a['prototype_lr_ratio']:g}, "
                    f"distortion→tokens {'yes' if a['distortion_to_tokens'] else 'no (sg)'}, "
                    f"task loss→prototypes {'yes' if a['task_grad_to_prototypes'] else 'no'}"
                    + f", {a.get('mode', 'straight_through').replace('_', '-')} token gradient")
        lines.append(
            f"| {a['arm']} | {what} | {100 * a['test_accuracy']:.2f}% | "
            f"{fmt(u.get('utilization'), '.0%') if u else '—'} | {fmt(u.get('perplexity'), '.1f') if u else '—'} | "
            f"{fmt(u.get('soft_perplexity'), '.1f') if u else '—'} | "
            f"{fmt(a.get('identity_max'), '.1e') if 'identity_max' in a else '—'} | {a['train_wall_s']:.0f} | "
            f"{a['params']:,} |")
    lines += ["", "Utilization and perplexity: dataset-level over every test token's hard argmin prototype "
              "(ddcl_vq.CodebookUsage); the identity column is the maximum over every training step.", ""]
    comp = results.get("compressor")
    if comp:
        lines += [f"## Hierarchical compressor", "",
                  f"On the `{comp['source_arm']}` arm's frozen final tokens ({comp['tokens_per_sequence']} per image, "
                  f"raster order), windows {comp['windows']}, trained {comp['steps']} steps on "
                  f"{comp['train_sequences']} training images with the stages' DDCL distortions "
                  f"(k-means init, distortion on stop-gradient inputs), measured on {comp['test_sequences']} test "
                  f"images. Error = Σ‖x − x̂‖² / Σ‖x − mean‖², x̂ = the ancestor summary (cumulative) or the "
                  f"window's summary (stage); window mean pooling is the L2-best summary for the same windows.", "",
                  "| stage | window | K | ratio | cumulative ratio | stage error | cumulative error | "
                  "window-mean cumulative error | utilization | perplexity |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for s in comp["stages"]:
            lines.append(f"| {s['stage']} | {s['window']} | {s['num_prototypes']} | {s['ratio']:.2f} | "
                         f"{s['cumulative_ratio']:.2f} | {s['stage_error']:.3f} | {s['cumulative_error']:.3f} | "
                         f"{s['window_mean_cumulative_error']:.3f} | {s['utilization']:.0%} | "
                         f"{s['perplexity']:.1f} |")
        lines.append("")
    lines += ["Codebook usage definitions:", "", "```", USAGE_DEFINITIONS, "```", ""]
    lines += [f"Plots: {', '.join(results['plots'])}", f"Total wall time: {meta['total_wall_s']:.0f} s", ""]
    return "\n".join(lines)


def machine() -> str:
    from ddcl_vq.eval.machine import cpu_model
    cpu = cpu_model()
    return (f"{os.cpu_count()}-core CPU ({cpu}), torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
            f"no GPU used")


# ----------------------------------------------------------------------------- main

def parse_args(argv: Optional[List[str]]):
    p = argparse.ArgumentParser(prog="ddcl-vq readout-study", description=HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/readout_study", help="output folder (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="a seconds-long run on data subsets (for tests)")
    p.add_argument("--arms", default="mean,cls,ddcl", help=f"comma list from {', '.join(ARMS)} (default: %(default)s)")
    p.add_argument("--steps", type=int, help=f"training steps per arm (default {DEFAULTS['steps']}, quick {QUICK['steps']})")
    p.add_argument("--batch-size", type=int, help=f"default {DEFAULTS['batch_size']}, quick {QUICK['batch_size']}")
    p.add_argument("--lr", type=float, help=f"Adam lr of every arm (default {DEFAULTS['lr']}, quick {QUICK['lr']})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-size", type=int, help=f"training images (default {DEFAULTS['train_size']})")
    p.add_argument("--test-size", type=int, help=f"test images (default {DEFAULTS['test_size']} = all)")
    p.add_argument("--eval-every", type=int, help="steps between test-accuracy points")
    p.add_argument("--log-every", type=int, default=25, help="steps per logged training record")
    p.add_argument("--patch", type=int, default=4, choices=(2, 4, 7, 14), help="patch size (default 4: 49 tokens)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--num-prototypes", type=int, default=64, help="K of the DDCL readout")
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE, help="τ relative to D")
    p.add_argument("--prototype-init", default="kmeans", choices=("kmeans", "normal"),
                   help="DDCL prototypes: k-means on the first batch's tokens, or N(0, 1) (default: %(default)s)")
    p.add_argument("--loss-weight", type=float, default=1.0, help="λ in CE + λ·distortion/D")
    p.add_argument("--prototype-lr-ratio", type=float, default=DEFAULT_PROTOTYPE_LR_RATIO,
                   help="prototype lr / encoder lr (timescale condition: > 1)")
    p.add_argument("--windows", default="2,2,2,2,2,2", help="compressor window per stage (default: %(default)s)")
    p.add_argument("--compressor-prototypes", type=int, default=64, help="K per compressor stage")
    p.add_argument("--compressor-steps", type=int)
    p.add_argument("--compressor-lr", type=float, default=1e-2)
    p.add_argument("--compressor-train", type=int, help="training images whose tokens train the compressor")
    p.add_argument("--compressor-test", type=int, help="test images whose tokens measure it")
    p.add_argument("--no-compressor", action="store_true", help="skip the compressor part")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: on cores shared with other jobs, 2 threads ran a step "
                        "15x slower than 1; on an idle machine 2 are about 1.7x faster)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    args = p.parse_args(argv)
    base = QUICK if args.quick else DEFAULTS
    for key, value in base.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in args.arms if a not in ARMS]
    if bad or not args.arms:
        p.error(f"unknown arm(s) {bad}; expected a comma list from {', '.join(ARMS)}")
    try:
        args.windows = [int(w) for w in args.windows.split(",") if w.strip()]
    except ValueError:
        p.error(f"expected --windows as comma-separated positive ints, got {args.windows!r}")
    if not args.windows or min(args.windows) < 1:
        p.error(f"expected --windows as comma-separated positive ints, got {args.windows!r}")
    for key in ("threads", "steps", "batch_size", "train_size", "test_size", "eval_every", "log_every", "compressor_steps",
                "compressor_train", "compressor_test"):
        if getattr(args, key) <= 0:
            p.error(f"expected --{key.replace('_', '-')} > 0, got {getattr(args, key)}")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    show = not args.no_progress
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run(args, argv, out, show)
    finally:
        torch.set_num_threads(threads)


def _run(args, argv: List[str], out: Path, show: bool) -> int:
    t_start = time.perf_counter()
    train_data = load_patches("train", args.train_size, args.patch, args.seed)
    test_data = load_patches("test", args.test_size, args.patch, args.seed + 1)
    cfg = {k: v for k, v in vars(args).items() if k not in ("out", "no_progress")}
    results = {"config": cfg, "num_tokens": int(train_data[0].shape[1]), "arms": {}}
    models = {}
    for name in args.arms:
        res, model = train_arm(name, args, train_data, test_data, show)
        results["arms"][name] = res
        models[name] = model
        u = res.get("usage")
        extra = (f", utilization {u['utilization']:.0%}, perplexity {u['perplexity']:.1f}, identity max "
                 f"{res['identity_max']:.1e}" if u else "")
        print(f"{name}: test accuracy {100 * res['test_accuracy']:.2f}%{extra}, train {res['train_wall_s']:.0f} s",
              flush=True)
    if not args.no_compressor:
        source = next((n for n in args.arms if ARMS[n][0] == "ddcl"), args.arms[0])
        results["compressor"] = run_compressor(args, models[source], train_data[0], test_data[0], show)
        for s in results["compressor"]["stages"]:
            print(f"compressor stage {s['stage']}: ratio x{s['cumulative_ratio']:.2f}, error "
                  f"{s['cumulative_error']:.3f} (window mean {s['window_mean_cumulative_error']:.3f})", flush=True)
    command = "ddcl-vq readout-study " + " ".join(shlex.quote(a) for a in argv)
    results["meta"] = {"command": command.strip(), "date": _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
                       "machine": machine(), "python": platform.python_version(),
                       "total_wall_s": time.perf_counter() - t_start}
    results["plots"] = plots(results, out)
    results["meta"]["total_wall_s"] = time.perf_counter() - t_start
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "report.md").write_text(report(results))
    print(f"wrote {out / 'results.json'}, {out / 'report.md'} and {len(results['plots'])} plots "
          f"({results['meta']['total_wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
