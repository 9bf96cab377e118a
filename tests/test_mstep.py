"""The DDCL codebook mechanisms, each by its defining property on a fixed batch: the M-step
codebook, revival of starved codes, the data-relative temperature, k-means start."""
import pytest
import torch

from ddcl_vq import DDCLQuantizer
from ddcl_vq.ddcl.statistics import soft_statistics


def batch(n=64, d=4, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=dtype)


def test_mstep_with_decay_0_puts_each_code_at_its_soft_weighted_mean():
    torch.manual_seed(0)
    quant = DDCLQuantizer(8, 4, channel_dim=-1, decay=0.0, revive_threshold=0.0, codebook_init="normal",
                          temperature=0.3).double()
    z = batch()
    w0 = quant.codebook.detach().clone()
    quant(z)
    d = torch.cdist(z, w0).pow(2)
    scale = 0.3 * d.min(1).values.mean()            # τ × the batch's mean nearest distance (first batch)
    q = torch.softmax(-d / scale, 1)
    expected = (q.t() @ z) / q.sum(0)[:, None]
    torch.testing.assert_close(quant.codebook.detach(), expected, rtol=1e-10, atol=1e-10)
    assert not quant.codebook.requires_grad


def test_mstep_is_a_moving_average_of_the_soft_statistics():
    torch.manual_seed(0)
    quant = DDCLQuantizer(8, 4, channel_dim=-1, decay=0.75, revive_threshold=0.0, codebook_init="normal").double()
    z1, z2 = batch(seed=1), batch(seed=2)
    quant(z1)
    mass, sums = quant.cluster_mass.clone(), quant.cluster_sums.clone()
    w1, scale = quant.codebook.detach().clone(), quant.softmax_scale()
    quant(z2)
    s = soft_statistics(z2, w1, scale)
    torch.testing.assert_close(quant.cluster_mass, 0.75 * mass + 0.25 * s.mass)
    torch.testing.assert_close(quant.cluster_sums, 0.75 * sums + 0.25 * s.sums)
    torch.testing.assert_close(quant.codebook.detach(), quant.cluster_sums / quant.cluster_mass[:, None])


def test_soft_statistics_equal_the_dense_computation_in_any_blocking():
    z, w = batch(300, 8, seed=3), batch(50, 8, seed=4)
    d = torch.cdist(z, w).pow(2)
    q = torch.softmax(-d / 2.0, 1)
    for rows in (7, 64, 1000):
        s = soft_statistics(z, w, 2.0, rows=rows)
        torch.testing.assert_close(s.mass, q.sum(0))
        torch.testing.assert_close(s.sums, q.t() @ z)
        torch.testing.assert_close(s.distortion, (q * d).sum(1).mean())
        torch.testing.assert_close(s.distortion, s.ols + s.variance, rtol=1e-10, atol=1e-12)
        assert torch.equal(s.indices, d.argmin(1))
        torch.testing.assert_close(s.nearest, d.min(1).values)


def test_a_starved_code_is_revived_on_a_batch_vector():
    torch.manual_seed(0)
    quant = DDCLQuantizer(8, 4, channel_dim=-1, codebook_init="normal", revive_threshold=0.1,
                          warmup_steps=0).double()
    z = batch()
    quant(z)                                         # initialise
    with torch.no_grad():                            # one code far from every vector, with no mass or use
        quant.weight[3] = 1e3
        quant.cluster_sums[3] = 1e3 * 1e-9
        quant.cluster_mass[3] = 1e-9
        quant.cluster_usage[3] = 1e-9
    quant(z)
    assert int(quant.revived) >= 1
    assert quant.codebook[3].abs().max() < 100       # re-seeded on a batch vector
    assert any(torch.allclose(quant.codebook[3], row) for row in z)
    assert (quant.cluster_mass > 0).all()
    assert quant.log_stats()["revived"] == float(quant.revived)


def test_a_revived_code_starts_at_its_uniform_share_and_is_not_re_seeded_by_the_next_batch():
    """Codes outnumber the batch (K = 512, N = 64): a re-seeded code starts at usage N/K, as every
    code does, not at the threshold, so a batch it does not win does not re-seed it again."""
    torch.manual_seed(0)
    quant = DDCLQuantizer(512, 4, channel_dim=-1, revive_threshold=0.03, warmup_steps=0).double()
    z = batch(64)
    quant(z)                                         # initialise: every code at usage N/K
    with torch.no_grad():
        quant.weight[3] = 1e3                        # far from every vector, with no use left
        quant.cluster_sums[3] = quant.weight[3] * quant.cluster_mass[3]
        quant.cluster_usage[3] = 1e-9
    quant(z)
    assert int(quant.revived) == 1
    assert quant.cluster_usage[3].item() == pytest.approx(64 / 512)
    assert quant.cluster_mass[3].item() == pytest.approx(64 / 512)           # mass too: its seed holds it
    torch.testing.assert_close(quant.cluster_sums[3], quant.weight[3].detach() * (64 / 512))
    near_code_0 = quant.codebook[0].detach().clone() + 1e-3 * torch.randn_like(z)   # a batch code 3 does not win
    out = quant(near_code_0)
    assert not bool((out.indices == 3).any())
    assert int(quant.revived) == 1                   # at the threshold it would have been re-seeded here


def test_no_revival_when_switched_off():
    torch.manual_seed(0)
    quant = DDCLQuantizer(8, 4, channel_dim=-1, codebook_init="normal", revive_threshold=0.0).double()
    z = batch()
    quant(z)
    with torch.no_grad():
        quant.cluster_usage[3] = 1e-9
    quant(z)
    assert int(quant.revived) == 0


def test_data_relative_temperature_is_invariant_to_the_feature_scale():
    z = batch(128, 4, seed=5)
    outs = []
    for c in (1.0, 37.0):
        torch.manual_seed(0)
        quant = DDCLQuantizer(16, 4, channel_dim=-1, codebook_init="normal").double()
        with torch.no_grad():
            quant.weight.mul_(c)
        first = quant(c * z)
        second = quant(c * z)
        outs.append((first, second, quant.softmax_scale() / c ** 2))
    for a, b in zip(outs[0][:2], outs[1][:2]):
        assert torch.equal(a.indices, b.indices)
        torch.testing.assert_close(a.soft_counts, b.soft_counts)
    assert outs[0][2] == pytest.approx(outs[1][2])


def test_kmeans_start_puts_codes_on_the_data_and_breaks_ties_when_codes_outnumber_vectors():
    torch.manual_seed(0)
    quant = DDCLQuantizer(32, 4, channel_dim=-1, revive_threshold=0.0).double()   # default k-means init
    z = batch(16)                                    # fewer vectors than codes: k-means repeats seeds
    quant(z)
    w = quant.codebook.detach()
    assert torch.cdist(w, w).add(torch.eye(32, dtype=w.dtype)).min() > 0    # no two codes identical
    assert torch.cdist(w, z).min(1).values.median() < 0.1                   # codes start on the data


@pytest.mark.parametrize("mode", ["soft", "soft_straight_through"])
def test_mstep_codebook_in_soft_modes(mode):
    torch.manual_seed(0)
    quant = DDCLQuantizer(8, 4, channel_dim=-1, mode=mode, codebook_init="normal").double()
    z = batch().requires_grad_(True)
    w0 = quant.codebook.detach().clone()
    out = quant(z)
    (out.quantized.sum() + out.loss).backward()
    assert z.grad.abs().sum() > 0 and quant.weight.grad is None
    assert not torch.equal(w0, quant.codebook.detach())               # the M-step moved the codes
    torch.testing.assert_close(out.terms["distortion"], out.terms["ols"] + out.terms["variance"])


def test_evaluation_mode_changes_nothing():
    torch.manual_seed(0)
    quant = DDCLQuantizer(8, 4, channel_dim=-1, codebook_init="normal").double()
    quant(batch(seed=1))
    state = {k: v.clone() for k, v in quant.state_dict().items()}
    quant.eval()
    quant(batch(seed=2))
    for k, v in quant.state_dict().items():
        assert torch.equal(v, state[k]), k


def test_truncated_support_keeps_the_hard_assignment_and_the_nearest_codes_statistics():
    g = torch.Generator().manual_seed(6)
    z = torch.randn(200, 4, generator=g, dtype=torch.float64)
    w = torch.randn(300, 4, generator=g, dtype=torch.float64)
    full = soft_statistics(z, w, 0.01, rows=64)
    top = soft_statistics(z, w, 0.01, rows=64, support=16)
    assert torch.equal(full.indices, top.indices) and torch.equal(full.nearest, top.nearest)
    torch.testing.assert_close(top.mass.sum(), torch.tensor(200.0, dtype=torch.float64))
    torch.testing.assert_close(top.mass, full.mass, atol=1e-3, rtol=0)     # weights beyond 16 codes are tiny
    torch.testing.assert_close(top.sums, full.sums, atol=1e-2, rtol=0)
    torch.testing.assert_close(top.distortion, top.ols + top.variance)


def test_large_codebooks_use_the_truncated_support():
    from ddcl_vq.ddcl import TRUNCATE_ABOVE, TRUNCATED_SUPPORT
    assert DDCLQuantizer(TRUNCATE_ABOVE, 4).statistics_support is None
    assert DDCLQuantizer(TRUNCATE_ABOVE + 1, 4).statistics_support == TRUNCATED_SUPPORT


def test_nearest_codes_is_the_first_minimum_of_the_distances_in_any_block_size():
    from ddcl_vq.base import squared_distances
    from ddcl_vq.blocks import nearest_codes
    torch.manual_seed(0)
    z, w = torch.randn(300, 8, dtype=torch.float64), torch.randn(50, 8, dtype=torch.float64)
    w[7] = w[3]                                           # a tie: the first index wins
    ref = squared_distances(z, w).min(1)
    values, indices = nearest_codes(z, w)                 # one block: the same bits
    assert torch.equal(values, ref.values) and torch.equal(indices, ref.indices)
    for rows in (1, 7, 64):
        values, indices = nearest_codes(z, w, rows)
        assert torch.equal(indices, ref.indices)
        torch.testing.assert_close(values, ref.values, rtol=1e-12, atol=1e-12)
    assert nearest_codes(z[:0], w)[1].shape == (0,)


def test_kmeans_work_is_bounded_by_fewer_iterations_then_a_sample():
    from ddcl_vq.kmeans import KMEANS_WORK, kmeans_budget
    assert kmeans_budget(8192, 16384, 10) == (8192, 10)            # the shipped settings: untouched
    assert kmeans_budget(16384, 4096, 10) == (16384, 10)
    points, iters = kmeans_budget(16384, 65536, 10)                # the large codebook: fewer iterations
    assert points == 16384 and 1 <= iters < 10 and points * 65536 * iters <= KMEANS_WORK
    points, iters = kmeans_budget(16384, 1 << 22, 10)              # one pass too many: a sample
    assert iters == 1 and points < 16384 and points * (1 << 22) <= KMEANS_WORK
    assert kmeans_budget(16384, 1 << 40, 10) == (1, 1)


def test_kmeans_refuses_an_empty_batch_and_blocks_give_the_same_fit():
    from ddcl_vq.kmeans import kmeans, kmeans_init_
    with pytest.raises(ValueError, match="at least one vector"):
        kmeans_init_(torch.empty(8, 4), torch.empty(0, 4))
    x = torch.randn(500, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    one = kmeans(x, 20, generator=torch.Generator().manual_seed(0))
    blocked = kmeans(x, 20, generator=torch.Generator().manual_seed(0), rows=37)
    torch.testing.assert_close(one, blocked, rtol=1e-12, atol=1e-12)


def test_first_training_batch_never_holds_an_n_by_k_tensor(monkeypatch):
    """The first batch of a fresh quantizer (k-means start, distance scale, M-step statistics, the
    straight-through output and its backward) works in blocks: no tensor the size of the N×K
    distance matrix is ever created (it was, several times, in the k-means start and the scale)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    import ddcl_vq.blocks as blocks

    class LargestStorage(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.untyped_storage().nbytes())
            return out

    n, d, k = 1024, 8, 8192
    monkeypatch.setattr(blocks, "NEAREST_BLOCK_BYTES", 1 << 20)
    z = torch.randn(n, d, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    quant = DDCLQuantizer(k, d, channel_dim=-1)
    with LargestStorage() as probe:
        out = quant(z)
        (out.quantized.sum() + out.loss).backward()
    assert bool(quant.initialized) and float(quant.distance_scale) > 0
    assert probe.largest <= n * k * 4 // 2, probe.largest     # the M-step statistics' block: 512 rows × K


def test_no_more_codes_are_re_seeded_in_a_batch_than_it_has_vectors_and_none_on_the_same_vector():
    """K = 512 codes, N = 64 vectors, every code starved at once: 64 are re-seeded, the most starved
    first, each on its own batch vector (drawn with repeats they would be identical codes for good);
    the others keep their place and wait for later batches."""
    torch.manual_seed(0)
    quant = DDCLQuantizer(512, 4, channel_dim=-1, revive_threshold=0.03, warmup_steps=0).double()
    z = batch(64)
    quant(z)
    with torch.no_grad():
        quant.cluster_usage.fill_(1e-9)
        quant.cluster_usage[:10] = 1e-12               # the most starved: re-seeded first
    quant(z)
    assert int(quant.revived) == 64
    reseeded = quant.cluster_usage == quant.cluster_usage.max()   # re-seeded codes start at N/K
    assert int(reseeded.sum()) == 64 and bool(reseeded[:10].all())
    seeds = quant.weight.detach()[reseeded]
    assert torch.unique(seeds, dim=0).shape[0] == 64                        # 64 distinct seeds ...
    assert bool((torch.cdist(seeds, z).min(1).values < 1e-6).all())        # ... each a batch vector


def test_seeds_are_drawn_uniformly_not_where_the_distortion_is():
    """One outlier 1000x farther from the codes than the other 63 vectors: drawn in proportion to the
    distance it would seed nearly every revival; drawn uniformly, about 1 in 64."""
    hits = 0
    for seed in range(40):
        torch.manual_seed(seed)
        quant = DDCLQuantizer(8, 4, channel_dim=-1, codebook_init="normal", revive_threshold=0.1,
                              warmup_steps=0).double()
        z = batch(64)
        quant(z)
        z = z.clone()
        z[0] = 30.0                                 # the outlier
        with torch.no_grad():
            quant.cluster_usage[3] = 1e-9
        quant(z)
        hits += bool(torch.allclose(quant.codebook[3], z[0]))
    assert hits <= 6
