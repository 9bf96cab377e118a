"""Training a prior over token files, with the conventions of ``ddcl-vq train``.

- The prior directory holds ``config.yaml`` (resolved), ``checkpoints/last.pt`` (+ periodic ones;
  atomic, loaded with ``weights_only``: :mod:`ddcl_vq.train.checkpoint`), ``tb/`` (TensorBoard),
  ``metrics.jsonl`` and ``summary.json``; one training at a time (``train.lock``).
- Resume: the same command continues from the newest checkpoint (model, optimizer, schedule, RNG,
  and the data order: batches come from :class:`ddcl_vq.train.data.EpochBatches`, so a resumed run
  sees exactly the batches a straight run would). Only :data:`~.config.RESUMABLE` settings may change,
  and the training tokens must be the same codes (checked by content, not by path).
- torchrun: detected from the environment (:func:`ddcl_vq.train.loop.setup_distributed`); the model
  is wrapped in DistributedDataParallel, ``train.batch_size`` is the global batch, rank 0 writes.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from ddcl_vq.models.prior import CodePrior
from ddcl_vq.train.checkpoint import (CheckpointError, latest_checkpoint, load_into, prune_periodic,
                                      save_checkpoint)
from ddcl_vq.train.errors import UserError
from ddcl_vq.train.rundir import RunDirError, RunLock, note

from .config import RESUMABLE, PriorConfig, differences, dump_config, from_dict
from .data import PriorDataError, Tokens, load_tokens, tokenizer_info

LN2 = math.log(2.0)


def build_prior(cfg: PriorConfig, num_codes: int, grid: Tuple[int, int], num_classes: int) -> CodePrior:
    m = cfg.model
    return CodePrior(num_codes, grid[0], grid[1], num_classes, dim=m.dim, layers=m.layers, heads=m.heads,
                     dropout=m.dropout, mlp_ratio=m.mlp_ratio)


def lr_factor(cfg: PriorConfig):
    t = cfg.train

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.lr_schedule == "constant":
            return 1.0
        span = max(t.steps - t.warmup_steps, 1)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(step - t.warmup_steps, span) / span))
    return factor


def build_optimizer(model: CodePrior, cfg: PriorConfig) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices and embeddings (dim >= 2), none on biases and LayerNorms."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.train.weight_decay},
                              {"params": other, "weight_decay": 0.0}], lr=cfg.train.lr, betas=(0.9, 0.95))


@torch.no_grad()
def nll_bits(model: CodePrior, tokens: Tokens, batch_size: int = 500, max_images: int = 0,
             device="cpu") -> Dict:
    """Negative log-likelihood of the code maps under the prior: {bits_per_token, bits_per_image,
    num_images, num_tokens}. bits/token = mean over every code of −log2 p(code | class, earlier codes);
    bits/image = bits/token x L (L = h·w codes per image)."""
    n = len(tokens.codes) if not max_images else min(max_images, len(tokens.codes))
    was = model.training
    model.eval()
    total = 0.0
    try:
        for i in range(0, n, batch_size):
            codes = tokens.codes[i:min(i + batch_size, n)].to(device)
            labels = None if tokens.labels is None or not model.num_classes else \
                tokens.labels[i:min(i + batch_size, n)].to(device)
            total += float(model.loss(codes, labels).double()) * codes.shape[0]
    finally:
        model.train(was)
    per_token = total / n / LN2
    return {"bits_per_token": per_token, "bits_per_image": per_token * model.length, "num_images": n,
            "num_tokens": n * model.length}


def _rng_state(device: torch.device) -> Dict:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


class PriorData:
    """The training (and first test) tokens, checked against the tokenizer's K and each other."""

    def __init__(self, cfg: PriorConfig):
        if not cfg.data.train_tokens:
            raise PriorDataError("expected training tokens (--tokens FILE, or data.train_tokens=FILE), got none")
        self.tokenizer = tokenizer_info(cfg.data.tokenizer)
        k = self.tokenizer["num_codes"]
        self.train = load_tokens(cfg.data.train_tokens, k, "training token file")
        latent = self.tokenizer.get("latent")
        if latent and self.train.grid != (latent, latent):
            raise PriorDataError(f"training token file {cfg.data.train_tokens!r} holds {self.train.grid} code maps; "
                                 f"the tokenizer {cfg.data.tokenizer!r} makes {latent}x{latent} ones")
        self.test: List[Tokens] = []
        for path in cfg.data.test_tokens:
            tokens = load_tokens(path, k, "test token file")
            if tokens.grid != self.train.grid:
                raise PriorDataError(f"test token file {path!r} holds {tokens.grid} code maps, the training tokens "
                                     f"{self.train.grid}")
            self.test.append(tokens)
        conditional = cfg.model.class_conditional and self.train.labels is not None
        self.num_classes = int(self.train.labels.max()) + 1 if conditional else 0
        for tokens in self.test:  # a test file without labels cannot be scored by a conditional prior
            if self.num_classes and (tokens.labels is None or int(tokens.labels.max()) >= self.num_classes):
                raise PriorDataError(f"test token file {tokens.path!r}: a class-conditional prior needs its labels "
                                     f"in [0, {self.num_classes}) (set model.class_conditional=false for an "
                                     "unconditional prior)")
        self.num_codes = k

    def meta(self) -> Dict:
        return {"num_codes": self.num_codes, "grid": list(self.train.grid), "num_classes": self.num_classes,
                "train_images": len(self.train.codes), "fingerprint": self.train.fingerprint(),
                "dataset": self.tokenizer["data"].name if self.tokenizer.get("data") is not None else None,
                "image_size": self.tokenizer["data"].image_size if self.tokenizer.get("data") is not None else None}


def check_resume(state: Dict, cfg: PriorConfig, data_meta: Dict, prior_dir: Path) -> List[str]:
    """Refuse (RunDirError) to resume a prior trained with another config or other tokens."""
    step = int(state["step"])
    saved = from_dict(state.get("config") or {})
    refused, notes = [], []
    for key, old, new in differences(saved, cfg):
        if key not in RESUMABLE:
            refused.append(f"{key} {old!r} -> {new!r}")
        elif key == "train.steps" and new < step:
            raise RunDirError(f"prior directory {str(prior_dir)!r} holds a prior trained {step} steps; train.steps="
                              f"{new} is fewer. Give train.steps >= {step}, or another run.dir for a new prior")
        elif key == "train.steps" and cfg.train.lr_schedule == "cosine":
            notes.append(f"train.steps {old} -> {new}: the cosine schedule follows {new} steps from here")
    old_fp = (state.get("data") or {}).get("fingerprint")
    if old_fp is not None and old_fp != data_meta["fingerprint"]:
        refused.append(f"the training tokens ({cfg.data.train_tokens!r} holds other codes than the file it was "
                       "trained on)")
    if refused:
        raise RunDirError(f"prior directory {str(prior_dir)!r} holds a prior trained {step} steps with another "
                          f"config; resuming it would mix the two ({'; '.join(refused)}). Only these may change on "
                          f"resume: {', '.join(RESUMABLE)}. For a new prior give another run.dir, or delete "
                          f"{str(prior_dir)!r}")
    return notes


def train_prior(cfg: PriorConfig, quiet: bool = False, stop_after: Optional[int] = None) -> Dict:
    """Train (or resume) the prior ``cfg`` describes; -> summary (also PRIOR_DIR/summary.json)."""
    from ddcl_vq.train.loop import setup_distributed

    env = setup_distributed(cfg.train.device)
    lock = RunLock(Path(cfg.run.dir)).acquire() if env["rank"] == 0 else None
    try:
        return _train(cfg, env, quiet, stop_after)
    finally:
        if lock is not None:
            lock.release()


def _train(cfg: PriorConfig, env: Dict, quiet: bool, stop_after: Optional[int]) -> Dict:
    from torch.utils.tensorboard import SummaryWriter

    from ddcl_vq.train.data import EpochBatches
    from ddcl_vq.train.progress import Progress

    world, device, rank = env["world"], env["device"], env["rank"]
    is_main = rank == 0
    t = cfg.train
    prior_dir = Path(cfg.run.dir)
    ckpt_dir = prior_dir / "checkpoints"
    torch.manual_seed(cfg.run.seed)
    data = PriorData(cfg)
    meta = data.meta()
    found = latest_checkpoint(ckpt_dir, map_location=device) if ckpt_dir.is_dir() else None
    notes = check_resume(found[0], cfg, meta, prior_dir) if found else []

    model = build_prior(cfg, data.num_codes, data.train.grid, data.num_classes).to(device)
    optimizer = build_optimizer(model, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg))
    step = 0
    if found:
        state, path = found
        load_into(model, state["model"], path, "prior")
        load_into(optimizer, state["optimizer"], path, "optimizer")
        load_into(scheduler, state["scheduler"], path, "learning-rate schedule")
        torch.set_rng_state(state["rng"]["torch"])
        if device.type == "cuda" and "cuda" in state["rng"]:
            torch.cuda.set_rng_state(state["rng"]["cuda"], device)
        step = int(state["step"])
        if is_main and not quiet:
            print(f"resuming {prior_dir} from {path.name} at step {step}", file=sys.stderr)
    found = None
    if is_main:
        for text in notes:
            note(text)
        (prior_dir / "config.yaml").write_text(dump_config(cfg))

    def save(at: int, periodic: bool) -> None:
        if not is_main:
            return
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "scheduler": scheduler.state_dict(), "step": at, "rng": _rng_state(device),
                 "config": cfg.to_dict(), "prior": dict(model.config), "data": meta}
        save_checkpoint(state, ckpt_dir / "last.pt")
        if periodic:
            save_checkpoint(state, ckpt_dir / f"step_{at:07d}.pt")
            prune_periodic(ckpt_dir)

    net = model
    if world > 1:
        net = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                                        else None)
    batches = EpochBatches(len(data.train.codes), t.batch_size, cfg.run.seed, rank, world, start_step=step)
    codes_all, labels_all = data.train.codes, data.train.labels if data.num_classes else None
    writer = metrics = bar = None
    if is_main:
        writer = SummaryWriter(str(prior_dir / "tb"), purge_step=step if step else None)
        metrics = open(prior_dir / "metrics.jsonl", "a" if step else "w")
        if not quiet:
            bar = Progress(t.steps, cfg.run.name, unit="step", initial=step, every=t.log_every)
    test = data.test[0] if data.test else None
    t_start, first = time.time(), step
    last_test = None
    model.train()
    try:
        for idx in batches:
            if step >= t.steps:
                break
            if stop_after is not None and step - first >= stop_after:
                save(step, periodic=False)
                break
            idx = torch.as_tensor(idx)
            codes = codes_all[idx].to(device)
            labels = labels_all[idx].to(device) if labels_all is not None else None
            loss = model.loss(codes, labels) if net is model else _ddp_loss(net, model, codes, labels)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"step {step}: loss is {loss.item()}; lower train.lr")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if t.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
            optimizer.step()
            scheduler.step()
            step += 1
            evaluate = test is not None and (step % t.eval_every == 0 or step == t.steps)
            if is_main and (step % t.log_every == 0 or step == t.steps or evaluate):
                record = {"step": step, "time": round(time.time() - t_start, 3), "loss": loss.item(),
                          "bits_per_token": loss.item() / LN2, "lr": optimizer.param_groups[0]["lr"]}
                if evaluate:
                    last_test = nll_bits(model, test, max_images=t.eval_images, device=device)
                    record["test_bits_per_token"] = last_test["bits_per_token"]
                    model.train()
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
                for key, value in record.items():
                    if key not in ("step", "time"):
                        writer.add_scalar(key, value, step)
                if bar is not None:
                    bar.set_postfix(bits=f"{record['bits_per_token']:.3f}")
            if step % t.checkpoint_every == 0 or step == t.steps:
                save(step, periodic=step % t.checkpoint_every == 0)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        if writer is not None:
            writer.close()
            metrics.close()
    seconds = time.time() - t_start
    summary = {"prior": str(prior_dir), "step": step, "steps": t.steps, "train_seconds": round(seconds, 1),
               "steps_per_second": round((step - first) / seconds, 3) if seconds > 0 and step > first else None,
               "parameters": sum(p.numel() for p in model.parameters()), **{k: v for k, v in meta.items()
                                                                            if k != "fingerprint"}}
    if step >= t.steps and test is not None:
        summary["test"] = last_test or nll_bits(model, test, max_images=t.eval_images, device=device)
        summary["test"]["file"] = test.path
    if is_main:
        (prior_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _ddp_loss(net, model: CodePrior, codes, labels):
    import torch.nn.functional as F
    logits = net(codes, labels)
    return F.cross_entropy(logits.reshape(-1, model.num_codes).float(), model.flatten(codes).reshape(-1))


class PriorLoadError(UserError, RuntimeError):
    """A prior directory cannot be loaded."""


def load_prior(prior_dir: str | Path, device="cpu") -> Tuple[PriorConfig, CodePrior, Dict]:
    """-> (config, prior in eval mode, checkpoint meta {step, data, path}) from a prior directory."""
    prior_dir = Path(prior_dir)
    if not prior_dir.is_dir():
        raise PriorLoadError(f"prior directory {str(prior_dir)!r} does not exist")
    found = latest_checkpoint(prior_dir / "checkpoints") if (prior_dir / "checkpoints").is_dir() else None
    if found is None:
        raise PriorLoadError(f"prior directory {str(prior_dir)!r} has no checkpoint (expected "
                             f"{str(prior_dir / 'checkpoints' / 'last.pt')!r}); train it with ddcl-vq prior train")
    state, path = found
    if "prior" not in state or "config" not in state:
        raise CheckpointError(f"checkpoint {str(path)!r} is not a prior's checkpoint (no 'prior' settings); is "
                              f"{str(prior_dir)!r} a VQ-VAE run directory?")
    cfg = from_dict(state["config"])
    model = CodePrior(**state["prior"])
    load_into(model, state["model"], path, "prior")
    return cfg, model.to(device).eval(), {"step": int(state["step"]), "data": state.get("data", {}),
                                          "checkpoint": str(path)}
