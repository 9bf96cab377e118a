"""DDCL's quantization warm-up: during the first ``warmup_steps`` training batches the decoder sees
z + α·(w_{k*} − z), α rising linearly from 0 to 1, while the M-step codebook already follows the
features; the encoder's gradient is the straight-through one throughout (a state_dict saved before the
warm-up existed is refused: tests/test_ddcl.py)."""
import pytest
import torch

from ddcl_vq import DDCLQuantizer


def batch(n=64, d=4, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, d, generator=g) * torch.linspace(0.5, 2.0, d)).to(dtype)


def test_warmup_blends_from_z_to_the_code_without_step_calls():
    quant = DDCLQuantizer(8, 4, channel_dim=-1, warmup_steps=4, revive_threshold=0.0).double()
    z = batch(seed=1).requires_grad_(True)
    out = quant(z)                                   # batch 0: alpha = 0, the decoder sees z itself
    torch.testing.assert_close(out.quantized, z.detach())
    out.quantized.sum().backward()
    torch.testing.assert_close(z.grad, torch.ones_like(z))   # straight-through identity
    for seen in (1, 2, 3, 4, 5):                      # no quant.step(): a host loop may never call it
        z = batch(seed=1 + seen).requires_grad_(True)
        codes = quant.codebook.detach().clone()      # the codebook this batch is decoded with
        out = quant(z)
        alpha = min(seen / 4, 1.0)
        torch.testing.assert_close(out.quantized, (1 - alpha) * z.detach() + alpha * codes[out.indices])
        out.quantized.sum().backward()
        torch.testing.assert_close(z.grad, torch.ones_like(z))
    assert int(quant.warmup_batches) == 4


def test_the_mstep_codebook_follows_the_features_during_warmup():
    quant = DDCLQuantizer(8, 4, channel_dim=-1, warmup_steps=100, revive_threshold=0.0).double()
    quant(batch(seed=1))
    before = quant.codebook.detach().clone()
    quant(batch(seed=2) * 3.0)
    assert not torch.allclose(quant.codebook.detach(), before)


def test_evaluation_quantizes_even_during_warmup():
    quant = DDCLQuantizer(8, 4, channel_dim=-1, warmup_steps=100).double()
    quant(batch(seed=1))
    quant.eval()
    out = quant(batch(seed=2))
    torch.testing.assert_close(out.quantized, quant.codebook.detach()[out.indices])
    assert int(quant.warmup_batches) == 1            # evaluation batches do not count


def test_warmup_position_is_restored_from_the_state_dict():
    a = DDCLQuantizer(8, 4, channel_dim=-1, warmup_steps=4, revive_threshold=0.0).double()
    for seed in (1, 2):
        a(batch(seed=seed))
    b = DDCLQuantizer(8, 4, channel_dim=-1, warmup_steps=4, revive_threshold=0.0).double()
    b.load_state_dict(a.state_dict())
    z = batch(seed=3)
    torch.testing.assert_close(b(z).quantized, a(z).quantized)   # both at alpha = 1/2


def test_warmup_steps_validated():
    for bad in (-1, 1.5, True, "10"):
        with pytest.raises(ValueError, match="warmup_steps"):
            DDCLQuantizer(8, 4, warmup_steps=bad)
