"""``ddcl-vq study --config configs/study_ablation.yaml``: train every arm, evaluate, compare, report.

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

Each arm's config = base <- part overrides <- sweep values <- arm overrides <- --quick <- command-line overrides
(<- run.seed with ``seeds``), run.dir = OUT/runs/<run name> (suffixes like ``_k1024``, ``_s0``); all are validated
before anything trains. With ``seeds`` the table is mean ± sd per arm x sweep point. Finished arms are skipped,
interrupted ones resume; SIGTERM or Ctrl-C stops the study (training arms save a checkpoint). More: docs/guide/studies.md.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import fnmatch
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

import yaml

from ddcl_vq.common.checkpoint import write_json
from ddcl_vq.common.config import ConfigError, Rules, build, differences, read_yaml_mapping
from ddcl_vq.common.data import SPLITS
from ddcl_vq.common.errors import SignalScope, Stopped, UserError, one_line
from ddcl_vq.common.machine import describe_machine
from ddcl_vq.common.rundir import RunLock
from ddcl_vq.tokenizer.config import Config, apply_overrides
from ddcl_vq.tokenizer.evaluate import EVAL_BATCH_SIZE

QUICK_OVERRIDES = ["model.channels=16", "model.res_hidden=8", "model.num_res_blocks=1", "model.latent_dim=8",
                   "data.batch_size=32", "train.steps=4", "train.log_every=2", "train.usage_window=2",
                   "train.checkpoint_every=4", "train.image_every=4", "train.eval_images=0", "loss.disc_start=2"]
QUICK_EVAL = {"max_images": 64, "grid_images": 4}
SWEEP_SHORT = {"num_codes": "k", "codebook_lr_ratio": "rho", "temperature": "tau"}
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


class StudyError(UserError, RuntimeError):
    """A study cannot run as asked (a run directory with another config, no arm finished, ...)."""


# ----------------------------------------------------------------------------- the study file
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
class Part:
    """A part of a study (held-out data); its overrides are "key=value" strings once read."""
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
    parts: List[Part] = field(default_factory=list)              # held-out data: one comparison per part


STUDY_RULES = Rules(choices={"eval.split": SPLITS}, positive={"eval.batch_size"},
                    non_negative={"eval.max_images", "eval.grid_images", "seeds"}, seeds={"seeds"})


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
class Study:
    name: str
    path: Path
    description: str
    out: Path
    eval: StudyEval
    arms: List[Arm]
    quick: bool = False
    seeds: Optional[List[int]] = None        # None: no seeds (one run per arm, base's run.seed)
    declared: int = 0                        # runs the file declares (before --arms selects)
    parts: List[Part] = field(default_factory=list)   # empty: one comparison of every arm


def as_overrides(spec: Any, where: str) -> List[str]:
    """A list of "key=value" strings or a mapping {dotted.key: value} -> list of strings."""
    if spec is None:
        return []
    if isinstance(spec, dict):
        return [f"{key}=" + yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...")
                .strip() for key, value in spec.items()]
    if isinstance(spec, list) and all(isinstance(s, str) for s in spec):
        return list(spec)
    raise ConfigError(f"{where}: expected a list of 'dotted.key=value' strings or a mapping of dotted keys, "
                      f"got {spec!r}")


def check_seeds(seeds: Sequence[int], where: str) -> None:
    if not seeds or len(set(seeds)) < len(seeds) or any(s < 0 for s in seeds):
        raise ConfigError(f"{where}: expected a non-empty list of distinct seeds >= 0, got {list(seeds)!r}")


def parse_study(raw: Dict[str, Any], where: str) -> StudyFile:
    """A study file's mapping, type-checked and its cross-references checked (``where``: how errors begin)."""
    try:
        spec = build(StudyFile, {k: v for k, v in raw.items() if v is not None}, STUDY_RULES,
                     name=lambda key: f"key {key!r}")
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    if not all(spec.sweep.values()):
        raise ConfigError(f"{where}: 'sweep' must map dotted keys to non-empty lists, got {raw['sweep']!r}")
    if not spec.arms:
        raise ConfigError(f"{where}: expected 'arms' to be a non-empty list, got {raw.get('arms')!r}")
    for i, arm in enumerate(spec.arms):
        if arm.name is None:
            raise ConfigError(f"{where}: arm #{i + 1}: expected {{name: ..., overrides: ...}}, got {raw['arms'][i]!r}")
    names = [arm.name for arm in spec.arms]
    if spec.seeds is not None:
        check_seeds(spec.seeds, f"{where}: key 'seeds'")
    for arm in spec.arms:
        at = f"{where}: arm {arm.name!r}"
        if arm.vs is not None and (arm.vs not in names or arm.vs == arm.name):
            raise ConfigError(f"{at}: 'vs' must name another arm of the study "
                              f"({', '.join(n for n in names if n != arm.name)}), got {arm.vs!r}")
        if arm.seeds is not None and spec.seeds is None:
            raise ConfigError(f"{at}: 'seeds' needs the study's own 'seeds' list (the table is then one row per "
                              "arm x sweep point, mean and sd over its seeds)")
        if arm.seeds is not None:
            check_seeds(arm.seeds, f"{at}: key 'seeds'")
        for key, values in (arm.sweep or {}).items():
            allowed = spec.sweep.get(key)
            if allowed is None:
                raise ConfigError(f"{at}: 'sweep' key {key!r} is not swept by the study (it sweeps "
                                  f"{', '.join(spec.sweep) or 'nothing'})")
            if not isinstance(values, list) or not values or any(v not in allowed for v in values):
                raise ConfigError(f"{at}: 'sweep' {key}: expected a non-empty list of the study's values "
                                  f"{allowed}, got {values!r}")
    for i, part in enumerate(spec.parts):
        if part.name is None or not NAME_RE.match(part.name):
            raise ConfigError(f"{where}: part #{i + 1}: expected {{name: ..., overrides: ...}} with a name "
                              f"of letters, digits, '_', '-', '.', got {raw['parts'][i]!r}")
        part.overrides = as_overrides(part.overrides, f"{where}: part {part.name!r}: 'overrides'")
        part.eval_overrides = as_overrides(part.eval_overrides, f"{where}: part {part.name!r}: 'eval_overrides'")
        part.description = part.description.strip()
        wrong = [o for o in part.eval_overrides if not o.split("=", 1)[0].strip().startswith("data.")]
        if wrong:  # the evaluation measures the model as trained
            raise ConfigError(f"{where}: part {part.name!r}: 'eval_overrides' may change data.* keys only (the "
                              f"evaluation measures the model as trained), got {', '.join(wrong)}")
    if len({part.name for part in spec.parts}) < len(spec.parts):
        raise ConfigError(f"{where}: expected distinct part names, got {', '.join(p.name for p in spec.parts)}")
    return spec


def read_study_file(path: Path) -> StudyFile:
    """The study YAML at ``path``, type-checked (``null`` values mean "not set")."""
    return parse_study(read_yaml_mapping(Path(path), "study file"), f"study {Path(path).name}")


def select_arms(arms: Sequence[Arm], patterns: Sequence[str], where: str) -> List[Arm]:
    """The arms whose name or group matches one of the shell ``patterns`` (``*_k256``); an error when none does."""
    chosen = [a for a in arms if any(fnmatch.fnmatchcase(a.name, p) or fnmatch.fnmatchcase(a.group, p)
                                     for p in patterns)]
    if not chosen:
        groups = list(dict.fromkeys(a.group for a in arms))
        raise ConfigError(f"{where}: no arm matches {','.join(patterns)!r}; the arms are "
                          f"{', '.join(groups[:12])}{', ...' if len(groups) > 12 else ''}")
    return chosen


def load_study(path: str | Path, quick: bool = False, out: Optional[str | Path] = None, overrides: Sequence[str] = (),
               seeds: Optional[Sequence[int]] = None, only: Sequence[str] = (), spec: Optional[StudyFile] = None,
               name: Optional[str] = None) -> Study:
    """Read a study YAML (or take ``spec``) and build and check every arm's config. ``seeds``: replaces the
    file's ``seeds``; ``only``: shell patterns selecting arms (every declared arm is still validated)."""
    path = Path(path)
    spec = spec or read_study_file(path)
    where, name = f"study {path.name}", name or spec.name or path.stem
    quick_overrides = as_overrides(QUICK_OVERRIDES if spec.quick is None else spec.quick,
                                   f"{where}: 'quick'") if quick else []
    out_dir = Path(out) if out else Path(spec.out or f"reports/{name}")
    if quick and not out:
        out_dir = out_dir.with_name(out_dir.name + "_quick")
    if seeds is not None:
        check_seeds(seeds, "option --seeds")
    seed_list = list(seeds) if seeds is not None else spec.seeds
    specs = [(arm, as_overrides(arm.overrides, f"{where}: arm {arm.name!r}")) for arm in spec.arms]
    if seed_list is not None:
        for who, given in [("", overrides)] + [(f": arm {a.name!r}", o) for a, o in specs]:
            if any(o.split("=", 1)[0].strip() == "run.seed" for o in given):
                raise ConfigError(f"{where}{who}: run.seed is set by 'seeds' ({seed_list}); choose seeds with "
                                  f"{'--seeds' if not who else 'the seeds keys'}, not run.seed=")
    combos = [dict(zip(spec.sweep, v)) for v in itertools.product(*spec.sweep.values())] if spec.sweep else [{}]
    arms: List[Arm] = []
    # parts vary slowest, then sweep values, then seeds
    for part, combo in itertools.product(spec.parts or [None], combos):
        leaves = [k.split(".")[-1] for k in combo]  # a run name's suffix per sweep value: _k1024, _rho3, _tau0.1
        suffix = [f"{SWEEP_SHORT.get(leaf, leaf)}{v}" for leaf, v in zip(leaves, combo.values())]
        prefix = [] if part is None else [part.name]
        groups = {arm.name: "_".join(prefix + [arm.name] + suffix) for arm, _ in specs}
        arm_seeds = [s for arm, _ in specs for s in (arm.seeds or [])] if seeds is None else []
        for seed in list(dict.fromkeys(seed_list + arm_seeds)) if seed_list is not None else [None]:
            for arm, arm_overrides in specs:
                if any(combo[k] not in values for k, values in (arm.sweep or {}).items()):
                    continue  # this arm is not run at this sweep point
                if seed is not None and seed not in (arm.seeds if arm.seeds is not None and seeds is None
                                                     else seed_list):
                    continue  # not one of this arm's seeds (--seeds replaces every arm's list)
                group = groups[arm.name]
                run_name = group if seed is None else f"{group}_s{seed}"
                if not NAME_RE.match(run_name) or any(a.name == run_name for a in arms):
                    raise ConfigError(f"{where}: arm name {run_name!r}: expected letters, digits, '_', '-', '.', "
                                      "each name once")
                given = ((part.overrides if part else []) + as_overrides(combo, "sweep") + arm_overrides
                         + quick_overrides + list(overrides) + ([] if seed is None else [f"run.seed={seed}"]))
                paths = [f"run.name={run_name}", f"run.dir={out_dir / 'runs' / run_name}"]
                try:
                    cfg = Config.from_dict(apply_overrides(spec.base, given + paths))
                    if part is not None and part.eval_overrides:  # the held-out evaluation's config, checked
                        Config.from_dict(apply_overrides(spec.base, given + paths + part.eval_overrides))
                except ConfigError as err:
                    raise ConfigError(f"{where}: arm {run_name!r}: {err}") from None
                arms.append(Arm(run_name, given, cfg, group=group, seed=seed, part=part and part.name,
                                vs=groups[arm.vs] if arm.vs is not None else None))
    declared = len(arms)
    return Study(name=name, path=path, description=spec.description.strip(), out=out_dir,
                 eval=replace(spec.eval, **QUICK_EVAL) if quick else spec.eval,
                 arms=select_arms(arms, only, "option --arms") if only else arms, quick=quick,
                 seeds=seed_list, declared=declared, parts=spec.parts)


# ----------------------------------------------------------------------------- the output folder
def arm_status(arm: Arm) -> str:
    from ddcl_vq.common.checkpoint import CheckpointError, load_checkpoint
    try:
        step = int(load_checkpoint(Path(arm.config.run.dir) / "checkpoints" / "last.pt")["step"])
    except CheckpointError:  # none there, or unreadable
        return "new"
    return "finished" if step >= arm.config.train.steps else f"interrupted at step {step}"


def check_run_dir(arm: Arm) -> None:
    """A run directory holding another config is an error (``run.dir`` aside: a study folder may be moved)."""
    from ddcl_vq.tokenizer.config import load_config
    cfg_path = Path(arm.config.run.dir) / "config.yaml"
    if not cfg_path.is_file():
        return
    old = load_config(cfg_path)
    old.run.dir = arm.config.run.dir
    diff = [f"{key}: {a!r} -> {b!r}" for key, a, b in differences(old, arm.config)]
    if diff:
        raise StudyError(f"arm {arm.name!r}: {cfg_path.parent} holds a run with a different config "
                         f"({'; '.join(diff[:4])}); delete that directory or choose another --out")


#: written into a study's output folder before anything trains: the study it belongs to (JSON {"study", "config"})
OWNER_FILE = ".ddcl-vq-study"


def check_out(study: Study) -> None:
    """Refuse, before anything trains, an output folder that holds another study: the one its owner file names,
    else its study.json (neither: a new folder)."""
    for name in (OWNER_FILE, "study.json"):
        try:
            owner = json.loads((study.out / name).read_text()).get("study")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(owner, str) and owner != study.name:
            raise StudyError(f"study {study.name!r}: the output folder {str(study.out)!r} holds the study {owner!r} "
                             f"(its runs, report and table); choose another --out")
        if isinstance(owner, str):
            return


@contextlib.contextmanager
def claimed(study: Study, others: Sequence[Study] = ()) -> Iterator["StudySignals"]:
    """Refuse, before anything trains, an output folder of another study (``study``'s and ``others``') or a run
    directory of another config; then hold OUT (:class:`OutLock`, :class:`StudySignals`) and claim it."""
    for one in [study, *others]:
        check_out(one)
    for arm in study.arms:
        check_run_dir(arm)
    with OutLock(study.out), StudySignals() as stop:
        check_out(study)  # again, now that no other study can claim the folder
        if not (study.out / OWNER_FILE).is_file():
            (study.out / OWNER_FILE).write_text(json.dumps({"study": study.name, "config": str(study.path)}) + "\n")
        yield stop


class OutLock(RunLock):
    """OUT/.study.lock, held while a study writes into OUT: a second one is refused at once, naming the holder."""

    def __init__(self, out: Path, what: str = "study"):
        super().__init__(out)
        self.path, self.what = self.run_dir / ".study.lock", what

    def _refuse(self) -> StudyError:
        return StudyError(f"the output folder {str(self.run_dir)!r} is in use by another {self.what} "
                          f"({self._holder()}); wait for it to end or stop it, or give this one another --out")


# ----------------------------------------------------------------------------- training the arms
class StudySignals(SignalScope):
    """SIGTERM or SIGINT stops a study: no other arm starts, worker processes get the signal once (they save a
    checkpoint), then :class:`Stopped` (exit 128 + the signal)."""

    def __init__(self) -> None:
        self.caught: Optional[int] = None
        self.workers: List[subprocess.Popen] = []
        self.signalled: set = set()
        self.hold = False                    # a worker is being started: the signal waits for it

    def _handler(self, signum: int, frame) -> None:
        self.caught = self.caught or signum
        self.forward()
        if not self.hold:
            self.check()

    def forward(self, signum: Optional[int] = None) -> None:
        """Send the signal caught (or ``signum``) to every worker still running that has not had one."""
        for proc in self.workers:
            if proc.pid not in self.signalled and proc.poll() is None and (self.caught or signum):
                self.signalled.add(proc.pid)
                proc.send_signal(self.caught or signum)

    def check(self) -> None:
        if self.caught is not None:
            raise Stopped(f"stopped by {signal.Signals(self.caught).name}: no other arm starts; an arm stopped in "
                          "training keeps its last checkpoint; run the same command again to resume", 128 + self.caught)


def _worker_setup() -> None:  # pragma: no cover - runs in the child
    """A session of its own (the study forwards Ctrl-C), and SIGTERM when the study's process dies."""
    os.setsid()
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _start_worker(arm: Arm, threads: Optional[int]) -> subprocess.Popen:
    """``python -m ddcl_vq train`` of one arm with ``threads`` (default 1) threads, logging to RUN_DIR/train.log."""
    from ddcl_vq.tokenizer.config import dump_config
    run_dir = Path(arm.config.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "study_arm.yaml").write_text(dump_config(arm.config))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads or 1), MKL_NUM_THREADS=str(threads or 1))
    with open(run_dir / "train.log", "a") as log:
        return subprocess.Popen([sys.executable, "-m", "ddcl_vq", "train", "--config", str(run_dir / "study_arm.yaml"),
                                 "--quiet"], stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_worker_setup)


def _worker_failure(arm: Arm, code: int) -> Optional[str]:
    """None when the worker succeeded, else why it failed (its log's last line)."""
    if code == 0:
        return None
    log = Path(arm.config.run.dir) / "train.log"
    tail = [line for line in log.read_text().splitlines() if line.strip()][-1:]
    return f"training exited with code {code}: {tail[0] if tail else ''} (see {log})"


def failure_text(err: BaseException) -> str:
    return f"{type(err).__name__}: {one_line(err)}"


class StudyRun:
    """One invocation of a study: which arms finished, failed or wait, and the lines it prints."""

    def __init__(self, study: Study, progress: bool = True):
        from ddcl_vq.common.progress import Progress
        self.study = study
        self.done: Dict[str, Dict] = {}
        self.failed: Dict[str, str] = {}
        self.unfinished: List[str] = []
        self.progress = Progress(len(study.arms), study.name, unit="arm", off=not progress)

    def fail(self, arm: Arm, reason: str, trace: Optional[str] = None) -> None:
        self.failed[arm.name] = reason
        self.progress.write(f"{arm.name}: FAILED ({reason})")
        if trace:
            run_dir = Path(arm.config.run.dir)
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "study_error.txt").write_text(trace)

    def evaluate(self, arm: Arm, trained: bool) -> None:
        """Evaluate a trained arm (``eval.json``, reused when it matches); a failure is recorded."""
        from ddcl_vq.studies.freshness import ensure_eval
        ev = self.study.eval
        try:
            result = ensure_eval(Path(arm.config.run.dir), ev.split, ev.max_images, ev.batch_size)
        except (KeyboardInterrupt, Stopped):
            raise
        except Exception as err:  # noqa: BLE001 - one arm's failure must not lose the others
            self.fail(arm, f"evaluation: {failure_text(err)}", traceback.format_exc())
            return
        self.done[arm.name] = result
        (Path(arm.config.run.dir) / "study_error.txt").unlink(missing_ok=True)  # an earlier failure's, now stale
        c = result["codebook"]
        self.progress.write(f"{arm.name}: {'' if trained else 'already trained; '}PSNR hard "
                            f"{result['recon']['hard']['psnr']:.2f} dB, utilization {c['utilization']:.1%}, "
                            f"perplexity {c['perplexity']:.1f}")

    def triage(self, train_arms: bool) -> List[Arm]:
        """Evaluate the finished arms; return the others to train (without ``train_arms``: list them unfinished)."""
        to_train = []
        for arm in self.study.arms:
            status = arm_status(arm)
            if status != "finished" and train_arms:
                to_train.append(arm)
                continue
            if status == "finished":
                self.evaluate(arm, trained=False)
            else:
                self.unfinished.append(f"{arm.name} ({status})")
            self.progress.update(1)
        return to_train

    def train_here(self, arms: Sequence[Arm], verbose: bool, threads: Optional[int]) -> None:
        """Train and evaluate ``arms`` one after another in this process."""
        from ddcl_vq.common.threads import set_threads
        from ddcl_vq.tokenizer.train import train
        for arm in arms:
            set_threads(arm.config.train.threads or threads)
            self.progress.set_postfix(arm=arm.name)
            try:
                train(arm.config, quiet=not verbose)
            except (KeyboardInterrupt, Stopped):
                raise
            except Exception as err:  # noqa: BLE001
                self.fail(arm, failure_text(err), traceback.format_exc())
            else:
                self.evaluate(arm, trained=True)
            self.progress.update(1)

    def train_workers(self, arms: Sequence[Arm], jobs: int, threads: Optional[int], stop: StudySignals) -> None:
        """Train ``arms`` ``jobs`` at a time in worker processes, evaluating each here as it ends; on a signal
        or an error the running workers stop (with a checkpoint) before this returns."""
        waiting, running = list(arms), {}
        try:
            while waiting or running:
                while waiting and len(running) < jobs:
                    stop.hold = True
                    arm = waiting.pop(0)
                    proc = _start_worker(arm, threads)
                    running[proc], stop.hold = arm, False
                    stop.workers.append(proc)
                    stop.forward()
                    stop.check()
                ended = [proc for proc in running if proc.poll() is not None]
                if not ended:
                    time.sleep(0.2)
                for proc in ended:
                    arm = running.pop(proc)
                    reason = _worker_failure(arm, proc.returncode)
                    self.evaluate(arm, trained=True) if reason is None else self.fail(arm, reason)
                    self.progress.update(1)
        finally:
            stop.hold = False
            stop.forward(signal.SIGTERM)
            for proc in running:
                proc.wait()


# ----------------------------------------------------------------------------- the tables and the report
def compare_finished(study: Study, run: StudyRun, command: Optional[str]):
    """The finished arms' tables and plots in OUT -> (rows, mean ± sd groups with seeds, else None)."""
    from ddcl_vq.studies.compare import check_one_dataset
    from ddcl_vq.studies.tables import make_row, tabulate
    order = {g: i for i, g in enumerate(dict.fromkeys(a.group for a in study.arms))}  # arm x sweep point order
    finished = sorted((a for a in study.arms if a.name in run.done), key=lambda a: (order[a.group], a.seed or 0))
    check_one_dataset([Path(a.config.run.dir) for a in finished])
    evals = [run.done[a.name] for a in finished]
    rows = [make_row(Path(a.config.run.dir), ev, a.name) for a, ev in zip(finished, evals)]
    return rows, tabulate(study.out, finished, rows, evals, study.eval, study.seeds is not None, command)


def timestamp() -> str:
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")


def run_study(study: Study, train_arms: bool = True, progress: bool = True, verbose: bool = False,
              command: Optional[str] = None, jobs: int = 1, threads: Optional[int] = None) -> Dict:
    """Train (unless ``train_arms`` is False), evaluate and compare every arm; write report.md and study.json.
    ``jobs`` > 1 trains that many arms at once in worker processes with ``threads`` threads each."""
    from ddcl_vq.studies.report import render_report
    short = [a.name for a in study.arms if a.config.quantizer['type'] == "ddcl"
             and a.config.train.steps < a.config.quantizer['warmup_steps']]
    if short and train_arms:
        print(f"warning: {len(short)} DDCL arm(s) (e.g. {short[0]}) end inside the quantizer's warm-up "
              "(train.steps < quantizer.warmup_steps): their code use and quality measure nothing yet", file=sys.stderr)
    with claimed(study) as stop:
        started, date_start, machine_start = time.time(), timestamp(), describe_machine()
        run = StudyRun(study, progress)
        try:
            to_train = run.triage(train_arms)
            if jobs <= 1:
                run.train_here(to_train, verbose, threads)
            elif to_train:
                run.train_workers(to_train, jobs, threads, stop)
        finally:
            run.progress.close()
        if not run.done:
            raise StudyError(f"study {study.name}: no arm finished ({len(run.failed)} failed, "
                             f"{len(run.unfinished)} unfinished)")
        rows, groups = compare_finished(study, run, command)
        info = {"command": command, "date_start": date_start, "date_end": timestamp(),
                "wall_seconds": round(time.time() - started, 1), "machine_start": machine_start,
                "machine_end": describe_machine(), "jobs": jobs, "failed": run.failed, "unfinished": run.unfinished}
        (study.out / "report.md").write_text(render_report(study, rows, info, groups))
        extra = {} if groups is None else {"seeds": study.seeds, "groups": groups}
        write_json(study.out / "study.json", {"study": study.name, "config": str(study.path),
                                              "arms": [a.name for a in study.arms], **info, "rows": rows, **extra})
    return {"rows": rows, "groups": groups, **info}
