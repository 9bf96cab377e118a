"""The prior's typed config: YAML (``configs/prior_fashion.yaml``) + dotted overrides -> dataclasses.

Read and checked by the same settings engine as the training config (:mod:`ddcl_vq.common.config`):
an unknown key names the nearest valid one; a wrong type or a value out of range names the key.
The command-line arguments of ``ddcl-vq prior train`` (the tokenizer, ``--tokens``, ``--test``)
land in ``data.*``, so a prior directory's ``config.yaml`` says everything it was trained on.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from ddcl_vq.common.config import (ConfigError, Rules, apply, check, check_finite, differences, dump_config,  # noqa: F401
                                   keys_of, read_yaml_mapping)
from ddcl_vq.common.config import apply_overrides as _apply_overrides


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
    positive={"model.dim", "model.layers", "model.heads", "model.mlp_ratio", "train.steps", "train.batch_size",
              "train.lr", "train.log_every", "train.checkpoint_every", "train.eval_every"},
    non_negative={"model.dropout", "train.weight_decay", "train.warmup_steps", "train.grad_clip", "train.eval_images"})

#: settings that may change when a prior resumes: how long it trains, what it logs, where things are
RESUMABLE = ("train.steps", "train.log_every", "train.checkpoint_every", "train.eval_every", "train.eval_images",
             "train.device", "run.dir", "run.name", "data.tokenizer", "data.train_tokens", "data.test_tokens")


def all_keys() -> List[str]:
    return keys_of(PriorConfig())


def from_dict(raw: Dict[str, Any]) -> PriorConfig:
    cfg = PriorConfig()
    apply(cfg, raw or {}, candidates=all_keys())
    check_finite(cfg)
    check(cfg, RULES)
    if cfg.model.dim % cfg.model.heads:
        raise ConfigError(f"config key 'model.heads': expected a divisor of model.dim={cfg.model.dim}, got "
                          f"{cfg.model.heads}")
    if not cfg.model.dropout < 1:
        raise ConfigError(f"config key 'model.dropout': expected a value < 1, got {cfg.model.dropout}")
    return cfg


def apply_overrides(raw: Dict[str, Any], overrides: Sequence[str]) -> Dict[str, Any]:
    return _apply_overrides(raw, overrides, all_keys())


def load_prior_config(path: Optional[str | Path] = None, overrides: Sequence[str] = ()) -> PriorConfig:
    """YAML file (optional; built-in defaults without) + dotted overrides -> validated PriorConfig."""
    raw = read_yaml_mapping(Path(path), "config file") if path is not None else {}
    return from_dict(apply_overrides(raw, overrides))
