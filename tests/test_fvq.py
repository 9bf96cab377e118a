"""FVQ (VQBridge + learning annealing) against its authors' formulation.

The reference below is yfChang-cv/FVQ's ``VectorQuantizer.forward`` (vq_model_qbridge_release.py) with its
``VQBridge`` (qbridge_ViT.py) written out by hand on the same weights: patch embedding as a convolution,
attention as an explicit softmax, the authors' un-patchify einsum. The library must give the same codes,
indices, loss and gradients (float64). Plus the interface rules every quantizer follows, the annealing
schedule against the authors' ``combined_lr_lambda``, and a small fit that must use most codes.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from ddcl_vq import QuantizerOutput
from ddcl_vq.common.skeleton import lr_schedule
from ddcl_vq.fvq import FVQQuantizer, bridge_grid


def authors_bridge(weight, bridge, num_heads):
    """qbridge_ViT.VQBridge.forward on the codebook as the authors lay it out, (K, D) -> (K, D)."""
    k, d = weight.shape
    h, w = bridge.grid
    p = bridge.patch_size
    x = weight.permute(1, 0).reshape(1, d, h, w)
    proj = bridge.x_embedder.proj
    x = F.conv2d(x, proj.weight, proj.bias, stride=p).flatten(2).transpose(1, 2)   # timm PatchEmbed
    n, t, c = x.shape
    for block in bridge.blocks:
        y = F.layer_norm(x, (c,), eps=1e-6)
        qkv = F.linear(y, block.attn.qkv.weight, block.attn.qkv.bias).reshape(n, t, 3, num_heads, c // num_heads)
        q, kk, v = qkv.permute(2, 0, 3, 1, 4)
        attn = torch.softmax(q @ kk.transpose(-2, -1) * (c // num_heads) ** -0.5, -1)
        y = (attn @ v).transpose(1, 2).reshape(n, t, c)
        x = x + F.linear(y, block.attn.proj.weight, block.attn.proj.bias)
        y = F.layer_norm(x, (c,), eps=1e-6)
        y = F.gelu(F.linear(y, block.mlp.fc1.weight, block.mlp.fc1.bias), approximate="tanh")
        x = x + F.linear(y, block.mlp.fc2.weight, block.mlp.fc2.bias)
    x = F.linear(F.layer_norm(x, (c,), eps=1e-6), bridge.final_layer.linear.weight, bridge.final_layer.linear.bias)
    x = x.reshape(1, h // p, w // p, p, p, d)
    x = torch.einsum("nhwpqc->nchpwq", x).reshape(1, d, h, w)
    return x.reshape(1, d, k).permute(0, 2, 1).squeeze(0)


def authors_fvq(z, weight, bridge, num_heads, beta=0.25):
    """vq_model_qbridge_release.VectorQuantizer.forward (training) on (B, D, H, W) features."""
    z = torch.einsum("b c h w -> b h w c", z).contiguous()
    z_flattened = z.view(-1, weight.shape[1])
    embedding = authors_bridge(weight, bridge, num_heads)
    d = torch.sum(z_flattened ** 2, dim=1, keepdim=True) + torch.sum(embedding ** 2, dim=1) - 2 * \
        torch.einsum("bd,dn->bn", z_flattened, embedding.t())
    ind = torch.argmin(d, dim=1)
    z_q = embedding[ind].view(z.shape)
    loss = torch.mean((z_q - z.detach()) ** 2) + beta * torch.mean((z_q.detach() - z) ** 2)
    z_q = z + (z_q - z).detach()
    return torch.einsum("b h w c -> b c h w", z_q), ind, loss, embedding


def authors_lr_lambda(current_step, warmup_steps, total_steps, sche_type, T=0.3):
    """vq_train_qbridge_lr_release.py, combined_lr_lambda (wp0 0.005, wpe 0.01)."""
    wp0, wpe, max_rest = 0.005, 0.01, 1 - T
    if current_step < warmup_steps:
        return wp0 + (1 - wp0) * (float(current_step) / float(max(1, warmup_steps)))
    if sche_type == "const":
        return 1.0
    pasd = (current_step - warmup_steps) / (total_steps - 1 - warmup_steps)
    if pasd < T:
        return 1.0
    if sche_type == "lin":
        return wpe + (1 - wpe) * (1 - pasd) / max_rest
    return wpe + (1 - wpe) * 0.5 * (1 + math.cos(math.pi * (pasd - T) / max_rest))


def randomise_last_layer(q, std=0.3):
    """The recover layer starts at zero (every code 0); give it weights so the codes differ."""
    with torch.no_grad():
        q.bridge.final_layer.linear.weight.normal_(0, std)
        q.bridge.final_layer.linear.bias.normal_(0, std)
        q.weight.normal_()
    return q


def small(k=64, d=8, **kw):
    kw = {"bridge_dim": 32, "bridge_heads": 4, **kw}
    return FVQQuantizer(k, d, **kw)


@pytest.mark.parametrize("num_codes", [64, 32])   # an 8×8 grid (the authors' square layout) and 4×8
def test_matches_the_authors_formulation(num_codes):
    torch.manual_seed(0)
    q = randomise_last_layer(small(num_codes, 4, bridge_depth=2).double())
    z = torch.randn(3, 4, 5, 2, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(3, 4, 5, 2, dtype=torch.float64)
    out = q(z)
    (out.loss + (out.quantized * upstream).sum()).backward()

    z_ref = z.detach().clone().requires_grad_()
    ref = randomise_last_layer(small(num_codes, 4, bridge_depth=2).double())
    ref.load_state_dict(q.state_dict())
    zq_ref, ind_ref, loss_ref, codes_ref = authors_fvq(z_ref, ref.weight, ref.bridge, 4)
    (loss_ref + (zq_ref * upstream).sum()).backward()

    assert torch.allclose(q.codebook, codes_ref, atol=1e-12)
    assert torch.equal(out.indices.reshape(-1), ind_ref)
    assert torch.allclose(out.quantized, zq_ref, atol=1e-12)
    assert out.loss.item() == pytest.approx(loss_ref.item(), abs=1e-12)
    assert torch.allclose(z.grad, z_ref.grad, atol=1e-12)
    for (name, a), b in zip(q.named_parameters(), ref.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-10), name


def test_initial_codes_are_zero_and_a_step_moves_every_code():
    q = small()
    assert torch.equal(q.codebook, torch.zeros(64, 8))   # the recover layer is zero-initialised, no residual
    assert bridge_grid(16384, 4) == (128, 128) and bridge_grid(262144, 8) == (512, 512) and bridge_grid(32, 4) == (4, 8)
    torch.manual_seed(0)
    randomise_last_layer(q)
    before = q.codebook.detach().clone()
    z = torch.randn(4, 8) * 0.1 + 3.0        # a batch that picks a handful of codes
    out = q.train()(z.reshape(1, 4, 8).transpose(1, 2))
    assert out.indices.unique().numel() <= 4
    out.loss.backward()
    with torch.no_grad():
        for p in q.parameters():
            p -= 1e-2 * p.grad
    moved = (q.codebook - before).abs().sum(1) > 0
    assert moved.all()   # the bridge's point: every code learns from every batch, not only the chosen ones


def test_interface_shapes_layouts_and_lookup():
    torch.manual_seed(0)
    for channel_dim, shape in ((1, (3, 8, 5, 4)), (-1, (2, 7, 8))):
        q = randomise_last_layer(small(channel_dim=channel_dim))
        z = torch.randn(*shape, requires_grad=True)
        out = q.train()(z)
        assert isinstance(out, QuantizerOutput)
        assert out.quantized.shape == z.shape and out.quantized.dtype == z.dtype
        idx_shape = shape[:1] + shape[2:] if channel_dim == 1 else shape[:-1]
        assert out.indices.shape == idx_shape and out.indices.dtype == torch.long
        assert out.loss.shape == () and torch.isfinite(out.loss) and set(out.terms) == {"codebook", "commitment"}
        assert 1.0 <= float(out.perplexity) <= q.num_codes
        assert torch.equal(q.lookup(out.indices), out.quantized)   # training value: exactly the code
        q.eval()
        with torch.no_grad():
            ev = q(z)
            flat = z.movedim(channel_dim, -1).reshape(-1, 8)
            assert torch.equal(ev.indices.reshape(-1), torch.cdist(flat, q.codebook).argmin(1))
            assert torch.equal(q.lookup(ev.indices), ev.quantized)


def test_gradients_reach_the_encoder_the_codebook_and_the_bridge():
    torch.manual_seed(0)
    q = small()
    z = torch.randn(2, 8, 4, 4, requires_grad=True)
    opt = torch.optim.Adam(q.parameters(), lr=1e-2)
    for _ in range(2):   # at initialisation only the (zero) recover layer has a gradient; after a step, all
        opt.zero_grad()
        z.grad = None
        out = q.train()(z)
        (out.quantized.square().mean() + out.loss).backward()
        opt.step()
    assert z.grad is not None and z.grad.abs().sum() > 0
    for name, p in q.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_state_dict_round_trip():
    torch.manual_seed(0)
    a = small()
    opt = torch.optim.Adam(a.parameters(), lr=1e-2)
    for _ in range(3):
        out = a.train()(torch.randn(4, 8, 4, 4))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    torch.manual_seed(123)   # a different random start: the state must carry everything
    b = small()
    b.load_state_dict(a.state_dict())
    z = torch.randn(2, 8, 4, 4)
    with torch.no_grad():
        oa, ob = a.eval()(z), b.eval()(z)
    assert torch.equal(oa.indices, ob.indices) and torch.equal(oa.quantized, ob.quantized)
    assert torch.equal(a.codebook, b.codebook)


def test_anneal_schedule_is_the_authors():
    """train.lr_schedule: anneal is the authors' combined_lr_lambda with their run's settings (lin, T = 0.3)."""
    total = 400   # their 40 epochs with 4 of warm-up, scaled: warm-up 40 steps
    factor = lr_schedule(total, "anneal")
    for step in range(total):
        assert factor(step) == pytest.approx(authors_lr_lambda(step, 40, total, "lin"), abs=1e-12)
    assert factor(0) == 0.005 and factor(total - 1) == pytest.approx(0.01)


def test_dtypes_autocast_and_bad_arguments():
    torch.manual_seed(0)
    q = randomise_last_layer(small(channel_dim=-1))
    out = q(torch.randn(4, 8, dtype=torch.float64))
    assert out.quantized.dtype == torch.float64 and out.loss.dtype == torch.float64
    with torch.autocast("cpu", dtype=torch.bfloat16):
        amp = q(torch.randn(4, 8).bfloat16())
    assert amp.quantized.dtype == torch.bfloat16 and amp.loss.dtype == torch.float32
    assert torch.equal(amp.quantized, q.codebook[amp.indices].bfloat16())
    with pytest.raises(ValueError, match="with D=8"):
        q(torch.randn(4, 5))
    for kwargs, match in [({"beta": -1}, "beta >= 0"), ({"patch_size": 0}, "patch_size"),
                          ({"bridge_dim": 30}, "bridge_dim divisible by bridge_heads"),
                          ({"bridge_depth": 1.5}, "bridge_depth"), ({"channel_dim": 2}, "channel_dim")]:
        with pytest.raises(ValueError, match=match):
            small(**kwargs)
    with pytest.raises(ValueError, match="num_codes = h·w"):
        FVQQuantizer(8, 8)
    with pytest.raises(ValueError, match="num_codes"):
        FVQQuantizer(0, 8)


@pytest.mark.parametrize("training", [True, False])
def test_empty_batch(training):
    q = small().train(training)
    z = torch.zeros(0, 8, 3, 3, requires_grad=True)
    out = q(z)
    assert out.indices.shape == (0, 3, 3) and out.loss.item() == 0.0
    out.loss.backward()


def test_fit_a_gaussian_mixture_uses_most_codes():
    """K = 64 codes on 512 fixed vectors from a 64-component mixture, 100 full-batch Adam steps (the authors'
    betas, their annealing): the codes must cover the data (≥ 50 of 64 used) and the distortion fall below
    15% of its start. A plain learned codebook trained the same way leaves more codes dead."""
    torch.manual_seed(0)
    k, d, steps = 64, 8, 100
    data = torch.randn(k, d) * 2
    data = data[torch.randint(0, k, (512,))] + 0.5 * torch.randn(512, d)
    start = data.pow(2).sum(1).mean().item()   # every code starts at 0

    torch.manual_seed(1)
    q = FVQQuantizer(k, d, channel_dim=-1)
    opt = torch.optim.Adam(q.parameters(), lr=3e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_schedule(steps, "anneal"))
    for _ in range(steps):
        out = q.train()(data)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        sched.step()
    with torch.no_grad():
        ev = q.eval()(data)
    used = ev.indices.unique().numel()
    assert used >= 50 and ev.terms["codebook"].item() < 0.15 * start

    torch.manual_seed(1)
    w = torch.nn.Parameter(torch.empty(k, d).uniform_(-1 / k, 1 / k))
    opt = torch.optim.Adam([w], lr=3e-3, betas=(0.9, 0.95))
    for _ in range(steps):
        idx = torch.cdist(data, w).argmin(1)
        loss = (w[idx] - data).pow(2).sum(1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert torch.cdist(data, w).argmin(1).unique().numel() < used
