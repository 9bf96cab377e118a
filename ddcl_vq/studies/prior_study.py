"""``ddcl-vq prior study --config configs/study_prior.yaml``: the same prior on several tokenizers' codes.

Does a fuller codebook make the prior's job harder, and what does that do to samples? A prior study
file has five parts:

    name, description, out            as a study file (out: the report directory)
    tokenizers: {base, eval, sweep, seeds, arms, quick}
                                      a study file's keys (see ddcl-vq study --help): the tokenizers,
                                      trained, evaluated and compared by the study code itself
                                      into OUT/tokenizers/ (reconstruction PSNR, utilization, ...)
    tokenize: {train_images, test_images, batch_size}       0 = the whole split
    prior: {base: {model: ..., train: ...}, seeds: [0, 1, 2]}
                                      one prior config (configs/prior_fashion.yaml's keys) for every
                                      tokenizer, trained once per prior seed (run.seed)
    evaluate: {samples, real, max_test, temperature, top_k, seed, classifier_steps, cache_dir}
    quick: {prior: [key=value, ...], tokenize: {...}, evaluate: {...}}   what --quick changes

For every finished tokenizer: tokenize the train and test splits (OUT/tokens/), train the prior once
per prior seed (OUT/priors/<tokenizer>_p<seed>), evaluate it (``ddcl-vq prior evaluate``), then one
table (OUT/table.md, .csv, .json: mean ± sd over the prior seeds beside the tokenizer's PSNR and
utilization; where an arm ran on several tokenizer seeds, a second table of mean ± sd over its
tokenizers, the spread of the tokenizer run) and one plot (OUT/recon_vs_generation.png).
Everything resumes: finished tokenizers, token files, priors and evaluations are reused when the
same command runs again. A study run in pieces (``--arms``, ``--prior-seeds``) writes each piece's
table; ``--report-only`` trains nothing and writes one table of every finished tokenizer and prior
(unfinished ones are named and left out).
"""
from __future__ import annotations

import json
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import yaml

from ddcl_vq.common.errors import UserError, entry_point
from ddcl_vq.common.config import ConfigError, Options, Rules, build, option
from ddcl_vq.tokenizer.testset import EVAL_BATCH_SIZE
from ddcl_vq.common.config import read_yaml_mapping

QUICK_PRIOR = ["model.dim=32", "model.layers=2", "model.heads=2", "train.batch_size=16", "train.steps=3",
               "train.warmup_steps=1", "train.log_every=1", "train.checkpoint_every=3", "train.eval_every=3",
               "train.eval_images=64"]
QUICK_TOKENIZE = {"train_images": 512, "test_images": 256}
QUICK_EVALUATE = {"samples": 50, "real": 200, "classifier_steps": 20}


@dataclass
class TokenizeSpec:
    train_images: int = 0
    test_images: int = 0
    batch_size: int = EVAL_BATCH_SIZE


@dataclass
class PriorSpec:
    base: Dict[str, Any] = field(default_factory=dict)
    seeds: List[int] = field(default_factory=lambda: [0, 1, 2])


@dataclass
class EvaluateSpec:
    samples: int = 1000
    real: int = 0
    max_test: int = 0
    temperature: float = 1.0
    top_k: int = 0
    seed: int = 0
    classifier_steps: int = 1000
    cache_dir: Optional[str] = None          # the feature classifier's cache ($DDCL_VQ_CACHE or ~/.cache/ddcl-vq)


@dataclass
class QuickSpec:
    prior: Optional[List[str]] = None
    tokenize: Dict[str, int] = field(default_factory=dict)
    evaluate: Dict[str, Any] = field(default_factory=dict)


@dataclass
class PriorStudyFile:
    name: Optional[str] = None
    description: str = ""
    out: Optional[str] = None
    tokenizers: Dict[str, Any] = field(default_factory=dict)
    tokenize: TokenizeSpec = field(default_factory=TokenizeSpec)
    prior: PriorSpec = field(default_factory=PriorSpec)
    evaluate: EvaluateSpec = field(default_factory=EvaluateSpec)
    quick: QuickSpec = field(default_factory=QuickSpec)


RULES = Rules(positive={"evaluate.samples", "evaluate.classifier_steps", "tokenize.batch_size"},
              non_negative={"tokenize.train_images", "tokenize.test_images", "evaluate.real", "evaluate.max_test",
                            "evaluate.temperature", "evaluate.top_k", "prior.seeds"})

#: the table's metrics averaged over prior seeds: (key, header, format)
METRICS = [("bits_per_token", "bits/token", ".4f"), ("bits_per_image", "bits/image", ".1f"),
           ("fd_samples", "FD samples", ".3f"), ("class_accuracy", "class acc.", ".1%")]
DEFINITIONS = """\
PSNR, utilization, perplexity = the tokenizer's (hard codes, the study's eval split; ddcl-vq study)
bits/token, bits/image        = the prior's test NLL: -log2 p(code | class, earlier codes), mean over
                                codes; x h x w per image (log2 K for a uniform prior)
FD samples                    = Fréchet distance between decoded samples and real test images in the
                                128 penultimate features of a small CNN trained here on the same
                                dataset; NOT Inception FID, not comparable to published FIDs
FD recon                      = the same for the tokenizer's reconstructions of the test tokens
                                (no prior: what the codes alone cost)
class acc.                    = the classifier's accuracy on samples drawn for each class
mean ± sd                     = over the prior seeds (sample sd); one tokenizer per row (in the
                                table over tokenizer seeds: over an arm's tokenizers)"""


class PriorStudyError(UserError, RuntimeError):
    """A prior study cannot run as asked."""


def read_prior_study(path: str | Path) -> PriorStudyFile:
    path = Path(path)
    raw = read_yaml_mapping(path, "study file")  # bounded: size, nesting, alias expansion
    try:
        spec = build(PriorStudyFile, {k: v for k, v in raw.items() if v is not None}, RULES,
                     name=lambda key: f"key {key!r}")
    except ConfigError as err:
        raise ConfigError(f"study {path.name}: {err}") from None
    if not spec.tokenizers.get("arms"):
        raise ConfigError(f"study {path.name}: expected 'tokenizers' with a non-empty 'arms' list (a study file's "
                          "keys)")
    if not spec.prior.seeds:
        raise ConfigError(f"study {path.name}: expected a non-empty list 'prior.seeds'")
    return spec


def _overrides(mapping: Dict[str, Any], prefix: str = "") -> List[str]:
    """{section: {key: value}} -> ["section.key=value", ...] (values as YAML)."""
    out = []
    for key, value in mapping.items():
        if isinstance(value, dict) and value:
            out += _overrides(value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}=" + yaml.safe_dump(value, default_flow_style=True, width=10**6)
                       .strip().removesuffix("...").strip())
    return out


def load_prior_study(path: str | Path, quick: bool = False, out: Optional[str | Path] = None,
                     arms: Sequence[str] = (), prior_seeds: Optional[Sequence[int]] = None):
    """-> (spec, tokenizer Study, prior overrides, tokenize spec, evaluate spec, prior seeds, out dir).
    Every tokenizer arm and the prior config are validated here, before anything trains."""
    from ddcl_vq.studies.config import load_study
    from ddcl_vq.prior.config import load_prior_config
    path = Path(path)
    spec = read_prior_study(path)
    name = spec.name or path.stem
    out_dir = Path(out) if out else Path(spec.out or f"reports/{name}")
    if quick and not out:
        out_dir = out_dir.with_name(out_dir.name + "_quick")
    out_dir.mkdir(parents=True, exist_ok=True)
    tok_file = out_dir / "tokenizers.yaml"
    tok_file.write_text(yaml.safe_dump({"name": f"{name}_tokenizers", **spec.tokenizers}, sort_keys=False))
    study = load_study(tok_file, quick=quick, out=out_dir / "tokenizers", only=arms)
    prior = _overrides(spec.prior.base) + (list(spec.quick.prior or QUICK_PRIOR) if quick else [])
    load_prior_config(None, prior)  # every key checked now
    tokenize = dict(vars(spec.tokenize), **((spec.quick.tokenize or QUICK_TOKENIZE) if quick else {}))
    evaluate = dict(vars(spec.evaluate), **((spec.quick.evaluate or QUICK_EVALUATE) if quick else {}))
    seeds = list(prior_seeds) if prior_seeds is not None else list(spec.prior.seeds)
    return spec, study, prior, tokenize, evaluate, seeds, out_dir


def run_prior_study(path: str | Path, quick: bool = False, out: Optional[str | Path] = None, arms: Sequence[str] = (),
                    prior_seeds: Optional[Sequence[int]] = None, progress: bool = True,
                    command: Optional[str] = None, report_only: bool = False) -> Dict:
    """Train (unless ``report_only``), evaluate and tabulate; -> {groups, runs, out, ...}."""
    from ddcl_vq.studies.run import run_study
    from ddcl_vq.tokenizer.tokenize import tokenize_run
    from ddcl_vq.prior.config import load_prior_config
    from ddcl_vq.prior.evaluation import evaluate_prior
    from ddcl_vq.prior.train import train_prior
    from ddcl_vq.prior.data import PriorData
    spec, study, prior_overrides, tok, ev, seeds, out_dir = load_prior_study(path, quick, out, arms, prior_seeds)
    started = time.time()
    say = (lambda text: print(text, file=sys.stderr, flush=True)) if progress else (lambda text: None)
    say(f"tokenizers: {len(study.arms)} run(s) -> {study.out}")
    by_name = {row["name"]: row for row in run_study(study, train_arms=not report_only, progress=progress)["rows"]}
    runs: List[Dict] = []
    left_out: List[str] = []
    for arm in study.arms:
        if arm.name not in by_name:
            say(f"{arm.name}: tokenizer did not finish; left out")
            left_out.append(arm.name)
            continue
        trow = by_name[arm.name]
        run_dir = Path(arm.config.run.dir)
        files = {split: out_dir / "tokens" / f"{arm.name}_{split}.npy" for split in ("train", "test")}
        if report_only and not all(f.is_file() for f in files.values()):
            say(f"{arm.name}: not tokenized; left out")
            left_out.append(arm.name)
            continue
        for split, limit in (("train", tok["train_images"]), ("test", tok["test_images"])):
            if not files[split].is_file():
                say(f"{arm.name}: tokenizing the {split} split")
                tokenize_run(run_dir, split, files[split], tok["batch_size"], limit)
        for seed in seeds:
            name = f"{arm.name}_p{seed}"
            prior_dir = out_dir / "priors" / name
            cfg = load_prior_config(None, prior_overrides + [
                f"data.tokenizer={run_dir}", f"data.train_tokens={files['train']}",
                f"data.test_tokens=[{json.dumps(str(files['test']))}]", f"run.dir={prior_dir}", f"run.name={name}",
                f"run.seed={seed}"])
            summary = finished_prior(cfg)  # a finished prior is read, not reopened (its summary keeps its time)
            if summary is None and report_only:
                say(f"{name}: prior not finished; left out")
                left_out.append(name)
                continue
            if summary is None:
                say(f"{name}: prior")
                summary = train_prior(cfg, PriorData, quiet=True)
            ev_path = prior_dir / "eval.json"
            evaluation = json.loads(ev_path.read_text()) if ev_path.is_file() else None
            if evaluation is None or evaluation.get("step") != summary["step"] or \
                    evaluation.get("samples", {}).get("count") != ev["samples"]:
                evaluation = evaluate_prior(prior_dir, progress=progress, **{k: ev[k] for k in (
                    "max_test", "samples", "real", "temperature", "top_k", "seed", "classifier_steps", "cache_dir")})
            runs.append(r := _row(arm, trow, seed, evaluation, summary))
            say(f"{name}: {r['bits_per_token']:.4f} bits/token, FD {_fmt(r['fd_samples'], '.3f')}, "
                f"class acc. {_fmt(r['class_accuracy'], '.1%')}")
    if not runs:
        raise PriorStudyError("no prior finished (no tokenizer finished?)")
    groups = aggregate(runs)
    seed_rows = over_tokenizer_seeds(groups)
    info = {"command": command, "wall_seconds": round(time.time() - started, 1), "quick": quick,
            "report_only": report_only, "left_out": left_out, "prior_seeds": seeds,
            "prior_overrides": prior_overrides, "tokenize": tok, "evaluate": ev}
    write_tables(out_dir, spec, groups, seed_rows, runs, info)
    write_plot(out_dir / "recon_vs_generation.png", groups)
    return {"groups": groups, "over_tokenizer_seeds": seed_rows, "runs": runs, "out": str(out_dir), **info}


def finished_prior(cfg) -> Optional[Dict]:
    """The summary of the prior in ``cfg.run.dir`` if it has trained ``cfg.train.steps`` steps with
    ``cfg``'s settings (paths, logging and device aside), else None."""
    from ddcl_vq.prior.config import RESUMABLE, differences, load_prior_config
    prior_dir = Path(cfg.run.dir)
    summary_path, config_path = prior_dir / "summary.json", prior_dir / "config.yaml"
    if not (summary_path.is_file() and config_path.is_file()):
        return None
    summary = json.loads(summary_path.read_text())
    changed = [key for key, _, _ in differences(load_prior_config(config_path), cfg)
               if key not in RESUMABLE or key == "train.steps"]
    return summary if summary.get("step", 0) >= cfg.train.steps and not changed else None


def _fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _row(arm, trow: Dict, seed: int, ev: Dict, summary: Dict) -> Dict:
    fd, ca, nll = ev.get("frechet") or {}, ev.get("class_accuracy") or {}, ev.get("nll") or {}
    return {"name": f"{arm.name}_p{seed}", "tokenizer": arm.name, "group": arm.group,
            "tokenizer_seed": arm.config.run.seed, "prior_seed": seed,
            "type": trow.get("type"), "num_codes": ev["num_codes"], "psnr": trow.get("hard_psnr"),
            "utilization": trow.get("utilization"), "perplexity": trow.get("perplexity"),
            "bits_per_token": nll.get("bits_per_token"), "bits_per_image": nll.get("bits_per_image"),
            "log2_k": ev["uniform_bits_per_token"], "fd_samples": fd.get("samples_vs_real"),
            "fd_recon": fd.get("reconstructions_vs_real"), "class_accuracy": ca.get("mean"),
            "classifier_accuracy": ca.get("classifier_on_real"), "prior_steps": summary["step"],
            "prior_seconds": summary.get("train_seconds")}


def _mean_sd_rows(rows: Sequence[Dict], by: str, metrics, head: Callable, least: int = 1) -> List[Dict]:
    """One row per value of ``by`` that at least ``least`` rows hold: ``head(value, members)``, then the mean
    and sample sd over the members (``<key>``, ``<key>_sd``) of each of ``metrics``."""
    from ddcl_vq.studies.aggregate import mean_sd
    groups: Dict[str, List[Dict]] = {}
    for r in rows:
        groups.setdefault(r[by], []).append(r)
    out = []
    for name, members in groups.items():
        if len(members) >= least:
            out.append(head(name, members))
            for key, _, _ in metrics:
                out[-1][key], out[-1][f"{key}_sd"], _ = mean_sd([m[key] for m in members])
    return out


def aggregate(runs: Sequence[Dict]) -> List[Dict]:
    """One row per tokenizer: its own figures, and mean ± sd over the prior seeds."""
    return _mean_sd_rows(runs, "tokenizer", METRICS, lambda name, members: {
        "tokenizer": name, "group": members[0].get("group", name), "tokenizer_seed": members[0].get("tokenizer_seed"),
        **{k: members[0][k] for k in ("type", "num_codes", "psnr", "utilization", "perplexity", "log2_k", "fd_recon")},
        "n": len(members), "prior_seeds": [m["prior_seed"] for m in members]})


#: what the table over tokenizer seeds averages: the tokenizer's figures, then the priors' means
SEED_METRICS = [("psnr", "PSNR (dB)", ".2f"), ("utilization", "utilization", ".1%"),
                ("perplexity", "perplexity", ".1f")] + METRICS + [("fd_recon", "FD recon", ".3f")]


def over_tokenizer_seeds(groups: Sequence[Dict]) -> List[Dict]:
    """One row per arm (``group``: the arm at one sweep point) trained on more than one tokenizer
    seed: mean ± sample sd over its tokenizers of each tokenizer's row (for the prior's figures,
    the tokenizer's mean over its prior seeds), so the spread is the tokenizer run's."""
    return _mean_sd_rows(groups, "group", SEED_METRICS, lambda name, members: {
        "arm": name, "type": members[0]["type"], "num_codes": members[0]["num_codes"], "n": len(members),
        "tokenizer_seeds": [m["tokenizer_seed"] for m in members]}, least=2)


def seeds_markdown(rows: Sequence[Dict]) -> str:
    head = ["arm", "quantizer", "K", "tokenizer seeds (n)"] + [h for _, h, _ in SEED_METRICS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        seeds = ",".join(map(str, r["tokenizer_seeds"]))
        cells = [r["arm"], str(r["type"]), str(r["num_codes"]), f"{seeds} ({r['n']})"]
        lines.append("| " + " | ".join(cells + [_pm(r, key, spec) for key, _, spec in SEED_METRICS]) + " |")
    return "\n".join(lines)


def _pm(row: Dict, key: str, spec: str) -> str:
    if row.get(key) is None:
        return "—"
    sd = row.get(f"{key}_sd")
    return f"{format(row[key], spec)} ± {'—' if sd is None else format(sd, spec)}"


def markdown(groups: Sequence[Dict]) -> str:
    head = ["tokenizer", "quantizer", "K", "PSNR (dB)", "utilization", "perplexity", "log2 K", "priors (n)"] + \
        [h for _, h, _ in METRICS] + ["FD recon"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in groups:
        cells = [g["tokenizer"], str(g["type"]), str(g["num_codes"]), _fmt(g["psnr"], ".2f"),
                 _fmt(g["utilization"], ".1%"), _fmt(g["perplexity"], ".1f"), f"{g['log2_k']:.3f}",
                 f"{','.join(map(str, g['prior_seeds']))} ({g['n']})"]
        cells += [_pm(g, key, spec) for key, _, spec in METRICS] + [_fmt(g["fd_recon"], ".3f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_tables(out: Path, spec: PriorStudyFile, groups, seed_rows, runs, info) -> None:
    from ddcl_vq.studies.compare import write_csv
    text = [f"# {spec.name or 'prior study'}", "", spec.description.strip(), ""]
    if info["quick"]:
        text += ["**--quick: a smoke test (tiny tokenizers and priors); these figures measure nothing.**", ""]
    text += [markdown(groups), ""]
    if seed_rows:
        text += ["Over tokenizer seeds (mean ± sample sd over the tokenizers of each arm; a tokenizer's "
                 "prior figures are its mean over prior seeds):", "", seeds_markdown(seed_rows), ""]
    text += ["Per prior seed:", "", "| run | bits/token | bits/image | FD samples | class acc. |",
             "|---|---|---|---|---|"]
    text += [f"| {r['name']} | {_fmt(r['bits_per_token'], '.4f')} | {_fmt(r['bits_per_image'], '.1f')} | "
             f"{_fmt(r['fd_samples'], '.3f')} | {_fmt(r['class_accuracy'], '.1%')} |" for r in runs]
    text += ["", f"Prior: {' '.join(info['prior_overrides']) or 'the built-in defaults'}; seeds {info['prior_seeds']}. "
             f"Evaluation: {info['evaluate']}. Tokens: {info['tokenize']}.",
             f"Command: `{info['command']}`" if info["command"] else ""]
    if info.get("left_out"):
        text += [f"Not finished, left out of the table: {', '.join(info['left_out'])}."]
    text += ["", "```", DEFINITIONS, "```", ""]
    (out / "table.md").write_text("\n".join(text))
    flat = [{k: (" ".join(map(str, v)) if isinstance(v, list) else v) for k, v in g.items()} for g in groups]
    write_csv(out / "table.csv", flat)
    (out / "table.json").write_text(json.dumps({"rows": groups, "over_tokenizer_seeds": seed_rows, "runs": runs,
                                                **info, "definitions": DEFINITIONS},
                                               indent=2) + "\n")


def write_plot(path: Path, groups: Sequence[Dict]) -> None:
    """Reconstruction vs generation: tokenizer PSNR against the prior's FD (left) and bits/token (right)."""
    from ddcl_vq.studies.plots import pyplot, save
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    panels = (("fd_samples", "FD of samples, classifier features (lower: better)"),
              ("bits_per_token", "prior test NLL (bits/token)"))
    markers = "osD^vP*X"
    types = list(dict.fromkeys(g["type"] for g in groups))
    ks = sorted({g["num_codes"] for g in groups})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, label) in zip(axes, panels):
        for g in groups:
            if g.get(key) is None or g.get("psnr") is None:
                continue
            ax.errorbar(g["psnr"], g[key], yerr=g.get(f"{key}_sd") or 0, fmt=markers[types.index(g["type"]) % 8],
                        color=colors[ks.index(g["num_codes"]) % len(colors)], capsize=3)
            ax.annotate(g["tokenizer"], (g["psnr"], g[key]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("tokenizer reconstruction PSNR, hard codes (dB)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], marker=markers[i % 8], linestyle="", color="gray", label=t)
               for i, t in enumerate(types)]
    handles += [plt.Line2D([], [], marker="s", linestyle="", color=colors[i % len(colors)], label=f"K = {k}")
                for i, k in enumerate(ks)]
    axes[1].legend(handles=handles, fontsize=7)
    fig.suptitle("Reconstruction vs generation (mean ± sd over prior seeds; FD is not Inception FID)")
    save(fig, path, dpi=120)


@dataclass(kw_only=True)
class StudyOptions:
    config: str = option(help="prior study YAML (configs/study_prior.yaml)")
    quick: bool = option(False, "tiny tokenizers and priors, few images (a smoke test; the figures measure nothing)")
    out: Optional[str] = option(None, "report directory", default_text="the study's 'out' ('_quick' appended with "
                                                                        "--quick)")
    arms: List[str] = option(default_factory=list, help="only the tokenizer runs matching these shell patterns "
                             "(e.g. 'ddcl_k256*')", sep=",", metavar="PATTERN,...", default_text="every tokenizer")
    prior_seeds: Optional[List[int]] = option(None, "prior seeds, replacing the study's prior.seeds", sep=",",
                                              metavar="SEED,...")
    threads: int = option(0, "torch intra-op threads (0 = torch's default)")
    report_only: bool = option(False, "train nothing: one table of every finished tokenizer and prior (with "
                               "--arms and --prior-seeds: of those); unfinished ones are named and left out")


OPTIONS = Options(StudyOptions, prog="ddcl-vq prior study", description=__doc__,
                  rules=Rules(non_negative={"threads", "prior_seeds"}))


@entry_point("ddcl-vq prior study")
def main(argv: Optional[List[str]] = None) -> int:
    opts = OPTIONS.parse(argv)
    if opts.threads:
        import torch
        torch.set_num_threads(opts.threads)
    command = shlex.join(["ddcl-vq", "prior", "study"] + list(sys.argv[2:] if argv is None else argv))
    result = run_prior_study(opts.config, opts.quick, opts.out, opts.arms, opts.prior_seeds, command=command,
                             report_only=opts.report_only)
    print(markdown(result["groups"]))
    if result["over_tokenizer_seeds"]:
        print("\nover tokenizer seeds:\n" + seeds_markdown(result["over_tokenizer_seeds"]))
    if result["left_out"]:
        print(f"\nnot finished, left out: {', '.join(result['left_out'])}")
    print(f"\nreport: {Path(result['out']) / 'table.md'}, plot: {Path(result['out']) / 'recon_vs_generation.png'}")
    return 0
