"""Studies with ``parts`` (held-out data): every part trained, evaluated and compared on its own.

  OUT/<part>/            the part as a study of its own (:func:`~.study.run_study`)
  OUT/<part>/<dataset>/  the same under the part's ``eval_overrides`` (RUN_DIR/eval_<dataset>.json)
  OUT/report.md          each part's table and headline; OUT/study.json the same as data
"""
from __future__ import annotations

import dataclasses
import time
import traceback
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ddcl_vq.common.checkpoint import write_json
from ddcl_vq.common.errors import Stopped
from ddcl_vq.studies.study import Arm, Part, Study, StudyError, claimed, failure_text, run_study, timestamp


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
    """``arm`` evaluated under the part's eval_overrides: RUN_DIR/eval_<dataset>.json, reused while current."""
    from ddcl_vq.studies.freshness import ensure_eval
    from ddcl_vq.tokenizer.evaluate import EvaluateError, eval_path, heldout_tag
    run_dir, ev = Path(arm.config.run.dir), study.eval
    tag = heldout_tag(run_dir, part.eval_overrides, ev.split)
    if tag is None:
        raise EvaluateError(f"part {part.name!r}: eval_overrides {' '.join(part.eval_overrides)} do not change the "
                            "evaluated data (expected another data.name or other photographs)")
    return ensure_eval(run_dir, ev.split, ev.max_images, ev.batch_size, made_by="study",
                       overrides=part.eval_overrides, path=eval_path(run_dir, tag=tag))


def compare_heldout(sub: Study, part: Part, finished: List[Arm], command: Optional[str], info: Dict
                    ) -> Tuple[Path, List[Dict], Optional[List[Dict]], Dict[str, str]]:
    """The part's arms compared under its eval_overrides into OUT/<part>/<dataset>/
    -> (that folder, rows, mean ± sd groups or None, failed arms)."""
    from ddcl_vq.studies.report import render_report
    from ddcl_vq.studies.tables import make_row, tabulate
    from ddcl_vq.tokenizer.evaluate import heldout_tag
    failed: Dict[str, str] = {}
    evaluated: List[Tuple[Arm, Dict]] = []
    for arm in finished:
        try:
            evaluated.append((arm, heldout_eval(arm, part, sub)))
        except (KeyboardInterrupt, Stopped):
            raise
        except Exception as err:  # noqa: BLE001 - one arm's failure must not lose the others
            failed[arm.name] = f"held-out evaluation: {failure_text(err)}"
            (Path(arm.config.run.dir) / "study_error.txt").write_text(traceback.format_exc())
    out = sub.out / heldout_tag(finished[0].config.run.dir, part.eval_overrides, sub.eval.split)
    out.mkdir(parents=True, exist_ok=True)
    if not evaluated:
        return out, [], None, failed
    arms, evals = [a for a, _ in evaluated], [e for _, e in evaluated]
    rows = [make_row(Path(a.config.run.dir), e, a.name) for a, e in evaluated]
    groups = tabulate(out, arms, rows, evals, sub.eval, sub.seeds is not None, command, part.eval_overrides)
    heading = (f"Held-out evaluation: trained on {describe_data(arms[0].config, 'train')}, evaluated on the "
               f"{describe_data(evaluated_config(arms[0], part), sub.eval.split)} {sub.eval.split} split "
               f"({' '.join(part.eval_overrides)}); the same runs on their own test split: ../report.md.")
    cross = dataclasses.replace(sub, name=f"{sub.name}_on_{out.name}", out=out,
                                description="\n\n".join(t for t in (heading, sub.description) if t))
    (out / "report.md").write_text(render_report(cross, rows, {**info, "failed": {**info["failed"], **failed}}, groups))
    return out, rows, groups, failed


def _section(title: str, link: str, rows: List[Dict], groups: Optional[List[Dict]]) -> List[str]:
    from ddcl_vq.studies.report import headline
    from ddcl_vq.studies.tables import markdown_table, mean_sd_table
    if not rows:
        return [f"### {title}", "", "No arm finished.", ""]
    table = markdown_table(rows) if groups is None else mean_sd_table(groups)
    return [f"### {title}", "", table, "", "Computed from the table:", ""] + headline(
        groups if groups is not None else rows) + ["", f"Full report, plots and per-seed table: [{link}]({link})", ""]


def _run_part(sub: Study, part: Part, command: Optional[str], run_args: Dict
              ) -> Tuple[Dict, List[str], Dict[str, str], List[str]]:
    """One part and its held-out evaluation -> (study.json entry, report lines, failed arms, unfinished arms)."""
    trained_on = describe_data(sub.arms[0].config, "train")
    tested_on = describe_data(sub.arms[0].config, sub.eval.split)
    entry: Dict = {"part": part.name, "description": part.description, "trained_on": trained_on,
                   "evaluated_on": tested_on, "out": str(sub.out)}
    try:
        result = run_study(sub, command=command, **run_args)
    except StudyError as err:
        entry["error"] = str(err)
        lines = [f"## Part `{part.name}`", "", part.description, "", f"Not compared: {err}", ""]
        return entry, lines, {}, [a.name for a in sub.arms]
    failed = dict(result["failed"])
    entry.update(rows=result["rows"], groups=result["groups"])
    lines = [f"## Part `{part.name}`", ""] + ([part.description, ""] if part.description else [])
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
                          f"held out: {' '.join(part.eval_overrides)})", f"{part.name}/{out.name}/report.md", rows,
                          groups)
    return entry, lines, failed, result["unfinished"]


def run_parts(study: Study, train_arms: bool = True, progress: bool = True, verbose: bool = False,
              command: Optional[str] = None, jobs: int = 1, threads: Optional[int] = None) -> Dict:
    """Every part of ``study`` as a study of its own, then OUT/report.md and OUT/study.json
    -> {"parts": [...], "failed", "unfinished", "summary": the report's tables as text}."""
    run_args = dict(train_arms=train_arms, progress=progress, verbose=verbose, jobs=jobs, threads=threads)
    with claimed(study, [part_study(study, part) for part in study.parts]):  # OUT and every part's folder
        started, date_start = time.time(), timestamp()
        failed, unfinished, parts, lines = {}, [], [], []  # failed: arm -> why; parts: one entry per part
        for part in study.parts:
            sub = part_study(study, part)
            if sub.arms:  # else --arms selected none of this part
                entry, more, bad, left = _run_part(sub, part, command, run_args)
                parts.append(entry)
                lines, unfinished = lines + more, unfinished + left
                failed.update(bad)
        if not parts:
            raise StudyError(f"study {study.name}: no part has an arm to run")
        date_end = timestamp()
        head = [f"# Study: {study.name}", ""] + ([study.description, ""] if study.description else []) + [
            f"- Command: `{command}`", f"- Config: `{study.path}`" + (
                " with `--quick` (tiny model and budget: a smoke test, not a result)" if study.quick else ""),
            f"- Date: {date_start} → {date_end} ({(time.time() - started) / 60:.1f} min for this invocation)",
            "- One table per part and per evaluation data: numbers measured on different data never share a table. "
            "Each part's folder holds its full report (budget, machine, per-seed table, plots, definitions).", ""]
        if failed or unfinished:
            head += ["**Not in the tables:**", ""] + [f"- {n}: failed — {why}" for n, why in failed.items()]
            head += [f"- {n}: not finished" for n in unfinished] + [""]
        (study.out / "report.md").write_text("\n".join(head + lines) + "\n")
        write_json(study.out / "study.json", {
            "study": study.name, "config": str(study.path), "command": command, "date_start": date_start,
            "date_end": date_end, "arms": [a.name for a in study.arms], "failed": failed, "unfinished": unfinished,
            "seeds": study.seeds, "parts": parts})
    return {"parts": parts, "failed": failed, "unfinished": unfinished, "summary": "\n".join(lines)}
