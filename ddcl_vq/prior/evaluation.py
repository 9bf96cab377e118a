"""``ddcl-vq prior evaluate``: test NLL, and sample quality in a small classifier's feature space.

A small CNN trained on the tokenizer's own dataset gives the feature space (its 128 penultimate features), and

    FD = ||mu_a − mu_b||² + Tr(S_a + S_b − 2 (S_a S_b)^½)

between the features of real test images and of samples: NOT Inception FID (see DEFINITIONS). The classifier is cached
(``--cache-dir``; default ``$DDCL_VQ_CACHE`` or ``~/.cache/ddcl-vq``) under a name made of its dataset and settings.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np
from torch import Tensor

from ddcl_vq.common.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, write_json
from ddcl_vq.models.classifier import SmallClassifier
from ddcl_vq.prior.classifier_train import ClassifierUnavailable, batched, dataset_tensors, train_classifier
from ddcl_vq.prior.data import load_tokens, tokenizer_dataset
from ddcl_vq.prior.sampling import sample_codes, sample_labels
from ddcl_vq.prior.train import load_prior, nll_bits

ARCH = "cnn3-16-32-64-v1"   # bump when the architecture or training recipe changes: old caches are not reused


def frechet_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Fréchet distance between Gaussians fitted to two feature sets (N, F) and (M, F), in float64
    (Tr((S_a S_b)^½) = Σ √eig(S_a^½ S_b S_a^½))."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"expected two (N, F) feature arrays with the same F, got {a.shape} and {b.shape}")
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"expected at least 2 vectors per set, got {len(a)} and {len(b)}")
    mu_a, mu_b = a.mean(0), b.mean(0)
    s_a, s_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    w, v = np.linalg.eigh(s_a)
    root_a = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    m = root_a @ s_b @ root_a
    trace_root = np.sqrt(np.clip(np.linalg.eigvalsh((m + m.T) / 2), 0, None)).sum()
    fd = float(((mu_a - mu_b) ** 2).sum() + np.trace(s_a) + np.trace(s_b) - 2 * trace_root)
    return max(fd, 0.0)


def get_classifier(data_cfg, cache_dir: Optional[str | Path] = None, steps: int = 1000, seed: int = 0,
                   device="cpu", progress: bool = False) -> Tuple[SmallClassifier, Dict]:
    """The cached classifier for this dataset and settings, trained (and cached) when missing."""
    spec = {"arch": ARCH, "dataset": data_cfg.name, "image_size": data_cfg.image_size, "steps": steps, "seed": seed,
            "batch_size": 128, "lr": 2e-3}
    digest = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    cache = Path(cache_dir or os.environ.get("DDCL_VQ_CACHE") or Path.home() / ".cache" / "ddcl-vq")
    path = cache / f"classifier_{data_cfg.name}_{data_cfg.image_size}_{digest}.pt"
    if path.is_file():
        try:
            state = load_checkpoint(path)
            info = state["info"]
            model = SmallClassifier(info["channels"], info["classes"], data_cfg.image_size)
            model.load_state_dict(state["model"])
            return model.to(device).eval(), {**info, "cache": str(path), "cached": True}
        except (CheckpointError, KeyError, RuntimeError):
            pass  # an unreadable or stale cache entry: train again and replace it
    model, info = train_classifier(data_cfg, steps, seed, device, progress)
    info = {**info, **spec}
    save_checkpoint({"model": model.state_dict(), "step": steps, "info": info}, path)
    return model, {**info, "cache": str(path), "cached": False}


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
    from ddcl_vq.common.data import build_dataset
    from ddcl_vq.tokenizer.decode import decode_indices, save_png
    from ddcl_vq.tokenizer.tokens import load_source
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

    decoder, tokenizer_cfg, _ = load_source(cfg.data.tokenizer, device=device)
    labels = sample_labels(model, samples)
    t0 = time.perf_counter()
    codes = sample_codes(model, samples, labels, temperature, top_k, seed, batch_size, device)
    seconds = time.perf_counter() - t0
    images = decode_indices(decoder, codes.numpy(), batch_size, device)
    result["samples"] = {"count": samples, "temperature": temperature, "top_k": top_k, "seed": seed,
                         "seconds": round(seconds, 3), "tokens_per_second": round(codes.numel() / seconds, 1),
                         "codes_used": int(codes.unique().numel())}
    if write:
        shown = min(samples, 10 * max(model.num_classes, 8))
        save_png(images[:shown], prior_dir / "samples.png", model.num_classes or 8)

    data_cfg = tokenizer_dataset(decoder, tokenizer_cfg)
    result["frechet"], result["classifier"], result["class_accuracy"] = None, None, None
    try:
        if data_cfg is None:
            raise ClassifierUnavailable("the tokenizer does not say which dataset it was trained on")
        classifier, info = get_classifier(data_cfg, cache_dir, classifier_steps, 0, device, progress)
    except ClassifierUnavailable as err:
        result["frechet_unavailable"] = str(err)
    else:
        result["classifier"] = info

        def features(x: Tensor) -> np.ndarray:
            return batched(classifier.features, x, device).double().numpy()
        x_real, _ = dataset_tensors(build_dataset(data_cfg, "test", 0), real)
        f_real = features(x_real)
        fd = {"samples_vs_real": frechet_distance(features(images), f_real),
              "num_samples": samples, "num_real": len(x_real), "feature_space": "penultimate layer (128) of a small "
              f"CNN trained here on {data_cfg.name} (test accuracy {info['test_accuracy']:.1%})",
              "note": "not Inception FID; not comparable to published FIDs"}
        if first_test is not None:
            n = min(len(first_test.codes), len(x_real), samples)
            recon = decode_indices(decoder, first_test.codes[:n].numpy(), batch_size, device)
            fd["reconstructions_vs_real"] = frechet_distance(features(recon), f_real)
            fd["num_reconstructions"] = n
        result["frechet"] = fd
        if labels is not None:
            pred = batched(lambda x: classifier(x).argmax(1), images, device)
            per = {int(c): float((pred[labels == c] == c).float().mean()) for c in range(model.num_classes)
                   if (labels == c).any()}
            result["class_accuracy"] = {"mean": float((pred == labels).float().mean()), "per_class": per,
                                        "classifier_on_real": info["test_accuracy"]}
    result["definitions"] = DEFINITIONS
    if write:
        write_json(prior_dir / "eval.json", result)
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
