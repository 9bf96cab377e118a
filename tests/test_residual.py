"""ResidualDDCL and GroupedDDCL: the residual chain, prefix decoding, the shared codebook's one pooled M-step,
quantizer dropout, the exact identity per level, code use per level against vector-quantize-pytorch's ResidualVQ,
grouped codebooks, and CodebookUsage per codebook."""
import copy

import pytest
import torch

from ddcl_vq import CodebookUsage, DDCLQuantizer, GroupedDDCL, Quantizer, ResidualDDCL

D, K, L = 8, 64, 3


def mixture(n, seed=0, clusters=32):
    """Vectors from a fixed Gaussian mixture in D dims (the centres do not depend on ``seed``)."""
    centres = torch.randn(clusters, D, generator=torch.Generator().manual_seed(123)) * 3
    g = torch.Generator().manual_seed(seed)
    return centres[torch.randint(0, clusters, (n,), generator=g)] + 0.5 * torch.randn(n, D, generator=g)


def trained(q, steps=150, batch=256):
    for step in range(steps):
        q(mixture(batch, seed=step))
        q.step()
    return q.eval()


def test_shapes_layouts_and_interface():
    torch.manual_seed(0)
    q = ResidualDDCL(K, D, L)
    assert isinstance(q, Quantizer) and len(q.levels) == L and q.num_levels == L
    assert all(isinstance(level, DDCLQuantizer) for level in q.levels) and len(set(map(id, q.levels))) == L
    z = torch.randn(2, D, 4, 5)
    out = q(z)
    assert out.quantized.shape == z.shape and out.indices.shape == (2, 4, 5, L) and out.indices.dtype == torch.long
    assert out.soft_counts.shape == (L, K) and q.codebook.shape == (L, K, D)
    assert out.loss.dim() == 0 and out.perplexity.dim() == 0
    for name in ("commitment", "distortion", "ols", "variance"):
        assert torch.allclose(out.terms[name], sum(out.terms[f"level{i}_{name}"] for i in range(L)))
    last = ResidualDDCL(K, D, L, channel_dim=-1)
    out = last(torch.randn(3, 7, D))
    assert out.quantized.shape == (3, 7, D) and out.indices.shape == (3, 7, L)
    assert ResidualDDCL(codebook_size=K, dim=D).num_codes == K
    empty = q(torch.zeros(0, D, 2, 2))
    assert empty.indices.shape == (0, 2, 2, L) and empty.soft_counts.shape == (L, K)


def test_bad_input_and_arguments_are_value_errors():
    q = ResidualDDCL(K, D, L)
    with pytest.raises(ValueError, match="expected channel size D=8"):
        q(torch.randn(2, 5, 3, 3))
    with pytest.raises(ValueError, match="finite"):
        q(torch.full((1, D, 2, 2), float("nan")))
    with pytest.raises(ValueError, match=r"1 <= L' <= 3"):
        q.lookup(torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"expected indices in \[-1, 63\]"):
        q.lookup(torch.full((2, 3), K))
    with pytest.raises(ValueError, match="integer index tensor"):
        q.lookup(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="num_levels"):
        ResidualDDCL(K, D, 0)
    with pytest.raises(ValueError, match="unknown"):
        ResidualDDCL(K, D, L, temperatur=0.1)
    with pytest.raises(ValueError, match="expected mode"):
        ResidualDDCL(K, D, L, mode="hard")


def test_chain_prefix_lookup_and_error_falling_with_levels():
    """In eval: level i's index is the nearest code of level i to what the levels before left; lookup of any prefix
    is the partial sum, the full lookup the output; the error falls with every level."""
    torch.manual_seed(0)
    q = trained(ResidualDDCL(K, D, L, channel_dim=-1))
    x = mixture(2048, seed=999)
    out = q(x)
    assert torch.equal(q.lookup(out.indices), out.quantized)
    errors = []
    partial = torch.zeros_like(x)
    for i, level in enumerate(q.levels):
        nearest = torch.cdist(x - partial, level.weight).argmin(1)
        assert (nearest == out.indices[:, i]).float().mean() > 0.999          # ties aside
        partial = partial + level.weight[out.indices[:, i]]
        assert torch.allclose(q.lookup(out.indices[:, :i + 1]), partial, atol=1e-6)
        errors.append(float((x - partial).pow(2).sum(1).mean()))
    print("residual error by levels used:", [round(e, 4) for e in errors], "data variance", float(x.var(0).sum()))
    assert errors[0] < 0.5 * float(x.var(0).sum())
    assert errors[1] < 0.8 * errors[0] and errors[2] < 0.8 * errors[1], errors
    # channel-first: lookup lays codes out as the input
    q1 = ResidualDDCL(K, D, L)
    q1.load_state_dict(q.state_dict())
    z = x[:40].reshape(2, 4, 5, D).movedim(-1, 1)
    out1 = q1.eval()(z)
    assert torch.equal(q1.lookup(out1.indices), out1.quantized) and out1.quantized.shape == z.shape
    assert torch.equal(out1.indices.reshape(-1, L), out.indices[:40])


def test_straight_through_gradient_is_the_identity_and_each_commitment_reaches_the_encoder():
    torch.manual_seed(0)
    q = ResidualDDCL(K, D, L, channel_dim=-1, warmup_steps=0)
    x = mixture(256).requires_grad_(True)
    upstream = torch.randn(256, D)
    out = q(x)
    (out.quantized * upstream).sum().backward()
    assert torch.equal(x.grad, upstream)                                     # not L × the identity
    x.grad = None
    q(x).loss.backward()
    assert x.grad.abs().sum() > 0


def test_warm_up_blends_the_sum_and_levels_quantize_codes():
    torch.manual_seed(0)
    q = ResidualDDCL(K, D, 2, channel_dim=-1, warmup_steps=4)
    assert all(level.warmup_steps == 0 for level in q.levels)
    x = mixture(256)
    first = q(x)
    assert torch.equal(first.quantized, x)                                   # α = 0
    # level 1 saw the residual of level 0's codes (not of the blend, which is zero at α = 0)
    assert float(q.levels[1].distance_scale) > 0 and q.levels[1].weight.abs().max() > 0.05
    for _ in range(4):
        q(x)
    assert int(q.warmup_batches) == 4 and q._warmup_over


def test_float64_identity_holds_at_every_level():
    torch.manual_seed(0)
    for shared in (False, True):
        q = ResidualDDCL(16, D, L, channel_dim=-1, shared_codebook=shared, mode="soft_straight_through").double()
        x = mixture(300).double()
        for train in (True, False):
            out = q.train(train)(x)
            assert out.quantized.dtype == torch.float64
            for i in range(L):
                t = {n: out.terms[f"level{i}_{n}"] for n in ("distortion", "ols", "variance")}
                assert t["distortion"].dtype == torch.float64
                assert abs(float(t["distortion"] - t["ols"] - t["variance"])) < 1e-10 * max(1.0, float(t["distortion"]))


def test_shared_codebook_makes_one_m_step_on_the_pooled_residuals():
    torch.manual_seed(0)
    q = ResidualDDCL(K, D, L, channel_dim=-1, shared_codebook=True, revive_threshold=0.0)
    assert q.codebook.shape == (K, D) and len(q.quantizers) == 1 and all(lv is q.levels[0] for lv in q.levels)
    assert sum(1 for k in q.state_dict() if k.endswith("weight")) == 1
    q(mixture(256, seed=1))                                                   # the first batch: k-means
    reference = copy.deepcopy(q.levels[0])
    x = mixture(256, seed=2)
    # the chain with the codebook as it stands, then one DDCL training forward on every level's residuals
    w = reference.weight.detach().clone()
    r, pooled = x, []
    for _ in range(L):
        pooled.append(r)
        r = r - w[torch.cdist(r, w).argmin(1)]
    expected = reference(torch.cat(pooled))
    out = q(x)
    assert torch.allclose(q.codebook, reference.weight, atol=1e-5)
    assert torch.allclose(q.levels[0].cluster_mass, reference.cluster_mass, atol=1e-4)
    assert torch.equal(out.indices.t().reshape(-1), expected.indices)
    q.eval()
    out = q(x)
    assert torch.equal(q.lookup(out.indices), out.quantized)


def test_quantize_dropout_only_in_training_and_dropped_levels_learn_nothing():
    torch.manual_seed(0)
    q = ResidualDDCL(K, D, L, quantize_dropout=True, decay=0.0, revive_threshold=0.0)
    z = torch.randn(64, D, 2, 2)
    q(z)                                                                      # k-means start
    out = q(z)
    idx = out.indices.reshape(64, 4, L)
    kept = (idx >= 0).sum(-1)
    assert (kept == kept[:, :1]).all() and (kept >= 1).all()                  # one count per sample
    assert len(set(kept[:, 0].tolist())) > 1                                  # random: not all L
    assert torch.equal(idx >= 0, torch.arange(L) < kept[..., None])           # a prefix of the levels
    for i, level in enumerate(q.levels):                                      # decay 0: this batch's mass only
        assert abs(float(level.cluster_mass.sum()) - float((kept > i).sum())) < 1e-3
    # a dropped level adds nothing: a one-level sample's output is its level-0 code
    one = (kept[:, 0] == 1).nonzero()[0, 0]
    assert torch.allclose(q.lookup(out.indices[one:one + 1]), q.lookup(out.indices[one:one + 1, ..., :1]))
    q.eval()
    assert (q(z).indices >= 0).all()


def test_step_and_state_dict_reach_every_level():
    q = ResidualDDCL(K, D, L, temperature=0.1, temperature_final=0.01, temperature_schedule="cosine",
                     schedule_steps=10)
    q(torch.randn(4, D, 4, 4))
    q.step()
    assert [int(level.schedule_step) for level in q.levels] == [1] * L
    assert q.temperature < 0.1 and set(q.log_stats()) >= {f"level{i}_temperature" for i in range(L)}
    copy_ = ResidualDDCL(K, D, L, temperature=0.1, temperature_final=0.01, temperature_schedule="cosine",
                         schedule_steps=10)
    copy_.load_state_dict(q.state_dict())
    z = torch.randn(2, D, 3, 3)
    assert torch.equal(copy_.eval()(z).quantized, q.eval()(z).quantized)
    assert copy_.temperature == q.temperature


def test_every_level_uses_its_codes_where_residual_vq_defaults_do_not():
    """150 steps on 32-cluster mixture data, K = 64 per level, 3 levels: the codes each level uses on held-out data.
    vector-quantize-pytorch's ResidualVQ at its defaults (EMA, random init, no expiry) leaves many dead."""
    from vector_quantize_pytorch import ResidualVQ
    x = mixture(8192, seed=999)
    torch.manual_seed(0)
    ours = trained(ResidualDDCL(K, D, L, channel_dim=-1))
    torch.manual_seed(0)
    peer = ResidualVQ(dim=D, num_quantizers=L, codebook_size=K)
    for step in range(150):
        peer(mixture(256, seed=step)[None])
    peer.eval()
    stats = {}
    with torch.no_grad():
        for name, indices in (("ResidualDDCL", ours(x).indices), ("ResidualVQ", peer(x[None])[1][0])):
            usage = CodebookUsage(K, codebooks=L)
            usage.update(indices)
            stats[name] = usage.compute().utilization_per_codebook
    print("per-level utilization:", {k: [round(v, 3) for v in u] for k, u in stats.items()})
    assert min(stats["ResidualDDCL"]) >= 0.9
    assert max(stats["ResidualVQ"]) < 0.9 and min(stats["ResidualVQ"]) < min(stats["ResidualDDCL"]) - 0.2


# ---------------------------------------------------------------- grouped

def test_grouped_shapes_lookup_and_indivisible_dim():
    torch.manual_seed(0)
    q = GroupedDDCL(16, D, 4)
    z = torch.randn(3, D, 2, 5)
    out = q(z)
    assert out.quantized.shape == z.shape and out.indices.shape == (3, 2, 5, 4) and q.codebook.shape == (4, 16, 2)
    assert out.soft_counts.shape == (4, 16)
    assert torch.allclose(out.loss, torch.stack([q.quantizers[g](z.movedim(1, -1)[..., 2 * g:2 * g + 2]).loss
                                                 for g in range(4)]).mean(), rtol=0.5)  # same scale
    q.eval()
    out = q(z)
    assert torch.equal(q.lookup(out.indices), out.quantized)
    assert torch.allclose(q.soft_codes(z), out.soft_codes, atol=1e-5)
    for g in range(4):                                                       # group g quantizes channels 2g, 2g+1
        part = z[:, 2 * g:2 * g + 2].movedim(1, -1)
        assert torch.equal(torch.cdist(part.reshape(-1, 2), q.quantizers[g].weight).argmin(1),
                           out.indices[..., g].reshape(-1))
    with pytest.raises(ValueError, match="expected dim divisible by groups, got dim=10 and groups=3"):
        GroupedDDCL(16, 10, 3)
    with pytest.raises(ValueError, match=r"\(\.\.\., 4\)"):
        q.lookup(torch.zeros(2, 3, dtype=torch.long))


def test_codebook_usage_per_level():
    torch.manual_seed(0)
    q = trained(ResidualDDCL(K, D, L, channel_dim=-1), steps=20)
    out = q(mixture(1024, seed=5))
    usage = CodebookUsage(K, codebooks=L)
    usage.update(out.indices, out.soft_counts)
    stats = usage.compute()
    for i in range(L):
        alone = CodebookUsage(K)
        alone.update(out.indices[:, i], out.soft_counts[i])
        one = alone.compute()
        assert stats.utilization_per_codebook[i] == one.utilization
        assert stats.active_codes_per_codebook[i] == one.active_codes
        assert stats.dead_codes_per_codebook[i] == one.dead_codes
        assert stats.perplexity_per_codebook[i] == pytest.approx(one.perplexity)
        assert stats.soft_perplexity_per_codebook[i] == pytest.approx(one.soft_perplexity)
    assert stats.codebooks == L and len(stats.counts) == L * K and stats.num_vectors == 1024 * L
    assert stats.active_codes == sum(stats.active_codes_per_codebook)
    assert "utilization_per_codebook" not in CodebookUsage(K).compute().to_dict()
