"""CodebookUsage against a hand-computed example."""
import math

import pytest
import torch

from ddcl_vq import CodebookUsage, DDCLQuantizer


def test_hand_computed_example():
    usage = CodebookUsage(4)
    usage.update(torch.tensor([[0, 0], [1, 0]]))
    usage.update(torch.tensor([1, 0]))
    s = usage.compute()
    # counts: code0=4, code1=2, code2=0, code3=0 -> p = (2/3, 1/3)
    assert s.counts == [4, 2, 0, 0]
    assert s.num_vectors == 6
    assert s.active_codes == 2 and s.dead_codes == 2 and s.utilization == 0.5
    h = -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3))
    assert s.perplexity == pytest.approx(math.exp(h))
    assert s.entropy_bits == pytest.approx(h / math.log(2))
    assert s.soft_perplexity is None


def test_soft_perplexity_and_reset():
    usage = CodebookUsage(2)
    usage.update(torch.tensor([0, 0]), soft_counts=torch.tensor([1.0, 1.0]))
    s = usage.compute()
    assert s.perplexity == pytest.approx(1.0) and s.soft_perplexity == pytest.approx(2.0)
    usage.reset()
    assert usage.compute().num_vectors == 0


def test_uniform_usage_has_perplexity_k():
    usage = CodebookUsage(8)
    usage.update(torch.arange(8).repeat(3))
    s = usage.compute()
    assert s.perplexity == pytest.approx(8.0) and s.entropy_bits == pytest.approx(3.0) and s.utilization == 1.0


def test_ddcl_output_feeds_usage():
    q = DDCLQuantizer(16, 4)
    out = q(torch.randn(2, 4, 3, 3))
    usage = CodebookUsage(16)
    usage.update(out.indices, out.soft_counts)
    s = usage.compute()
    assert s.num_vectors == 18 and s.soft_perplexity is not None
    assert float(out.soft_counts.sum()) == pytest.approx(18.0, rel=1e-5)


def test_out_of_range_index_rejected():
    with pytest.raises(ValueError, match=r"\[0, 3\]"):
        CodebookUsage(4).update(torch.tensor([4]))


def test_counting_without_a_host_sync_equals_bincount_and_defers_the_range_check():
    # the path update takes for accelerator tensors, run here on CPU tensors
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 8, (500,), generator=g)
    ref, fast = CodebookUsage(8), CodebookUsage(8)
    ref.update(idx)
    fast._count_on_device(idx)
    assert torch.equal(ref.counts, fast.counts) and ref.compute() == fast.compute()
    fast._count_on_device(torch.tensor([3, 8, -1]))
    with pytest.raises(ValueError, match=r"expected indices in \[0, 7\], got 2 out of range"):
        fast.compute()
    fast.reset()
    assert fast.compute().num_vectors == 0


def test_recent_usage_queue_and_batches_by_hand():
    from ddcl_vq.usage import RecentUsage
    recent = RecentUsage(10, queue_length=8)
    recent.update(torch.tensor([1, 2, 3]))
    first = recent.compute()
    assert first["queue_utilization"] == 0.3 and first["queue_indices"] == 3 and first["batches"] == 1
    assert first["batch_utilization"] == pytest.approx(0.3)
    recent.update(torch.arange(10))            # longer than the queue: only its last 8 stay
    recent.update(torch.tensor([[5, 5], [5, 5]]))  # the queue now holds 5 5 5 5 6 7 8 9 (oldest first)
    second = recent.compute()
    assert second["queue_utilization"] == 0.5 and second["queue_indices"] == 8
    assert second["batch_utilization"] == pytest.approx((1.0 + 0.1) / 2)   # a new average after compute
    assert second["queue_ceiling"] == pytest.approx(1 - 0.9 ** 8)
    assert recent.compute()["batch_utilization"] is None  # no batch since


def test_recent_usage_resumes_exactly():
    from ddcl_vq.usage import RecentUsage
    torch.manual_seed(0)
    straight, first = RecentUsage(50, queue_length=64), RecentUsage(50, queue_length=64)
    batches = [torch.randint(0, 50, (int(n),)) for n in torch.randint(1, 40, (9,))]
    for b in batches[:5]:
        straight.update(b)
        first.update(b)
    resumed = RecentUsage(50, queue_length=64)
    resumed.load_state_dict(first.state_dict())
    for b in batches[5:]:
        straight.update(b)
        resumed.update(b)
    assert straight.compute() == resumed.compute()


def test_uniform_ceiling():
    from ddcl_vq.usage import uniform_ceiling
    assert uniform_ceiling(65536, 65536) == pytest.approx(1 - math.exp(-1), rel=1e-4)
    assert uniform_ceiling(262144, 640000) == pytest.approx(0.913, abs=1e-3)
    assert uniform_ceiling(1, 5) == 1.0 and uniform_ceiling(10, 0) == 0.0
