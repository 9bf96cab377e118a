"""Train, evaluate and compare every arm of a study; resume what was interrupted."""
from __future__ import annotations

import datetime as _dt
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ddcl_vq.common.machine import describe_machine
from ddcl_vq.common.errors import UserError

from ddcl_vq.studies.config import Arm, Study
from ddcl_vq.studies.report import render_report


class StudyError(UserError, RuntimeError):
    """A study cannot run as asked (a run directory with another config, no arm finished, ...)."""


def checkpoint_step(run_dir: Path) -> Optional[int]:
    from ddcl_vq.common.checkpoint import CheckpointError, load_checkpoint
    try:
        return int(load_checkpoint(run_dir / "checkpoints" / "last.pt")["step"])
    except CheckpointError:  # none there, or unreadable
        return None


def _diff(old: Dict, new: Dict, prefix: str = "") -> List[str]:
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict) and key != "vqp":
            out += _diff(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out


def check_run_dir(arm: Arm) -> None:
    """A run directory that already holds another config is an error (never mixed silently). The
    path it was written under (``run.dir``) is not part of the run: a study directory can be moved
    or copied and still be resumed and tabulated."""
    from ddcl_vq.tokenizer.config import load_config
    cfg_path = Path(arm.config.run.dir) / "config.yaml"
    if not cfg_path.is_file():
        return
    old = load_config(cfg_path, migrate=True).to_dict()
    new = arm.config.to_dict()
    old["run"] = dict(old["run"], dir=new["run"]["dir"])
    diff = _diff(old, new)
    if diff:
        raise StudyError(f"arm {arm.name!r}: {cfg_path.parent} holds a run with a different config "
                         f"({'; '.join(diff[:4])}); delete that directory or choose another --out")


#: written into a study's output folder before anything trains: the study it belongs to (JSON {"study", "config"})
OWNER_FILE = ".ddcl-vq-study"


def out_owner(out: Path) -> Optional[str]:
    """The name of the study whose output folder ``out`` is (its owner file, else the study.json of a finished
    study), or None for a new folder."""
    for name in (OWNER_FILE, "study.json"):
        try:
            found = json.loads((out / name).read_text()).get("study")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(found, str):
            return found
    return None


def check_out(study: Study) -> None:
    """Refuse, before anything trains, an output folder that holds another study (its runs, report and
    table would be mixed with this one's: a partial report, a table of both)."""
    owner = out_owner(study.out)
    if owner is not None and owner != study.name:
        raise StudyError(f"study {study.name!r}: the output folder {str(study.out)!r} holds the study {owner!r} "
                         f"(its runs, report and table); choose another --out")


def claim_out(study: Study) -> None:
    """Create the output folder and record that it is this study's (after :func:`check_out`)."""
    study.out.mkdir(parents=True, exist_ok=True)
    if not (study.out / OWNER_FILE).is_file():
        (study.out / OWNER_FILE).write_text(json.dumps({"study": study.name, "config": str(study.path)}) + "\n")


def arm_status(arm: Arm) -> str:
    step = checkpoint_step(Path(arm.config.run.dir))
    return "new" if step is None else "finished" if step >= arm.config.train.steps else f"interrupted at step {step}"


def _train_subprocess(arm: Arm, threads: Optional[int]) -> Optional[str]:
    """Train one arm in a child process (``python -m ddcl_vq train``) with ``threads`` (default 1)
    intra-op threads (the arm's own train.threads wins); None on success, else the reason."""
    import subprocess
    from ddcl_vq.tokenizer.config import dump_config
    run_dir = Path(arm.config.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_file = run_dir / "study_arm.yaml"
    cfg_file.write_text(dump_config(arm.config))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads or 1), MKL_NUM_THREADS=str(threads or 1))
    with open(run_dir / "train.log", "a") as log:
        proc = subprocess.run([sys.executable, "-m", "ddcl_vq", "train", "--config", str(cfg_file), "--quiet"],
                              stdout=log, stderr=subprocess.STDOUT, env=env)
    if proc.returncode == 0:
        return None
    tail = [line for line in (run_dir / "train.log").read_text().splitlines() if line.strip()][-1:]
    return f"training exited with code {proc.returncode}: {tail[0] if tail else ''} (see {run_dir / 'train.log'})"


def _first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"


class StudyRun:
    """One invocation of a study: which arms finished, failed or wait, and the lines it prints.

    Progress is a bar on a terminal and plain lines in a log file or pipe
    (:class:`~ddcl_vq.common.progress.Progress`); each arm's result is one line on stdout."""

    def __init__(self, study: Study, progress: bool = True):
        from ddcl_vq.common.progress import Progress
        self.study = study
        self.done: Dict[str, Dict] = {}
        self.failed: Dict[str, str] = {}
        self.unfinished: List[str] = []
        self.progress = Progress(len(study.arms), study.name, unit="arm", off=not progress)

    def say(self, text: str) -> None:
        self.progress.write(text)

    def advance(self) -> None:
        """One more arm handled."""
        self.progress.update(1)

    def fail(self, arm: Arm, reason: str, trace: Optional[str] = None) -> None:
        self.failed[arm.name] = reason
        self.say(f"{arm.name}: FAILED ({reason})")
        if trace:
            run_dir = Path(arm.config.run.dir)
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "study_error.txt").write_text(trace)

    def evaluate(self, arm: Arm, trained: bool) -> None:
        """Evaluate a trained arm (``eval.json``, reused when it matches); a failure is recorded."""
        from ddcl_vq.studies.compare import ensure_eval
        ev = self.study.eval
        try:
            result = ensure_eval(Path(arm.config.run.dir), ev.split, ev.max_images, ev.batch_size)
        except KeyboardInterrupt:
            raise
        except Exception as err:  # noqa: BLE001 - one arm's failure must not lose the others
            self.fail(arm, f"evaluation: {_first_line(err)}", traceback.format_exc())
            return
        self.done[arm.name] = result
        (Path(arm.config.run.dir) / "study_error.txt").unlink(missing_ok=True)  # an earlier failure's, now stale
        self.say(f"{arm.name}: {'' if trained else 'already trained; '}PSNR hard "
                 f"{result['recon']['hard']['psnr']:.2f} dB, utilization {result['codebook']['utilization']:.1%}, "
                 f"perplexity {result['codebook']['perplexity']:.1f}")

    def close(self) -> None:
        self.progress.close()


def triage(run: StudyRun, train_arms: bool) -> List[Arm]:
    """Evaluate the arms whose training has finished; the others are returned to train (or, without
    ``train_arms``, listed as unfinished)."""
    to_train = []
    for arm in run.study.arms:
        status = arm_status(arm)
        if status == "finished":
            run.evaluate(arm, trained=False)
            run.advance()
        elif not train_arms:
            run.unfinished.append(f"{arm.name} ({status})")
            run.advance()
        else:
            to_train.append(arm)
    return to_train


def train_in_process(run: StudyRun, arms: Sequence[Arm], verbose: bool, threads: Optional[int]) -> None:
    """Train ``arms`` one after another in this process, each evaluated when it ends; torch threads:
    the arm's train.threads, else ``threads`` (None: automatic, :mod:`ddcl_vq.common.threads`)."""
    from ddcl_vq.tokenizer.train import train
    from ddcl_vq.common.threads import set_threads
    for arm in arms:
        set_threads(arm.config.train.threads or threads)
        run.progress.set_postfix(arm=arm.name)
        try:
            train(arm.config, quiet=not verbose)
        except KeyboardInterrupt:
            raise
        except Exception as err:  # noqa: BLE001
            run.fail(arm, _first_line(err), traceback.format_exc())
        else:
            run.evaluate(arm, trained=True)
        run.advance()


def train_in_subprocesses(run: StudyRun, arms: Sequence[Arm], jobs: int, threads: Optional[int]) -> None:
    """Train ``arms`` ``jobs`` at a time, each in its own process (:func:`_train_subprocess`), and
    evaluate each in this process as it ends."""
    from concurrent.futures import ThreadPoolExecutor, as_completed
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(_train_subprocess, arm, threads): arm for arm in arms}
        for future in as_completed(futures):
            arm = futures[future]
            reason = future.result()
            if reason is None:
                run.evaluate(arm, trained=True)
            else:
                run.fail(arm, reason)
            run.advance()


def compare_finished(study: Study, finished: List[Arm], command: Optional[str]
                     ) -> Tuple[List[Dict], Optional[List[Dict]]]:
    """The comparison tables and plots of the finished arms: one row per run, and with seeds one
    mean ± sd group per arm x sweep point (:func:`compare_seeds`; None without seeds)."""
    from ddcl_vq.studies.compare import compare
    if study.seeds is not None:
        return compare_seeds(study, finished, command)
    ev = study.eval
    rows = compare([Path(a.config.run.dir) for a in finished], study.out, ev.split, ev.max_images, ev.batch_size,
                   names=[a.name for a in finished], grid_images=ev.grid_images, command=command)
    return rows, None


def write_report(study: Study, rows: List[Dict], groups: Optional[List[Dict]], info: Dict) -> None:
    """report.md and study.json in the study's output folder."""
    (study.out / "report.md").write_text(render_report(study, rows, info, groups))
    extra = {} if groups is None else {"seeds": study.seeds, "groups": groups}
    (study.out / "study.json").write_text(json.dumps({"study": study.name, "config": str(study.path),
                                                      "arms": [a.name for a in study.arms], **info,
                                                      "rows": rows, **extra}, indent=2) + "\n")


def _now() -> str:
    return _dt.datetime.now().astimezone().isoformat(timespec="seconds")


def run_study(study: Study, train_arms: bool = True, progress: bool = True, verbose: bool = False,
              command: Optional[str] = None, jobs: int = 1, threads: Optional[int] = None) -> Dict:
    """Train (unless ``train_arms`` is False), evaluate and compare every arm; write report.md.

    ``jobs`` > 1 trains that many arms at once, each in its own ``python -m ddcl_vq train`` process
    with ``threads`` (default 1) intra-op threads; with one job arms train in this process with
    ``threads`` (default: automatic, :mod:`ddcl_vq.common.threads`). Evaluation stays in this process.
    """
    check_out(study)  # before anything trains
    for arm in study.arms:
        check_run_dir(arm)
    claim_out(study)
    started, date_start, machine_start = time.time(), _now(), describe_machine()
    run = StudyRun(study, progress)
    try:
        to_train = triage(run, train_arms)
        if jobs <= 1:
            train_in_process(run, to_train, verbose, threads)
        elif to_train:
            train_in_subprocesses(run, to_train, jobs, threads)
    finally:
        run.close()
    finished = [a for a in study.arms if a.name in run.done]
    if not finished:
        raise StudyError(f"study {study.name}: no arm finished ({len(run.failed)} failed, "
                         f"{len(run.unfinished)} unfinished)")
    rows, groups = compare_finished(study, finished, command)
    info = {"command": command, "date_start": date_start, "date_end": _now(),
            "wall_seconds": round(time.time() - started, 1), "machine_start": machine_start,
            "machine_end": describe_machine(), "jobs": jobs, "failed": run.failed, "unfinished": run.unfinished}
    write_report(study, rows, groups, info)
    return {"rows": rows, "groups": groups, **info}


def compare_seeds(study: Study, finished: List[Arm], command: Optional[str]) -> Tuple[List[Dict], List[Dict]]:
    """A study with seeds: per-run rows, one mean ± sd row per arm x sweep point, the tables
    (:func:`write_seed_tables`) and the plots (per-run plots show each arm's first finished seed)."""
    from ddcl_vq.studies.compare import evaluate_runs, write_plots
    from ddcl_vq.studies.aggregate import aggregate, write_seed_tables
    ev = study.eval
    rows, evals = evaluate_runs([Path(a.config.run.dir) for a in finished], ev.split, ev.max_images,
                                ev.batch_size, names=[a.name for a in finished])
    for row, arm in zip(rows, finished):
        row["group"], row["seed"] = arm.group, arm.seed
    order = {g: i for i, g in enumerate(dict.fromkeys(a.group for a in study.arms))}  # arm x sweep point order
    ranked = sorted(range(len(rows)), key=lambda i: (order[finished[i].group], finished[i].seed))  # arms may have own seeds
    rows, evals, finished = [rows[i] for i in ranked], [evals[i] for i in ranked], [finished[i] for i in ranked]
    groups = aggregate(rows)
    write_seed_tables(study.out, groups, rows, evals, ev.split, ev.max_images, command)
    first = [i for i, a in enumerate(finished) if i == 0 or finished[i - 1].group != a.group]
    write_plots(study.out, [Path(finished[i].config.run.dir) for i in first], [finished[i].name for i in first],
                [evals[i] for i in first], groups, ev.split, ev.grid_images)
    return rows, groups
