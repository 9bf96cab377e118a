"""``ddcl-vq study --config configs/study_X.yaml``: train every arm, evaluate, compare, report.

A study YAML:

    name: study_utilization            # optional; default: the file's stem
    description: one paragraph          # optional; copied into report.md
    out: reports/study_utilization      # optional default for --out
    base: {data: ..., model: ..., train: ...}    # a train config (same keys as configs/*.yaml)
    eval: {split: test, max_images: 2000, batch_size: 256, grid_images: 8}
    sweep: {quantizer.num_codes: [256, 1024, 4096]}   # optional: every arm x every combination
    arms:
      - name: ddcl_st
        overrides: {quantizer.type: ddcl, quantizer.mode: straight_through}   # or ["key=value", ...]
    quick: ["train.steps=4", ...]       # optional: what --quick changes (default QUICK_OVERRIDES)

Each arm's config = base <- sweep values <- arm overrides <- --quick <- command-line overrides,
with run.name = the arm's name and run.dir = OUT/runs/<arm>. Every arm is validated before
anything trains (train.config's ConfigError, prefixed with the arm's name). Finished arms
(checkpoint at train.steps) are skipped, interrupted ones resume from their checkpoints, so
an interrupted study continues when the same command runs again. A run directory holding a
different config is an error, never silently mixed into the table.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import yaml

QUICK_OVERRIDES = [
    "model.channels=16", "model.res_hidden=8", "model.num_res_blocks=1", "model.latent_dim=8",
    "data.batch_size=32", "train.steps=4", "train.log_every=2", "train.usage_window=2",
    "train.checkpoint_every=4", "train.image_every=4", "train.eval_images=0",
]

QUICK_EVAL = {"max_images": 64, "grid_images": 4}

STUDY_KEYS = {"name", "description", "out", "base", "eval", "sweep", "arms", "quick"}

EVAL_KEYS = {"split": str, "max_images": int, "batch_size": int, "grid_images": int}

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


@dataclass
class Arm:
    name: str
    overrides: List[str]
    config: Any  # train.config.Config


@dataclass
class Study:
    name: str
    path: Path
    description: str
    out: Path
    eval: Dict[str, Any]
    arms: List[Arm]
    base: Dict[str, Any] = field(default_factory=dict)
    quick: bool = False


def _as_overrides(spec: Any, where: str) -> List[str]:
    """A list of "key=value" strings or a mapping {dotted.key: value} -> list of strings."""
    from ddcl_vq.train.config import ConfigError
    if spec is None:
        return []
    if isinstance(spec, dict):
        out = []
        for key, value in spec.items():
            text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
            if text.endswith("\n...") or text.endswith("..."):
                text = text.rsplit("...", 1)[0].strip()
            out.append(f"{key}={text}")
        return out
    if isinstance(spec, list) and all(isinstance(s, str) for s in spec):
        return list(spec)
    raise ConfigError(f"{where}: expected a list of 'dotted.key=value' strings or a mapping of dotted keys, "
                      f"got {spec!r}")


def _sweep_suffix(key: str, value: Any) -> str:
    leaf = key.split(".")[-1]
    short = {"num_codes": "k", "codebook_lr_ratio": "rho", "temperature": "tau"}.get(leaf, leaf)
    return f"{short}{value}"


def load_study(path: str | Path, quick: bool = False, out: Optional[str | Path] = None,
               overrides: Sequence[str] = ()) -> Study:
    """Read and validate a study YAML; every arm's config is built (and checked) here."""
    from ddcl_vq.train.config import ConfigError, Config, apply_overrides

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"study file {str(path)!r} does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"study file {str(path)!r} is not valid YAML: {str(err).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"study file {str(path)!r}: expected a mapping at the top, got {type(raw).__name__}")
    unknown = sorted(set(raw) - STUDY_KEYS)
    if unknown:
        import difflib
        near = difflib.get_close_matches(unknown[0], sorted(STUDY_KEYS), n=1, cutoff=0.0)
        raise ConfigError(f"study {path.name}: unknown key {unknown[0]!r}; did you mean {near[0]!r}?")
    name = str(raw.get("name") or path.stem)
    base = raw.get("base") or {}
    if not isinstance(base, dict):
        raise ConfigError(f"study {path.name}: 'base' must be a mapping (a train config), got {base!r}")
    ev = dict(raw.get("eval") or {})
    for key, value in ev.items():
        if key not in EVAL_KEYS:
            raise ConfigError(f"study {path.name}: unknown key 'eval.{key}'; expected one of {sorted(EVAL_KEYS)}")
        if not isinstance(value, EVAL_KEYS[key]) or isinstance(value, bool):
            raise ConfigError(f"study {path.name}: 'eval.{key}' expected {EVAL_KEYS[key].__name__}, got {value!r}")
    ev = {"split": "test", "max_images": 0, "batch_size": 256, "grid_images": 8, **ev}
    if ev["split"] not in ("train", "test"):
        raise ConfigError(f"study {path.name}: 'eval.split' expected 'train' or 'test', got {ev['split']!r}")
    if quick:
        ev.update(QUICK_EVAL)
    sweep = raw.get("sweep") or {}
    if not isinstance(sweep, dict) or not all(isinstance(v, list) and v for v in sweep.values()):
        raise ConfigError(f"study {path.name}: 'sweep' must map dotted keys to non-empty lists, got {sweep!r}")
    arms_raw = raw.get("arms")
    if not isinstance(arms_raw, list) or not arms_raw:
        raise ConfigError(f"study {path.name}: expected 'arms' to be a non-empty list, got {arms_raw!r}")
    quick_overrides = _as_overrides(raw.get("quick", QUICK_OVERRIDES), f"study {path.name}: 'quick'") if quick else []
    out_dir = Path(out) if out else Path(raw.get("out") or f"reports/{name}")
    if quick and not out:
        out_dir = out_dir.with_name(out_dir.name + "_quick")

    combos = [dict(zip(sweep, values)) for values in itertools.product(*sweep.values())] if sweep else [{}]
    arms: List[Arm] = []
    seen = set()
    specs = []
    for i, spec in enumerate(arms_raw):
        if not isinstance(spec, dict) or "name" not in spec or set(spec) - {"name", "overrides"}:
            raise ConfigError(f"study {path.name}: arm #{i + 1}: expected {{name: ..., overrides: ...}}, got {spec!r}")
        specs.append((spec, _as_overrides(spec.get("overrides"), f"study {path.name}: arm {spec['name']!r}")))
    # sweep values vary slowest: every arm at the first value trains first (list the headline value first)
    for combo in combos:
        for spec, arm_overrides in specs:
            arm_name = "_".join([str(spec["name"])] + [_sweep_suffix(k, v) for k, v in combo.items()])
            if not NAME_RE.match(arm_name):
                raise ConfigError(f"study {path.name}: arm name {arm_name!r}: expected letters, digits, '_', '-', '.'")
            if arm_name in seen:
                raise ConfigError(f"study {path.name}: arm name {arm_name!r} appears twice")
            seen.add(arm_name)
            all_overrides = (_as_overrides(combo, "sweep") + arm_overrides + quick_overrides + list(overrides)
                             + [f"run.name={arm_name}", f"run.dir={out_dir / 'runs' / arm_name}"])
            try:
                cfg = Config.from_dict(apply_overrides(base, all_overrides))
            except ConfigError as err:
                raise ConfigError(f"study {path.name}: arm {arm_name!r}: {err}") from None
            arms.append(Arm(arm_name, all_overrides[:-2], cfg))
    return Study(name=name, path=path, description=str(raw.get("description") or "").strip(), out=out_dir,
                 eval=ev, arms=arms, base=base, quick=quick)
