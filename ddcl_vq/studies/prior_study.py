"""``ddcl-vq prior study --config configs/study_prior.yaml``: the same prior on several tokenizers' codes.

A prior study file:

    name, description, out            as a study file (out: the report directory)
    tokenizers: {base, eval, sweep, seeds, arms, quick}     a study file (ddcl-vq study --help), run as a
                                      study into OUT/tokenizers/ (reconstruction PSNR, utilization, ...)
    tokenize: {train_images, test_images, batch_size}       0 = the whole split
    prior: {base: {model: ..., train: ...}, seeds: [0, 1, 2]}   one prior config (configs/prior_fashion.yaml's
                                      keys) for every tokenizer, trained once per prior seed (run.seed)
    evaluate: {samples, real, max_test, temperature, top_k, seed, classifier_steps, cache_dir}
    quick: {prior: [key=value, ...], tokenize: {...}, evaluate: {...}}   what --quick changes

For every finished tokenizer: its tokens (OUT/tokens/), a prior per prior seed (OUT/priors/<tokenizer>_p<seed>) and
its evaluation; then OUT/table.md, .csv, .json (mean ± sd over the prior seeds, and over an arm's tokenizer seeds) and
OUT/recon_vs_generation.png. Everything finished is reused when the same command runs again.
"""
from __future__ import annotations

import json
import shlex
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from ddcl_vq.common.checkpoint import write_json
from ddcl_vq.common.config import ConfigError, Options, Rules, build, option, read_yaml_mapping
from ddcl_vq.common.errors import UserError, entry_point
from ddcl_vq.common.progress import fmt
from ddcl_vq.tokenizer.evaluate import EVAL_BATCH_SIZE
from ddcl_vq.prior.cli import SamplingOptions

from ddcl_vq.studies.study import OutLock, StudySignals, as_overrides, load_study, parse_study
from ddcl_vq.studies.tables import aggregate, markdown_table, pm_columns, seeds_cell, write_csv

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
class QuickSpec:
    prior: Optional[List[str]] = None
    tokenize: Dict[str, int] = field(default_factory=dict)
    evaluate: Dict[str, Any] = field(default_factory=dict)


@dataclass
class PriorStudyFile:
    name: Optional[str] = None
    description: str = ""
    out: Optional[str] = None
    tokenizers: Dict[str, Any] = field(default_factory=dict)   # a study file (parse_study)
    tokenize: TokenizeSpec = field(default_factory=TokenizeSpec)
    prior: PriorSpec = field(default_factory=PriorSpec)
    evaluate: SamplingOptions = field(default_factory=SamplingOptions)
    quick: QuickSpec = field(default_factory=QuickSpec)


RULES = Rules(positive={"evaluate.samples", "evaluate.classifier_steps", "tokenize.batch_size"},
              non_negative={"tokenize.train_images", "tokenize.test_images", "evaluate.real", "evaluate.max_test",
                            "evaluate.temperature", "evaluate.top_k", "prior.seeds"}, seeds={"prior.seeds"})

#: the table's metrics averaged over prior seeds: (key, header, format)
METRICS = [("bits_per_token", "bits/token", ".4f"), ("bits_per_image", "bits/image", ".1f"),
           ("fd_samples", "FD samples", ".3f"), ("class_accuracy", "class acc.", ".1%")]
#: a tokenizer's own figures, the same for each of its priors
TOKENIZER = ("group", "tokenizer_seed", "type", "num_codes", "psnr", "utilization", "perplexity", "log2_k", "fd_recon")
#: what the table over tokenizer seeds averages: the tokenizer's figures, then the priors' means
SEED_METRICS = [("psnr", "PSNR (dB)", ".2f"), ("utilization", "utilization", ".1%"),
                ("perplexity", "perplexity", ".1f")] + METRICS + [("fd_recon", "FD recon", ".3f")]
COLUMNS = [("name", "tokenizer", "s"), ("type", "quantizer", "s"), ("num_codes", "K", "d"),
           ("psnr", "PSNR (dB)", ".2f"), ("utilization", "utilization", ".1%"), ("perplexity", "perplexity", ".1f"),
           ("log2_k", "log2 K", ".3f"),
           ("seeds", "priors (n)", seeds_cell)] + pm_columns(METRICS) + [("fd_recon", "FD recon", ".3f")]
SEED_COLUMNS = [("name", "arm", "s"), ("type", "quantizer", "s"), ("num_codes", "K", "d"),
                ("seeds", "tokenizer seeds (n)", seeds_cell)] + pm_columns(SEED_METRICS)
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
    """The prior study YAML at ``path``, type-checked, its ``tokenizers`` as a study file."""
    path = Path(path)
    raw = read_yaml_mapping(path, "study file")  # bounded: size, nesting, alias expansion
    try:
        spec = build(PriorStudyFile, {k: v for k, v in raw.items() if v is not None}, RULES,
                     name=lambda key: f"key {key!r}")
    except ConfigError as err:
        raise ConfigError(f"study {path.name}: {err}") from None
    spec.tokenizers = parse_study(spec.tokenizers, f"study {path.name}: 'tokenizers'")
    if not spec.prior.seeds:
        raise ConfigError(f"study {path.name}: expected a non-empty list 'prior.seeds'")
    return spec


def _dotted(mapping: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """{section: {key: value}} -> {"section.key": value}."""
    out: Dict[str, Any] = {}
    for key, value in mapping.items():
        out.update(_dotted(value, f"{prefix}{key}.") if isinstance(value, dict) and value else {prefix + key: value})
    return out


def load_prior_study(path: str | Path, quick: bool = False, out: Optional[str | Path] = None,
                     arms: Sequence[str] = (), prior_seeds: Optional[Sequence[int]] = None):
    """-> (spec, tokenizer Study, prior overrides, tokenize spec, evaluate spec, prior seeds, out dir), all checked."""
    from ddcl_vq.prior.train import load_prior_config
    path = Path(path)
    spec = read_prior_study(path)
    name = spec.name or path.stem
    out_dir = Path(out) if out else Path(spec.out or f"reports/{name}")
    if quick and not out:
        out_dir = out_dir.with_name(out_dir.name + "_quick")
    study = load_study(path, quick=quick, out=out_dir / "tokenizers", only=arms, spec=spec.tokenizers,
                       name=f"{name}_tokenizers")
    prior = as_overrides(_dotted(spec.prior.base), f"study {path.name}: 'prior.base'")
    prior += list(spec.quick.prior or QUICK_PRIOR) if quick else []
    load_prior_config(None, prior)  # every key checked now
    tokenize = dict(vars(spec.tokenize), **((spec.quick.tokenize or QUICK_TOKENIZE) if quick else {}))
    evaluate = dict(vars(spec.evaluate), **((spec.quick.evaluate or QUICK_EVALUATE) if quick else {}))
    seeds = list(prior_seeds) if prior_seeds is not None else list(spec.prior.seeds)
    return spec, study, prior, tokenize, evaluate, seeds, out_dir


def _tokens(arm, out_dir: Path, tok: Dict, report_only: bool, say) -> Optional[Dict[str, Path]]:
    """The tokenizer's train and test token files (made now when missing; None with ``report_only``)."""
    from ddcl_vq.tokenizer.tokens import tokenize_run
    files = {split: out_dir / "tokens" / f"{arm.name}_{split}.npy" for split in ("train", "test")}
    if report_only and not all(f.is_file() for f in files.values()):
        return None
    for split, limit in (("train", tok["train_images"]), ("test", tok["test_images"])):
        if not files[split].is_file():
            say(f"{arm.name}: tokenizing the {split} split")
            tokenize_run(Path(arm.config.run.dir), split, files[split], tok["batch_size"], limit)
    return files


def _prior_run(arm, trow: Dict, seed: int, files: Dict[str, Path], overrides: List[str], out_dir: Path, ev: Dict,
               report_only: bool, progress: bool) -> Optional[Dict]:
    """The prior of seed ``seed`` on ``arm``'s tokens, trained and evaluated as needed, as a table row (None when
    it is not finished and ``report_only``)."""
    from ddcl_vq.prior.data import PriorData
    from ddcl_vq.prior.evaluation import evaluate_prior
    from ddcl_vq.prior.train import load_prior_config, train_prior
    name = f"{arm.name}_p{seed}"
    prior_dir = out_dir / "priors" / name
    cfg = load_prior_config(None, overrides + [
        f"data.tokenizer={arm.config.run.dir}", f"data.train_tokens={files['train']}",
        f"data.test_tokens=[{json.dumps(str(files['test']))}]", f"run.dir={prior_dir}", f"run.name={name}",
        f"run.seed={seed}"])
    summary = finished_prior(cfg)  # a finished prior is read, not reopened (its summary keeps its time)
    if summary is None and report_only:
        return None
    if summary is None:
        if progress:
            print(f"{name}: prior", file=sys.stderr, flush=True)
        summary = train_prior(cfg, PriorData, quiet=True)
    ev_path = prior_dir / "eval.json"
    found = json.loads(ev_path.read_text()) if ev_path.is_file() else None
    if found is None or found.get("step") != summary["step"] or found.get("samples", {}).get("count") != ev["samples"]:
        found = evaluate_prior(prior_dir, progress=progress, **{f.name: ev[f.name] for f in fields(SamplingOptions)})
    fd, ca, nll = found.get("frechet") or {}, found.get("class_accuracy") or {}, found.get("nll") or {}
    return {"name": name, "tokenizer": arm.name, "group": arm.group, "tokenizer_seed": arm.config.run.seed,
            "prior_seed": seed, "type": trow.get("type"), "num_codes": found["num_codes"],
            "psnr": trow.get("hard_psnr"), "utilization": trow.get("utilization"), "perplexity": trow.get("perplexity"),
            "bits_per_token": nll.get("bits_per_token"), "bits_per_image": nll.get("bits_per_image"),
            "log2_k": found["uniform_bits_per_token"], "fd_samples": fd.get("samples_vs_real"),
            "fd_recon": fd.get("reconstructions_vs_real"), "class_accuracy": ca.get("mean"),
            "classifier_accuracy": ca.get("classifier_on_real"), "prior_steps": summary["step"],
            "prior_seconds": summary.get("train_seconds")}


def run_prior_study(path: str | Path, quick: bool = False, out: Optional[str | Path] = None, arms: Sequence[str] = (),
                    prior_seeds: Optional[Sequence[int]] = None, progress: bool = True,
                    command: Optional[str] = None, report_only: bool = False) -> Dict:
    """Train (unless ``report_only``), evaluate and tabulate; -> {groups, runs, out, ...}."""
    from ddcl_vq.studies.study import run_study
    spec, study, prior_overrides, tok, ev, seeds, out_dir = load_prior_study(path, quick, out, arms, prior_seeds)
    started = time.time()
    say = (lambda text: print(text, file=sys.stderr, flush=True)) if progress else (lambda text: None)
    with OutLock(out_dir, "prior study"), StudySignals():
        say(f"tokenizers: {len(study.arms)} run(s) -> {study.out}")
        by_name = {r["name"]: r for r in run_study(study, train_arms=not report_only, progress=progress)["rows"]}
        runs: List[Dict] = []
        left_out: List[str] = []
        for arm in study.arms:
            files = _tokens(arm, out_dir, tok, report_only, say) if arm.name in by_name else None
            if files is None:
                say(f"{arm.name}: tokenizer not finished or not tokenized; left out")
                left_out.append(arm.name)
                continue
            for seed in seeds:
                row = _prior_run(arm, by_name[arm.name], seed, files, prior_overrides, out_dir, ev, report_only,
                                 progress)
                if row is None:
                    say(f"{arm.name}_p{seed}: prior not finished; left out")
                    left_out.append(f"{arm.name}_p{seed}")
                    continue
                runs.append(row)
                say(f"{row['name']}: {fmt(row['bits_per_token'], '.4f')} bits/token, FD "
                    f"{fmt(row['fd_samples'], '.3f')}, class acc. {fmt(row['class_accuracy'], '.1%')}")
        if not runs:
            raise PriorStudyError("no prior finished (no tokenizer finished?)")
        groups = aggregate_priors(runs)
        seed_rows = over_tokenizer_seeds(groups)
        info = {"command": command, "wall_seconds": round(time.time() - started, 1), "quick": quick,
                "report_only": report_only, "left_out": left_out, "prior_seeds": seeds,
                "prior_overrides": prior_overrides, "tokenize": tok, "evaluate": ev}
        write_prior_tables(out_dir, spec, groups, seed_rows, runs, info)
        write_plot(out_dir / "recon_vs_generation.png", groups)
    return {"groups": groups, "over_tokenizer_seeds": seed_rows, "runs": runs, "out": str(out_dir), **info}


def finished_prior(cfg) -> Optional[Dict]:
    """The summary of the prior in ``cfg.run.dir`` if it finished with ``cfg``'s settings, else None."""
    from ddcl_vq.prior.train import RESUMABLE, differences, load_prior_config
    prior_dir = Path(cfg.run.dir)
    summary_path, config_path = prior_dir / "summary.json", prior_dir / "config.yaml"
    if not (summary_path.is_file() and config_path.is_file()):
        return None
    summary = json.loads(summary_path.read_text())
    changed = [key for key, _, _ in differences(load_prior_config(config_path), cfg)
               if key not in RESUMABLE or key == "train.steps"]
    return summary if summary.get("step", 0) >= cfg.train.steps and not changed else None


def aggregate_priors(runs: Sequence[Dict]) -> List[Dict]:
    """One row per tokenizer (``name``): its own figures, and mean ± sd over its priors (``seeds``: their seeds)."""
    return aggregate(runs, METRICS, by="tokenizer", shared=TOKENIZER, seed="prior_seed")


def over_tokenizer_seeds(groups: Sequence[Dict]) -> List[Dict]:
    """One row per arm x sweep point with several tokenizer seeds: mean ± sd over its tokenizers' rows."""
    return aggregate(groups, SEED_METRICS, by="group", shared=("type", "num_codes"), seed="tokenizer_seed", least=2)


def markdown(groups: Sequence[Dict]) -> str:
    return markdown_table(groups, COLUMNS)


def seeds_markdown(rows: Sequence[Dict]) -> str:
    return markdown_table(rows, SEED_COLUMNS)


def write_prior_tables(out: Path, spec: PriorStudyFile, groups, seed_rows, runs, info) -> None:
    """OUT/table.md (per tokenizer, over tokenizer seeds, per prior), table.csv and table.json."""
    text = [f"# {spec.name or 'prior study'}", "", spec.description.strip(), ""]
    if info["quick"]:
        text += ["**--quick: a smoke test (tiny tokenizers and priors); these figures measure nothing.**", ""]
    text += [markdown(groups), ""]
    if seed_rows:
        text += ["Over tokenizer seeds (mean ± sample sd over the tokenizers of each arm; a tokenizer's "
                 "prior figures are its mean over prior seeds):", "", seeds_markdown(seed_rows), ""]
    text += ["Per prior seed:", "", markdown_table(runs, [("name", "run", "s")] + METRICS), "",
             f"Prior: {' '.join(info['prior_overrides']) or 'the built-in defaults'}; seeds {info['prior_seeds']}. "
             f"Evaluation: {info['evaluate']}. Tokens: {info['tokenize']}.",
             f"Command: `{info['command']}`" if info["command"] else ""]
    if info.get("left_out"):
        text += [f"Not finished, left out of the table: {', '.join(info['left_out'])}."]
    (out / "table.md").write_text("\n".join(text + ["", "```", DEFINITIONS, "```", ""]))
    write_csv(out / "table.csv", groups)
    write_json(out / "table.json", {"rows": groups, "over_tokenizer_seeds": seed_rows, "runs": runs, **info,
                                    "definitions": DEFINITIONS})


def write_plot(path: Path, groups: Sequence[Dict]) -> None:
    """Reconstruction vs generation: tokenizer PSNR against the prior's FD (left) and bits/token (right)."""
    from ddcl_vq.studies.plots import label, pyplot, save
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    panels = (("fd_samples", "FD of samples, classifier features (lower: better)"),
              ("bits_per_token", "prior test NLL (bits/token)"))
    markers = "osD^vP*X"
    types = list(dict.fromkeys(g["type"] for g in groups))
    ks = sorted({g["num_codes"] for g in groups})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, ylabel) in zip(axes, panels):
        for g in groups:
            if g.get(key) is None or g.get("psnr") is None:
                continue
            ax.errorbar(g["psnr"], g[key], yerr=g.get(f"{key}_sd") or 0, fmt=markers[types.index(g["type"]) % 8],
                        color=colors[ks.index(g["num_codes"]) % len(colors)], capsize=3)
            ax.annotate(g["name"], (g["psnr"], g[key]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        label(ax, "tokenizer reconstruction PSNR, hard codes (dB)", ylabel)
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
