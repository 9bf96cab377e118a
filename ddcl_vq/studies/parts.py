"""Studies with ``parts`` (held-out data): every part trained, evaluated and compared on its own.

A part is a setting of the data applied to every arm (e.g. train on two photographs, test on a
third; or train on Fashion-MNIST) and, optionally, ``eval_overrides``: data.* overrides under
which every arm of the part is also evaluated (e.g. ``data.name=digits``: a codebook trained on
one dataset measured on another). Numbers measured on different data never share a table:

  OUT/<part>/            the part as a study of its own (:func:`~.run.run_study`): report.md, tables,
                         plots, the arms on the part's own test split
  OUT/<part>/<dataset>/  with eval_overrides: the same for that evaluation (each run's result is
                         kept in RUN_DIR/eval_<dataset>.json, reused while it matches the checkpoint)
  OUT/report.md          each part's table and headline in turn, headed by what it was trained
                         and evaluated on; OUT/study.json the same as data
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import time
import traceback
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ddcl_vq.studies.config import Arm, Part, Study


def part_study(study: Study, part: Part) -> Study:
    """The arms of ``part`` as a study of their own, reporting into OUT/<part>/."""
    description = "\n\n".join(text for text in (part.description, study.description) if text)
    return dataclasses.replace(study, name=f"{study.name}_{part.name}", description=description,
                               out=study.out / part.name, arms=[a for a in study.arms if a.part == part.name], parts=[])


def describe_data(cfg, split: str = "test") -> str:
    """What a config's ``split`` holds: the dataset's name, natural_patches with its photographs."""
    data = cfg.data
    if data.name == "natural_patches":
        return f"natural_patches ({', '.join(data.train_photos if split == 'train' else data.test_photos)})"
    return data.name


def evaluated_config(arm: Arm, part: Part):
    """The arm's config as its held-out evaluation reads it (the part's eval_overrides applied)."""
    from ddcl_vq.tokenizer.config import Config, apply_overrides
    return Config.from_dict(apply_overrides(arm.config.to_dict(), part.eval_overrides), saved=True)


def heldout_eval(arm: Arm, part: Part, study: Study) -> Dict:
    """``arm`` evaluated under the part's eval_overrides: RUN_DIR/eval_<dataset>.json, reused when it was made from the
    run's current checkpoint as asked, else made now and written there (the run's own eval.json is never touched)."""
    from ddcl_vq.tokenizer.evaluate import EvaluateError, eval_path, evaluate_run, heldout_tag, write_eval
    from ddcl_vq.studies.freshness import current_checkpoint, is_fresh, read_eval
    run_dir, ev = Path(arm.config.run.dir), study.eval
    tag = heldout_tag(run_dir, part.eval_overrides, ev.split)
    if tag is None:
        raise EvaluateError(f"part {part.name!r}: eval_overrides {' '.join(part.eval_overrides)} do not change the "
                            "evaluated data (expected another data.name or other photographs)")
    path = eval_path(run_dir, tag=tag)
    found = read_eval(path)
    if is_fresh(found, current_checkpoint(run_dir), ev.split, ev.max_images, part.eval_overrides):
        return found
    result = evaluate_run(run_dir, ev.split, ev.max_images, ev.batch_size, overrides=part.eval_overrides,
                          write=False, made_by="study",
                          command=f"ddcl-vq study (held-out evaluation of {run_dir}: --split {ev.split} --max-images "
                                  f"{ev.max_images} --batch-size {ev.batch_size} {' '.join(part.eval_overrides)})")
    write_eval(run_dir, result, path)
    return result


def compare_heldout(sub: Study, part: Part, finished: List[Arm], command: Optional[str], info: Dict
                    ) -> Tuple[Path, List[Dict], Optional[List[Dict]], Dict[str, str]]:
    """The part's arms evaluated under its eval_overrides, compared into OUT/<part>/<dataset>/
    (tables, plots, report.md). -> (that folder, rows, mean ± sd groups or None, failed arms)."""
    from ddcl_vq.studies.compare import make_row, write_plots, write_tables
    from ddcl_vq.tokenizer.evaluate import heldout_tag
    from ddcl_vq.studies.aggregate import aggregate, write_seed_tables
    from ddcl_vq.studies.report import render_report
    failed: Dict[str, str] = {}
    evaluated: List[Tuple[Arm, Dict]] = []
    for arm in finished:
        try:
            evaluated.append((arm, heldout_eval(arm, part, sub)))
        except KeyboardInterrupt:
            raise
        except Exception as err:  # noqa: BLE001 - one arm's failure must not lose the others
            failed[arm.name] = f"held-out evaluation: {type(err).__name__}: {(str(err).splitlines() or [''])[0]}"
            (Path(arm.config.run.dir) / "study_error.txt").write_text(traceback.format_exc())
    tag = heldout_tag(finished[0].config.run.dir, part.eval_overrides, sub.eval.split)
    out = sub.out / tag
    out.mkdir(parents=True, exist_ok=True)
    if not evaluated:
        return out, [], None, failed
    arms, evals = [a for a, _ in evaluated], [e for _, e in evaluated]
    rows = [make_row(Path(a.config.run.dir), e, a.name) for a, e in evaluated]
    ev, groups = sub.eval, None
    if sub.seeds is not None:
        for row, arm in zip(rows, arms):
            row["group"], row["seed"] = arm.group, arm.seed
        groups = aggregate(rows)
        write_seed_tables(out, groups, rows, evals, ev.split, ev.max_images, command)
        first = [i for i, a in enumerate(arms) if i == 0 or arms[i - 1].group != a.group]
        write_plots(out, [Path(arms[i].config.run.dir) for i in first], [arms[i].name for i in first],
                    [evals[i] for i in first], groups, ev.split, ev.grid_images, part.eval_overrides)
    else:
        write_tables(out, rows, evals, ev.split, ev.max_images, command)
        write_plots(out, [Path(a.config.run.dir) for a in arms], [a.name for a in arms], evals, rows, ev.split,
                    ev.grid_images, part.eval_overrides)
    trained_on = describe_data(arms[0].config, "train")
    evaluated_on = describe_data(evaluated_config(arms[0], part), ev.split)
    heading = (f"Held-out evaluation: trained on {trained_on}, evaluated on the {evaluated_on} {ev.split} split "
               f"({' '.join(part.eval_overrides)}); the same runs on their own test split: ../report.md.")
    cross = dataclasses.replace(sub, name=f"{sub.name}_on_{tag}", out=out,
                                description="\n\n".join(t for t in (heading, sub.description) if t))
    (out / "report.md").write_text(render_report(cross, rows, {**info, "failed": {**info["failed"], **failed}}, groups))
    return out, rows, groups, failed


def _section(title: str, link: str, rows: List[Dict], groups: Optional[List[Dict]]) -> List[str]:
    from ddcl_vq.studies.compare import markdown_table
    from ddcl_vq.studies.aggregate import mean_sd_table
    from ddcl_vq.studies.report import headline
    if not rows:
        return [f"### {title}", "", "No arm finished.", ""]
    table = markdown_table(rows) if groups is None else mean_sd_table(groups)
    return [f"### {title}", "", table, "", "Computed from the table:", ""]\
        + headline(groups if groups is not None else rows) + ["", f"Full report, plots and per-seed table: [{link}]({link})", ""]


def run_parts(study: Study, train_arms: bool = True, progress: bool = True, verbose: bool = False,
              command: Optional[str] = None, jobs: int = 1, threads: Optional[int] = None) -> Dict:
    """Every part of ``study`` as a study of its own (:func:`part_study`, :func:`~.run.run_study`), its
    held-out evaluation (:func:`compare_heldout`), then OUT/report.md and OUT/study.json.
    -> {"parts": [...], "failed", "unfinished", "summary": the report's tables as text}."""
    from ddcl_vq.studies.run import StudyError, check_out, check_run_dir, claim_out, run_study
    check_out(study)  # before anything trains: OUT and every part's folder
    for part in study.parts:
        check_out(part_study(study, part))
    for arm in study.arms:
        check_run_dir(arm)
    started, date_start = time.time(), _dt.datetime.now().astimezone().isoformat(timespec="seconds")
    claim_out(study)
    failed, unfinished, parts, lines = {}, [], [], []  # failed: arm -> why; parts: one entry per part
    for part in study.parts:
        sub = part_study(study, part)
        if not sub.arms:
            continue  # --arms selected none of this part
        trained_on = describe_data(sub.arms[0].config, "train")
        tested_on = describe_data(sub.arms[0].config, sub.eval.split)
        entry: Dict = {"part": part.name, "description": part.description, "trained_on": trained_on,
                       "evaluated_on": tested_on, "out": str(sub.out)}
        try:
            result = run_study(sub, train_arms, progress, verbose, command, jobs, threads)
        except StudyError as err:
            entry["error"] = str(err)
            parts.append(entry)
            lines += [f"## Part `{part.name}`", "", part.description, "", f"Not compared: {err}", ""]
            unfinished += [a.name for a in sub.arms]
            continue
        failed.update(result["failed"])
        unfinished += result["unfinished"]
        entry.update(rows=result["rows"], groups=result["groups"])
        lines += [f"## Part `{part.name}`", ""] + ([part.description, ""] if part.description else [])
        lines += _section(f"Trained on {trained_on}, evaluated on {tested_on} ({sub.eval.split} split)",
                          f"{part.name}/report.md", result["rows"], result["groups"])
        if part.eval_overrides:
            names = {r["name"] for r in result["rows"]}
            finished = [a for a in sub.arms if a.name in names]
            out, rows, groups, bad = compare_heldout(sub, part, finished, command, result)
            failed.update(bad)
            evaluated_on = describe_data(evaluated_config(finished[0], part), sub.eval.split)
            entry["heldout"] = {"evaluated_on": evaluated_on, "eval_overrides": part.eval_overrides,
                                "out": str(out), "rows": rows, "groups": groups}
            lines += _section(f"Trained on {trained_on}, evaluated on {evaluated_on} ({sub.eval.split} split; "
                              f"held out: {' '.join(part.eval_overrides)})",
                              f"{part.name}/{out.name}/report.md", rows, groups)
        parts.append(entry)
    if not parts:
        raise StudyError(f"study {study.name}: no part has an arm to run")
    date_end = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
    head = [f"# Study: {study.name}", ""] + ([study.description, ""] if study.description else []) + [
        f"- Command: `{command}`", f"- Config: `{study.path}`" + (" with `--quick` (tiny model and budget: a smoke "
                                                                   "test, not a result)" if study.quick else ""),
        f"- Date: {date_start} → {date_end} ({(time.time() - started) / 60:.1f} min for this invocation)",
        "- One table per part and per evaluation data: numbers measured on different data never share a table. "
        "Each part's folder holds its full report (budget, machine, per-seed table, plots, definitions).", ""]
    if failed or unfinished:
        head += ["**Not in the tables:**", ""] + [f"- {n}: failed — {why}" for n, why in failed.items()]
        head += [f"- {n}: not finished" for n in unfinished] + [""]
    (study.out / "report.md").write_text("\n".join(head + lines) + "\n")
    (study.out / "study.json").write_text(json.dumps(
        {"study": study.name, "config": str(study.path), "command": command, "date_start": date_start,
         "date_end": date_end, "arms": [a.name for a in study.arms], "failed": failed, "unfinished": unfinished,
         "seeds": study.seeds, "parts": parts}, indent=2) + "\n")
    return {"parts": parts, "failed": failed, "unfinished": unfinished, "summary": "\n".join(lines)}
