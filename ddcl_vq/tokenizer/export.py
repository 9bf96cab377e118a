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

import errno
import json
import os
import shutil
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
from safetensors import SafetensorError

from ddcl_vq.models import VQVAE
from ddcl_vq.models.vqvae import QUANTIZER_TYPES
from ddcl_vq.models.vqgan import diffusers_config, diffusers_state_dict

from ddcl_vq.common.checkpoint import umask
from ddcl_vq.common.config import Options, Rules, option
from ddcl_vq.common.data import build_dataset, image_channels
from ddcl_vq.common.errors import UserError, entry_point, one_line
from ddcl_vq.tokenizer.evaluate import load_run
from ddcl_vq.tokenizer.tokens import run_data


class ExportError(UserError, RuntimeError):
    """The run cannot be exported as asked (output folder in the way, upload failed, ...)."""


#: the files each export format writes into OUT_DIR (``--overwrite`` removes the other format's)
EXPORT_FILES = {"ddcl-vq": ("config.json", "model.safetensors", "README.md"),
                "diffusers": ("config.json", "diffusion_pytorch_model.safetensors", "README.md")}
FILES = EXPORT_FILES["ddcl-vq"]


# ----------------------------------------------------------------------------- what both formats share
def check_out_dir(run_dir: Path, out_dir: Path, overwrite: bool) -> None:
    """Before any work: ``out_dir`` is a folder that may be written (empty, or ``overwrite``), not the run's."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"{str(out_dir)!r} exists and is not a folder")
    blocking = next((p for p in out_dir.parents if p.exists()), None)
    if blocking is not None and not blocking.is_dir():
        raise ExportError(f"OUT_DIR {str(out_dir)!r} cannot be written: {str(blocking)!r} is a file, not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise ExportError(f"{str(out_dir)!r} is not empty; pass --overwrite to replace an earlier export there")
    if out_dir.resolve() == run_dir.resolve():
        raise ExportError("OUT_DIR must not be the run directory")


def move_into_place(staging: Path, out_dir: Path, files: Sequence[str], overwrite: bool) -> None:
    """Move the checked export ``files`` from ``staging`` into ``out_dir`` with the umask's modes; without
    ``overwrite``, an OUT_DIR another command filled meanwhile is an ExportError."""
    mask = umask()
    os.chmod(staging, 0o777 & ~mask)  # an export is for sharing
    for name in files:
        os.chmod(staging / name, 0o666 & ~mask)
    try:
        os.rename(staging, out_dir)  # onto a missing or empty folder; ENOTEMPTY onto a folder with files
        return
    except OSError as err:
        if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        if not overwrite:
            raise ExportError(f"{str(out_dir)!r} was written by another command while this export ran; pass "
                              "--overwrite to replace it") from None
    for name in files:
        os.replace(staging / name, out_dir / name)
    stale = {name for names in EXPORT_FILES.values() for name in names} - set(files)
    for name in sorted(stale):
        (out_dir / name).unlink(missing_ok=True)


def check_inputs(model, cfg) -> torch.Tensor:
    """A fixed batch to check the export on: the first test images, or seeded noise offline."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            test = build_dataset(cfg.data, "test", cfg.run.seed)
        return torch.stack([test[i][0] for i in range(min(16, len(test)))])
    except UserError:
        size = cfg.data.image_size
        return torch.rand(16, image_channels(cfg.data), size, size, generator=torch.Generator().manual_seed(0))


def write_checked(out_dir: Path, overwrite: bool, files: Sequence[str], write) -> Dict[str, int]:
    """``write(staging)`` (which checks what it wrote) in a new hidden folder beside ``out_dir``, then the files moved
    into ``out_dir``; a failure leaves OUT_DIR as it was. -> {file name: size in bytes}."""
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.export-", dir=out_dir.parent))
    except OSError as err:
        raise ExportError(f"OUT_DIR {str(out_dir)!r} cannot be written ({err.strerror or err}); nothing was "
                          "written") from None
    try:
        write(staging)
        move_into_place(staging, out_dir, files, overwrite)  # 0755 / 0644 under the usual umask
    except (OSError, SafetensorError) as err:  # SafetensorError: an I/O error inside safetensors (a full disk)
        why = err.strerror if isinstance(err, OSError) and err.strerror else str(err).strip()[:200]
        raise ExportError(f"could not write the export into {str(out_dir)!r} ({why}); nothing was written "
                          "there") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {name: (out_dir / name).stat().st_size for name in files}


# ----------------------------------------------------------------------------- --format diffusers
# A VQGAN run as what VQModel.save_pretrained writes; checked: loaded by diffusers alone, it decodes the run's hard
# codes to the run's images within DECODE_ATOL and picks the run's codes wherever they are not ties (TIE_RTOL).
#: the largest max |difference| allowed between the run's and the exported VQModel's decoded images
DECODE_ATOL = 1e-5
#: two codes are tied when their squared distances differ by at most this fraction of |z|^2 + |w_a|^2 + |w_b|^2
TIE_RTOL = 1e-5
#: why a quantizer's hard index is not the nearest codebook row (``Quantizer.assigns_nearest_code`` is False)
NOT_NEAREST = {"fsq": "it rounds a projection of the feature to a grid", "lfq": "it takes the signs of a projection",
               "ibq": "quantizer.logits=dot: it takes the row of largest dot product with the feature, not the "
                      "nearest one"}


def decode_with_vqmodel(vq, indices: torch.Tensor) -> torch.Tensor:
    """(B, h, w) code indices -> (B, C, H, W) images, as a diffusers user decodes them."""
    b, h, w = indices.shape
    quant = vq.quantize.get_codebook_entry(indices.reshape(-1), (b, h, w, vq.config.vq_embed_dim))
    return vq.decode(quant, force_not_quantize=True).sample


def untied_disagreements(latents: torch.Tensor, codebook: torch.Tensor, ours: torch.Tensor,
                         theirs: torch.Tensor) -> int:
    """How many positions get another code from diffusers (``theirs``) than from the run (``ours``) without a tie.
    ``latents``: (B, D, h, w); ``codebook``: (K, D); ``ours``, ``theirs``: (B, h, w) indices."""
    z = latents.detach().permute(0, 2, 3, 1).reshape(-1, latents.shape[1]).double()
    cb = codebook.detach().double()
    o, t = ours.reshape(-1), theirs.reshape(-1)
    differ = o != t
    z, o, t = z[differ], o[differ], t[differ]
    d_ours, d_theirs = ((z - cb[o]) ** 2).sum(1), ((z - cb[t]) ** 2).sum(1)
    scale = (z ** 2).sum(1) + (cb[o] ** 2).sum(1) + (cb[t] ** 2).sum(1)
    return int(((d_ours - d_theirs).abs() > TIE_RTOL * scale).sum())


def diffusers_card(config: Dict, source: Dict, check: Dict) -> str:
    size = config["sample_size"]
    lines = ["---", "library_name: diffusers", "tags:", "- vq-vae", "- vqgan", "- image-tokenizer", "- ddcl", "---", "",
             f"# {source['name']}: a VQGAN image tokenizer (diffusers VQModel) trained with ddcl-vq", "",
             f"K = {config['num_vq_embeddings']} codes of dimension {config['vq_embed_dim']} "
             f"({source['quantizer_type']} codebook, trained {source['step']} steps); "
             f"{config['in_channels']}x{size}x{size} images in [0, 1] (diffusers VQModel convention for this "
             "export: the range the model was trained on, [0, 1], not [-1, 1]).", "",
             "```python", "from diffusers import VQModel", "", 'vq = VQModel.from_pretrained("this folder or hub id")',
             "codes = ...  # (B, h, w) long indices in [0, K)",
             "quant = vq.quantize.get_codebook_entry(codes.flatten(), (*codes.shape, vq.config.vq_embed_dim))",
             "images = vq.decode(quant, force_not_quantize=True).sample", "```", "",
             f"Checked at export: decodes the run's hard codes to the run's images, max |difference| "
             f"{check['max_abs_diff']:.3g} (tolerance {DECODE_ATOL:g}); diffusers' own nearest-code search "
             f"picks the run's codes for {check['index_agreement']:.2%} of latent positions."]
    return "\n".join(lines) + "\n"


def export_diffusers(run_dir: str | Path, out_dir: str | Path, overwrite: bool = False) -> Dict:
    """Write the diffusers VQModel folder of a VQGAN run and check it; returns what was done."""
    from diffusers import VQModel
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    cfg, model, step, ckpt = load_run(run_dir)
    if cfg.model['arch'] != "vqgan":
        raise ExportError(f"--format diffusers needs a VQGAN run (model.arch vqgan: diffusers' VQModel "
                          f"encoder/decoder); {str(run_dir)!r} is a {cfg.model['arch']} run: export it with --format "
                          "ddcl-vq")
    if not model.quantizer.assigns_nearest_code:
        raise ExportError(f"--format diffusers needs a quantizer whose hard index is the nearest codebook row "
                          f"(diffusers' VQModel encodes by nearest-code search); the {cfg.quantizer['type']} "
                          f"quantizer's index is not ({NOT_NEAREST.get(cfg.quantizer['type'], 'another rule')}), so "
                          "the exported VQModel would encode other codes than the run: export it with --format ddcl-vq")
    check_out_dir(run_dir, out_dir, overwrite)
    model = model.cpu().eval()
    codes = torch.arange(model.quantizer.num_codes)
    with torch.no_grad():
        looked_up = model.quantizer.lookup(codes[:, None, None]).reshape(len(codes), -1)
    if not torch.equal(looked_up.float(), model.quantizer.codebook.detach().float()):
        raise ExportError(f"--format diffusers needs a quantizer whose hard codes are rows of its codebook (VQModel "
                          f"looks codes up in one embedding table); the {cfg.quantizer['type']} quantizer's are not")
    vq = VQModel(**diffusers_config(model.config["model"], model.quantizer.num_codes))
    vq.load_state_dict(diffusers_state_dict(model), strict=True)  # the run's weights and hard codebook
    x, check = check_inputs(model, cfg), {}

    def write(staging: Path) -> None:
        vq.save_pretrained(str(staging), safe_serialization=True)
        # the check: loaded by diffusers alone, it decodes the run's codes to its images and encodes its codes
        loaded = VQModel.from_pretrained(str(staging)).eval()
        with torch.no_grad():
            indices = model.encode_indices(x)
            diff = float((model.decode_indices(indices) - decode_with_vqmodel(loaded, indices)).abs().max())
            latents = loaded.encode(x).latents
            _, _, (_, _, their_indices) = loaded.quantize(latents)
        their_indices = their_indices.reshape(indices.shape)
        agreement = float((their_indices == indices).float().mean())
        if not diff <= DECODE_ATOL:  # pragma: no cover - a bug, not a user error
            raise RuntimeError(f"the diffusers export of {run_dir} decodes the run's codes with max |difference| "
                               f"{diff:g} > {DECODE_ATOL:g}")
        untied = untied_disagreements(latents, loaded.quantize.embedding.weight, indices, their_indices)
        if untied:
            raise ExportError(f"the diffusers export of {str(run_dir)!r} would be another model: diffusers' "
                              f"nearest-code search picks other codes than the run at {untied} of {indices.numel()} "
                              f"latent positions that are not ties ({agreement:.2%} agree); nothing was written to "
                              f"{str(out_dir)!r}; export it with --format ddcl-vq")
        check.update(max_abs_diff=diff, index_agreement=agreement, checked_images=int(x.shape[0]),
                     tolerance=DECODE_ATOL)
        source = {"name": cfg.run.name, "step": step, "quantizer_type": cfg.quantizer['type']}
        config = json.loads((staging / "config.json").read_text())
        (staging / "README.md").write_text(diffusers_card(config, source, check))

    files = write_checked(out_dir, overwrite, EXPORT_FILES["diffusers"], write)  # 0644 files (diffusers writes 0600)
    return {"run": str(run_dir), "out_dir": str(out_dir), "step": step, "checkpoint": str(ckpt),
            "quantizer_type": cfg.quantizer['type'], **check, "files": files}


@dataclass(kw_only=True)
class ExportOptions:
    run_dir: str = option(help="a run directory written by ddcl-vq train", positional=True)
    out_dir: str = option(help="the model folder to write", positional=True)
    overwrite: bool = option(False, "replace the files of an earlier export in OUT_DIR")
    format: str = option("ddcl-vq", "ddcl-vq (VQVAE.from_pretrained) or diffusers (a model.arch vqgan run as a "
                                    "plain diffusers.VQModel folder; see ddcl_vq/tokenizer/export.py)")
    push_to_hub: Optional[str] = option(None, "also upload OUT_DIR to this Hugging Face Hub repository "
                                               "(needs network and a token: hf auth login)", metavar="USER/NAME")
    private: bool = option(False, "with --push-to-hub: create the repository private")
    quiet: bool = option(False, "print only errors")


OPTIONS = Options(ExportOptions, prog="ddcl-vq export", description=__doc__,
                  rules=Rules(choices={"format": tuple(EXPORT_FILES)}))


def model_card(config: Dict, summary: Optional[Dict], out_dir: Path) -> str:
    q, dim, source, data = config["quantizer"], config["model"]["latent_dim"], config["source"], config["data"]
    size, latent = data["image_size"], data["latent_size"]
    lines = ["---", "library_name: ddcl-vq", "tags:", "- vq-vae", "- image-tokenizer", "- ddcl",
             "- pytorch_model_hub_mixin", "---", "",
             f"# {source['name']}: a VQ-VAE image tokenizer ({q['type']} quantizer)", "",
             f"K = {q['num_codes']} codes of dimension D = {dim}; {data['channels']}×{size}×{size} images "
             f"({data['name']}) -> {latent}×{latent} code indices. Trained with ddcl-vq for {source['step']} "
             "steps.", ""]
    if summary and "hard" in summary:
        c = summary.get("codebook", {})
        lines += [f"Test set ({summary.get('num_images')} images), hard codes: PSNR {summary['hard']['psnr']:.2f} dB, "
                  f"codebook utilization {c.get('utilization', float('nan')):.1%}, "
                  f"perplexity {c.get('perplexity', float('nan')):.1f}.", ""]
    lines += ["```python", "import torch", "from ddcl_vq.models import VQVAE", "",
              f'model = VQVAE.from_pretrained("{out_dir.name}")  # this folder, or its hub id',
              f"images = torch.rand(4, {data['channels']}, {size}, {size})  # in [0, 1]",
              "indices = model.encode_indices(images)  # (B, h, w) code indices: what a prior learns",
              "recon = model.decode_indices(indices)  # decoded from the hard codes", "```", "",
              "Files: `config.json` (constructor arguments; `quantizer_state` is informative, the state itself "
              "is in the weights), `model.safetensors` (weights and quantizer buffers, no pickle)."]
    peer = getattr(QUANTIZER_TYPES[q["type"]], "peer", None)
    if peer:
        lines += ["", f"This model's quantizer is vector-quantize-pytorch's `{peer}`: loading it needs "
                      "`pip install vector-quantize-pytorch`."]
    return "\n".join(lines) + "\n"


def export_run(run_dir: str | Path, out_dir: str | Path, overwrite: bool = False) -> Dict:
    """Write the export of ``run_dir`` into ``out_dir`` and check it; returns what was done."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    cfg, model, step, ckpt = load_run(run_dir)
    check_out_dir(run_dir, out_dir, overwrite)
    model.config.update({
        "source": {"name": cfg.run.name, "run": str(run_dir), "checkpoint": Path(ckpt).name, "step": step,
                   "train_steps": cfg.train.steps},
        "data": run_data(cfg, model),
    })
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        summary = None
    x = check_inputs(model, cfg)

    def write(staging: Path) -> None:
        model.save_pretrained(staging)
        config = json.loads((staging / "config.json").read_text())
        (staging / "README.md").write_text(model_card(config, summary, out_dir))
        loaded = VQVAE.from_pretrained(str(staging))  # the check: the folder alone gives the run's codes and images
        if not (torch.equal(model.reconstruct(x, "hard"), loaded.reconstruct(x, "hard"))
                and torch.equal(model.encode_indices(x), loaded.encode_indices(x))):  # pragma: no cover - a bug
            raise RuntimeError(f"the export in {out_dir} does not reproduce the run's hard reconstructions")

    files = write_checked(out_dir, overwrite, FILES, write)
    return {"run": str(run_dir), "out_dir": str(out_dir), "step": step, "checkpoint": str(ckpt),
            "train_steps": cfg.train.steps, "quantizer_type": cfg.quantizer['type'],
            "checked_images": int(x.shape[0]), "files": files}


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
        raise ExportError(f"upload to the hub repository {repo_id!r} failed ({type(err).__name__}: {one_line(err)}); "
                          f"the export in {str(out_dir)!r} is complete, retry with network and `hf auth login`"
                          ) from None


@entry_point("ddcl-vq export")
def main(argv: Optional[List[str]] = None) -> int:
    opts = OPTIONS.parse(argv)
    diffusers = opts.format == "diffusers"  # a VQGAN run as a plain diffusers.VQModel folder
    done = (export_diffusers if diffusers else export_run)(opts.run_dir, opts.out_dir, opts.overwrite)
    if not diffusers and done["step"] < done["train_steps"]:
        print(f"warning: {done['run']} is at step {done['step']} of {done['train_steps']} (still training, or "
              f"stopped early): exported its checkpoint of step {done['step']}", file=sys.stderr)
    if not opts.quiet:
        for name, size in done["files"].items():
            print(f"wrote {Path(opts.out_dir) / name} ({size:,} bytes)")
        checked = f"step {done['step']} of {done['run']} ({Path(done['checkpoint']).name}); checked:"
        if diffusers:
            print(f"{checked} diffusers.VQModel.from_pretrained decodes the run's hard codes of "
                  f"{done['checked_images']} images with max |difference| {done['max_abs_diff']:.3g} (tolerance "
                  f"{done['tolerance']:g}); its own nearest-code search agrees on {done['index_agreement']:.2%} of "
                  "codes")
            print("load it without ddcl-vq: from diffusers import VQModel; "
                  f"VQModel.from_pretrained({str(opts.out_dir)!r})")
        else:
            print(f"{checked} from_pretrained reproduces the hard reconstructions and indices of "
                  f"{done['checked_images']} images bit for bit")
            if hasattr(QUANTIZER_TYPES[done["quantizer_type"]], "peer"):
                print(f"note: a {done['quantizer_type']} model needs vector-quantize-pytorch installed where it is "
                      "loaded")
            print(f"load it: VQVAE.from_pretrained({str(opts.out_dir)!r})  (from ddcl_vq.models import VQVAE)")
    if opts.push_to_hub:
        url = push(opts.out_dir, opts.push_to_hub, opts.private, EXPORT_FILES[opts.format])
        if not opts.quiet:
            print(f"pushed to {url}")
    return 0
