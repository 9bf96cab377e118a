"""Train, evaluate and compare every arm of a study; resume what was interrupted."""
from __future__ import annotations

import datetime as _dt
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ddcl_vq.eval.machine import describe_machine
from ddcl_vq.train.errors import UserError

from .config import Arm, Study
from .report import render_report


class StudyError(UserError, RuntimeError):
    """A study cannot run as asked (a run directory with another config, no arm finished, ...)."""


def checkpoint_step(run_dir: Path) -> Optional[int]:
    from ddcl_vq.train.checkpoint import CheckpointError, load_checkpoint
    path = run_dir / "checkpoints" / "last.pt"
    if not path.is_file():
        return None
    try:
        return int(load_checkpoint(path)["step"])
    except CheckpointError:
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
    """A run directory that already holds another config is an error (never mixed silently)."""
    from ddcl_vq.train.config import load_config
    cfg_path = Path(arm.config.run.dir) / "config.yaml"
    if not cfg_path.is_file():
        return
    old = load_config(cfg_path, migrate=True).to_dict()
    diff = _diff(old, arm.config.to_dict())
    if diff:
        raise StudyError(f"arm {arm.name!r}: {cfg_path.parent} holds a run with a different config "
                         f"({'; '.join(diff[:4])}); delete that directory or choose another --out")


def arm_status(arm: Arm) -> str:
    step = checkpoint_step(Path(arm.config.run.dir))
    if step is None:
        return "new"
    return "finished" if step >= arm.config.train.steps else f"interrupted at step {step}"


def _train_subprocess(arm: Arm, threads: int) -> Optional[str]:
    """Train one arm in a child process (``python -m ddcl_vq.train``); None on success, else the reason."""
    import subprocess

    from ddcl_vq.train.config import dump_config
    run_dir = Path(arm.config.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg_file = run_dir / "study_arm.yaml"
    cfg_file.write_text(dump_config(arm.config))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads or 1), MKL_NUM_THREADS=str(threads or 1))
    with open(run_dir / "train.log", "a") as log:
        proc = subprocess.run([sys.executable, "-m", "ddcl_vq.train", "--config", str(cfg_file), "--quiet"],
                              stdout=log, stderr=subprocess.STDOUT, env=env)
    if proc.returncode == 0:
        return None
    tail = [line for line in (run_dir / "train.log").read_text().splitlines() if line.strip()][-1:]
    return f"training exited with code {proc.returncode}: {tail[0] if tail else ''} (see {run_dir / 'train.log'})"


def run_study(study: Study, train_arms: bool = True, progress: bool = True, verbose: bool = False,
              command: Optional[str] = None, jobs: int = 1, threads: int = 0) -> Dict:
    """Train (unless ``train_arms`` is False), evaluate and compare every arm; write report.md.

    ``jobs`` > 1 trains that many arms at once, each in its own ``python -m ddcl_vq.train`` process
    with ``threads`` (default 1) intra-op threads; evaluation stays in this process.
    """
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from tqdm import tqdm

    from ddcl_vq.train.loop import train

    from ddcl_vq.eval.compare import compare, ensure_eval

    for arm in study.arms:  # before anything trains
        check_run_dir(arm)
    study.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    machine_start = describe_machine()
    date_start = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
    done: Dict[str, Dict] = {}
    failed: Dict[str, str] = {}
    unfinished: List[str] = []
    bar = tqdm(total=len(study.arms), desc=study.name, unit="arm", disable=not progress, dynamic_ncols=True)

    def fail(arm: Arm, reason: str, trace: Optional[str] = None) -> None:
        failed[arm.name] = reason
        bar.write(f"{arm.name}: FAILED ({reason})")
        if trace:
            run_dir = Path(arm.config.run.dir)
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "study_error.txt").write_text(trace)

    def finish(arm: Arm, trained: bool) -> None:
        try:
            ev = ensure_eval(Path(arm.config.run.dir), study.eval.split, study.eval.max_images,
                             study.eval.batch_size)
        except KeyboardInterrupt:
            raise
        except Exception as err:  # noqa: BLE001 - one arm's failure must not lose the others
            fail(arm, f"evaluation: {type(err).__name__}: {(str(err).splitlines() or [''])[0]}", traceback.format_exc())
            return
        done[arm.name] = ev
        bar.write(f"{arm.name}: {'' if trained else 'already trained; '}PSNR hard {ev['recon']['hard']['psnr']:.2f} dB, "
                  f"utilization {ev['codebook']['utilization']:.1%}, perplexity {ev['codebook']['perplexity']:.1f}")

    to_train = []
    for arm in study.arms:
        status = arm_status(arm)
        if status == "finished":
            finish(arm, trained=False)
            bar.update(1)
        elif not train_arms:
            unfinished.append(f"{arm.name} ({status})")
            bar.update(1)
        else:
            to_train.append(arm)
    if jobs <= 1:
        for arm in to_train:
            bar.set_postfix_str(arm.name)
            try:
                train(arm.config, quiet=not verbose)
            except KeyboardInterrupt:
                raise
            except Exception as err:  # noqa: BLE001
                fail(arm, f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}", traceback.format_exc())
            else:
                finish(arm, trained=True)
            bar.update(1)
    elif to_train:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = {pool.submit(_train_subprocess, arm, threads): arm for arm in to_train}
            for future in as_completed(futures):
                arm = futures[future]
                reason = future.result()
                if reason is None:
                    finish(arm, trained=True)
                else:
                    fail(arm, reason)
                bar.update(1)
    bar.close()
    finished = [a for a in study.arms if a.name in done]
    if not finished:
        raise StudyError(f"study {study.name}: no arm finished ({len(failed)} failed, {len(unfinished)} unfinished)")
    if study.seeds is None:
        rows = compare([Path(a.config.run.dir) for a in finished], study.out, study.eval.split,
                       study.eval.max_images, study.eval.batch_size, names=[a.name for a in finished],
                       grid_images=study.eval.grid_images, command=command)
        groups = None
    else:
        rows, groups = compare_seeds(study, finished, command)
    info = {"command": command, "date_start": date_start,
            "date_end": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "wall_seconds": round(time.time() - started, 1), "machine_start": machine_start,
            "machine_end": describe_machine(), "jobs": jobs, "failed": failed, "unfinished": unfinished}
    (study.out / "report.md").write_text(render_report(study, rows, info, groups))
    extra = {} if groups is None else {"seeds": study.seeds, "groups": groups}
    (study.out / "study.json").write_text(json.dumps({"study": study.name, "config": str(study.path),
                                                      "arms": [a.name for a in study.arms], **info,
                                                      "rows": rows, **extra}, indent=2) + "\n")
    return {"rows": rows, "groups": groups, **info}


def compare_seeds(study: Study, finished: List[Arm], command: Optional[str]) -> Tuple[List[Dict], List[Dict]]:
    """A study with seeds: per-run rows, one mean ± sd row per arm x sweep point, the tables
    (:func:`write_seed_tables`) and the plots (per-run plots show each arm's first finished seed)."""
    from ddcl_vq.eval.compare import evaluate_runs, write_plots

    from .aggregate import aggregate, write_seed_tables

    ev = study.eval
    rows, evals = evaluate_runs([Path(a.config.run.dir) for a in finished], ev.split, ev.max_images,
                                ev.batch_size, names=[a.name for a in finished])
    for row, arm in zip(rows, finished):
        row["group"], row["seed"] = arm.group, arm.seed
    order = {g: i for i, g in enumerate(dict.fromkeys(a.group for a in study.arms))}  # arm x sweep point order
    ranked = sorted(range(len(rows)), key=lambda i: (order[finished[i].group], study.seeds.index(finished[i].seed)))
    rows, evals, finished = [rows[i] for i in ranked], [evals[i] for i in ranked], [finished[i] for i in ranked]
    groups = aggregate(rows)
    write_seed_tables(study.out, groups, rows, evals, ev.split, ev.max_images, command)
    first = [i for i, a in enumerate(finished) if i == 0 or finished[i - 1].group != a.group]
    write_plots(study.out, [Path(finished[i].config.run.dir) for i in first], [finished[i].name for i in first],
                [evals[i] for i in first], groups, ev.split, ev.grid_images)
    return rows, groups
