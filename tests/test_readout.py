"""DDCLReadout and HierarchicalCompressor: identity, masking, linear cost, errors, a real-data run."""
import json

import pytest
import torch
from torch.overrides import TorchFunctionMode

from ddcl_vq import CodebookUsage, DDCLReadout, HierarchicalCompressor, prototype_param_groups


def make_readout(dim=8, k=6, seed=0, dtype=torch.float64, **kw):
    torch.manual_seed(seed)
    kw.setdefault("prototype_init", "normal")
    return DDCLReadout(dim, k, **kw).to(dtype)


def padded_batch(dim=8, dtype=torch.float64, seed=1):
    """Three sequences of lengths 7, 4, 1 padded to T=7; pads filled with huge values and a NaN."""
    g = torch.Generator().manual_seed(seed)
    lengths = [7, 4, 1]
    x = torch.randn(3, 7, dim, generator=g, dtype=dtype)
    mask = torch.arange(7)[None, :] < torch.tensor(lengths)[:, None]
    x[~mask] = 1e6
    x[1, 5, 0] = float("nan")
    return x, mask, lengths


# ----------------------------------------------------------------------------- decomposition

@pytest.mark.parametrize("tau", [1e-3, 0.1, 10.0])
def test_readout_decomposition_identity_float64(tau):
    readout = make_readout(temperature=tau)
    x, mask, _ = padded_batch()
    out = readout(x, mask)
    lq, ols, var = out.distortion.item(), out.ols.item(), out.variance.item()
    assert abs(lq - ols - var) <= 1e-10 * lq  # each term against its definition below
    # against the definitions, computed independently on the real tokens only
    z, w = x[mask], readout.prototypes
    d = (z[:, None] - w[None]).pow(2).sum(-1)
    q = torch.softmax(-d / (tau * 8), 1)
    soft = q @ w
    assert torch.allclose(out.distortion, (q * d).sum(1).mean(), rtol=1e-10)
    assert torch.allclose(out.ols, (z - soft).pow(2).sum(1).mean(), rtol=1e-8, atol=1e-12)
    assert torch.allclose(out.variance, (q * (w[None] - soft[:, None]).pow(2).sum(-1)).sum(1).mean(),
                          rtol=1e-8, atol=1e-12)
    assert torch.allclose(out.assignments[mask], q, atol=1e-12)
    assert torch.allclose(out.soft[mask], soft, atol=1e-10)
    assert torch.allclose(out.loss, out.distortion / 8)


def test_pooled_is_masked_mean_of_soft_summaries_and_a_convex_combination():
    readout = make_readout()
    x, mask, lengths = padded_batch()
    out = readout(x, mask)
    for b, n in enumerate(lengths):
        assert torch.allclose(out.pooled[b], out.soft[b, :n].mean(0), atol=1e-12)
        assert torch.allclose(out.histogram[b], out.assignments[b, :n].mean(0), atol=1e-12)
    assert torch.allclose(out.pooled, out.histogram @ readout.prototypes, atol=1e-10)
    assert torch.allclose(out.histogram.sum(1), torch.ones(3, dtype=torch.float64))
    assert (out.indices[~mask] == -1).all() and (out.indices[mask] >= 0).all()
    assert torch.equal(out.indices[mask], out.assignments[mask].argmax(1))
    assert out.pooled.shape == (3, 8) and out.soft.shape == (3, 7, 8) and out.assignments.shape == (3, 7, 6)


# ----------------------------------------------------------------------------- masking

def test_padding_changes_nothing_compared_with_truncation():
    readout = make_readout()
    x, mask, lengths = padded_batch()
    padded = readout(x, mask)
    for b, n in enumerate(lengths):
        # no mask, truncated to the real tokens. A matmul over a different number of rows may
        # round differently in the last bit, so per sequence: equal to float64 precision.
        alone = readout(x[b:b + 1, :n])
        same = dict(rtol=1e-12, atol=1e-14)
        assert torch.allclose(padded.pooled[b], alone.pooled[0], **same)
        assert torch.allclose(padded.soft[b, :n], alone.soft[0], **same)
        assert torch.allclose(padded.assignments[b, :n], alone.assignments[0], **same)
        assert torch.allclose(padded.histogram[b], alone.histogram[0], **same)
        assert torch.equal(padded.indices[b, :n], alone.indices[0])
        assert torch.equal(padded.soft[b, n:], torch.zeros_like(padded.soft[b, n:]))
        assert torch.equal(padded.assignments[b, n:], torch.zeros_like(padded.assignments[b, n:]))
    # batch-level terms: bit-identical to the same real tokens packed without any padding
    packed = readout(x[mask][None])
    assert torch.equal(padded.soft[mask], packed.soft[0])
    for name in ("distortion", "ols", "variance", "loss"):
        assert torch.equal(getattr(padded, name), getattr(packed, name)), name
    assert torch.equal(padded.soft_counts, packed.soft_counts)
    assert torch.isfinite(padded.pooled).all() and torch.isfinite(padded.loss)


def test_pad_values_do_not_matter_and_get_no_gradient():
    readout = make_readout()
    x, mask, _ = padded_batch()
    x2 = x.clone()
    x2[~mask] = -3.0
    a = readout(x, mask)
    b = readout(x2, mask)
    assert torch.equal(a.pooled, b.pooled) and torch.equal(a.loss, b.loss)
    x = x.clone().requires_grad_(True)
    out = readout(x, mask)
    (out.pooled.pow(2).sum() + out.soft.sum() + out.assignments.sum() + out.loss).backward()
    assert torch.equal(x.grad[~mask], torch.zeros_like(x.grad[~mask]))
    assert x.grad[mask].abs().sum() > 0
    assert readout.prototypes.grad.abs().sum() > 0


@pytest.mark.parametrize("to_tokens, task_to_protos", [(True, True), (False, True), (True, False), (False, False)])
def test_gradient_routing_flags(to_tokens, task_to_protos):
    x, mask, _ = padded_batch()
    ref = make_readout()(x, mask)
    readout = make_readout(distortion_to_tokens=to_tokens, task_grad_to_prototypes=task_to_protos)
    xg = x.clone().requires_grad_(True)
    out = readout(xg, mask)
    for name in ("pooled", "soft", "distortion", "ols", "variance", "loss"):   # values never change
        assert torch.allclose(getattr(out, name), getattr(ref, name), rtol=1e-12, atol=1e-14), name
    g_tok, g_proto = torch.autograd.grad(out.loss, (xg, readout.prototypes), retain_graph=True, allow_unused=True)
    assert (g_tok is not None and g_tok[mask].abs().sum() > 0) == to_tokens
    assert g_proto.abs().sum() > 0                          # the distortion always trains prototypes
    g_tok, g_proto = torch.autograd.grad(out.pooled.pow(2).sum(), (xg, readout.prototypes), allow_unused=True)
    assert g_tok[mask].abs().sum() > 0                      # the task always reaches the tokens through q
    assert (g_proto is not None and g_proto.abs().sum() > 0) == task_to_protos


def test_usage_statistics_count_real_tokens_only():
    readout = make_readout()
    x, mask, lengths = padded_batch()
    out = readout(x, mask)
    usage = CodebookUsage(6)
    usage.update(out.usage_indices, out.soft_counts)
    stats = usage.compute()
    assert stats.num_vectors == sum(lengths) == out.usage_indices.numel()
    assert torch.allclose(out.soft_counts.sum(), torch.tensor(float(sum(lengths)), dtype=torch.float64))


def test_float32_and_autocast_inputs():
    torch.manual_seed(0)
    readout = DDCLReadout(16, 8, prototype_init="normal")
    x = torch.randn(2, 5, 16)
    out = readout(x)
    assert out.pooled.dtype == torch.float32
    assert abs(out.distortion - out.ols - out.variance) <= 1e-5 * out.distortion
    out16 = readout(x.bfloat16())
    assert out16.pooled.dtype == torch.bfloat16 and out16.distortion.dtype == torch.float32


def test_kmeans_init_places_prototypes_on_the_tokens():
    torch.manual_seed(0)
    readout = DDCLReadout(4, 3)  # default prototype_init="kmeans"
    centers = torch.tensor([[10.0, 0, 0, 0], [0, 10.0, 0, 0], [0, 0, 10.0, 0]])
    x = (centers.repeat_interleave(20, 0) + 0.01 * torch.randn(60, 4))[None]
    out = readout(x)
    assert bool(readout.initialized)
    dist = torch.cdist(readout.prototypes.detach(), centers).min(1).values
    assert dist.max() < 0.1
    assert CodebookUsage(3).__class__  # sanity
    assert len(set(out.indices[0].tolist())) == 3


# ----------------------------------------------------------------------------- linear cost

MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm, torch.bmm,
           torch.Tensor.bmm, torch.mv, torch.Tensor.mv, torch.nn.functional.linear}


class WorkCounter(TorchFunctionMode):
    """Counts work at the torch-function level: matmul FLOPs (2·M·N·inner from the operand shapes),
    the total number of elements every function produces, and the largest tensor produced."""

    def __init__(self):
        super().__init__()
        self.matmul_flops = 0
        self.elements = 0
        self.largest = 0
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls.append(getattr(func, "__name__", str(func)))
        if func in MATMULS:
            a = args[0]
            inner = a.shape[-1]
            self.matmul_flops += 2 * inner * out.numel()
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.elements += t.numel()
                self.largest = max(self.largest, t.numel())
        return out


def work(module, t):
    x = torch.randn(2, t, 16)
    with WorkCounter() as counter:
        module(x)
    return counter


def test_readout_cost_is_linear_in_sequence_length():
    torch.manual_seed(0)
    readout = DDCLReadout(16, 8, prototype_init="normal")
    w1, w2, w4 = work(readout, 64), work(readout, 128), work(readout, 256)
    assert w1.matmul_flops > 0 and w1.calls == w2.calls == w4.calls   # same program at every length
    assert w2.matmul_flops == 2 * w1.matmul_flops and w4.matmul_flops == 4 * w1.matmul_flops
    assert w2.largest == 2 * w1.largest and w4.largest == 4 * w1.largest   # no T x T intermediate
    # total elements produced: affine in T (per-token work doubles; per-sequence/scalar parts stay)
    assert w4.elements - w2.elements == 2 * (w2.elements - w1.elements) > 0
    # the counter would see a quadratic op: T x T attention scores
    with WorkCounter() as c1:
        torch.randn(64, 16) @ torch.randn(64, 16).t()
    with WorkCounter() as c2:
        torch.randn(128, 16) @ torch.randn(128, 16).t()
    assert c2.matmul_flops == 4 * c1.matmul_flops


def test_compressor_cost_is_linear_in_sequence_length():
    torch.manual_seed(0)
    comp = HierarchicalCompressor(16, [4, 4], 8, prototype_init="normal")
    w1, w2 = work(comp, 64), work(comp, 128)
    assert w1.matmul_flops > 0 and w2.matmul_flops == 2 * w1.matmul_flops
    assert w2.largest == 2 * w1.largest


# ----------------------------------------------------------------------------- compressor

def test_compressor_ratios_shapes_and_errors():
    torch.manual_seed(0)
    comp = HierarchicalCompressor(8, [4, 3, 2], [8, 6, 4], prototype_init="normal").double()
    x = torch.randn(2, 48, 8, dtype=torch.float64)
    out = comp(x)
    assert [lvl.shape for lvl in out.levels] == [(2, 12, 8), (2, 4, 8), (2, 2, 8)]
    assert out.summaries.shape == (2, 2, 8) and out.mask.all()
    assert out.ratios.tolist() == [4.0, 3.0, 2.0]
    assert out.cumulative_ratios.tolist() == [4.0, 12.0, 24.0]
    assert out.errors.shape == out.cumulative_errors.shape == (3,)
    assert torch.equal(out.errors[0], out.cumulative_errors[0])
    assert (out.errors >= 0).all() and (out.cumulative_errors >= 0).all()
    assert torch.allclose(out.loss, sum(s.loss for s in out.stages))
    # stage 1 error by hand: every token reconstructed by its window's pooled summary
    summ = out.stages[0].pooled.reshape(2, 12, 8)
    rec = summ.repeat_interleave(4, 1)
    expect = (x - rec).pow(2).sum() / (x - x.reshape(-1, 8).mean(0)).pow(2).sum()
    assert torch.allclose(out.errors[0], expect)
    # cumulative error of stage 3: every original token reconstructed by its top-level summary
    rec3 = out.summaries.repeat_interleave(24, 1)
    expect3 = (x - rec3).pow(2).sum() / (x - x.reshape(-1, 8).mean(0)).pow(2).sum()
    assert torch.allclose(out.cumulative_errors[2], expect3)


def test_compressor_with_ragged_masks():
    torch.manual_seed(0)
    comp = HierarchicalCompressor(8, [4, 2], 5, prototype_init="normal")
    x = torch.randn(2, 10, 8)
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[0, :10] = True
    mask[1, :3] = True
    out = comp(x, mask)
    assert out.masks[0].tolist() == [[True, True, True], [True, False, False]]
    assert out.masks[1].tolist() == [[True, True], [True, False]]
    assert torch.allclose(out.ratios, torch.tensor([13 / 4, 4 / 3], dtype=torch.float64))
    assert torch.allclose(out.cumulative_ratios, torch.tensor([13 / 4, 13 / 3], dtype=torch.float64))
    # the short sequence's summaries equal those of the same sequence alone, unpadded
    alone = comp(x[1:, :3])
    assert torch.allclose(out.levels[0][1, 0], alone.levels[0][0, 0], atol=1e-6)
    assert torch.equal(out.levels[0][1, 1:], torch.zeros(2, 8))


def test_compressor_is_perfect_when_windows_are_constant_and_prototypes_fit():
    centers = torch.eye(4, dtype=torch.float64) * 5
    comp = HierarchicalCompressor(4, [3], 4, temperature=1e-3, prototype_init="normal").double()
    with torch.no_grad():
        comp.stages[0].prototypes.copy_(centers)
    x = centers[torch.tensor([0, 2, 1, 3])].repeat_interleave(3, 0)[None]  # 4 constant windows
    out = comp(x)
    assert out.errors[0] < 1e-10 and out.ratios[0] == 3.0


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("make_input, words", [
    (lambda: torch.randn(2, 8), ["rank 3", "got rank 2"]),
    (lambda: torch.randn(2, 3, 5), ["D=8", "(2, 3, 5)"]),
    (lambda: torch.randint(0, 3, (2, 3, 8)), ["floating-point", "int64"]),
    (lambda: [[0.0] * 8], ["torch.Tensor", "list"]),
    (lambda: torch.randn(0, 3, 8), ["at least one", "(0, 3, 8)"]),
])
def test_bad_tokens(make_input, words):
    readout = make_readout(dtype=torch.float32)
    with pytest.raises(ValueError) as err:
        readout(make_input())
    for w in words:
        assert w in str(err.value)


@pytest.mark.parametrize("make_mask, words", [
    (lambda: torch.ones(2, 3, dtype=torch.long), ["bool mask", "int64", "mask.bool()"]),
    (lambda: torch.ones(2, 4, dtype=torch.bool), ["(2, 3)", "(2, 4)"]),
    (lambda: torch.tensor([[True, True, True], [False, False, False]]), ["all-masked rows [1]"]),
    (lambda: [[True] * 3] * 2, ["bool torch.Tensor", "list"]),
])
def test_bad_masks(make_mask, words):
    readout = make_readout(dtype=torch.float32)
    with pytest.raises(ValueError) as err:
        readout(torch.randn(2, 3, 8), make_mask())
    for w in words:
        assert w in str(err.value)


def test_nan_in_a_real_token_is_an_error_but_not_in_a_pad():
    readout = make_readout(dtype=torch.float32)
    x = torch.randn(1, 3, 8)
    x[0, 2, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN/Inf"):
        readout(x)
    out = readout(x, torch.tensor([[True, True, False]]))
    assert torch.isfinite(out.pooled).all()


@pytest.mark.parametrize("kwargs, words", [
    (dict(dim=0, num_prototypes=4), ["dim", "0"]),
    (dict(dim=4, num_prototypes=0), ["num_prototypes", "0"]),
    (dict(dim=4, num_prototypes=4, temperature=0.0), ["temperature > 0", "0.0"]),
    (dict(dim=4, num_prototypes=4, temperature=float("nan")), ["temperature", "nan"]),
    (dict(dim=4, num_prototypes=4, loss_weight=-1.0), ["loss_weight", "-1.0"]),
    (dict(dim=4, num_prototypes=4, prototype_init="zeros"), ["prototype_init", "zeros"]),
])
def test_bad_constructor_arguments(kwargs, words):
    with pytest.raises(ValueError) as err:
        DDCLReadout(**kwargs)
    for w in words:
        assert w in str(err.value)


@pytest.mark.parametrize("windows, k, words", [
    ([], 4, ["at least one stage"]),
    ([2, 0], 4, ["window", "0"]),
    ([2, 2], [4], ["one num_prototypes per stage (2)", "got 1"]),
    (3, 4, ["sequence of positive ints", "3"]),
])
def test_bad_compressor_arguments(windows, k, words):
    with pytest.raises(ValueError) as err:
        HierarchicalCompressor(4, windows, k)
    for w in words:
        assert w in str(err.value)


def test_prototype_param_groups_and_timescale_warning():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), DDCLReadout(4, 3))
    groups = prototype_param_groups(model, 1e-3, 10.0)
    assert [g["lr"] for g in groups] == [1e-3, pytest.approx(1e-2)]
    assert groups[1]["params"][0] is model[1].prototypes
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    with pytest.warns(UserWarning, match="timescale"):
        prototype_param_groups(model, 1e-3, 1.0)
    with pytest.raises(ValueError, match="DDCLReadout"):
        prototype_param_groups(torch.nn.Linear(2, 2), 1e-3)


# ----------------------------------------------------------------------------- the study, on real data

def test_study_arms_share_the_encoder_initialisation():
    from ddcl_vq.models import PatchTransformer

    def build(kind):
        torch.manual_seed(0)
        return PatchTransformer(kind, 49, 16, 32, 1, 2, 10, 8, 0.1, 1.0, True)

    a, b, c = build("mean"), build("cls"), build("ddcl")
    for name, p in a.named_parameters():
        assert torch.equal(p, dict(b.named_parameters())[name]) and torch.equal(p, dict(c.named_parameters())[name])


def test_help_explains(capsys):
    from ddcl_vq.studies.readout.cli import main
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for word in ("mean pooling", "class token", "DDCL readout", "--quick", "--out", "results.json"):
        assert word in text


def test_quick_study_on_real_data(tmp_path):
    pytest.importorskip("matplotlib")
    from ddcl_vq.common.data import DataUnavailable
    from ddcl_vq.studies.readout.cli import main

    try:
        rc = main(["--quick", "--out", str(tmp_path), "--no-progress", "--arms", "mean,ddcl"])
    except DataUnavailable as err:
        pytest.skip(str(err))
    assert rc == 0
    res = json.loads((tmp_path / "results.json").read_text())
    for name in ("mean", "ddcl"):
        assert res["arms"][name]["test_accuracy"] > 0.2, res["arms"][name]["test_accuracy"]  # chance: 0.10
    ddcl = res["arms"]["ddcl"]
    log = ddcl["train_log"]
    # The distortion is computed on stop-gradient tokens: the encoder first spreads its tokens out
    # (distortion up from the k-means fit of the random encoder's tokens), then the prototypes,
    # which learn from it, catch up (distortion down from the peak).
    peak = max(range(len(log)), key=lambda i: log[i]["distortion"])
    assert peak < len(log) - 1 and log[-1]["distortion"] < 0.85 * log[peak]["distortion"]
    assert log[-1]["ce"] < log[0]["ce"] - 0.3
    assert ddcl["identity_max"] < 1e-4
    assert all(abs(r["distortion"] - r["ols"] - r["variance"]) <= 1e-4 * r["distortion"] for r in log)
    assert ddcl["usage"]["utilization"] > 0.05 and ddcl["usage"]["perplexity"] > 2
    comp = res["compressor"]["stages"]
    assert [round(s["cumulative_ratio"], 2) for s in comp] == [1.96, 3.77, 7.0, 12.25, 24.5, 49.0]
    assert all(0 <= s["cumulative_error"] for s in comp)
    for f in ("report.md", "accuracy.png", "ddcl_terms.png", "compressor.png"):
        assert (tmp_path / f).stat().st_size > 0
    assert "| ddcl |" in (tmp_path / "report.md").read_text()
