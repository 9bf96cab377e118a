"""The prior's config (configs/prior_fashion.yaml's keys) and training loop: an autoregressive transformer over a
tokenizer's code maps (N, h, w), run inside :class:`~ddcl_vq.common.skeleton.TrainingRun`; a resumed prior may change
only :data:`RESUMABLE` settings and must train on the same codes (checked by content).
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ddcl_vq.models.prior import CodePrior

from ddcl_vq.common.checkpoint import CheckpointError, latest_checkpoint, load_into, write_json
from ddcl_vq.common.data import EpochBatches
from ddcl_vq.common.config import (ConfigError, Rules, apply, apply_overrides, check, check_finite, differences,
                                   dump_config, keys_of, read_yaml_mapping)
from ddcl_vq.common.errors import Diverged, UserError
from ddcl_vq.common.rundir import RunDirError, note
from ddcl_vq.common.skeleton import TrainingRun, lr_schedule, wrap_ddp

LN2 = math.log(2.0)


# ----------------------------------------------------------------------------- the prior's config
# configs/prior_fashion.yaml + dotted overrides; ``ddcl-vq prior train``'s tokenizer, --tokens and --test land in data.*
@dataclass
class PriorRunConfig:
    name: str = "prior_fashion"
    dir: str = "runs/prior_fashion"          # config.yaml, checkpoints/, tb/, metrics.jsonl, eval.json
    seed: int = 0


@dataclass
class PriorDataConfig:
    tokenizer: str = ""                      # the run directory or exported folder that made the tokens
    train_tokens: str = ""                   # .npy or .safetensors written by ddcl-vq tokenize
    test_tokens: List[str] = field(default_factory=list)   # held-out token files (NLL while training, evaluate)


@dataclass
class PriorModelConfig:
    dim: int = 128
    layers: int = 4
    heads: int = 4
    mlp_ratio: int = 4
    dropout: float = 0.1
    class_conditional: bool = True           # a class token first when the tokens have labels


@dataclass
class PriorTrainConfig:
    steps: int = 2000
    batch_size: int = 64                     # global batch of code maps (split over torchrun processes)
    lr: float = 1.0e-3                       # AdamW
    weight_decay: float = 0.01               # on weight matrices and embeddings, not on biases or norms
    warmup_steps: int = 100                  # linear warm-up, then lr_schedule
    lr_schedule: str = "cosine"              # constant | cosine (to 10% of lr)
    grad_clip: float = 1.0                   # max global grad norm; 0 = off
    log_every: int = 25
    checkpoint_every: int = 250
    eval_every: int = 500                    # test NLL on the first eval_images maps of data.test_tokens
    eval_images: int = 2000
    device: str = "auto"                     # auto | cpu | cuda


@dataclass
class PriorConfig:
    run: PriorRunConfig = field(default_factory=PriorRunConfig)
    data: PriorDataConfig = field(default_factory=PriorDataConfig)
    model: PriorModelConfig = field(default_factory=PriorModelConfig)
    train: PriorTrainConfig = field(default_factory=PriorTrainConfig)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


RULES = Rules(choices={"train.lr_schedule": ("constant", "cosine"), "train.device": ("auto", "cpu", "cuda")},
              positive={"model.dim", "model.layers", "model.heads", "model.mlp_ratio", "train.steps", "train.lr",
                        "train.batch_size", "train.log_every", "train.checkpoint_every", "train.eval_every"},
              non_negative={"model.dropout", "train.weight_decay", "train.warmup_steps", "train.grad_clip",
                            "train.eval_images"}, seeds={"run.seed"})
#: settings that may change when a prior resumes: how long it trains, what it logs, where things are
RESUMABLE = ("train.steps", "train.log_every", "train.checkpoint_every", "train.eval_every", "train.eval_images",
             "train.device", "run.dir", "run.name", "data.tokenizer", "data.train_tokens", "data.test_tokens")
KEYS = keys_of(PriorConfig())


def from_dict(raw: Dict[str, Any]) -> PriorConfig:
    cfg = PriorConfig()
    apply(cfg, raw or {})
    check_finite(cfg)
    check(cfg, RULES)
    if cfg.model.dim % cfg.model.heads:
        raise ConfigError(f"config key 'model.heads': expected a divisor of model.dim={cfg.model.dim}, got "
                          f"{cfg.model.heads}")
    if not cfg.model.dropout < 1:
        raise ConfigError(f"config key 'model.dropout': expected a value < 1, got {cfg.model.dropout}")
    return cfg


def load_prior_config(path: Optional[str | Path] = None, overrides: Sequence[str] = ()) -> PriorConfig:
    """YAML file (optional; built-in defaults without) + dotted overrides -> validated PriorConfig."""
    raw = read_yaml_mapping(Path(path), "config file") if path is not None else {}
    return from_dict(apply_overrides(raw, overrides, KEYS))


class PriorDataError(UserError, ValueError):
    """Token files or tokenizer that a prior cannot use as asked."""


def build_optimizer(model: CodePrior, cfg: PriorConfig) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices and embeddings (dim >= 2), none on biases and LayerNorms."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.train.weight_decay},
                              {"params": other, "weight_decay": 0.0}], lr=cfg.train.lr, betas=(0.9, 0.95))


@torch.no_grad()
def nll_bits(model: CodePrior, tokens: Any, batch_size: int = 500, max_images: int = 0, device="cpu") -> Dict:
    """Test NLL -> {bits_per_token (mean −log2 p(code | class, earlier codes)), bits_per_image (x h·w), num_images,
    num_tokens}."""
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
        raise RunDirError(f"prior directory {str(prior_dir)!r} holds a prior trained {step} steps with another config; "
                          f"resuming it would mix the two ({'; '.join(refused)}). Only these may change on resume: "
                          f"{', '.join(RESUMABLE)}. For a new prior give another run.dir, or delete {str(prior_dir)!r}")
    return notes


def train_prior(cfg: PriorConfig, load_data: Callable[[PriorConfig], Any], quiet: bool = False,
                stop_after: Optional[int] = None) -> Dict:
    """Train (or resume) the prior ``cfg`` describes on ``load_data(cfg)``; -> summary (also PRIOR_DIR/summary.json)."""
    t = cfg.train
    run = TrainingRun(cfg.run.dir, t.steps, checkpoint_every=t.checkpoint_every, log_every=t.log_every,
                      name=cfg.run.name, device=t.device, quiet=quiet, stop_after=stop_after, config=cfg.to_dict())
    with run:
        device, is_main = run.device, run.is_main
        torch.manual_seed(cfg.run.seed)
        data = load_data(cfg)
        meta = data.meta()
        if len(data.train.codes) < t.batch_size:
            raise PriorDataError(f"training token file {data.train.path!r} holds {len(data.train.codes)} code maps, "
                                 f"fewer than one batch (train.batch_size={t.batch_size}); lower train.batch_size or "
                                 "tokenize more of the split (--max-images)")
        found = run.latest()
        notes = check_resume(found[0], cfg, meta, run.dir) if found else []
        m = cfg.model
        model = CodePrior(data.num_codes, *data.train.grid, data.num_classes, dim=m.dim, layers=m.layers,
                          heads=m.heads, dropout=m.dropout, mlp_ratio=m.mlp_ratio).to(device)
        optimizer = build_optimizer(model, cfg)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(t.steps, t.lr_schedule, t.warmup_steps))
        run.keep(model=model, optimizer=optimizer, scheduler=scheduler)
        run.extra = {"prior": dict(model.config), "data": meta}
        step = run.resume(found)
        found = None
        if is_main:
            for text in notes:
                note(text)
            (run.dir / "config.yaml").write_text(dump_config(cfg))

        net = wrap_ddp(model, device) if run.world > 1 else model
        batches = EpochBatches(len(data.train.codes), t.batch_size, cfg.run.seed, run.rank, run.world, start_step=step)
        codes_all, labels_all = data.train.codes, data.train.labels if data.num_classes else None
        test = data.test[0] if data.test else None
        run.postfix = lambda record: {"bits": f"{record['bits_per_token']:.3f}"}
        t_start, first, last_test = time.time(), step, None
        model.train()
        for step, idx in run.steps(batches, step):
            idx = torch.as_tensor(idx)
            codes = codes_all[idx].to(device)
            labels = labels_all[idx].to(device) if labels_all is not None else None
            # model.loss, computed through net: under torchrun the DDP wrapper, whose backward averages the gradients
            logits = net(codes, labels).reshape(-1, model.num_codes).float()
            loss = F.cross_entropy(logits, model.flatten(codes).reshape(-1))
            if not torch.isfinite(loss):
                raise Diverged(f"step {step}: loss is {loss.item()}; lower train.lr (now {t.lr:g})")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if t.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
            optimizer.step()
            scheduler.step()
            evaluate = test is not None and run.due(t.eval_every, step + 1)
            if is_main and (run.due(t.log_every, step + 1) or evaluate):
                record = {"time": round(time.time() - t_start, 3), "loss": loss.item(),
                          "bits_per_token": loss.item() / LN2, "lr": optimizer.param_groups[0]["lr"]}
                if evaluate:
                    last_test = nll_bits(model, test, max_images=t.eval_images, device=device)
                    record["test_bits_per_token"] = last_test["bits_per_token"]
                run.log(step + 1, record)
        step = run.step
        seconds = time.time() - t_start
        summary = {"prior": str(run.dir), "step": step, "steps": t.steps, "train_seconds": round(seconds, 1),
                   "steps_per_second": round((step - first) / seconds, 3) if seconds > 0 and step > first else None,
                   "parameters": sum(p.numel() for p in model.parameters()),
                   **{k: v for k, v in meta.items() if k != "fingerprint"}}
        if is_main and step >= t.steps and test is not None:  # the others' summaries are printed nowhere
            summary["test"] = last_test or nll_bits(model, test, max_images=t.eval_images, device=device)
            summary["test"]["file"] = test.path
        if is_main:
            write_json(run.dir / "summary.json", summary)
        return summary


class PriorLoadError(UserError, RuntimeError):
    """A prior directory cannot be loaded."""


def load_prior(prior_dir: str | Path, device="cpu") -> Tuple[PriorConfig, CodePrior, Dict]:
    """-> (config, prior in eval mode, checkpoint meta {step, data, path}) from a prior directory."""
    prior_dir = Path(prior_dir)
    if not prior_dir.is_dir():
        raise PriorLoadError(f"prior directory {str(prior_dir)!r} does not exist")
    found = latest_checkpoint(prior_dir / "checkpoints")
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
