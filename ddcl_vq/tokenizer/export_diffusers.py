"""``ddcl-vq export RUN_DIR OUT_DIR --format diffusers``: a VQGAN run -> a plain ``diffusers.VQModel`` folder.

A run trained with ``model.arch: vqgan`` is diffusers' VQModel encoder/decoder with our quantizer in the
VectorQuantizer's place (:mod:`ddcl_vq.models.vqgan`). This export writes what diffusers itself writes for a VQModel
(``VQModel.save_pretrained``: ``config.json`` + ``diffusion_pytorch_model.safetensors``) with the trained codebook as
``quantize.embedding.weight``, plus a README.md. Loading it needs diffusers and torch only — no ddcl-vq::

    from diffusers import VQModel
    vq = VQModel.from_pretrained("OUT_DIR")
    quant = vq.quantize.get_codebook_entry(indices.flatten(), (B, h, w, vq.config.vq_embed_dim))
    images = vq.decode(quant, force_not_quantize=True).sample          # the same as ddcl-vq's decode_indices
    # or end to end: vq(images).sample (diffusers' own nearest-code search: the same codes up to exact ties)

Only a quantizer whose hard index is the nearest codebook row (``Quantizer.assigns_nearest_code``) can be exported so:
diffusers' VQModel encodes by nearest-code search, so FSQ, LFQ (a rounded projection) or IBQ with dot-product logits
would load as a model that encodes other codes; they are refused up front. The folder is checked before it is moved into
place: loaded by diffusers alone, it must decode the run's hard codes of a fixed batch to the run's images within
:data:`DECODE_ATOL` (the same modules and weights: 0 is what one machine measures), and diffusers' own nearest-code
search must pick the run's codes wherever they are not ties (:data:`TIE_RTOL`); otherwise nothing is written.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Dict, Optional

import torch

from ddcl_vq.tokenizer.export_checks import EXPORT_FILES, ExportError

#: the largest max |difference| allowed between the run's and the exported VQModel's decoded images
DECODE_ATOL = 1e-5
#: two codes are tied for a latent vector when their squared distances to it differ by at most this
#: fraction of |z|^2 + |w_a|^2 + |w_b|^2 (float32 rounding of z^2 + w^2 - 2 z.w, with room to spare)
TIE_RTOL = 1e-5
FILES = EXPORT_FILES["diffusers"]


def to_vqmodel(model):
    """A ``diffusers.VQModel`` holding the weights of a VQGAN ``model`` (a ddcl-vq VQVAE with arch vqgan)
    and its hard codebook; eval mode."""
    from diffusers import VQModel
    from ddcl_vq.models.vqgan import diffusers_config, diffusers_state_dict
    vq = VQModel(**diffusers_config(model.config["encoder_kwargs"], model.quantizer.num_codes))
    vq.load_state_dict(diffusers_state_dict(model), strict=True)
    return vq.eval()


def decode_with_vqmodel(vq, indices: torch.Tensor) -> torch.Tensor:
    """(B, h, w) code indices -> (B, C, H, W) images, as a diffusers user decodes them."""
    b, h, w = indices.shape
    quant = vq.quantize.get_codebook_entry(indices.reshape(-1), (b, h, w, vq.config.vq_embed_dim))
    return vq.decode(quant, force_not_quantize=True).sample


def untied_disagreements(latents: torch.Tensor, codebook: torch.Tensor, ours: torch.Tensor,
                         theirs: torch.Tensor) -> int:
    """How many latent positions get another code from diffusers' nearest-code search (``theirs``) than
    from the run (``ours``) without being a tie (:data:`TIE_RTOL`). ``latents``: (B, D, h, w), what
    diffusers' quantizer searches with; ``codebook``: (K, D); ``ours``, ``theirs``: (B, h, w) indices."""
    z = latents.detach().permute(0, 2, 3, 1).reshape(-1, latents.shape[1]).double()
    cb = codebook.detach().double()
    o, t = ours.reshape(-1), theirs.reshape(-1)
    differ = o != t
    if not bool(differ.any()):
        return 0
    z, o, t = z[differ], o[differ], t[differ]
    d_ours, d_theirs = ((z - cb[o]) ** 2).sum(1), ((z - cb[t]) ** 2).sum(1)
    scale = (z ** 2).sum(1) + (cb[o] ** 2).sum(1) + (cb[t] ** 2).sum(1)
    return int(((d_ours - d_theirs).abs() > TIE_RTOL * scale).sum())


def model_card(config: Dict, source: Dict, check: Dict) -> str:
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
    from ddcl_vq.tokenizer.evaluate import load_run
    from ddcl_vq.tokenizer.export_checks import check_inputs as _check_inputs, check_out_dir, move_into_place, staging_folder
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    cfg, model, step, ckpt = load_run(run_dir)
    if getattr(cfg.model, "arch", "vqvae") != "vqgan":
        raise ExportError(f"--format diffusers needs a VQGAN run (model.arch vqgan: diffusers' VQModel "
                          f"encoder/decoder); {str(run_dir)!r} is a {cfg.model.arch} run: export it with --format "
                          "ddcl-vq")
    if not model.quantizer.assigns_nearest_code:
        raise ExportError(f"--format diffusers needs a quantizer whose hard index is the nearest codebook row "
                          f"(diffusers' VQModel encodes by nearest-code search); the {cfg.quantizer.type} quantizer's "
                          f"index is not (e.g. a rounded projection), so the exported VQModel would encode other codes "
                          f"than the run: export it with --format ddcl-vq")
    check_out_dir(run_dir, out_dir, overwrite)
    model = model.cpu().eval()
    codes = torch.arange(model.quantizer.num_codes)
    with torch.no_grad():
        looked_up = model.quantizer.lookup(codes[:, None, None]).reshape(len(codes), -1)
    if not torch.equal(looked_up.float(), model.quantizer.codebook.detach().float()):
        raise ExportError(f"--format diffusers needs a quantizer whose hard codes are rows of its codebook (VQModel "
                          f"looks codes up in one embedding table); the {cfg.quantizer.type} quantizer's are not")

    vq = to_vqmodel(model)
    x = _check_inputs(model, cfg)
    staging = staging_folder(out_dir)  # checked there, then moved into place: a failed check leaves OUT_DIR as it was
    try:
        vq.save_pretrained(str(staging), safe_serialization=True)

        # the check: the folder, loaded by diffusers alone, decodes the run's hard codes to the run's images
        # and encodes the run's codes (up to ties)
        loaded = VQModel.from_pretrained(str(staging)).eval()
        with torch.no_grad():
            indices = model.encode_indices(x)
            ours = model.decode_indices(indices)
            theirs = decode_with_vqmodel(loaded, indices)
            diff = float((ours - theirs).abs().max())
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
        check = {"max_abs_diff": diff, "index_agreement": agreement, "checked_images": int(x.shape[0]),
                 "tolerance": DECODE_ATOL}
        source = {"name": cfg.run.name, "step": step, "quantizer_type": cfg.quantizer.type}
        (staging / "README.md").write_text(model_card(json.loads((staging / "config.json").read_text()), source, check))
        move_into_place(staging, out_dir, FILES)  # 0644 files (diffusers writes its weights 0600)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return {"run": str(run_dir), "out_dir": str(out_dir), "step": step, "checkpoint": str(ckpt),
            "quantizer_type": cfg.quantizer.type, **check,
            "files": {name: (out_dir / name).stat().st_size for name in FILES if (out_dir / name).exists()}}


def report(done: Dict, out_dir: str, quiet: bool = False) -> Optional[str]:
    if quiet:
        return None
    lines = [f"wrote {Path(out_dir) / name} ({size:,} bytes)" for name, size in done["files"].items()]
    lines.append(f"step {done['step']} of {done['run']} ({Path(done['checkpoint']).name}); checked: "
                 f"diffusers.VQModel.from_pretrained decodes the run's hard codes of {done['checked_images']} images "
                 f"with max |difference| {done['max_abs_diff']:.3g} (tolerance {done['tolerance']:g}); its own "
                 f"nearest-code search agrees on {done['index_agreement']:.2%} of codes")
    lines.append(f"load it without ddcl-vq: from diffusers import VQModel; VQModel.from_pretrained({str(out_dir)!r})")
    return "\n".join(lines)
