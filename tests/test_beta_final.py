"""The commitment ramp (DDCLQuantizer(beta_final=1.0), the default): beta rises linearly to
beta_final over schedule_steps calls of step(), then stays; without schedule_steps, or with
beta_final=None, it is constant; bad values are refused; configs carry it."""
import pytest
import torch

from ddcl_vq import DDCLQuantizer
from ddcl_vq.tokenizer.config import Config


def _weights(quantizer, steps):
    torch.manual_seed(0)
    z = torch.randn(256, 4)
    weights = []
    for _ in range(steps):
        out = quantizer(z + 0.1 * torch.randn_like(z))
        weights.append(float(out.loss) * quantizer.dim / float(out.terms["commitment"]))
        quantizer.step()
    return weights


def test_commitment_weight_rises_linearly_then_stays():
    q = DDCLQuantizer(16, 4, schedule_steps=10, channel_dim=-1, warmup_steps=0).train()   # the defaults: 0.25 -> 1
    weights = _weights(q, 13)
    assert weights[0] == pytest.approx(0.25, rel=1e-4)
    assert weights[4] == pytest.approx(0.25 + 0.75 * 0.4, rel=1e-4)
    assert weights[10:] == pytest.approx([1.0] * 3, rel=1e-4)


def test_without_beta_final_or_schedule_steps_the_weight_is_constant():
    q = DDCLQuantizer(16, 4, beta=0.25, beta_final=None, schedule_steps=10, channel_dim=-1, warmup_steps=0).train()
    assert _weights(q, 12) == pytest.approx([0.25] * 12, rel=1e-4)
    q = DDCLQuantizer(16, 4, beta=0.5, channel_dim=-1, warmup_steps=0).train()   # a host loop's drop-in
    assert _weights(q, 4) == pytest.approx([0.5] * 4, rel=1e-4)


def test_assigning_the_temperature_keeps_the_ramp():
    q = DDCLQuantizer(16, 4, schedule_steps=10, channel_dim=-1, warmup_steps=0).train()
    q.temperature = 0.1
    assert q.schedule_steps == 10 and _weights(q, 11)[10] == pytest.approx(1.0, rel=1e-4)


def test_bad_beta_final_is_refused_and_configs_carry_it():
    with pytest.raises(ValueError, match="beta_final >= 0 or None"):
        DDCLQuantizer(16, 4, beta_final=-1.0)
    cfg = Config.from_dict({"quantizer": {"beta_final": 1.0}})
    assert Config.from_dict(cfg.to_dict()).quantizer["beta_final"] == 1.0
    assert "beta=0.25->1" in repr(DDCLQuantizer(16, 4))
    assert "beta=0.25," in repr(DDCLQuantizer(16, 4, beta_final=None))
