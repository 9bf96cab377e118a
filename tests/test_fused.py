"""Fused and chunked DDCL paths: same values and z-gradients as the reference, O(chunk·K) memory."""
import threading

import pytest
import torch

import ddcl_vq.blocks as blocks
import ddcl_vq.ddcl.fused as fused
from ddcl_vq import DDCLQuantizer
from ddcl_vq.ddcl import cpu_pool
from ddcl_vq.ddcl.assignment import assign
from ddcl_vq.blocks import first_argmax
from ddcl_vq.ddcl.fused import DDCLFunction

MODES = ["soft", "straight_through", "soft_straight_through"]
# (N, K, D, chunk): chunk not dividing N, N < chunk, K = 1, K past the argmax block width
SHAPES = [(37, 16, 8, 5), (10, 300, 5, 64), (20, 1, 4, 3), (70, 260, 6, 16)]
TOL = {torch.float64: dict(rtol=1e-9, atol=1e-11), torch.float32: dict(rtol=2e-4, atol=2e-5)}


def run(impl, mode, dtype, n, k, d, chunk, seed=0, tau=0.1):
    torch.manual_seed(seed)
    quant = DDCLQuantizer(k, d, mode=mode, temperature=tau, codebook_init="normal", channel_dim=-1,
                          implementation=impl, chunk_size=chunk).to(dtype)
    z = torch.randn(n, d, dtype=dtype, requires_grad=True)
    upstream = torch.randn(n, d, dtype=dtype)
    out = quant(z)
    ((out.quantized * upstream).sum() + 3.0 * out.loss).backward()
    return out, z.grad


def assert_close(a, b, dtype, what):
    scale = max(b.abs().max().item(), 1.0)
    assert torch.allclose(a, b, rtol=TOL[dtype]["rtol"], atol=TOL[dtype]["atol"] * scale), \
        f"{what}: max abs diff {(a - b).abs().max().item():.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "N{}-K{}-D{}-chunk{}".format(*s))
@pytest.mark.parametrize("mode", MODES)
def test_fused_and_chunked_match_reference(mode, shape, dtype):
    ref, ref_gz = run("reference", mode, dtype, *shape)
    for impl in ("fused", "chunked"):
        out, gz = run(impl, mode, dtype, *shape)
        assert torch.equal(out.indices, ref.indices), impl
        assert out.quantized.dtype == ref.quantized.dtype == dtype
        assert_close(out.quantized, ref.quantized, dtype, f"{impl} quantized")
        assert_close(out.loss, ref.loss, dtype, f"{impl} loss")
        assert set(out.terms) == set(ref.terms)
        for name in ref.terms:
            assert_close(out.terms[name], ref.terms[name], dtype, f"{impl} {name}")
        assert_close(out.soft_counts, ref.soft_counts, dtype, f"{impl} soft_counts")
        assert_close(out.perplexity, ref.perplexity, torch.float32, f"{impl} perplexity")
        assert_close(gz, ref_gz, dtype, f"{impl} grad z")
        t = out.terms
        assert abs(t["distortion"] - t["ols"] - t["variance"]) <= (1e-10 if dtype == torch.float64 else 1e-5) * t["distortion"]


def test_assign_paths_match_reference():
    """assign() on every path against the reference, distortion weight and upstream both on."""
    g = torch.Generator().manual_seed(3)
    z = (torch.randn(45, 6, generator=g, dtype=torch.float64) + 40.0)    # far from the origin: centring
    w = torch.randn(23, 6, generator=g, dtype=torch.float64) + 40.0
    up = torch.randn(45, 6, generator=g, dtype=torch.float64)
    results = []
    for impl in ("reference", "fused", "chunked"):
        zz = z.clone().requires_grad_(True)
        a = assign(zz, w, 0.4, implementation=impl, chunk_size=7)
        assert (a.q is not None) == (impl == "reference")
        (0.7 * a.distortion + (a.soft * up).sum()).backward()
        results.append((a.soft.detach(), a.distortion.detach(), a.ols, a.variance, a.soft_counts, a.indices, zz.grad))
    for other in results[1:]:
        for x, y in zip(other, results[0]):
            if y.dtype == torch.long:
                assert torch.equal(x, y)
            else:
                assert torch.allclose(x.detach(), y.detach(), rtol=1e-9, atol=1e-10)


def test_blocked_paths_refuse_a_codebook_that_asks_for_a_gradient():
    z, w = torch.randn(30, 4, requires_grad=True), torch.randn(9, 4, requires_grad=True)
    for impl in ("fused", "chunked"):
        with pytest.raises(ValueError, match=f"codebook without gradient on the {impl} path"):
            assign(z, w, 0.5, implementation=impl)
        with torch.no_grad():
            assign(z, w, 0.5, implementation=impl)                         # nothing to differentiate: fine
    assign(z, w, 0.5).distortion.backward()                                 # the reference path differentiates it
    assert w.grad is not None


def test_gradcheck_fused_function_float64():
    z = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 3, dtype=torch.float64)
    for store in (True, False):
        def f(z_):
            soft, dist = DDCLFunction.apply(z_, w, 0.7, 3, store)[:2]
            return soft, dist
        assert torch.autograd.gradcheck(f, (z,), eps=1e-6, atol=1e-7)


def test_auto_picks_chunked_above_threshold():
    big = DDCLQuantizer(16, 4, chunk_threshold_bytes=100)
    small = DDCLQuantizer(16, 4)
    assert big.resolve_implementation(1) == "fused"                      # N·K·4 B = 64 B <= 100 B
    assert big.resolve_implementation(2) == "chunked"                    # 128 B > 100 B
    assert big.resolve_implementation(1, torch.float64) == "chunked"     # 8-byte elements
    assert small.resolve_implementation(100) == "fused"
    assert DDCLQuantizer(16, 4, implementation="reference", chunk_threshold_bytes=0).resolve_implementation(10**9) == "reference"
    with pytest.raises(ValueError, match="implementation"):
        DDCLQuantizer(16, 4, implementation="fast")
    with pytest.raises(ValueError, match="chunk_size"):
        DDCLQuantizer(16, 4, chunk_size=0)


def saved_numels(quant, z):
    """numel of every tensor autograd saves for backward during one forward."""
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = quant(z)
    return sizes, out


@pytest.mark.parametrize("mode", MODES)
def test_chunked_keeps_nothing_of_size_n_by_k(mode):
    n, k, d = 96, 40, 3
    torch.manual_seed(0)
    z = torch.randn(n, d, requires_grad=True)
    chunked = DDCLQuantizer(k, d, mode=mode, channel_dim=-1, implementation="auto", chunk_threshold_bytes=1,
                            chunk_size=8)
    assert chunked.resolve_implementation(n) == "chunked"
    sizes, out = saved_numels(chunked, z)
    assert sizes and max(sizes) < n * k, sizes           # O(N·D + K·D), nothing N×K
    (out.quantized.sum() + out.loss).backward()           # and backward still works
    assert torch.isfinite(z.grad).all()
    # the soft modes' reference path keeps N×K tensors, their fused path exactly one; straight_through
    # mode keeps none whatever the path (its assignment is the M-step's statistics, without autograd)
    st = mode == "straight_through"
    ref_sizes, _ = saved_numels(DDCLQuantizer(k, d, mode=mode, channel_dim=-1, implementation="reference"), z)
    assert sum(s >= n * k for s in ref_sizes) >= (0 if st else 2)
    fused_sizes, _ = saved_numels(DDCLQuantizer(k, d, mode=mode, channel_dim=-1, implementation="fused"), z)
    assert sum(s >= n * k for s in fused_sizes) == (0 if st else 1)


def test_chunked_allocates_only_block_sized_buffers(monkeypatch):
    """Observed with the profiler's allocation tracking: no single N×K-sized allocation."""
    from torch.profiler import ProfilerActivity, profile
    monkeypatch.setattr(cpu_pool, "_ENABLED", False)       # every op on this (profiled) thread
    n, k, d, chunk = 4096, 64, 4, 128
    z = torch.randn(n, d, requires_grad=True)
    w = torch.randn(k, d)
    up = torch.randn(n, d)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        a = assign(z, w, 0.3, implementation="chunked", chunk_size=chunk)
        ((a.soft * up).sum() + a.distortion).backward()
    biggest = max(e.cpu_memory_usage for e in prof.events())
    assert 0 < biggest < n * k * 4 // 4, biggest           # blocks are chunk×K, 32× smaller than N×K


@pytest.mark.parametrize("impl", ["fused", "chunked"])
@pytest.mark.parametrize("mode", MODES)
def test_no_nan_at_tiny_tau_and_huge_distances(mode, impl):
    torch.manual_seed(0)
    quant = DDCLQuantizer(300, 8, mode=mode, temperature=1e-4, codebook_init="normal", implementation=impl,
                          chunk_size=7)
    z = (torch.randn(2, 8, 4, 4) * 250).requires_grad_(True)  # squared distances ~ 1e6
    out = quant(z)
    assert out.terms["distortion"] > 1e5
    (out.quantized.sum() + out.loss).backward()
    for t in [out.quantized, out.loss, z.grad, quant.weight, *out.terms.values()]:
        assert torch.isfinite(t).all()


def test_first_argmax_is_exactly_argmax_with_ties():
    g = torch.Generator().manual_seed(0)
    for k in (1, 5, 127, 128, 256, 300, 1000, 1024):
        x = torch.randint(0, 4, (33, k), generator=g).float()
        assert torch.equal(first_argmax(x), x.argmax(1)), k


def test_blocks_are_deterministic_and_thread_settings_untouched():
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    z = torch.randn(500, 6)
    w = torch.randn(70, 6)
    runs = []
    for _ in range(2):
        zz = z.clone().requires_grad_(True)
        a = assign(zz, w, 0.2, implementation="chunked", chunk_size=16)
        (a.soft.sum() + a.distortion).backward()
        runs.append((a.soft, a.distortion, a.soft_counts, zz.grad))
    for x, y in zip(*runs):
        assert torch.equal(x, y)
    assert torch.get_num_threads() == threads
    seen = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert seen == [threads]                               # new threads start from the same default


def test_bf16_autocast_fused_computes_in_float32():
    torch.manual_seed(0)
    quant = DDCLQuantizer(300, 16, mode="soft", temperature=0.05, codebook_init="normal", implementation="fused").eval()
    conv = torch.nn.Conv2d(3, 16, 1)
    x = torch.randn(4, 3, 6, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = conv(x)
        out = quant(z)
    assert torch.equal(out.indices, quant(z.float()).indices)
    assert out.loss.dtype == torch.float32 and out.terms["distortion"].dtype == torch.float32
    out.loss.backward()
    assert conv.weight.grad.dtype == torch.float32 and torch.isfinite(conv.weight.grad).all()


@pytest.mark.parametrize("impl", ["fused", "chunked"])
def test_empty_batch_behaves_like_reference(impl):
    for mode in ("soft", "straight_through"):
        ref = DDCLQuantizer(8, 4, mode=mode, implementation="reference")
        quant = DDCLQuantizer(8, 4, mode=mode, implementation=impl)
        quant.weight.data.copy_(ref.weight.data)
        for q in (ref, quant):
            z = torch.randn(0, 4, 3, 3, requires_grad=True)
            out = q(z)
            (out.quantized.sum() + out.loss).backward()
            assert out.quantized.shape == z.shape and out.indices.shape == (0, 3, 3)
            # the empty-batch rule (tests/test_baselines.py): a zero loss, zero gradients
            assert out.loss.item() == 0.0 and torch.equal(z.grad, torch.zeros_like(z)) and q.weight.grad is None


def test_double_backward_is_refused_not_silently_wrong():
    z = torch.randn(12, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 3, dtype=torch.float64)
    a = assign(z, w, 0.5, implementation="fused", chunk_size=4)
    (gz,) = torch.autograd.grad(a.soft.sum() + a.distortion, z, create_graph=True)
    with pytest.raises(RuntimeError):
        gz.sum().backward()


def test_public_softmax_fallback_gives_the_same_results(monkeypatch):
    """Without torch._softmax (a private function) the blocked paths use torch.softmax + copy."""
    torch.manual_seed(0)
    z, w, up = torch.randn(300, 6), torch.randn(40, 6), torch.randn(300, 6)
    results = []
    for softmax in (blocks.softmax_into, blocks.softmax_into_public):
        monkeypatch.setattr(fused, "softmax_into", softmax)
        zz = z.clone().requires_grad_(True)
        a = assign(zz, w, 0.3, implementation="chunked", chunk_size=64)
        ((a.soft * up).sum() + a.distortion).backward()
        results.append((a.soft, a.distortion, a.soft_counts, a.indices, zz.grad))
    for x, y in zip(*results):
        assert torch.equal(x, y)


def test_worker_pool_switch():
    """set_parallel_blocks(False): blocks run in the calling thread; same results to rounding."""
    torch.manual_seed(0)
    # float64: with two workers the blocks' partial sums add up in another order, which float32
    # rounding shows at ~1e-5 relative; float64 shows what the switch must not change
    z, w = torch.randn(2000, 8, dtype=torch.float64), torch.randn(64, 8, dtype=torch.float64)
    runs = []
    for enabled in (True, False):
        previous = cpu_pool.set_parallel_blocks(enabled)
        try:
            assert cpu_pool.parallel_blocks_enabled() is enabled
            zz = z.clone().requires_grad_(True)
            a = assign(zz, w, 0.2, implementation="fused", chunk_size=100)
            (a.soft.sum() + a.distortion).backward()
            runs.append((a.soft, a.distortion, a.soft_counts, zz.grad))
            assert cpu_pool.num_workers(z, 20) == (min(torch.get_num_threads(), 20) if enabled else 1)
        finally:
            cpu_pool.set_parallel_blocks(previous)
    for x, y in zip(*runs):
        assert torch.allclose(x, y, rtol=1e-10, atol=1e-10)
