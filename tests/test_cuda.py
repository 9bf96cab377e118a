"""CUDA checks: they run where a GPU is present and are skipped, with the reason shown, elsewhere.

``scripts/gpu_check.sh`` runs them all (plus ``ddcl-vq bench --quick --device cuda``). What they
check on the GPU:

* fused = chunked = reference in values and z-gradients, every mode, float32 and float64, with the
  GPU block policy (one block for the whole batch) and with a budget small enough to force blocks;
  ``soft_statistics`` likewise, against the CPU;
* bf16/fp16 autocast: the quantizer computes in float32 (the same indices as float32 on the same
  input, exactly), and against a float32 encoder the indices differ only where the float32
  distance gap is within what the encoder's rounding can move (the documented tolerance:
  d(z, w_b) − d(z, w_a) ≤ 2‖δ‖(‖z − w_a‖ + ‖z − w_b‖) + 2‖δ‖², δ = z_amp − z_fp32);
* a few training steps of the default config through the real ``train`` entry (and with bf16);
* ``torch.compile`` of the default VQ-VAE with the DDCL quantizer, forward and backward, equal to
  eager (also run on the CPU when a C++ compiler is there: it compiles in well under a minute);
* ``ddcl-vq bench --device cuda`` gives the same rows as on the CPU.
"""
import json
import shutil

import pytest
import torch

import ddcl_vq.blocks as blocks
import ddcl_vq.ddcl.fused as fused
from ddcl_vq import DDCLQuantizer
from ddcl_vq.ddcl.assignment import assign
from ddcl_vq.ddcl.statistics import soft_statistics

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device here (torch.cuda.is_available() is False); "
                                                 "run scripts/gpu_check.sh on a machine with a GPU")

MODES = ["soft", "straight_through", "soft_straight_through"]
TOL = {torch.float64: dict(rtol=1e-9, atol=1e-11), torch.float32: dict(rtol=2e-4, atol=2e-5)}


def assert_close(a, b, dtype, what):
    a, b = a.detach().cpu().to(torch.float64), b.detach().cpu().to(torch.float64)
    scale = max(b.abs().max().item(), 1.0) if b.numel() else 1.0
    assert torch.allclose(a, b, rtol=TOL[dtype]["rtol"], atol=TOL[dtype]["atol"] * scale), \
        f"{what}: max abs diff {(a - b).abs().max().item():.3g} (scale {scale:.3g})"


def run(impl, mode, dtype, n, k, d, device, seed=0, tau=0.1):
    torch.manual_seed(seed)
    quant = DDCLQuantizer(k, d, mode=mode, temperature=tau, codebook_init="normal", channel_dim=-1,
                          implementation=impl)
    quant = quant.to(device=device, dtype=dtype)
    # drawn in float32 on the CPU whatever the dtype and device: the same values everywhere
    z = torch.randn(n, d).to(device, dtype).requires_grad_(True)
    upstream = torch.randn(n, d).to(device, dtype)
    out = quant(z)
    ((out.quantized * upstream).sum() + 3.0 * out.loss).backward()
    return out, z.grad


@pytest.fixture
def block_counts(monkeypatch):
    """Records the number of blocks of every blocked forward/backward."""
    seen = []
    real = fused.run_blocks

    def spy(x, num_blocks, *args):
        seen.append(num_blocks)
        return real(x, num_blocks, *args)
    monkeypatch.setattr(fused, "run_blocks", spy)
    return seen


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("budget", [None, 2**20], ids=["one-block", "forced-blocks"])
def test_fused_chunked_reference_agree_on_cuda(mode, dtype, budget, block_counts, monkeypatch):
    n, k, d = 3000, 700, 16
    if budget is not None:
        monkeypatch.setattr(blocks, "DEVICE_BLOCK_BUDGET_BYTES", budget)
    ref, ref_gz = run("reference", mode, dtype, n, k, d, "cuda")
    cpu, cpu_gz = run("reference", mode, torch.float64, n, k, d, "cpu")
    for impl in ("fused", "chunked"):
        block_counts.clear()
        out, gz = run(impl, mode, dtype, n, k, d, "cuda")
        # straight_through mode assigns by the M-step's statistics alone: no blocked assignment runs
        assert all((c == 1) == (budget is None) for c in block_counts), block_counts
        assert bool(block_counts) == (mode != "straight_through"), block_counts
        assert out.quantized.device.type == "cuda" and out.quantized.dtype == dtype
        assert torch.equal(out.indices, ref.indices), impl
        assert_close(out.quantized, ref.quantized, dtype, f"{impl} quantized")
        assert_close(out.loss, ref.loss, dtype, f"{impl} loss")
        for name in ref.terms:
            assert_close(out.terms[name], ref.terms[name], dtype, f"{impl} {name}")
        assert_close(out.soft_counts, ref.soft_counts, dtype, f"{impl} soft_counts")
        assert_close(gz, ref_gz, dtype, f"{impl} grad z")
        # and the GPU agrees with the CPU's float64 reference
        assert_close(out.quantized, cpu.quantized, torch.float32, f"{impl} quantized vs CPU")
        assert_close(gz, cpu_gz, torch.float32, f"{impl} grad z vs CPU")


@needs_cuda
def test_assign_on_cuda_matches_cpu_and_never_uses_the_worker_pool(monkeypatch):
    from ddcl_vq.ddcl import cpu_pool
    torch.manual_seed(0)
    z, w, up = torch.randn(5000, 8, dtype=torch.float64), torch.randn(300, 8, dtype=torch.float64), torch.randn(5000, 8)
    results = []
    for device in ("cpu", "cuda"):
        if device == "cuda":  # the CPU runs may use the pool; from here on it must not run
            monkeypatch.setattr(cpu_pool, "_pool", lambda size: pytest.fail("the CPU worker pool ran for CUDA tensors"))
        for impl in ("reference", "fused", "chunked"):
            # copies: z.to("cpu") is z itself, and its .grad would accumulate over the implementations
            zz = z.to(device, copy=True).requires_grad_(True)
            a = assign(zz, w.to(device), 0.3, implementation=impl)
            ((a.soft * up.to(device, torch.float64)).sum() + 2.0 * a.distortion).backward()
            results.append((a.soft, a.distortion, a.ols, a.variance, zz.grad, a.indices))
    for other in results[1:]:
        for x, y in zip(results[0], other):
            if x.dtype == torch.long:
                assert torch.equal(x.cpu(), y.cpu())
            else:
                assert_close(y, x, torch.float64, "assign cpu vs cuda")


@needs_cuda
@pytest.mark.parametrize("support", [None, 7])
@pytest.mark.parametrize("budget", [None, 2**16], ids=["one-block", "forced-blocks"])
def test_soft_statistics_on_cuda_match_cpu(support, budget, monkeypatch):
    if budget is not None:
        monkeypatch.setattr(blocks, "DEVICE_BLOCK_BUDGET_BYTES", budget)
    torch.manual_seed(0)
    z, w = torch.randn(4000, 12, dtype=torch.float64), torch.randn(200, 12, dtype=torch.float64)
    cpu = soft_statistics(z, w, 0.5, support=support)
    for dtype in (torch.float64, torch.float32):
        gpu = soft_statistics(z.to("cuda", dtype), w.to("cuda", dtype), 0.5, support=support)
        assert torch.equal(gpu.indices.cpu(), cpu.indices)
        for name in ("nearest", "mass", "sums", "distortion", "ols", "variance"):
            assert_close(getattr(gpu, name), getattr(cpu, name), dtype, f"soft_statistics {name} {dtype}")


@needs_cuda
@pytest.mark.parametrize("amp_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("impl", ["fused", "chunked", "reference"])
def test_autocast_on_cuda_computes_in_float32(amp_dtype, mode, impl):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 16, 1).cuda()
    quant = DDCLQuantizer(300, 16, mode=mode, temperature=0.05, codebook_init="normal",
                          implementation=impl).cuda().eval()   # eval: the codebook stays put between calls
    x = torch.randn(8, 3, 12, 12, device="cuda")
    with torch.autocast("cuda", dtype=amp_dtype):
        z = conv(x)
        out = quant(z)
    assert z.dtype == amp_dtype
    # the quantizer's own arithmetic is float32: the same input in float32 gives the same indices
    same = quant(z.float())
    assert torch.equal(out.indices, same.indices)
    assert out.loss.dtype == torch.float32 and out.terms["distortion"].dtype == torch.float32
    assert out.quantized.dtype == amp_dtype            # the output follows the input's dtype
    out.loss.backward()
    assert conv.weight.grad.dtype == torch.float32 and torch.isfinite(conv.weight.grad).all()
    # against a float32 encoder: indices differ only where rounding of z can move the argmin
    z32 = conv(x).detach()
    ref = quant(z32)
    flat32 = z32.permute(0, 2, 3, 1).reshape(-1, 16)
    delta = (z.detach().float() - z32).permute(0, 2, 3, 1).reshape(-1, 16).norm(dim=1)
    a, b = ref.indices.reshape(-1), out.indices.reshape(-1)
    w = quant.weight.detach()
    da, db = (flat32 - w[a]).norm(dim=1), (flat32 - w[b]).norm(dim=1)
    gap = db.pow(2) - da.pow(2)
    bound = 2 * delta * (da + db) + 2 * delta.pow(2) + 1e-5 * (1 + da.pow(2))
    assert bool((gap <= bound).all()), f"{int((gap > bound).sum())} indices moved by more than the rounding allows"
    assert (a != b).float().mean().item() < 0.05


@needs_cuda
def test_few_training_steps_of_the_default_config_on_cuda(tmp_path):
    from ddcl_vq.cli import main
    for amp in ("none", "bf16"):
        run = tmp_path / f"run_{amp}"
        assert main(["train", "--config", "configs/fashion_ddcl.yaml", "--quiet", f"run.dir={run}", "train.steps=20",
                           "train.device=cuda", f"train.amp={amp}", "train.log_every=5", "train.eval_images=512",
                           "train.checkpoint_every=10", "train.image_every=10"]) == 0
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if "loss" in r][-1] == 20
        assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records if "loss" in r)
        summary = json.loads((run / "summary.json").read_text())
        assert summary["step"] == 20 and summary["codebook"]["active_codes"] > 0
        ckpt = torch.load(run / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
        assert ckpt["step"] == 20


def _compile_check(device):
    """torch.compile of the default VQ-VAE (configs/fashion_ddcl.yaml: DDCL, M-step codebook) and of
    a soft-mode DDCL model (the fused custom autograd.Function): forward + backward equal eager.
    Graph breaks are expected (the quantizer's host-side bookkeeping, the blocked path's Python
    loop); what must hold is that it compiles, runs and gives the same numbers."""
    import warnings

    import torch._dynamo
    from ddcl_vq.tokenizer.config import build_model
    from ddcl_vq.tokenizer.config import load_config
    torch._dynamo.reset()
    x = torch.rand(16, 1, 32, 32, generator=torch.Generator().manual_seed(0)).to(device)
    for overrides in ([], ["quantizer.mode=soft", "quantizer.implementation=fused"]):
        cfg = load_config("configs/fashion_ddcl.yaml", overrides)
        torch.manual_seed(0)
        eager = build_model(cfg, in_channels=1).to(device).train()
        compiled_model = build_model(cfg, in_channels=1).to(device).train()
        compiled_model.load_state_dict(eager.state_dict())
        compiled = torch.compile(compiled_model)
        grads = []
        for model in (eager, compiled):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out = model(x)
                loss = torch.nn.functional.mse_loss(out.reconstruction, x) + out.quantizer.loss
                loss.backward()
            grads.append((loss.detach(), out.quantizer.indices,
                          [p.grad.detach().clone() for p in eager.encoder.parameters()] if model is eager else
                          [p.grad.detach().clone() for p in compiled_model.encoder.parameters()]))
        (l0, i0, g0), (l1, i1, g1) = grads
        assert torch.isfinite(l1) and torch.allclose(l0, l1, rtol=1e-4, atol=1e-6), (overrides, l0, l1)
        assert (i0 == i1).float().mean() > 0.99
        for a, b in zip(g0, g1):
            # compiled kernels sum in another order: compare each gradient tensor as a whole
            rel = ((a - b).norm() / a.norm().clamp_min(1e-30)).item()
            assert rel < 1e-2, (overrides, rel)


@needs_cuda
def test_torch_compile_default_model_on_cuda():
    _compile_check("cuda")


@pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None and shutil.which("g++") is None,
                    reason="torch.compile on the CPU needs a C++ compiler (gcc/cc); none on PATH")
def test_torch_compile_default_model_on_cpu():
    """About 45 s on one shared core (inductor generates and compiles C++ once per graph)."""
    _compile_check("cpu")


@needs_cuda
def test_bench_device_cuda_has_the_same_rows_as_cpu(tmp_path):
    from ddcl_vq.studies.bench.cli import main as bench_main
    rows = {}
    for device in ("cpu", "cuda"):
        out = tmp_path / f"{device}.json"
        assert bench_main(["--shapes", "256,8,64", "--repeats", "1", "--no-e2e", "--no-progress", "--device", device,
                           "--json", str(out)]) == 0
        data = json.loads(out.read_text())
        rows[device] = data["rows"]
        assert data["meta"]["device"] == device
    assert [(r["impl"], r["N"], r["D"], r["K"]) for r in rows["cpu"]] == \
           [(r["impl"], r["N"], r["D"], r["K"]) for r in rows["cuda"]]
    assert all(r["device"] == "cuda" and r["memory_method"] == "cuda" for r in rows["cuda"])
    assert all(r["ms"] > 0 for r in rows["cuda"] if not r.get("skipped"))


@pytest.mark.skipif(CUDA, reason="checks the message a machine without a GPU gives")
def test_bench_device_cuda_without_gpu_is_a_one_line_error(capsys):
    from ddcl_vq.studies.bench.cli import main as bench_main
    assert bench_main(["--quick", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--device cuda" in err and "no CUDA device" in err
