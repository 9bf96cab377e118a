"""``ddcl-vq study --config configs/study_X.yaml``: train every arm, evaluate, compare, report.

A study YAML:

    name: study_utilization            # optional; default: the file's stem
    description: one paragraph          # optional; copied into report.md
    out: reports/study_utilization      # optional default for --out
    base: {data: ..., model: ..., train: ...}    # a train config (same keys as configs/*.yaml)
    eval: {split: test, max_images: 2000, batch_size: 256, grid_images: 8}
    sweep: {quantizer.num_codes: [256, 1024, 4096]}   # optional: every arm x every combination
    seeds: [0, 1, 2]                    # optional: every arm x sweep point once per seed (run.seed)
    arms:
      - name: ddcl_st
        overrides: {quantizer.type: ddcl, quantizer.mode: straight_through}   # or ["key=value", ...]
        vs: hard                        # optional: the arm this one is measured against in report.md
        seeds: [0, 1, 2]                # optional (with 'seeds'): this arm's seeds instead of the file's
        sweep: {quantizer.num_codes: [256]}   # optional: this arm at these of the sweep's values only
    quick: ["train.steps=4", ...]       # optional: what --quick changes (default QUICK_OVERRIDES)
    parts:                              # optional: every arm once per part, one comparison per part
      - name: photos_a                  # run names <part>_<arm>...
        description: train on astronaut and rocket, test on coffee
        overrides: {data.train_photos: [astronaut, rocket], data.test_photos: [coffee]}
      - name: fashion_to_digits
        overrides: {data.name: fashion_mnist}
        eval_overrides: {data.name: digits}   # also evaluated on this (data.* only): a table of its own

The file is read into :class:`StudyFile` by the same typed-settings code as the training config
(:mod:`ddcl_vq.common.config`): an unknown key names the nearest valid one, a wrong type or value
says what was expected. ``null`` means "not set".

Each arm's config = base <- part overrides <- sweep values <- arm overrides <- --quick <- command-line
overrides (<- run.seed with ``seeds``), with run.name = the arm's name and run.dir = OUT/runs/<arm>. Run
names: with ``parts`` the part's name first (``photos_a_``), the arm's name, a suffix per sweep value
(``_k1024``), and with ``seeds`` a seed suffix (``_s0``).
Without ``seeds`` every arm runs once with the base's run.seed and the table has one row per arm;
with ``seeds`` the table has one row per arm x sweep point, mean and sample sd over the seeds, and
a per-seed table below it (``--seeds 0,1`` on the command line replaces the file's list). Every arm is validated before
anything trains (a ConfigError prefixed with the arm's name). Finished arms
(checkpoint at train.steps) are skipped, interrupted ones resume from their checkpoints, so
an interrupted study continues when the same command runs again. A run directory holding a
different config is an error, never silently mixed into the table.

With ``parts`` (held-out data: other photographs, another dataset), every part is compared on its
own, never in one table with another part: OUT/<part>/ holds its report.md, tables and plots
(the arms on the part's own test split), OUT/<part>/<dataset>/ the same for its ``eval_overrides``
evaluation (e.g. trained on Fashion-MNIST, evaluated on digits; each run's result is kept in
RUN_DIR/eval_<dataset>.json), and OUT/report.md puts the parts' tables one after another, each
headed by what it was trained and evaluated on (:mod:`.parts`).
"""
from __future__ import annotations

import dataclasses
import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import yaml

from ddcl_vq.tokenizer.config import Config, apply_overrides
from ddcl_vq.common.data import SPLITS
from ddcl_vq.common.config import ConfigError, Rules, build
from ddcl_vq.tokenizer.testset import EVAL_BATCH_SIZE
from ddcl_vq.common.config import read_yaml_mapping

QUICK_OVERRIDES = ["model.channels=16", "model.res_hidden=8", "model.num_res_blocks=1", "model.latent_dim=8",
                   "data.batch_size=32", "train.steps=4", "train.log_every=2", "train.usage_window=2",
                   "train.checkpoint_every=4", "train.image_every=4", "train.eval_images=0", "loss.disc_start=2"]
QUICK_EVAL = {"max_images": 64, "grid_images": 4}
SWEEP_SHORT = {"num_codes": "k", "codebook_lr_ratio": "rho", "temperature": "tau"}
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


@dataclass
class StudyEval:
    split: str = "test"                      # train | test
    max_images: int = 0                      # first N images of the split (0 = all)
    batch_size: int = EVAL_BATCH_SIZE
    grid_images: int = 8                     # test images in reconstructions.png


@dataclass
class ArmSpec:
    name: Optional[str] = None               # required
    overrides: Any = None                    # ["dotted.key=value", ...] or {dotted.key: value}
    vs: Optional[str] = None                 # another arm's name: report.md says what this arm changes
    seeds: Optional[List[int]] = None        # this arm's seeds instead of the file's (needs the file's 'seeds')
    sweep: Optional[Dict[str, List[Any]]] = None  # this arm at these of the sweep's values only


@dataclass
class PartSpec:
    name: Optional[str] = None               # required: the prefix of its run names and its folder
    description: str = ""
    overrides: Any = None                    # training config overrides for every arm of this part
    eval_overrides: Any = None               # data.* overrides: the arms are also evaluated on that data


@dataclass
class StudyFile:
    """A study YAML, as written (every arm's full config is built from it by :func:`load_study`)."""

    name: Optional[str] = None               # default: the file's stem
    description: str = ""
    out: Optional[str] = None                # default --out
    base: Dict[str, Any] = field(default_factory=dict)          # a training config, checked per arm
    eval: StudyEval = field(default_factory=StudyEval)
    sweep: Dict[str, List[Any]] = field(default_factory=dict)   # dotted key -> values
    arms: List[ArmSpec] = field(default_factory=list)
    seeds: Optional[List[int]] = None        # every arm x sweep point once per seed (default: base's run.seed)
    quick: Any = None                        # what --quick overrides (default QUICK_OVERRIDES)
    parts: List[PartSpec] = field(default_factory=list)          # held-out data: one comparison per part


STUDY_RULES = Rules(choices={"eval.split": SPLITS}, positive={"eval.batch_size"},
                    non_negative={"eval.max_images", "eval.grid_images", "seeds"})


@dataclass
class Arm:
    name: str                                # run name: arm, sweep suffixes, _s<seed> with seeds
    overrides: List[str]
    config: Config
    group: str = ""                          # the arm x sweep point (the name without the seed suffix)
    seed: Optional[int] = None               # with seeds: this run's seed
    vs: Optional[str] = None                 # the group it is measured against (ArmSpec.vs at this point)
    part: Optional[str] = None               # with parts: the part it belongs to

    def __post_init__(self) -> None:
        self.group = self.group or self.name


@dataclass
class Part:
    """A part of a study with ``parts``: its overrides as "key=value" strings."""
    name: str
    description: str = ""
    overrides: List[str] = field(default_factory=list)
    eval_overrides: List[str] = field(default_factory=list)


@dataclass
class Study:
    name: str
    path: Path
    description: str
    out: Path
    eval: StudyEval
    arms: List[Arm]
    base: Dict[str, Any] = field(default_factory=dict)
    quick: bool = False
    seeds: Optional[List[int]] = None        # None: no seeds (one run per arm, base's run.seed)
    declared: int = 0                        # runs the file declares (before --arms selects)
    parts: List[Part] = field(default_factory=list)   # empty: one comparison of every arm


def _as_overrides(spec: Any, where: str) -> List[str]:
    """A list of "key=value" strings or a mapping {dotted.key: value} -> list of strings."""
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


def read_study_file(path: Path) -> StudyFile:
    """The study YAML at ``path``, type-checked (``null`` values mean "not set")."""
    raw = read_yaml_mapping(path, "study file")  # bounded: size, nesting, alias expansion
    try:
        spec = build(StudyFile, {k: v for k, v in raw.items() if v is not None}, STUDY_RULES,
                     name=lambda key: f"key {key!r}")
    except ConfigError as err:
        raise ConfigError(f"study {path.name}: {err}") from None
    if not all(spec.sweep.values()):
        raise ConfigError(f"study {path.name}: 'sweep' must map dotted keys to non-empty lists, got {raw['sweep']!r}")
    if not spec.arms:
        raise ConfigError(f"study {path.name}: expected 'arms' to be a non-empty list, got {raw.get('arms')!r}")
    for i, arm in enumerate(spec.arms):
        if arm.name is None:
            raise ConfigError(f"study {path.name}: arm #{i + 1}: expected {{name: ..., overrides: ...}}, "
                              f"got {raw['arms'][i]!r}")
    names = [arm.name for arm in spec.arms]
    for arm in spec.arms:
        if arm.vs is not None and (arm.vs not in names or arm.vs == arm.name):
            raise ConfigError(f"study {path.name}: arm {arm.name!r}: 'vs' must name another arm of the study "
                              f"({', '.join(n for n in names if n != arm.name)}), got {arm.vs!r}")
    if spec.seeds is not None:
        check_seeds(spec.seeds, f"study {path.name}: key 'seeds'")
    for arm in spec.arms:
        where = f"study {path.name}: arm {arm.name!r}"
        if arm.seeds is not None:
            if spec.seeds is None:
                raise ConfigError(f"{where}: 'seeds' needs the study's own 'seeds' list (the table is then one row "
                                  "per arm x sweep point, mean and sd over its seeds)")
            check_seeds(arm.seeds, f"{where}: key 'seeds'")
        for key, values in (arm.sweep or {}).items():
            allowed = spec.sweep.get(key)
            if allowed is None:
                raise ConfigError(f"{where}: 'sweep' key {key!r} is not swept by the study (it sweeps "
                                  f"{', '.join(spec.sweep) or 'nothing'})")
            if not isinstance(values, list) or not values or any(v not in allowed for v in values):
                raise ConfigError(f"{where}: 'sweep' {key}: expected a non-empty list of the study's values "
                                  f"{allowed}, got {values!r}")
    for i, part in enumerate(spec.parts):
        if part.name is None or not NAME_RE.match(part.name):
            raise ConfigError(f"study {path.name}: part #{i + 1}: expected {{name: ..., overrides: ...}} with a name "
                              f"of letters, digits, '_', '-', '.', got {raw['parts'][i]!r}")
    part_names = [part.name for part in spec.parts]
    if len(set(part_names)) < len(part_names):
        raise ConfigError(f"study {path.name}: expected distinct part names, got {', '.join(part_names)}")
    return spec


def _parts(spec: StudyFile, path: Path) -> List[Part]:
    """The file's parts with their overrides as strings; eval_overrides may change data.* only (the
    evaluation measures the model as trained)."""
    parts = []
    for p in spec.parts:
        where = f"study {path.name}: part {p.name!r}"
        evals = _as_overrides(p.eval_overrides, f"{where}: 'eval_overrides'")
        wrong = [o for o in evals if not o.split("=", 1)[0].strip().startswith("data.")]
        if wrong:
            raise ConfigError(f"{where}: 'eval_overrides' may change data.* keys only (the evaluation measures the "
                              f"model as trained), got {', '.join(wrong)}")
        parts.append(Part(p.name, p.description.strip(), _as_overrides(p.overrides, f"{where}: 'overrides'"), evals))
    return parts


def check_seeds(seeds: Sequence[int], where: str) -> None:
    if not seeds:
        raise ConfigError(f"{where}: expected a non-empty list of seeds, got {list(seeds)!r}")
    if len(set(seeds)) < len(seeds):
        raise ConfigError(f"{where}: expected distinct seeds, got {list(seeds)!r}")
    if any(s < 0 for s in seeds):
        raise ConfigError(f"{where}: expected seeds >= 0, got {list(seeds)!r}")


def _sets_seed(overrides: Sequence[str]) -> bool:
    return any(o.split("=", 1)[0].strip() == "run.seed" for o in overrides)


def select_arms(arms: Sequence[Arm], patterns: Sequence[str], where: str) -> List[Arm]:
    """The arms whose name or group (the name without its seed suffix) matches one of the shell
    ``patterns`` (fnmatch: ``*_k256``, ``ddcl*``); an error when none does."""
    import fnmatch
    chosen = [a for a in arms if any(fnmatch.fnmatchcase(a.name, p) or fnmatch.fnmatchcase(a.group, p)
                                     for p in patterns)]
    if not chosen:
        groups = list(dict.fromkeys(a.group for a in arms))
        raise ConfigError(f"{where}: no arm matches {','.join(patterns)!r}; the arms are "
                          f"{', '.join(groups[:12])}{', ...' if len(groups) > 12 else ''}")
    return chosen


def load_study(path: str | Path, quick: bool = False, out: Optional[str | Path] = None,
               overrides: Sequence[str] = (), seeds: Optional[Sequence[int]] = None, only: Sequence[str] = ()) -> Study:
    """Read and validate a study YAML; every arm's config is built (and checked) here.

    ``seeds``: replaces the file's ``seeds``; ``only``: shell patterns selecting arms by name or by
    arm x sweep point (every declared arm is still validated)."""
    path = Path(path)
    spec = read_study_file(path)
    name = spec.name or path.stem
    ev = dataclasses.replace(spec.eval, **QUICK_EVAL) if quick else spec.eval
    quick_overrides = (_as_overrides(QUICK_OVERRIDES if spec.quick is None else spec.quick,
                                     f"study {path.name}: 'quick'") if quick else [])
    out_dir = Path(out) if out else Path(spec.out or f"reports/{name}")
    if quick and not out:
        out_dir = out_dir.with_name(out_dir.name + "_quick")
    if seeds is not None:
        check_seeds(seeds, "option --seeds")
    seed_list = list(seeds) if seeds is not None else spec.seeds
    if seed_list is not None and _sets_seed(overrides):
        raise ConfigError(f"study {path.name}: run.seed is set by 'seeds' ({seed_list}); "
                          "choose seeds with --seeds, not run.seed=")

    sweep = spec.sweep
    combos = [dict(zip(sweep, values)) for values in itertools.product(*sweep.values())] if sweep else [{}]
    parts = _parts(spec, path)
    arms, seen = [], set()
    specs = [(arm, _as_overrides(arm.overrides, f"study {path.name}: arm {arm.name!r}")) for arm in spec.arms]
    if seed_list is not None:
        for arm, arm_overrides in specs:
            if _sets_seed(arm_overrides):
                raise ConfigError(f"study {path.name}: arm {arm.name!r}: run.seed is set by 'seeds' ({seed_list}); "
                                  "remove it from the arm's overrides")
    # parts vary slowest, then sweep values, then seeds: every arm at the first value with the first
    # seed trains first (list the headline value first)
    for part, combo in itertools.product(parts or [None], combos):
        leaves = [k.split(".")[-1] for k in combo]  # a run name's suffix per sweep value: _k1024, _rho3, _tau0.1
        suffix = [f"{SWEEP_SHORT.get(leaf, leaf)}{v}" for leaf, v in zip(leaves, combo.values())]
        prefix = [] if part is None else [part.name]
        groups = {arm.name: "_".join(prefix + [arm.name] + suffix) for arm, _ in specs}
        arm_seeds = [s for arm, _ in specs for s in (arm.seeds or [])] if seeds is None else []
        every_seed = list(dict.fromkeys(seed_list + arm_seeds)) if seed_list is not None else [None]
        for seed in every_seed:
            for arm, arm_overrides in specs:
                if any(combo[k] not in values for k, values in (arm.sweep or {}).items()):
                    continue  # this arm is not run at this sweep point
                if seed is not None and seed not in (arm.seeds if arm.seeds is not None and seeds is None
                                                     else seed_list):
                    continue  # not one of this arm's seeds (--seeds replaces every arm's list)
                group = groups[arm.name]
                arm_name = group if seed is None else f"{group}_s{seed}"
                if not NAME_RE.match(arm_name):
                    raise ConfigError(f"study {path.name}: arm name {arm_name!r}: expected letters, digits, "
                                      "'_', '-', '.'")
                if arm_name in seen:
                    raise ConfigError(f"study {path.name}: arm name {arm_name!r} appears twice")
                seen.add(arm_name)
                all_overrides = ((part.overrides if part else []) + _as_overrides(combo, "sweep") + arm_overrides
                                 + quick_overrides + list(overrides) + ([] if seed is None else [f"run.seed={seed}"])
                                 + [f"run.name={arm_name}", f"run.dir={out_dir / 'runs' / arm_name}"])
                try:
                    cfg = Config.from_dict(apply_overrides(spec.base, all_overrides))
                    if part is not None and part.eval_overrides:  # the held-out evaluation's config, checked
                        Config.from_dict(apply_overrides(spec.base, all_overrides + part.eval_overrides))
                except ConfigError as err:
                    raise ConfigError(f"study {path.name}: arm {arm_name!r}: {err}") from None
                arms.append(Arm(arm_name, all_overrides[:-2], cfg, group=group, seed=seed,
                                vs=groups[arm.vs] if arm.vs is not None else None,
                                part=None if part is None else part.name))
    declared = len(arms)
    if only:
        arms = select_arms(arms, only, "option --arms")
    return Study(name=name, path=path, description=spec.description.strip(), out=out_dir, eval=ev, arms=arms,
                 base=spec.base, quick=quick, seeds=seed_list, declared=declared, parts=parts)
