"""The device-aware block policy (a pure function, tested on the CPU) and that the block size
never changes a result."""
import pytest
import torch

import ddcl_vq.blocks as blocks
import ddcl_vq.ddcl.fused as fused
from ddcl_vq.ddcl import cpu_pool
from ddcl_vq.ddcl.assignment import assign
from ddcl_vq.blocks import block_rows, chunk_rows, nearest_other_code
from ddcl_vq.ddcl.statistics import soft_statistics

GiB = 2**30


@pytest.mark.parametrize("n, k, rows", [
    (8192, 1024, 256),        # ≈ 2**18 / K
    (8192, 8192, 64),         # floor: never fewer than 64 rows on the CPU
    (8192, 65536, 64),
    (8192, 16, 1024),         # ceiling: never more than 1024
    (100, 16, 100),           # never more than the batch
    (0, 16, 1),               # an empty batch still gets a positive block
])
def test_cpu_blocks_are_cache_sized(n, k, rows):
    assert block_rows("cpu", n, k, itemsize=4, memory_budget_bytes=GiB) == rows
    assert chunk_rows(n, k) == rows                       # the old name, same policy
    # the memory budget is a GPU setting: the CPU ignores it
    assert block_rows("cpu", n, k, itemsize=4, memory_budget_bytes=1) == rows


@pytest.mark.parametrize("device", ["cuda", "mps", "xpu"])
def test_gpu_one_block_while_it_fits_the_budget(device):
    # 8192 × 8192 × 4 bytes × 4 live tensors = 1 GiB: exactly fits
    assert block_rows(device, 8192, 8192, itemsize=4, memory_budget_bytes=GiB) == 8192
    assert block_rows(device, 65536, 1024, itemsize=4, memory_budget_bytes=GiB) == 65536
    # above it: the fewest equal blocks that fit
    assert block_rows(device, 8193, 8192, itemsize=4, memory_budget_bytes=GiB) == 4097      # 2 blocks
    assert block_rows(device, 16384, 65536, itemsize=4, memory_budget_bytes=GiB) == 1024    # 16 blocks
    assert block_rows(device, 16384, 65536, itemsize=2, memory_budget_bytes=GiB) == 2048    # half the bytes
    assert block_rows(device, 16384, 65536, itemsize=8, memory_budget_bytes=GiB) == 512
    # a budget below one row still gives one row per block
    assert block_rows(device, 10, 1 << 20, itemsize=4, memory_budget_bytes=1) == 1


def test_gpu_blocks_are_equal_and_within_budget():
    for n in (1, 7, 1000, 4097, 123457):
        for k in (1, 512, 8192, 100000):
            for budget in (2**20, 2**26, GiB):
                rows = block_rows("cuda", n, k, itemsize=4, memory_budget_bytes=budget)
                assert 1 <= rows <= n
                num_blocks = -(-n // rows)
                assert rows * 4 * 4 * k <= budget or rows == 1
                # fewest blocks: one block fewer would not fit
                assert num_blocks == 1 or -(-n // (num_blocks - 1)) * 4 * 4 * k > budget


def test_default_budget_is_read_at_call_time(monkeypatch):
    assert blocks.DEVICE_BLOCK_BUDGET_BYTES == GiB
    assert block_rows("cuda", 8192, 8192) == 8192
    monkeypatch.setattr(blocks, "DEVICE_BLOCK_BUDGET_BYTES", GiB // 4)
    assert block_rows("cuda", 8192, 8192) == 2048


def test_explicit_chunk_size_wins_on_every_device():
    for device in ("cpu", "cuda"):
        assert block_rows(device, 8192, 8192, itemsize=4, memory_budget_bytes=GiB, chunk_size=100) == 100
        assert block_rows(device, 50, 8192, itemsize=4, memory_budget_bytes=1, chunk_size=100) == 50


def test_worker_pool_never_runs_for_other_devices():
    """The CPU pool is for CPU tensors only (a GPU's blocks run in the calling thread)."""
    previous = cpu_pool.set_parallel_blocks(True)
    try:
        for device in ("meta", "cuda") if torch.cuda.is_available() else ("meta",):
            x = torch.empty(4, 4, device=device)
            assert cpu_pool.num_workers(x, 1000) == 1
        assert cpu_pool.num_workers(torch.empty(4, 4), 1000) == min(torch.get_num_threads(), 1000)
    finally:
        cpu_pool.set_parallel_blocks(previous)


@pytest.mark.parametrize("impl", ["fused", "chunked"])
def test_results_do_not_depend_on_block_rows(impl, monkeypatch):
    """Any block size gives the same values and gradients (float64: equal to rounding far below
    any tolerance): the CPU default, one row, uneven blocks, and one block for the whole batch
    (what a GPU gets)."""
    torch.manual_seed(0)
    z = torch.randn(301, 7, dtype=torch.float64)
    w = torch.randn(45, 7, dtype=torch.float64)
    up = torch.randn(301, 7, dtype=torch.float64)
    runs = []
    for rows in (None, 1, 13, 64, 301, 1000):
        zz = z.clone().requires_grad_(True)
        a = assign(zz, w, 0.3, implementation=impl, chunk_size=rows)
        ((a.soft * up).sum() + 3.0 * a.distortion).backward()
        runs.append((a.soft, a.distortion, a.ols, a.variance, a.soft_counts, a.indices, zz.grad))
    assert block_rows("cuda", 301, 45, itemsize=8) == 301       # the GPU policy: one block
    for run in runs[1:]:
        for x, y in zip(runs[0], run):
            assert torch.allclose(x, y, rtol=1e-11, atol=1e-12) if x.is_floating_point() else torch.equal(x, y)


def test_soft_statistics_do_not_depend_on_block_rows():
    torch.manual_seed(0)
    z = torch.randn(500, 6, dtype=torch.float64)
    w = torch.randn(70, 6, dtype=torch.float64)
    for support in (None, 5):
        runs = [soft_statistics(z, w, 0.4, rows=rows, support=support) for rows in (None, 1, 33, 500, 4096)]
        for s in runs[1:]:
            assert torch.equal(s.indices, runs[0].indices)
            for name in ("nearest", "mass", "sums", "distortion", "ols", "variance"):
                assert torch.allclose(getattr(s, name), getattr(runs[0], name), rtol=1e-11, atol=1e-12), name


# ----------------------------------------------------------------------------- q buffer reuse (CPU)


def _soft_step(z, w, up, **kw):
    zz = z.clone().requires_grad_(True)
    a = assign(zz, w, 0.3, implementation="fused", **kw)
    return a, zz, (a.soft * up).sum() + 2.0 * a.distortion


def test_fused_q_buffer_is_reused_only_after_the_graph_is_freed():
    torch.manual_seed(0)
    z, w, up = torch.randn(300, 6), torch.randn(40, 6), torch.randn(300, 6)
    previous = fused.set_buffer_reuse(True)
    try:
        fused.release_buffers()
        a, zz, loss = _soft_step(z, w, up)
        loss.backward()
        held = fused._SPARE[torch.float32]
        assert len(held) == 1 and held[0].numel() == 300 * 40
        ptr = held[0].data_ptr()
        first = (a.soft.detach(), zz.grad)
        # the next step of the same (or a smaller) size takes it: same results
        a, zz, loss = _soft_step(z, w, up)
        assert not fused._SPARE[torch.float32]
        loss.backward()
        assert fused._SPARE[torch.float32][0].data_ptr() == ptr
        for x, y in zip(first, (a.soft.detach(), zz.grad)):
            assert torch.equal(x, y)
        # retain_graph: the graph keeps its q, nothing is handed back, and a later forward in
        # between does not disturb the second backward
        fused.release_buffers()
        a, zz, loss = _soft_step(z, w, up)
        loss.backward(retain_graph=True)
        assert not fused._SPARE.get(torch.float32)
        g1 = zz.grad.clone()
        zz.grad = None
        b, zb, loss_b = _soft_step(z.flip(0), w, up)    # another step meanwhile
        loss_b.backward()
        c, zc, loss_c = _soft_step(z.flip(0), w, up)    # takes the buffer loss_b handed back
        assert not fused._SPARE.get(torch.float32)
        loss.backward()
        assert torch.equal(zz.grad, g1)
        # two graphs alive at once: each has its own q
        a1, z1, l1 = _soft_step(z, w, up)
        a2, z2, l2 = _soft_step(z * 2, w, up)
        (l1 + l2).backward()
        assert torch.equal(z1.grad, first[1])
    finally:
        fused.set_buffer_reuse(previous)


def test_buffer_reuse_switch_frees_and_gives_the_same_results():
    torch.manual_seed(0)
    z, w, up = torch.randn(200, 5, dtype=torch.float64), torch.randn(30, 5, dtype=torch.float64), \
        torch.randn(200, 5, dtype=torch.float64)
    results = []
    previous = fused.set_buffer_reuse(True)
    try:
        for enabled in (True, True, False):
            fused.set_buffer_reuse(enabled)
            a, zz, loss = _soft_step(z, w, up)
            loss.backward()
            results.append((a.soft.detach(), a.distortion.detach(), zz.grad))
            assert bool(fused._SPARE.get(torch.float64)) is enabled
        assert fused.release_buffers() == 0           # turning it off freed what was held
    finally:
        fused.set_buffer_reuse(previous)
    for run in results[1:]:
        for x, y in zip(results[0], run):
            assert torch.equal(x, y)


def test_nearest_other_code_is_the_brute_force_minimum_over_the_other_codes():
    w = torch.randn(37, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    expected = torch.cdist(w, w).pow(2).masked_fill(torch.eye(37, dtype=torch.bool), float("inf")).min(1).values
    for rows in (None, 7, 8):
        torch.testing.assert_close(nearest_other_code(w, rows=rows), expected)
    assert nearest_other_code(w[:1]).isinf().all()
