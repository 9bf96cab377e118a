"""``ddcl-vq prior train|sample|evaluate|study``: the commands and their options."""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import List, Optional

from ddcl_vq.common.errors import entry_point
from ddcl_vq.common.config import Options, Rules, option

USAGE = """\
usage: ddcl-vq prior SUBCOMMAND [ARGS ...]

A prior over a tokenizer's codes makes the VQ-VAE a generative model (docs/guide/prior.md):

  ddcl-vq tokenize runs/fashion_ddcl --split train --out tokens/train.npy    (and --split test)
  ddcl-vq prior train runs/fashion_ddcl --tokens tokens/train.npy --test tokens/test.npy run.dir=runs/prior
  ddcl-vq prior sample runs/prior --count 100 --out samples.png

subcommands:
  train     train (or resume) an autoregressive transformer over token files
  sample    sample code maps, decode them with the tokenizer -> PNG grid + .npy codes
  evaluate  test NLL (bits/token, bits/image), Fréchet distance in a small classifier's features
            (not Inception FID), class accuracy of class-conditional samples -> PRIOR_DIR/eval.json
  study     the same prior on the tokens of several tokenizers (configs/study_prior.yaml)

ddcl-vq prior SUBCOMMAND --help explains each one."""


def _device(name: str) -> str:
    import torch
    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name


# ----------------------------------------------------------------------------- train
TRAIN_HELP = """\
Train an autoregressive transformer prior over the code maps in a token file (ddcl-vq tokenize),
class-conditional when the tokens have labels. RUN_OR_EXPORT is the tokenizer that wrote them (its
decoder turns samples into images). Settings: --config (default: the built-in defaults, the same as
configs/prior_fashion.yaml) and dotted overrides; the prior directory is run.dir.

A prior resumes from RUN_DIR/checkpoints when the same command runs again (only train.steps,
logging, evaluation, device and paths may change). Multi-process: torchrun --nproc_per_node 2
-m ddcl_vq prior train ...

  ddcl-vq prior train runs/fashion_ddcl --tokens tokens/train.npy --test tokens/test.npy \\
      run.dir=runs/prior_fashion train.steps=2000
"""


@dataclass(kw_only=True)
class TrainOptions:
    tokenizer: str = option(help="the tokenizer: a run directory or an exported model folder", positional=True,
                            metavar="RUN_OR_EXPORT")
    tokens: str = option(help="training token file (.npy or .safetensors)", metavar="FILE")
    test: List[str] = option(default_factory=list, help="held-out token file(s), comma-separated: NLL while "
                             "training and in evaluate", sep=",", metavar="FILE[,FILE...]",
                             default_text="none")
    config: Optional[str] = option(None, "prior YAML config (configs/prior_fashion.yaml)")
    overrides: List[str] = option(default_factory=list, help="dotted config overrides", positional=True, nargs="*",
                                  metavar="key=value")
    quiet: bool = option(False, "no progress or summary")
    stop_after: Optional[int] = option(None, "leave after STEPS steps in this session with a checkpoint; the same "
                                             "command resumes", metavar="STEPS")
    print_config: bool = option(False, "print the resolved config and exit")


TRAIN = Options(TrainOptions, prog="ddcl-vq prior train", description=TRAIN_HELP, intermixed=True,
                rules=Rules(positive={"stop_after"}))


@entry_point("ddcl-vq prior train")
def train_main(argv: Optional[List[str]] = None) -> int:
    opts = TRAIN.parse(argv)
    from ddcl_vq.prior.train import dump_config, load_prior_config, train_prior
    from ddcl_vq.prior.data import PriorData
    data = [f"data.tokenizer={opts.tokenizer}", f"data.train_tokens={opts.tokens}"]
    if opts.test:
        data.append("data.test_tokens=[" + ", ".join(json.dumps(t) for t in opts.test) + "]")
    cfg = load_prior_config(opts.config, data + list(opts.overrides))
    if opts.print_config:
        print(dump_config(cfg), end="")
        return 0
    summary = train_prior(cfg, PriorData, quiet=opts.quiet, stop_after=opts.stop_after)
    if not opts.quiet and os.environ.get("RANK", "0") == "0":  # under torchrun: one summary, from rank 0
        done = summary["step"] >= summary["steps"]
        print(f"{'done' if done else 'stopped'}: {summary['step']} of {summary['steps']} steps "
              f"({summary['train_seconds']:.0f} s this session, {summary['parameters']:,} parameters, "
              f"K = {summary['num_codes']}, {'x'.join(map(str, summary['grid']))} codes, "
              f"{summary['num_classes'] or 'no'} classes) -> {summary['prior']}")
        if summary.get("test"):
            t = summary["test"]
            print(f"test NLL ({t['num_images']} maps): {t['bits_per_token']:.4f} bits/token, "
                  f"{t['bits_per_image']:.1f} bits/image")
        if not done:
            print("run the same command again to resume")
        from ddcl_vq.common.errors import tensorboard_hint
        print(f"TensorBoard: {tensorboard_hint(Path(summary['prior']) / 'tb')}")
    return 0


# ----------------------------------------------------------------------------- sample
@dataclass(kw_only=True)
class SampleOptions:
    prior_dir: str = option(help="a prior directory written by ddcl-vq prior train", positional=True)
    count: int = option(help="how many images to sample")
    out: str = option(help="the PNG grid to write; the codes go to the same name with .npy", metavar="FILE.png")
    klass: Optional[int] = option(None, "sample this class only (class-conditional priors)", flag="--class",
                                  metavar="C", default_text="classes 0, 1, ... in turn")
    temperature: float = option(1.0, "softmax temperature (0 = greedy)")
    top_k: int = option(0, "keep the K most likely codes at each step (0 = all)", metavar="K")
    seed: int = option(0, "sampling seed (same seed, same samples)")
    nrow: Optional[int] = option(None, "images per row", default_text="the number of classes, else 8")
    tokenizer: Optional[str] = option(None, "decode with this tokenizer instead of the one the prior was trained "
                                            "on (same K and grid)", metavar="RUN_OR_EXPORT")
    device: str = option("auto", "cpu, cuda (auto: CUDA when available)")


SAMPLE = Options(SampleOptions, prog="ddcl-vq prior sample",
                 description="Sample code maps from a prior, decode them with the tokenizer's decoder and write a "
                             "PNG grid (and the codes as .npy, labels in .labels.npy, readable by ddcl-vq decode).",
                 rules=Rules(positive={"count", "nrow"}, non_negative={"temperature", "top_k", "seed"}))


@entry_point("ddcl-vq prior sample")
def sample_main(argv: Optional[List[str]] = None) -> int:
    opts = SAMPLE.parse(argv)
    from ddcl_vq.prior.sampling import sample_to_files
    done = sample_to_files(opts.prior_dir, opts.count, opts.out, opts.klass, opts.temperature, opts.top_k, opts.seed,
                           opts.nrow, opts.tokenizer, _device(opts.device))
    classes = "" if done["classes"] is None else f", classes {done['classes']}"
    print(f"sampled {done['count']} code maps of {'x'.join(map(str, done['grid']))} from step {done['step']}{classes} "
          f"in {done['seconds']:.2f} s ({done['tokens_per_second']:.0f} tokens/s)")
    print(f"wrote {done['out']} and {done['tokens']}")
    return 0


# ----------------------------------------------------------------------------- evaluate
@dataclass(kw_only=True)
class SamplingOptions:
    """What ``prior evaluate`` samples and measures; also a prior study's ``evaluate`` section."""

    max_test: int = option(0, "first N maps of each test file (0 = all)")
    samples: int = option(1000, "images sampled for the Fréchet distance and class accuracy")
    real: int = option(0, "real test images the samples are compared with (0 = the whole test split)")
    temperature: float = option(1.0, "sampling temperature")
    top_k: int = option(0, "sampling top-k (0 = off)", metavar="K")
    seed: int = option(0, "sampling seed")
    cache_dir: Optional[str] = option(None, "where the feature classifier is cached",
                                      default_text="$DDCL_VQ_CACHE or ~/.cache/ddcl-vq")
    classifier_steps: int = option(1000, "training steps of the feature classifier (part of its cache key)")


@dataclass(kw_only=True)
class EvaluateOptions(SamplingOptions):
    prior_dir: str = option(help="a prior directory written by ddcl-vq prior train", positional=True)
    test: List[str] = option(default_factory=list, help="test token file(s), comma-separated", sep=",",
                             metavar="FILE[,FILE...]", default_text="the prior's data.test_tokens")
    device: str = option("auto", "cpu, cuda (auto: CUDA when available)")
    quiet: bool = option(False, "print only errors")


EVALUATE = Options(EvaluateOptions, prog="ddcl-vq prior evaluate",
                   description="Test NLL in bits per token and bits per image; samples decoded and compared with "
                               "real test images by the Fréchet distance in the features of a small classifier "
                               "trained here on the same dataset (cached; NOT Inception FID, not comparable to "
                               "published FIDs); for a class-conditional prior, the classifier's accuracy on the "
                               "samples of each class. Writes PRIOR_DIR/eval.json and PRIOR_DIR/samples.png.",
                   rules=Rules(positive={"samples", "classifier_steps"},
                               non_negative={"max_test", "real", "temperature", "top_k", "seed"}))


@entry_point("ddcl-vq prior evaluate")
def evaluate_main(argv: Optional[List[str]] = None) -> int:
    opts = EVALUATE.parse(argv)
    from ddcl_vq.prior.evaluation import evaluate_prior, format_eval
    result = evaluate_prior(opts.prior_dir, opts.test or None, device=_device(opts.device), progress=not opts.quiet,
                            **{f.name: getattr(opts, f.name) for f in fields(SamplingOptions)})
    if not opts.quiet:
        print(format_eval(result))
        print(f"wrote {Path(opts.prior_dir) / 'eval.json'} and {Path(opts.prior_dir) / 'samples.png'}")
    return 0


# ----------------------------------------------------------------------------- dispatch
# ``ddcl-vq prior study`` is a study (ddcl_vq.studies.prior_study): the ddcl-vq dispatcher routes it there
SUBCOMMANDS = {"train": train_main, "sample": sample_main, "evaluate": evaluate_main}


def _dispatch(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if argv[0] not in SUBCOMMANDS:
        print(f"ddcl-vq prior: error: unknown subcommand {argv[0]!r}; expected one of: "
              f"{', '.join([*SUBCOMMANDS, 'study'])}", file=sys.stderr)
        return 2
    return int(SUBCOMMANDS[argv[0]](argv[1:]) or 0)


def main(argv: Optional[List[str]] = None) -> int:
    """``ddcl-vq prior SUBCOMMAND ...``: each subcommand's main is an :func:`~ddcl_vq.common.errors.entry_point`."""
    return _dispatch(argv)


main.__wrapped__ = _dispatch  # what entry_point-wrapped mains expose (tests/test_cli.py checks every command)


if __name__ == "__main__":
    sys.exit(main())
