"""The training step's speed work changes no values: the M-step statistics, computed in cached
blocks with in-place passes, against a frozen copy of the dense computation they replaced; the
quantizer trained for a few steps with either gives the same indices, revivals and codebook."""
import pytest
import torch

import ddcl_vq.ddcl.quantizer as ddcl_module
from ddcl_vq import DDCLQuantizer
from ddcl_vq.blocks import first_min
from ddcl_vq.ddcl.statistics import SoftStatistics, soft_statistics, statistics_rows
from ddcl_vq.base import squared_distances


@torch.no_grad()
def dense_statistics(z, codebook, scale, rows=None, support=None, split=True, keep_soft=False):
    """The M-step statistics as first written (blocks of ≈ 2**22 elements up to 4096 rows,
    out-of-place passes; ``support``: the truncated path; ``split`` is ignored: every term is computed): the
    reference the faster code must equal (training only: no ``keep_soft``)."""
    assert not keep_soft
    n, k = z.shape[0], codebook.shape[0]
    truncated = support is not None and support < k
    rows = rows or max(64, min(4096, (1 << 22) // max(k, 1)))
    center = codebook.mean(0)
    w = codebook - center
    w_sq = w.pow(2).sum(1)
    indices = torch.empty(n, dtype=torch.long)
    nearest = torch.empty(n, dtype=z.dtype)
    mass = torch.zeros(k, dtype=z.dtype)
    sums = torch.zeros_like(w)
    totals = z.new_zeros(3)
    for start in range(0, n, rows):
        x = z[start:start + rows] - center
        d = squared_distances(x, w)
        if truncated:
            d_top, code = torch.topk(d, support, dim=1, largest=False, sorted=True)
            dmin, idx = d_top[:, 0], code[:, 0]
            indices[start:start + rows] = idx
            nearest[start:start + rows] = dmin
            q = torch.softmax((dmin[:, None] - d_top) / scale, 1)
            mass.index_add_(0, code.reshape(-1), q.reshape(-1))
            sums.index_add_(0, code.reshape(-1), (q[:, :, None] * x[:, None, :]).reshape(-1, x.shape[1]))
            soft = torch.einsum("rs,rsd->rd", q, w[code])
            totals[0] += (q * d_top).sum()
            totals[1] += (x - soft).pow(2).sum()
            totals[2] += ((q * w_sq[code]).sum(1) - soft.pow(2).sum(1)).clamp_min(0).sum()
            continue
        dmin, idx = d.min(1)
        indices[start:start + rows] = idx
        nearest[start:start + rows] = dmin
        q = torch.softmax((dmin[:, None] - d) / scale, 1)
        mass += q.sum(0)
        sums += q.t() @ x
        soft = q @ w
        totals[0] += (q * d).sum()
        totals[1] += (x - soft).pow(2).sum()
        totals[2] += (q @ w_sq - soft.pow(2).sum(1)).clamp_min(0).sum()
    totals /= max(n, 1)
    sums += mass[:, None] * center
    return SoftStatistics(indices=indices, nearest=nearest, mass=mass, sums=sums,
                          distortion=totals[0], ols=totals[1], variance=totals[2])


def features(n, d, k, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(n, d, generator=g) * 2 + 0.3).to(dtype)
    w = torch.randn(k, d, generator=g).to(dtype)
    return z, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n, d, k", [(2048, 16, 512), (1000, 8, 300), (77, 4, 50), (129, 3, 1000), (0, 4, 8)])
def test_blocked_statistics_equal_the_dense_computation(n, d, k, dtype):
    z, w = features(n, d, k, seed=k, dtype=dtype)
    scale = 0.1 * float(squared_distances(z, w).min(1).values.mean()) if n else 1.0
    ref = dense_statistics(z, w, scale)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    for rows in (None, 64, 100):
        s = soft_statistics(z, w, scale, rows=rows)
        assert torch.equal(s.indices, ref.indices)
        if rows is None and dtype == torch.float32:       # the default blocks: the same bits (float64
            assert torch.equal(s.nearest, ref.nearest)    # GEMMs may round a row by its block's size)
        torch.testing.assert_close(s.nearest, ref.nearest, **tol)
        for name in ("mass", "sums", "distortion", "ols", "variance"):
            torch.testing.assert_close(getattr(s, name), getattr(ref, name), **tol, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_truncated_statistics_equal_the_first_implementation(dtype):
    z, w = features(700, 8, 600, seed=2, dtype=dtype)
    scale = 0.1 * float(squared_distances(z, w).min(1).values.mean())
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    for rows in (None, 100):
        ref, s = dense_statistics(z, w, scale, rows=rows, support=16), soft_statistics(z, w, scale, rows=rows, support=16)
        assert torch.equal(s.indices, ref.indices)
        for name in ("nearest", "mass", "sums", "distortion", "ols", "variance"):
            torch.testing.assert_close(getattr(s, name), getattr(ref, name), **tol, msg=name)


def test_first_min_is_exactly_min_with_ties():
    g = torch.Generator().manual_seed(0)
    for k in (1, 5, 127, 128, 256, 300, 1000, 1024):
        x = torch.randint(0, 4, (33, k), generator=g).float()
        values, indices = first_min(x)
        ref = x.min(1)
        assert torch.equal(values, ref.values) and torch.equal(indices, ref.indices), k


def test_statistics_blocks_are_cache_sized_on_the_cpu():
    assert statistics_rows(512) == 512 and statistics_rows(1024) == 256 and statistics_rows(300) % 64 == 0
    assert statistics_rows(1 << 20) == 64 and statistics_rows(2) == 4096
    assert statistics_rows(512, "cuda") == 4096 and statistics_rows(8192, truncated=True) == 512


def run_quantizer(monkeypatch, statistics, steps=25):
    """A DDCL quantizer (defaults: M-step, k-means start, data-relative τ, revival) on a drifting
    stream of batches that starves codes; -> per-step indices, revivals, final state."""
    monkeypatch.setattr(ddcl_module, "soft_statistics", statistics)
    torch.manual_seed(0)
    quant = DDCLQuantizer(256, 8, channel_dim=-1, revive_threshold=0.2)
    g = torch.Generator().manual_seed(1)
    indices, revived = [], []
    for step in range(steps):
        z = torch.randn(600, 8, generator=g) * (1 + 0.1 * step)
        z[:, 0] += 0.2 * step                      # the data drifts away from part of the codebook
        out = quant(z)
        quant.step()
        indices.append(out.indices.clone())
        revived.append(int(quant.revived))
    return indices, revived, {k: v.clone() for k, v in quant.state_dict().items()}


def test_quantizer_trajectory_is_unchanged(monkeypatch):
    ref = run_quantizer(monkeypatch, dense_statistics)
    new = run_quantizer(monkeypatch, soft_statistics)
    assert ref[1][-1] > 0, "the stream is meant to revive codes"
    assert ref[1] == new[1]                              # the same revival decisions, step by step
    for a, b in zip(ref[0], new[0]):
        assert torch.equal(a, b)                         # the same hard indices, step by step
    for key, value in ref[2].items():
        if value.is_floating_point():
            torch.testing.assert_close(new[2][key], value, rtol=1e-5, atol=1e-5, msg=key)
        else:
            assert torch.equal(new[2][key], value), key


@pytest.mark.parametrize("support", [None, 16])
def test_statistics_without_the_split_are_the_same_statistics(support):
    """split=False leaves out the terms (distortion, ols, variance: NaN) and changes nothing the M-step reads."""
    z, w = features(700, 8, 600, seed=3)
    scale = 0.1 * float(squared_distances(z, w).min(1).values.mean())
    full, lean = soft_statistics(z, w, scale, support=support), soft_statistics(z, w, scale, support=support, split=False)
    for name in ("indices", "nearest", "mass", "sums"):
        assert torch.equal(getattr(lean, name), getattr(full, name)), name
    assert all(getattr(lean, t).isnan() and getattr(full, t).isfinite() for t in ("distortion", "ols", "variance"))


def test_a_quantizer_that_is_not_asked_for_the_split_trains_the_same_codebook():
    """report_terms=False in training: only the commitment in ``terms``, the same indices and state step by
    step; in eval mode every term is there whatever it says."""
    runs = []
    for report in (True, False):
        torch.manual_seed(0)
        quant = DDCLQuantizer(64, 8, channel_dim=-1)
        quant.report_terms = report
        g = torch.Generator().manual_seed(1)
        outs = []
        for step in range(12):
            outs.append(quant(torch.randn(300, 8, generator=g) * (1 + 0.1 * step)))
            quant.step()
        runs.append((quant, outs))
    (a, outs_a), (b, outs_b) = runs
    for oa, ob in zip(outs_a, outs_b):
        assert torch.equal(oa.indices, ob.indices) and torch.equal(oa.terms["commitment"], ob.terms["commitment"])
        assert set(oa.terms) == {"commitment", "distortion", "ols", "variance"} and set(ob.terms) == {"commitment"}
    for key, value in a.state_dict().items():
        assert torch.equal(b.state_dict()[key], value), key
    b.eval()
    t = b(torch.randn(50, 8)).terms
    torch.testing.assert_close(t["distortion"], t["ols"] + t["variance"])
