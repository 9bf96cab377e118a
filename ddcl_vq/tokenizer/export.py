"""Export a run directory written by `ddcl-vq train` as a model folder: config.json (constructor
arguments, quantizer and its temperature state included) + model.safetensors (weights and
quantizer buffers, no pickle) + README.md. Load it anywhere with

  from ddcl_vq.models import VQVAE
  model = VQVAE.from_pretrained("OUT_DIR")        # or a hub id after --push-to-hub

The export is checked before the command returns: the loaded folder reproduces the run's hard
reconstructions and indices bit for bit. A vqp (vector-quantize-pytorch) model needs that
package installed where it is loaded.

  ddcl-vq export runs/fashion_ddcl exported/fashion_ddcl
  ddcl-vq export runs/fashion_ddcl exported/fashion_ddcl --push-to-hub me/fashion-ddcl-vq
"""
from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import torch
from safetensors import SafetensorError

from ddcl_vq.common.errors import entry_point
from ddcl_vq.common.config import Options, option

from ddcl_vq.tokenizer.export_checks import (EXPORT_FILES, ExportError, check_inputs as _check_inputs, check_out_dir, move_into_place,
                     staging_folder)

HELP = __doc__  # the module docstring is the --help text

FILES = EXPORT_FILES["ddcl-vq"]


@dataclass(kw_only=True)
class ExportOptions:
    run_dir: str = option(help="a run directory written by ddcl-vq train", positional=True)
    out_dir: str = option(help="the model folder to write", positional=True)
    overwrite: bool = option(False, "replace the files of an earlier export in OUT_DIR")
    format: str = option("ddcl-vq", "ddcl-vq (VQVAE.from_pretrained) or diffusers (a model.arch vqgan run as a "
                                    "plain diffusers.VQModel folder; see ddcl_vq/tokenizer/export_diffusers.py)")
    push_to_hub: Optional[str] = option(None, "also upload OUT_DIR to this Hugging Face Hub repository "
                                               "(needs network and a token: hf auth login)", metavar="USER/NAME")
    private: bool = option(False, "with --push-to-hub: create the repository private")
    quiet: bool = option(False, "print only errors")


OPTIONS = Options(ExportOptions, prog="ddcl-vq export", description=HELP)


def model_card(config: Dict, summary: Optional[Dict], out_dir: Path) -> str:
    q, qtype = config["quantizer_kwargs"], config["quantizer_type"]
    source, data = config.get("source", {}), config.get("data", {})
    lines = ["---", "library_name: ddcl-vq", "tags:", "- vq-vae", "- image-tokenizer", "- ddcl",
             "- pytorch_model_hub_mixin", "---", "",
             f"# {source.get('name', out_dir.name)}: a VQ-VAE image tokenizer ({qtype} quantizer)", "",
             f"K = {q['num_codes']} codes of dimension D = {q['dim']}; "
             f"{data.get('channels', '?')}×{data.get('image_size', '?')}×{data.get('image_size', '?')} images "
             f"({data.get('name', '?')}) -> {data.get('latent_size', '?')}×{data.get('latent_size', '?')} code "
             f"indices. Trained with ddcl-vq for {source.get('step', '?')} steps.", ""]
    if summary and "hard" in summary:
        c = summary.get("codebook", {})
        lines += [f"Test set ({summary.get('num_images')} images), hard codes: PSNR {summary['hard']['psnr']:.2f} dB, "
                  f"codebook utilization {c.get('utilization', float('nan')):.1%}, "
                  f"perplexity {c.get('perplexity', float('nan')):.1f}.", ""]
    lines += ["```python", "import torch", "from ddcl_vq.models import VQVAE", "",
              f'model = VQVAE.from_pretrained("{out_dir.name}")  # this folder, or its hub id',
              "images = torch.rand(4, %s, %s, %s)  # in [0, 1]" % (
                  data.get("channels", 1), data.get("image_size", 32), data.get("image_size", 32)),
              "indices = model.encode_indices(images)  # (B, h, w) code indices: what a prior learns",
              "recon = model.decode_indices(indices)  # decoded from the hard codes", "```", "",
              "Files: `config.json` (constructor arguments; `quantizer_state` is informative, the state itself "
              "is in the weights), `model.safetensors` (weights and quantizer buffers, no pickle)."]
    peer = {"vqp": "VectorQuantize", "fsq": "FSQ", "simvq": "SimVQ", "lfq": "LFQ"}.get(qtype)
    if peer:
        lines += ["", f"This model's quantizer is vector-quantize-pytorch's `{peer}`: loading it needs "
                      "`pip install vector-quantize-pytorch`."]
    return "\n".join(lines) + "\n"


def export_run(run_dir: str | Path, out_dir: str | Path, overwrite: bool = False) -> Dict:
    """Write the export of ``run_dir`` into ``out_dir`` and check it; returns what was done. config.json holds the
    constructor arguments of encoder, quantizer and decoder, the quantizer's temperature state, the run and the data."""
    from ddcl_vq.tokenizer.evaluate import load_run
    from ddcl_vq.models import VQVAE
    from ddcl_vq.common.data import image_channels
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    cfg, model, step, ckpt = load_run(run_dir)
    check_out_dir(run_dir, out_dir, overwrite)
    factor = 2 ** (len(cfg.model.ch_mult) - 1 if getattr(cfg.model, "arch", "vqvae") == "vqgan"
                   else cfg.model.num_downsamples)
    model.config.update({
        "source": {"name": cfg.run.name, "run": str(run_dir), "checkpoint": Path(ckpt).name, "step": step,
                   "train_steps": cfg.train.steps},
        "data": {"name": cfg.data.name, "image_size": cfg.data.image_size, "channels": image_channels(cfg.data),
                 "latent_size": cfg.data.image_size // factor, "seed": cfg.run.seed, "range": [0.0, 1.0]},
    })
    summary = None
    if (run_dir / "summary.json").is_file():
        try:
            summary = json.loads((run_dir / "summary.json").read_text())
        except ValueError:
            summary = None
    x = _check_inputs(model, cfg)
    # written into a hidden folder beside OUT_DIR, checked there, then moved into place: a full
    # disk or a failed check leaves OUT_DIR as it was (not created, or its earlier files)
    staging = staging_folder(out_dir)
    try:
        try:
            model.save_pretrained(staging)
        except SafetensorError as err:  # an I/O error inside safetensors (a full disk, a file size limit)
            raise ExportError(f"could not write the export of {str(run_dir)!r} ({str(err).strip()[:200]}); "
                              f"nothing was written to {str(out_dir)!r}") from None
        config = json.loads((staging / "config.json").read_text())
        (staging / "README.md").write_text(model_card(config, summary, out_dir))

        # the check: the folder alone reproduces the run's hard reconstructions and indices
        loaded = VQVAE.from_pretrained(str(staging))
        same = (torch.equal(model.reconstruct(x, "hard"), loaded.reconstruct(x, "hard"))
                and torch.equal(model.encode_indices(x), loaded.encode_indices(x)))
        if not same:  # pragma: no cover - a bug, not a user error
            raise RuntimeError(f"the export in {out_dir} does not reproduce the run's hard reconstructions")
        move_into_place(staging, out_dir, FILES)  # 0755 / 0644 under the usual umask; a diffusers export's files go
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {"run": str(run_dir), "out_dir": str(out_dir), "step": step, "checkpoint": str(ckpt),
            "train_steps": cfg.train.steps, "quantizer_type": config["quantizer_type"],
            "checked_images": int(x.shape[0]), "files": {name: (out_dir / name).stat().st_size for name in FILES}}


def push(out_dir: str | Path, repo_id: str, private: bool = False, files=FILES) -> str:
    """Upload the exported folder to the Hugging Face Hub; -> the repository URL."""
    try:
        from huggingface_hub import HfApi
        api = HfApi()
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        api.upload_folder(folder_path=str(out_dir), repo_id=repo_id, repo_type="model",
                          allow_patterns=list(files), commit_message="ddcl-vq export")
        return str(url)
    except Exception as err:  # network, auth, name: all things the user fixes
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ExportError(f"upload to the hub repository {repo_id!r} failed ({type(err).__name__}: {first}); "
                          f"the export in {str(out_dir)!r} is complete, retry with network and `hf auth login`"
                          ) from None


@entry_point("ddcl-vq export")
def main(argv: Optional[List[str]] = None) -> int:
    opts = OPTIONS.parse(argv)
    if opts.format not in ("ddcl-vq", "diffusers"):
        raise ExportError(f"option --format: expected ddcl-vq or diffusers, got {opts.format!r}")
    files = EXPORT_FILES[opts.format]
    if opts.format == "diffusers":  # a VQGAN run as a plain diffusers.VQModel folder
        from ddcl_vq.tokenizer.export_diffusers import export_diffusers, report
        text = report(export_diffusers(opts.run_dir, opts.out_dir, opts.overwrite), opts.out_dir, opts.quiet)
        if text:
            print(text)
    else:
        done = export_run(opts.run_dir, opts.out_dir, opts.overwrite)
        if done["step"] < done["train_steps"]:
            print(f"warning: {done['run']} is at step {done['step']} of {done['train_steps']} (still training, or "
                  f"stopped early): exported its checkpoint of step {done['step']}", file=sys.stderr)
        if not opts.quiet:
            for name, size in done["files"].items():
                print(f"wrote {Path(opts.out_dir) / name} ({size:,} bytes)")
            print(f"step {done['step']} of {done['run']} ({Path(done['checkpoint']).name}); checked: from_pretrained "
                  f"reproduces the hard reconstructions and indices of {done['checked_images']} images bit for bit")
            if done["quantizer_type"] in ("vqp", "fsq", "simvq", "lfq"):
                print(f"note: a {done['quantizer_type']} model needs vector-quantize-pytorch installed where it is "
                      "loaded")
            print(f"load it: VQVAE.from_pretrained({str(opts.out_dir)!r})  (from ddcl_vq.models import VQVAE)")
    if opts.push_to_hub:
        url = push(opts.out_dir, opts.push_to_hub, opts.private, files)
        if not opts.quiet:
            print(f"pushed to {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
