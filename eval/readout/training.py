"""The readout study's arms and their training loop (same budget, data order and encoder init)."""
from __future__ import annotations

import math
import time
from typing import Dict, List

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ddcl_vq import CodebookUsage
from ddcl_vq.models import PatchTransformer
from ddcl_vq.readout import prototype_param_groups

from .data import to_float

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
