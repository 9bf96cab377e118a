"""The readout study's training: each readout arm over a small patch transformer at the same budget, resumable in
OUT/runs/<arm> (:class:`~ddcl_vq.common.skeleton.TrainingRun`), and the hierarchical compressor on a trained arm's
frozen tokens, measured next to window-mean pooling.
"""
from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ddcl_vq import CodebookUsage, HierarchicalCompressor
from ddcl_vq.models import PatchTransformer
from ddcl_vq.readout import prototype_param_groups

from ddcl_vq.common.rundir import RunDirError
from ddcl_vq.common.skeleton import TrainingRun, lr_schedule, metrics_records

# arm name -> (readout kind, overrides of the DDCL settings)
ARMS = {
    "mean": ("mean", {}), "cls": ("cls", {}), "ddcl": ("ddcl", {}), "ddcl_soft": ("ddcl", {"mode": "soft"}),
    "ddcl_joint": ("ddcl", {"mode": "soft", "distortion_to_tokens": True}),
    # ablations (not run by default): the timescale ratio, gradient routing, temperature
    "ddcl_rho1": ("ddcl", {"prototype_lr_ratio": 1.0}), "ddcl_ponly": ("ddcl", {"task_grad_to_prototypes": False}),
    "ddcl_joint_rho1": ("ddcl", {"mode": "soft", "distortion_to_tokens": True, "prototype_lr_ratio": 1.0}),
    "ddcl_tau0.03": ("ddcl", {"temperature": 0.03}), "ddcl_tau0.3": ("ddcl", {"temperature": 0.3}),
}
#: the study's options an arm's training depends on (a resumed arm must have the same)
ARM_SETTINGS = ("steps", "batch_size", "lr", "seed", "train_size", "test_size", "patch", "dim", "layers", "heads",
                "num_prototypes", "temperature", "prototype_init", "loss_weight", "prototype_lr_ratio",
                "eval_every", "log_every")


def load_patches(split: str, size: int, patch: int, seed: int) -> Tuple[Tensor, Tensor]:
    """Fashion-MNIST as uint8 patch tokens (N, T, patch*patch) and labels (N,); a fixed subset if size < N."""
    from ddcl_vq.common.data import fashion_mnist_arrays
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


@torch.no_grad()
def accuracy(model: PatchTransformer, tokens_u8: Tensor, labels: Tensor, batch: int = 1000):
    """-> (test accuracy, the readout's prototype usage over the tokens, or None)."""
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


def batch_order(n: int, batch_size: int, seed: int, start: int) -> Iterator[Tensor]:
    """The arm's data order (the same for every arm) from batch ``start`` on: per epoch a permutation of the ``n``
    images cut into batches (a short last one dropped), every permutation drawn from one generator seeded ``seed``;
    a resumed arm draws again those before ``start``."""
    gen = torch.Generator().manual_seed(seed)
    per_epoch = max(1, n // batch_size)
    epoch, offset = divmod(start, per_epoch)
    for _ in range(epoch):
        torch.randperm(n, generator=gen)
    while True:
        order = torch.randperm(n, generator=gen)
        for b in range(offset, per_epoch):
            yield order[b * batch_size:(b + 1) * batch_size]
        offset = 0


class _Window:
    """Running means since the last log line, the identity's worst case and the training seconds; resumable."""

    def __init__(self):
        self.values: Dict[str, List[float]] = defaultdict(list)
        self.identity_max, self.seconds = 0.0, 0.0

    def state_dict(self) -> Dict:
        return {"values": dict(self.values), "identity_max": self.identity_max, "seconds": self.seconds}

    def load_state_dict(self, state: Dict) -> None:
        self.values = defaultdict(list, state["values"])
        self.identity_max, self.seconds = float(state["identity_max"]), float(state["seconds"])

    def mean_record(self) -> Dict:
        record = {k: float(np.mean(v)) for k, v in self.values.items() if v}
        self.values = defaultdict(list)
        return record


def _arm_setup(name: str, args, n_tokens: int, token_dim: int):
    """-> (readout kind, the arm's DDCL settings, model, optimizer, schedule), the model built right after seeding."""
    kind, over = ARMS[name]
    ddcl = {"temperature": args.temperature, "prototype_lr_ratio": args.prototype_lr_ratio,
            "distortion_to_tokens": False, "task_grad_to_prototypes": True, "mode": "straight_through",
            "loss_weight": args.loss_weight, **over}
    torch.manual_seed(args.seed)
    model = PatchTransformer(kind, n_tokens, token_dim, args.dim, args.layers, args.heads, 10, args.num_prototypes,
                             ddcl["temperature"], args.loss_weight, ddcl["distortion_to_tokens"], args.prototype_init,
                             ddcl["task_grad_to_prototypes"], ddcl["mode"])
    groups = [{"params": list(model.parameters()), "lr": args.lr}]
    if kind == "ddcl":
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the rho = 1 ablation is deliberate
            groups = prototype_param_groups(model, args.lr, ddcl["prototype_lr_ratio"])
    opt = torch.optim.Adam(groups)
    schedule = lr_schedule(args.steps, "cosine", warmup=max(1, args.steps // 20), floor=0.0)
    return kind, ddcl, model, opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule)


def train_arm(name: str, args, train_data, test_data, out: Path, show_progress: bool):
    """Train (or resume, or reuse) the readout arm ``name`` in OUT/runs/<name>; -> (result dict, model)."""
    (xtr, ytr), (xte, yte) = train_data, test_data
    settings = {"arm": name, **{key: getattr(args, key) for key in ARM_SETTINGS}}
    run = TrainingRun(Path(out) / "runs" / name, args.steps, checkpoint_every=args.eval_every,
                      log_every=args.log_every, name=f"{name:>12}", device="cpu", quiet=not show_progress,
                      config=settings)
    with run:
        found = run.latest()
        if found is not None and found[0].get("config") != settings:
            saved = found[0].get("config") or {}
            changed = ", ".join(f"{k} {saved.get(k)!r} -> {v!r}" for k, v in settings.items() if saved.get(k) != v)
            raise RunDirError(f"{str(run.dir)!r} holds the arm {name!r} trained with other settings ({changed}); "
                              "give another --out, or delete that folder")
        kind, ddcl, model, opt, scheduler = _arm_setup(name, args, xtr.shape[1], xtr.shape[2])
        window = _Window()
        run.keep(model=model, optimizer=opt, scheduler=scheduler, window=window)
        step = run.resume(found, announce=False)
        found = None
        finished = run.dir / "summary.json"
        if step >= args.steps and finished.is_file():  # trained before: reuse it
            return json.loads(finished.read_text()), model
        if run.is_main:
            (run.dir / "config.yaml").write_text(json.dumps(settings, indent=2) + "\n")
        run.postfix = lambda record: ({"ce": f"{record['ce']:.3f}", "acc": f"{record['acc']:.3f}"}
                                      if "ce" in record else {})
        t0 = time.perf_counter()
        for step, idx in run.steps(batch_order(len(ytr), args.batch_size, args.seed, step), step):
            x, y = to_float(xtr[idx]), ytr[idx]
            logits, out_ = model(x)
            ce = F.cross_entropy(logits, y)
            loss = ce if out_ is None else ce + out_.loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            scheduler.step()
            values = {"ce": float(ce.detach()), "acc": float((logits.argmax(1) == y).float().mean())}
            if out_ is not None:
                d, o, v = (float(t.detach()) for t in (out_.distortion, out_.ols, out_.variance))
                window.identity_max = max(window.identity_max, abs(d - o - v) / max(d, 1e-30))
                values.update(distortion=d, ols=o, variance=v, perplexity=float(out_.perplexity))
            for key, value in values.items():
                window.values[key].append(value)
            if run.due(args.log_every, step + 1) or step == 0:
                run.log(step + 1, {**window.mean_record(),
                                   **({"identity_max_so_far": window.identity_max} if out_ is not None else {})})
            if run.due(args.eval_every, step + 1):
                window.seconds += time.perf_counter() - t0
                run.log(step + 1, {"test_accuracy": accuracy(model, xte, yte)[0]})
                t0 = time.perf_counter()
        t_eval = time.perf_counter()
        acc, usage = accuracy(model, xte, yte)
        t_eval, records = time.perf_counter() - t_eval, metrics_records(run.dir)
        result = {"arm": name, "readout": kind, "test_accuracy": acc, "train_wall_s": window.seconds,
                  "eval_wall_s": t_eval, "params": sum(p.numel() for p in model.parameters()),
                  "curve": [{"step": r["step"], "test_accuracy": r["test_accuracy"]} for r in records
                            if "test_accuracy" in r], "train_log": [r for r in records if "ce" in r]}
        if kind == "ddcl":
            result.update(**ddcl, usage=usage.to_dict(), identity_max=window.identity_max)
        if run.is_main:
            finished.write_text(json.dumps(result, indent=2) + "\n")
        return result, model


def train_compressor(args, tokens: Tensor, show_progress: bool):
    """The compressor trained on frozen tokens (N, T, D) -> (compressor, first loss, last loss, wall seconds)."""
    torch.manual_seed(args.seed)
    comp = HierarchicalCompressor(tokens.shape[-1], args.windows, args.compressor_prototypes,
                                  temperature=args.temperature, distortion_to_tokens=False, prototype_init="kmeans")
    opt = torch.optim.Adam(comp.parameters(), lr=args.compressor_lr)
    gen = torch.Generator().manual_seed(args.seed)
    from tqdm.auto import tqdm
    t0 = time.perf_counter()
    batch, losses = min(256, len(tokens)), []
    for _ in tqdm(range(args.compressor_steps), desc="  compressor", disable=not show_progress, mininterval=1.0):
        idx = torch.randint(len(tokens), (batch,), generator=gen)
        out = comp(tokens[idx])
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        opt.step()
        losses.append(float(out.loss.detach()))
    return comp, losses[0], losses[-1], time.perf_counter() - t0


@torch.no_grad()
def features(model: PatchTransformer, tokens_u8: Tensor, batch: int = 1000) -> Tensor:
    model.eval()
    outs = [model.tokens(to_float(tokens_u8[i:i + batch])) for i in range(0, len(tokens_u8), batch)]
    return torch.cat([h[:, 1:] if model.cls is not None else h for h in outs])  # without the class token


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
    comp, first_loss, last_loss, wall = train_compressor(args, ftr, show_progress)
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
    stages = [{"stage": s + 1, "window": w, "num_prototypes": comp.stages[s].num_prototypes,
               "tokens_out_per_sequence": int(out.masks[s][0].sum()), "ratio": float(out.ratios[s]),
               "cumulative_ratio": float(out.cumulative_ratios[s]), "stage_error": float(out.errors[s]),
               "cumulative_error": float(out.cumulative_errors[s]), "window_mean_cumulative_error": mean_errs[s],
               "distortion": float(out.stages[s].distortion), "ols": float(out.stages[s].ols),
               "variance": float(out.stages[s].variance), **per_stage_usage[s]} for s, w in enumerate(args.windows)]
    return {"source_arm": model.kind, "tokens_per_sequence": int(fte.shape[1]), "windows": args.windows,
            "train_sequences": len(ftr), "test_sequences": len(fte), "steps": args.compressor_steps,
            "train_loss_first": first_loss, "train_loss_last": last_loss, "train_wall_s": wall, "stages": stages}
