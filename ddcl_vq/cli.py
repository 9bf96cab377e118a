"""``ddcl-vq`` (also ``python -m ddcl_vq``): one console script, one subcommand per job.

Each subcommand lives in its own module with a ``main(argv)`` function; only the subcommands whose module is present are
offered, so ``--help`` never lists one that does not work. The commands need the ``train`` extra
(``pip install 'ddcl-vq[train]'``); the library alone (``pip install ddcl-vq``) needs torch and einops, and
a command run without the extra says so in one line (exit 2) instead of a traceback.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
from typing import List, Optional

# name -> (module, one-line help)
COMMANDS = {
    "train": ("ddcl_vq.tokenizer.train", "train a VQ-VAE from a YAML config (also: python -m ddcl_vq train, torchrun)"),
    "evaluate": ("ddcl_vq.tokenizer.evaluate", "evaluate a run directory on a dataset split -> RUN_DIR/eval.json"),
    "gap": ("ddcl_vq.tokenizer.gap", "where a run's error comes from: quantizer vs autoencoder, codebook vs k-means"),
    "compare": ("ddcl_vq.studies.compare", "compare run directories -> table.md/.csv/.json and PNG plots"),
    "study": ("ddcl_vq.studies.cli", "train, evaluate and compare every arm of a study config"),
    "bench": ("ddcl_vq.studies.bench.cli", "quantizer speed and memory, side by side with the peers"),
    "readout-study": ("ddcl_vq.studies.readout.cli", "DDCL readout vs mean pooling vs class token on Fashion-MNIST"),
    "export": ("ddcl_vq.tokenizer.export", "a run -> a model folder (config.json + weights) for VQVAE.from_pretrained"),
    "tokenize": ("ddcl_vq.tokenizer.tokens", "a dataset split -> hard code indices (.npy / safetensors) for a prior"),
    "decode": ("ddcl_vq.tokenizer.decode", "code indices (.npy / safetensors) -> a PNG grid of decoded images"),
    "prior": ("ddcl_vq.prior.cli", "a transformer prior over the codes: train, sample (-> images), evaluate, study"),
}

#: (command, subcommand) served by another module than the command's own
ROUTES = {("prior", "study"): "ddcl_vq.studies.prior_study"}

#: import name -> distribution of every package the commands need beyond torch and einops: the ``train``
#: extra of pyproject.toml (tests/test_packaging.py checks that the two agree)
TRAIN_EXTRA = {
    "torchvision": "torchvision", "numpy": "numpy", "yaml": "pyyaml", "tqdm": "tqdm", "tensorboard": "tensorboard",
    "PIL": "pillow", "skimage": "scikit-image", "torchmetrics": "torchmetrics", "lpips": "lpips",
    "matplotlib": "matplotlib", "huggingface_hub": "huggingface_hub", "safetensors": "safetensors",
}


def missing_extra(name: str, err: ModuleNotFoundError) -> Optional[str]:
    """The one-line message for a command that failed on a missing package of the ``train`` extra, else None."""
    top = (err.name or "").split(".")[0]
    if top not in TRAIN_EXTRA:
        return None
    return f"ddcl-vq: the command {name!r} needs the toolkit's extra: pip install 'ddcl-vq[train]' " \
           f"(missing: {TRAIN_EXTRA[top]})"


def available() -> dict:
    out = {}
    for name, (module, text) in COMMANDS.items():
        with contextlib.suppress(ModuleNotFoundError):  # find_spec raises it when the module's package is missing
            if importlib.util.find_spec(module) is not None:
                out[name] = (module, text)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = available()
    if not argv or argv[0] in ("-h", "--help", "help"):
        width = max((len(n) for n in commands), default=8)
        print("\n".join(["usage: ddcl-vq COMMAND [ARGS ...]", "", "commands:"]
                        + [f"  {n.ljust(width)}  {t}" for n, (_, t) in commands.items()]
                        + ["", "ddcl-vq COMMAND --help explains each command."]))
        return 0
    if argv[0] in ("-V", "--version"):
        import ddcl_vq
        print(f"ddcl-vq {ddcl_vq.__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in commands:
        print(f"ddcl-vq: unknown command {name!r}; expected one of: {', '.join(commands)}", file=sys.stderr)
        return 2
    module = commands[name][0]
    if rest and (name, rest[0]) in ROUTES:
        module, rest = ROUTES[(name, rest[0])], rest[1:]
    try:
        code = int(importlib.import_module(module).main(rest) or 0)
    except ModuleNotFoundError as err:  # an extra's package, imported by the command's module or inside it
        message = missing_extra(name, err)
        if message is None:
            raise
        print(message, file=sys.stderr)
        return 2
    if code == 0:  # a command run under torchrun: after success only (a barrier after a failure could hang)
        from ddcl_vq.common.skeleton import teardown_distributed
        teardown_distributed()
    return code


if __name__ == "__main__":
    sys.exit(main())
