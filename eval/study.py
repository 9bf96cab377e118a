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

import argparse
import datetime as _dt
import itertools
import json
import os
import platform
import re
import shlex
import sys
import time
import traceback
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


class StudyError(RuntimeError):
    """A study cannot run as asked (a run directory with another config, no arm finished, ...)."""


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


# --------------------------------------------------------------------------- running arms

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


def machine_description() -> str:
    import torch
    from ddcl_vq.eval.machine import cpu_model
    cpu = cpu_model()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{os.cpu_count()} CPU cores ({cpu}), {gpu}; torch {torch.__version__} with "
            f"{torch.get_num_threads()} intra-op thread(s); Python {platform.python_version()}; "
            f"load average (1/5/15 min) {load}")


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

    from .compare import compare, ensure_eval

    for arm in study.arms:  # before anything trains
        check_run_dir(arm)
    study.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    machine_start = machine_description()
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
            ev = ensure_eval(Path(arm.config.run.dir), study.eval["split"], study.eval["max_images"],
                             study.eval["batch_size"])
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
    rows = compare([Path(a.config.run.dir) for a in finished], study.out, study.eval["split"],
                   study.eval["max_images"], study.eval["batch_size"], names=[a.name for a in finished],
                   grid_images=study.eval["grid_images"], command=command)
    info = {"command": command, "date_start": date_start,
            "date_end": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "wall_seconds": round(time.time() - started, 1), "machine_start": machine_start,
            "machine_end": machine_description(), "jobs": jobs, "failed": failed, "unfinished": unfinished}
    (study.out / "report.md").write_text(render_report(study, rows, info))
    (study.out / "study.json").write_text(json.dumps({"study": study.name, "config": str(study.path),
                                                      "arms": [a.name for a in study.arms], **info,
                                                      "rows": rows}, indent=2) + "\n")
    return {"rows": rows, **info}


# --------------------------------------------------------------------------- report

def headline(rows: Sequence[Dict]) -> List[str]:
    """Computed, not written: per K, the best hard-code PSNR among baselines and among DDCL arms,
    and which DDCL arms reach 100% utilization."""
    lines = []
    for k in sorted({r["num_codes"] for r in rows}):
        at_k = [r for r in rows if r["num_codes"] == k]
        base = [r for r in at_k if r["type"] != "ddcl"]
        ddcl = [r for r in at_k if r["type"] == "ddcl"]
        parts = []
        b = max(base, key=lambda r: r["hard_psnr"]) if base else None
        if b:
            parts.append(f"best baseline {b['name']} {b['hard_psnr']:.2f} dB at {b['utilization']:.1%} utilization")
        if ddcl:
            d = max(ddcl, key=lambda r: r["hard_psnr"])
            text = f"best DDCL {d['name']} {d['hard_psnr']:.2f} dB at {d['utilization']:.1%} utilization ({d['dead_codes']} dead)"
            if b:
                text += f", {d['hard_psnr'] - b['hard_psnr']:+.2f} dB vs the best baseline"
            parts.append(text)
            u = max(ddcl, key=lambda r: (r["utilization"], r["hard_psnr"]))
            parts.append(f"highest DDCL utilization {u['name']} {u['utilization']:.1%} ({u['hard_psnr']:.2f} dB)")
            full = [r["name"] for r in ddcl if r["dead_codes"] == 0]
            parts.append(f"DDCL arms with 0 dead codes: {', '.join(full) if full else 'none'}")
        lines.append(f"- K = {k}: " + "; ".join(parts) + ".")
    return lines


def render_report(study: Study, rows: Sequence[Dict], info: Dict) -> str:
    from .compare import COLUMN_DEFINITIONS, markdown_table
    from .metrics import definitions

    b = study.arms[0].config
    budget = (f"{b.data.name}, {b.data.image_size}×{b.data.image_size}, batch {b.data.batch_size}; encoder/decoder "
              f"{b.model.channels} channels, {b.model.num_res_blocks} residual blocks, {b.model.num_downsamples} "
              f"downsamplings, D = {b.model.latent_dim}; {b.train.steps} steps, lr {b.train.lr:g} "
              f"({b.train.lr_schedule}), seed {b.run.seed}")
    ev = study.eval
    stamps = sorted(Path(r["run"], "checkpoints", "last.pt").stat().st_mtime for r in rows
                    if Path(r["run"], "checkpoints", "last.pt").is_file())
    when = (lambda t: _dt.datetime.fromtimestamp(t).astimezone().isoformat(timespec="seconds"))
    trained = (f"final checkpoints of the arms in the table written between {when(stamps[0])} and {when(stamps[-1])}"
               if stamps else "no checkpoint found")
    lines = [f"# Study: {study.name}", ""]
    if study.description:
        lines += [study.description, ""]
    lines += [f"- Command: `{info['command']}`",
              f"- Config: `{study.path}`" + (" with `--quick` (tiny model and budget: a smoke test, not a result)"
                                             if study.quick else ""),
              f"- Date: this report {info['date_start']} → {info['date_end']} ({info['wall_seconds'] / 60:.1f} min "
              f"for this invocation; finished arms are not retrained); {trained}",
              f"- Machine at start: {info['machine_start']}",
              f"- Machine at end: {info['machine_end']}",
              f"- Shared budget (every arm): {budget}",
              f"- Evaluation: {ev['split']} split, "
              f"{'all' if not ev['max_images'] else 'first ' + str(ev['max_images'])} images, hard codes "
              "(soft codes too for DDCL)",
              f"- Arms: {len(study.arms)} declared, {len(rows)} in the table"
              + (f", {len(info['failed'])} failed" if info["failed"] else "")
              + (f", {len(info['unfinished'])} not finished" if info["unfinished"] else ""), ""]
    if info["failed"] or info["unfinished"]:
        lines += ["**Not in the table:**", ""]
        lines += [f"- {name}: failed — {why} (traceback in its run directory, study_error.txt)"
                  for name, why in info["failed"].items()]
        lines += [f"- {name}: training not finished" for name in info["unfinished"]]
        lines.append("")
    lines += ["## Results", "", markdown_table(rows), "", "Computed from the table:", ""] + headline(rows)
    lines += ["", "## Plots", "", "![sorted code usage](usage_histograms.png)", "",
              "![usage during training](usage_over_training.png)", "",
              "![PSNR vs utilization](psnr_vs_utilization.png)", "",
              "![reconstructions](reconstructions.png)", "", "## Arms", ""]
    for arm in study.arms:
        lines.append(f"- `{arm.name}`: " + " ".join(f"`{o}`" for o in arm.overrides))
    lines += ["", f"Run directories: `{study.out / 'runs'}/<arm>` (config.yaml, checkpoints, metrics.jsonl, "
              "eval.json, TensorBoard events).", "", "## Definitions", "", "```", COLUMN_DEFINITIONS, "",
              definitions(), "```", ""]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="ddcl-vq study", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="study YAML (configs/study_*.yaml)")
    parser.add_argument("--quick", action="store_true", help="tiny model, a few steps, few eval images (smoke test)")
    parser.add_argument("--out", default=None, help="report directory (default: the study's 'out', "
                                                     "or reports/<name>; '_quick' appended with --quick)")
    parser.add_argument("--report-only", action="store_true",
                        help="train nothing: evaluate and report the arms whose training has finished")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (0 = torch's default; 1 is fastest on a loaded machine)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="arms trained at once, each in its own process (default 1: in this process)")
    parser.add_argument("--verbose", action="store_true", help="show each arm's training progress (--jobs 1)")
    parser.add_argument("--list", action="store_true", help="print the arms and their status, then exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides for every arm")
    args = parser.parse_intermixed_args(argv)

    from ddcl_vq.train.checkpoint import CheckpointError
    from ddcl_vq.train.config import ConfigError
    from ddcl_vq.train.data import DataUnavailable

    from .evaluate import EvaluateError

    command = shlex.join(["ddcl-vq", "study"] + list(sys.argv[1:] if argv is None else argv))
    if args.threads < 0 or args.jobs < 1:
        print(f"ddcl-vq study: error: expected --threads >= 0 and --jobs >= 1, got {args.threads} and {args.jobs}",
              file=sys.stderr)
        return 2
    try:
        study = load_study(args.config, quick=args.quick, out=args.out, overrides=args.overrides)
        if args.list:
            for arm in study.arms:
                print(f"{arm.name:40s} {arm_status(arm):28s} {' '.join(arm.overrides)}")
            return 0
        if args.threads:
            import torch
            torch.set_num_threads(args.threads)
        result = run_study(study, train_arms=not args.report_only, progress=True, verbose=args.verbose,
                           command=command, jobs=args.jobs, threads=args.threads)
    except (ConfigError, StudyError, EvaluateError, CheckpointError, DataUnavailable) as err:
        print(f"ddcl-vq study: error: {err}", file=sys.stderr)
        return 2
    from .compare import markdown_table
    print(markdown_table(result["rows"]))
    print(f"\nreport: {study.out / 'report.md'}")
    if result["failed"] or result["unfinished"]:
        print(f"not in the table: {', '.join(list(result['failed']) + result['unfinished'])}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
