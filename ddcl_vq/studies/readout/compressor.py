"""The hierarchical compressor trained on the DDCL arm's frozen tokens, next to window-mean pooling."""
from __future__ import annotations

from typing import Dict, List

import torch
import torch.nn.functional as F
from torch import Tensor

from ddcl_vq import CodebookUsage
from ddcl_vq.models import PatchTransformer

from ddcl_vq.studies.readout.train import to_float, train_compressor


@torch.no_grad()
def features(model: PatchTransformer, tokens_u8: Tensor, batch: int = 1000) -> Tensor:
    model.eval()
    outs = [model.tokens(to_float(tokens_u8[i:i + batch])) for i in range(0, len(tokens_u8), batch)]
    return torch.cat([h[:, 1:] if model.cls is not None else h for h in outs])  # without the class token


@torch.no_grad()
def window_mean_errors(tokens: Tensor, windows: List[int]) -> List[float]:
    """Cumulative relative error of plain window-mean pooling over the same windows (no masks)."""
    b, t0, d = tokens.shape
    x, pos, errs = tokens, torch.arange(t0).expand(b, t0), []
    total = (tokens - tokens.reshape(-1, d).mean(0)).pow(2).sum().double()
    for w in windows:
        t = x.shape[1]
        n = -(-t // w)
        pad = n * w - t
        xw = F.pad(x, (0, 0, 0, pad)).reshape(b, n, w, d)
        cnt = F.pad(torch.ones(b, t), (0, pad)).reshape(b, n, w).sum(2, keepdim=True)
        x = xw.sum(2) / cnt
        pos = torch.div(pos, w, rounding_mode="floor")
        rec = torch.gather(x, 1, pos[..., None].expand(b, t0, d))
        errs.append(float((tokens - rec).pow(2).sum().double() / total))
    return errs


def run_compressor(args, model: PatchTransformer, train_u8: Tensor, test_u8: Tensor, show_progress: bool) -> Dict:
    ftr = features(model, train_u8[:args.compressor_train])
    fte = features(model, test_u8[:args.compressor_test])
    comp, first_loss, last_loss, wall = train_compressor(args, ftr, show_progress)
    comp.eval()
    with torch.no_grad():
        out = comp(fte)
        per_stage_usage = []
        for st, readout in zip(out.stages, comp.stages):
            u = CodebookUsage(readout.num_prototypes)
            u.update(st.usage_indices, st.soft_counts)
            s = u.compute()
            per_stage_usage.append({"utilization": s.utilization, "perplexity": s.perplexity})
    mean_errs = window_mean_errors(fte, args.windows)
    stages = [{"stage": s + 1, "window": w, "num_prototypes": comp.stages[s].num_prototypes,
               "tokens_out_per_sequence": int(out.masks[s][0].sum()), "ratio": float(out.ratios[s]),
               "cumulative_ratio": float(out.cumulative_ratios[s]), "stage_error": float(out.errors[s]),
               "cumulative_error": float(out.cumulative_errors[s]), "window_mean_cumulative_error": mean_errs[s],
               "distortion": float(out.stages[s].distortion), "ols": float(out.stages[s].ols),
               "variance": float(out.stages[s].variance), **per_stage_usage[s]} for s, w in enumerate(args.windows)]
    return {"source_arm": model.kind, "tokens_per_sequence": int(fte.shape[1]), "windows": args.windows,
            "train_sequences": len(ftr), "test_sequences": len(fte), "steps": args.compressor_steps,
            "train_loss_first": first_loss, "train_loss_last": last_loss, "train_wall_s": wall, "stages": stages}
