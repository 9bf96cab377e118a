"""``ddcl-vq prior evaluate``: test NLL, and sample quality in a small classifier's feature space."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from ddcl_vq.prior.classifier import ClassifierUnavailable, features, frechet_distance, get_classifier, predict, real_images
from ddcl_vq.prior.data import load_tokenizer, load_tokens, tokenizer_info
from ddcl_vq.prior.sampling import sample_codes
from ddcl_vq.prior.train import load_prior, nll_bits

DEFINITIONS = """\
bits/token      = mean over every code of the test token file of -log2 p(code | class, earlier codes
                  in raster order); a uniform prior scores log2 K
bits/image      = bits/token x h x w (the code length of one image under the prior)
FD (classifier) = Frechet distance between Gaussians fitted to the 128 penultimate features of a small
                  CNN trained here on the tokenizer's dataset (train split) — of real test images and
                  of decoded samples. NOT Inception FID; not comparable to published FIDs; biased
                  upward at small counts: compare only at equal counts, same classifier
FD recon        = the same distance for the tokenizer's own reconstructions of the test tokens: the
                  floor a perfect prior over these codes would reach (what the codebook alone costs)
class accuracy  = the classifier's accuracy on samples drawn for each class (class-conditional
                  priors), beside its accuracy on real test images"""


def evaluate_prior(prior_dir: str | Path, test_tokens: Optional[List[str]] = None, max_test: int = 0,
                   samples: int = 1000, real: int = 0, temperature: float = 1.0, top_k: int = 0, seed: int = 0,
                   cache_dir: Optional[str] = None, classifier_steps: int = 1000, batch_size: int = 250,
                   device: str = "cpu", progress: bool = False, write: bool = True) -> Dict:
    """Evaluate a prior directory; writes PRIOR_DIR/eval.json and PRIOR_DIR/samples.png (``write``)."""
    from torchvision.utils import save_image
    from ddcl_vq.tokenizer.decode import decode_indices
    prior_dir = Path(prior_dir)
    cfg, model, meta = load_prior(prior_dir, device)
    result: Dict = {"prior": str(prior_dir), "step": meta["step"], "num_codes": model.num_codes,
                    "grid": [model.height, model.width], "num_classes": model.num_classes,
                    "tokenizer": cfg.data.tokenizer, "uniform_bits_per_token": math.log2(model.num_codes)}
    nll, first_test = [], None
    for path in test_tokens or cfg.data.test_tokens:
        tokens = load_tokens(path, model.num_codes, "test token file")
        if model.num_classes and tokens.labels is None:
            raise ClassifierUnavailable(f"test token file {path!r} has no labels; this prior is class-conditional")
        nll.append({"file": str(path), **nll_bits(model, tokens, batch_size, max_test, device)})
        first_test = first_test or tokens
    result.update(nll=nll[0] if nll else None, nll_files=nll)

    decoder = load_tokenizer(cfg.data.tokenizer, device)
    labels = torch.arange(samples) % model.num_classes if model.num_classes else None
    t0 = time.perf_counter()
    codes = sample_codes(model, samples, labels, temperature, top_k, seed, batch_size, device)
    seconds = time.perf_counter() - t0
    images = decode_indices(decoder, codes.numpy(), batch_size, device)
    result["samples"] = {"count": samples, "temperature": temperature, "top_k": top_k, "seed": seed,
                         "seconds": round(seconds, 3), "tokens_per_second": round(codes.numel() / seconds, 1),
                         "codes_used": int(codes.unique().numel())}
    if write:
        shown = min(samples, 10 * max(model.num_classes, 8))
        save_image(images[:shown], str(prior_dir / "samples.png"), nrow=model.num_classes or 8, padding=2)

    data_cfg = tokenizer_info(cfg.data.tokenizer)["data"]
    result["frechet"], result["classifier"], result["class_accuracy"] = None, None, None
    try:
        if data_cfg is None:
            raise ClassifierUnavailable("the tokenizer does not say which dataset it was trained on")
        classifier, info = get_classifier(data_cfg, cache_dir, classifier_steps, 0, device, progress)
    except ClassifierUnavailable as err:
        result["frechet_unavailable"] = str(err)
    else:
        result["classifier"] = info
        x_real, y_real = real_images(data_cfg, "test", real)
        f_real = features(classifier, x_real, device=device)
        fd = {"samples_vs_real": frechet_distance(features(classifier, images, device=device), f_real),
              "num_samples": samples, "num_real": len(x_real), "feature_space": "penultimate layer (128) of a small "
              f"CNN trained here on {data_cfg.name} (test accuracy {info['test_accuracy']:.1%})",
              "note": "not Inception FID; not comparable to published FIDs"}
        if first_test is not None:
            n = min(len(first_test.codes), len(x_real), samples)
            recon = decode_indices(decoder, first_test.codes[:n].numpy(), batch_size, device)
            fd["reconstructions_vs_real"] = frechet_distance(features(classifier, recon, device=device), f_real)
            fd["num_reconstructions"] = n
        result["frechet"] = fd
        if labels is not None:
            pred = predict(classifier, images, device=device)
            per = {int(c): float((pred[labels == c] == c).float().mean()) for c in range(model.num_classes)
                   if (labels == c).any()}
            result["class_accuracy"] = {"mean": float((pred == labels).float().mean()), "per_class": per,
                                        "classifier_on_real": info["test_accuracy"]}
    result["definitions"] = DEFINITIONS
    if write:
        (prior_dir / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def format_eval(result: Dict) -> str:
    lines = []
    n = result.get("nll")
    if n:
        lines.append(f"test NLL ({n['num_images']} maps of {Path(n['file']).name}): {n['bits_per_token']:.4f} "
                     f"bits/token, {n['bits_per_image']:.1f} bits/image (uniform: "
                     f"{result['uniform_bits_per_token']:.3f} bits/token)")
    s = result["samples"]
    lines.append(f"{s['count']} samples (temperature {s['temperature']}, top-k {s['top_k'] or 'off'}): "
                 f"{s['seconds']:.1f} s, {s['tokens_per_second']:.0f} tokens/s, {s['codes_used']} codes used")
    fd = result.get("frechet")
    if fd:
        lines.append(f"Fréchet distance in classifier features (NOT Inception FID): samples {fd['samples_vs_real']:.3f}"
                     + (f", tokenizer reconstructions {fd['reconstructions_vs_real']:.3f}"
                        if "reconstructions_vs_real" in fd else "") + f" (vs {fd['num_real']} real test images)")
    elif result.get("frechet_unavailable"):
        lines.append(f"Fréchet distance: not computed ({result['frechet_unavailable']})")
    ca = result.get("class_accuracy")
    if ca:
        per = " ".join(f"{c}:{a:.0%}" for c, a in ca["per_class"].items())
        lines.append(f"class accuracy of samples: {ca['mean']:.1%} (per class {per}); the classifier on real test "
                     f"images: {ca['classifier_on_real']:.1%}")
    lines.append("definitions:\n  " + DEFINITIONS.replace("\n", "\n  "))
    return "\n".join(lines)
