"""Why a trained DDCL run's dead codes are dead.

  python scripts/dead_codes.py RUN_DIR [--images 1000]

Reads RUN_DIR/eval.json (`ddcl-vq evaluate RUN_DIR`) and the checkpoint, and prints for the dead codes and the codes
in use: the share that has won no training vector since it was last re-seeded, and the median squared distance to
the nearest other code and to the nearest test feature, both over ``distance_scale``.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from ddcl_vq.tokenizer.evaluate import load_run
from ddcl_vq.tokenizer.gap import _features, _images
from ddcl_vq.common.data import build_dataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("--images", type=int, default=1000, help="test images whose features the distances use")
    parser.add_argument("--batch-vectors", type=int, default=None,
                        help="N, vectors a training batch (default: data.batch_size x latent positions)")
    args = parser.parse_args()
    run = Path(args.run_dir)
    if not (run / "eval.json").is_file():
        raise SystemExit(f"dead_codes: {run / 'eval.json'} not found: run `ddcl-vq evaluate {run}` first")
    cfg, model, _, _ = load_run(run)
    q = model.quantizer
    if not hasattr(q, "cluster_usage"):
        raise SystemExit(f"dead_codes: expected a DDCL run, got quantizer.type={cfg.quantizer['type']!r}")
    counts = torch.tensor(json.loads((run / "eval.json").read_text())["usage_counts"])
    dead = counts == 0
    z = _features(model, _images(build_dataset(cfg.data, "test"), args.images), 250)
    features = z.permute(0, 2, 3, 1).reshape(-1, z.shape[1])
    n = args.batch_vectors or cfg.data.batch_size * z.shape[2] * z.shape[3]
    share = n / q.num_codes
    t = torch.log((q.cluster_usage.double() / share).clamp_min(1e-300)) / math.log(q.decay)
    fresh = (t - t.round()).abs() < 1e-3  # usage = share · decay^t: no win since seeding
    w, scale = q.weight.detach().float(), float(q.distance_scale)
    print(f"{run}: K = {q.num_codes}, N = {n}, dead on the test split: {int(dead.sum())}; "
          f"no training vector won since the last re-seed: {int(fresh.sum())} codes")
    for name, mask in (("dead", dead), ("in use", ~dead)):
        rows = torch.nonzero(mask).flatten()[:2000]
        if len(rows) == 0:
            continue
        other = torch.cdist(w[rows], w).pow(2)
        other[torch.arange(len(rows)), rows] = float("inf")
        to_data = torch.stack([torch.cdist(w[rows], part).pow(2).min(1).values for part in features.split(8192)]).min(0)
        f = fresh[mask]
        print(f"  {name}: {f.double().mean():.1%} won nothing since the last re-seed"
              f" (median {t[mask][f].round().median():.0f} batches ago); median squared distance / scale:"
              f" to the nearest other code {float((other.min(1).values / scale).median()):.3f},"
              f" to the nearest test feature {float((to_data.values / scale).median()):.3f}"
              f" ({len(rows)} codes)")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
