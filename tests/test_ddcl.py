"""DDCLQuantizer: the exact decomposition, indices, outputs and gradients of every mode; its
temperature schedule; old state_dicts refused; the Quantizer interface's neutral defaults for the
baselines; the public names."""
import math
import re

import pytest
import torch

from ddcl_vq import EMAVQ, HardVQ
from ddcl_vq import DDCLQuantizer as _DDCLQuantizer
from ddcl_vq.ddcl.assignment import assign


def DDCLQuantizer(*args, **kw):
    """The assignment math of these tests: no warm-up, no revival (the M-step codebook's own
    properties are tested in tests/test_mstep.py; the warm-up in tests/test_warmup.py)."""
    kw.setdefault("warmup_steps", 0)
    kw.setdefault("revive_threshold", 0.0)
    return _DDCLQuantizer(*args, **kw)


def reference(z_flat, w, tau):
    """Independent computation: explicit pairwise differences, no expansion trick."""
    d = (z_flat[:, None, :] - w[None, :, :]).pow(2).sum(-1)
    q = torch.softmax(-d / (tau * w.shape[1]), dim=1)
    return d, q


def make(num_codes=16, dim=8, dtype=torch.float64, seed=0, **kw):
    """In eval mode: the codebook stays put and the softmax divisor is τ·D (no scale measured yet)."""
    torch.manual_seed(seed)
    return DDCLQuantizer(num_codes, dim, codebook_init="normal", **kw).to(dtype).eval()


def check_identity(z, w, tau, rel):
    a = assign(z, w, tau * z.shape[1])
    lq, ols, var = a.distortion.item(), a.ols.item(), a.variance.item()
    assert abs(lq - (ols + var)) <= rel * max(abs(lq), 1e-300), (lq, ols, var)
    # and against the definitions computed independently (V: the q-weighted spread of the codes around ẑ)
    d, q = reference(z, w, tau)
    soft = q @ w
    spread = (q * (w[None] - soft[:, None]).pow(2).sum(-1)).sum(1).mean()
    assert torch.allclose(a.variance, spread, rtol=max(rel, 1e-12) * 10, atol=1e-6 * lq), (var, spread.item())
    assert torch.allclose(a.distortion, (q * d).sum(1).mean(), rtol=max(rel, 1e-12) * 10)
    assert torch.allclose(a.ols, (z - soft).pow(2).sum(1).mean(), rtol=1e-4, atol=1e-6 * lq)
    v = (q * (w[None] - soft[:, None]).pow(2).sum(-1)).sum(1).mean()
    assert torch.allclose(a.variance, v, rtol=1e-4, atol=1e-6 * lq)


CASES = {
    "random": lambda g: (torch.randn(64, 8, generator=g), torch.randn(16, 8, generator=g), 0.1),
    "huge_norms": lambda g: (1e3 * torch.randn(64, 8, generator=g), 1e3 * torch.randn(16, 8, generator=g), 0.5),
    "far_offset": lambda g: (torch.randn(64, 8, generator=g) + 500.0, torch.randn(16, 8, generator=g) + 500.0, 0.1),
    "tiny_tau": lambda g: (torch.randn(64, 8, generator=g), torch.randn(16, 8, generator=g), 1e-4),
    "k_equals_1": lambda g: (torch.randn(64, 8, generator=g), torch.randn(1, 8, generator=g), 0.1),
    "duplicate_codes": lambda g: (torch.randn(64, 8, generator=g), torch.randn(4, 8, generator=g).repeat(4, 1), 0.1),
    "high_tau": lambda g: (torch.randn(64, 8, generator=g), torch.randn(16, 8, generator=g), 100.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_decomposition_float64(case):
    z, w, tau = CASES[case](torch.Generator().manual_seed(1))
    check_identity(z.double(), w.double(), tau, rel=1e-10)


@pytest.mark.parametrize("case", list(CASES))
def test_decomposition_float32(case):
    z, w, tau = CASES[case](torch.Generator().manual_seed(2))
    check_identity(z.float(), w.float(), tau, rel=1e-5)


@pytest.mark.parametrize("mode", ["soft", "straight_through", "soft_straight_through"])
def test_reported_terms_obey_identity_in_every_mode(mode):
    quant = make(mode=mode, temperature=0.05)
    out = quant(torch.randn(4, 8, 5, 5, dtype=torch.float64))
    t = out.terms
    assert abs(t["distortion"] - t["ols"] - t["variance"]) <= 1e-10 * t["distortion"]
    # V against its definition, from the same z and q (eval mode: the divisor is τ·D)
    z = torch.randn(4, 8, 5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    t = quant(z).terms
    d, q = reference(z.permute(0, 2, 3, 1).reshape(-1, 8), quant.codebook, 0.05)
    soft = q @ quant.codebook
    assert torch.allclose(t["variance"], (q * (quant.codebook[None] - soft[:, None]).pow(2).sum(-1)).sum(1).mean(),
                          rtol=1e-10)


def test_indices_are_argmin_and_soft_output_is_qW():
    quant = make(mode="soft", temperature=0.2)
    z = torch.randn(3, 8, 4, 4, dtype=torch.float64)
    out = quant(z)
    flat = z.permute(0, 2, 3, 1).reshape(-1, 8)
    d, q = reference(flat, quant.codebook.detach(), 0.2)
    assert torch.equal(out.indices, d.argmin(1).reshape(3, 4, 4))
    expected = (q @ quant.codebook.detach()).reshape(3, 4, 4, 8).permute(0, 3, 1, 2)
    assert torch.allclose(out.quantized, expected, atol=1e-12)
    assert out.indices.dtype == torch.long and out.quantized.shape == z.shape


def test_channel_last_layout():
    quant = make(mode="straight_through", channel_dim=-1)
    z = torch.randn(2, 7, 8, dtype=torch.float64)
    out = quant(z)
    assert out.quantized.shape == (2, 7, 8) and out.indices.shape == (2, 7)
    assert torch.equal(out.quantized, quant.lookup(out.indices))


def test_straight_through_forward_and_gradients():
    beta, tau = 0.25, 0.1
    quant = make(mode="straight_through", temperature=tau, beta=beta)
    z = torch.randn(2, 8, 3, 3, dtype=torch.float64, requires_grad=True)
    out = quant(z)
    assert torch.equal(out.quantized, quant.lookup(out.indices))
    upstream = torch.randn_like(z)
    (out.quantized * upstream).sum().add(out.loss).backward()
    # encoder: straight-through identity + gradient of beta*||z - sg(w*)||^2 / D (mean over vectors)
    flat = z.detach().permute(0, 2, 3, 1).reshape(-1, 8)
    hard = quant.codebook.detach()[out.indices.reshape(-1)]
    n = flat.shape[0]
    commit_grad = (beta * 2 * (flat - hard) / n / 8).reshape(2, 3, 3, 8).permute(0, 3, 1, 2)
    assert torch.allclose(z.grad, upstream + commit_grad, atol=1e-12)
    assert quant.weight.grad is None and not quant.weight.requires_grad   # the M-step trains the codebook


def test_soft_straight_through_forward_hard_gradients_soft():
    z = torch.randn(2, 8, 3, 3, dtype=torch.float64)
    upstream = torch.randn_like(z)
    grads = {}
    for mode in ("soft", "soft_straight_through"):
        quant = make(mode=mode, temperature=0.3, seed=5)
        zz = z.clone().requires_grad_(True)
        out = quant(zz)
        if mode == "soft_straight_through":
            assert torch.allclose(out.quantized, quant.lookup(out.indices), atol=1e-12)
        (out.quantized * upstream).sum().add(out.loss).backward()
        grads[mode] = zz.grad
    assert torch.allclose(grads["soft"], grads["soft_straight_through"], atol=1e-12)


def test_gradcheck_reference_assignment_float64():
    """The differentiable core (soft codes and all three terms) against finite differences."""
    z = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)

    def f(z_, w_):
        a = assign(z_, w_, 0.7)
        return a.soft, a.distortion, a.ols, a.variance

    assert torch.autograd.gradcheck(f, (z, w), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("implementation", ["reference", "fused", "chunked"])
def test_gradcheck_soft_mode_module_float64(implementation):
    """The whole module in soft mode, on every assignment path (straight-through modes use a surrogate
    gradient by design)."""
    quant = make(num_codes=5, dim=3, mode="soft", temperature=0.5, implementation=implementation, chunk_size=3)
    z = torch.randn(2, 3, 2, 2, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(2, 3, 2, 2, dtype=torch.float64)

    def g(z_):
        out = quant(z_)
        return (out.quantized * upstream).sum() + out.loss

    assert torch.autograd.gradcheck(g, (z,), eps=1e-6, atol=1e-7)


def test_every_code_moves_to_the_data_but_hardvq_dead_codes_get_no_gradient():
    torch.manual_seed(0)
    ddcl = DDCLQuantizer(32, 8, temperature=0.5, codebook_init="normal", decay=0.0).double()
    z = torch.randn(4, 8, 2, 2, dtype=torch.float64, requires_grad=True)  # 16 vectors < 32 codes
    w0 = ddcl.weight.detach().clone()
    ddcl(z)
    assert ((ddcl.weight - w0).abs().sum(1) > 0).all()                   # the M-step moved every code

    hard = HardVQ(32, 8).double()
    hard.weight.data = w0.clone()
    out = hard(z)
    (out.quantized.pow(2).sum() + out.loss).backward()
    used = torch.zeros(32, dtype=torch.bool)
    used[out.indices.reshape(-1)] = True
    assert (~used).any()
    assert (hard.weight.grad[~used] == 0).all()
    assert (hard.weight.grad[used].abs().sum(1) > 0).all()


def test_low_temperature_soft_output_approaches_hard_code():
    z = torch.randn(2, 8, 3, 3, dtype=torch.float64)
    errors = []
    for tau in (1.0, 0.1, 0.01, 1e-3, 1e-5):
        quant = make(mode="soft", temperature=tau, seed=3)
        out = quant(z)
        errors.append((out.quantized - quant.lookup(out.indices)).abs().mean().item())
    assert errors[-1] < 1e-6
    assert errors == sorted(errors, reverse=True)


@pytest.mark.parametrize("mode", ["soft", "straight_through", "soft_straight_through"])
def test_no_nan_at_tiny_tau_and_huge_distances(mode):
    torch.manual_seed(0)
    quant = DDCLQuantizer(16, 8, mode=mode, temperature=1e-4, codebook_init="normal")
    z = (torch.randn(2, 8, 4, 4) * 250).requires_grad_(True)  # squared distances ~ 1e6
    out = quant(z)
    assert out.terms["distortion"] > 1e5
    (out.quantized.sum() + out.loss).backward()
    for t in [out.quantized, out.loss, z.grad, quant.weight, *out.terms.values()]:
        assert torch.isfinite(t).all()


def test_bf16_autocast_same_indices_and_float32_math():
    torch.manual_seed(0)
    quant = DDCLQuantizer(64, 16, temperature=0.05, codebook_init="normal").eval()
    conv = torch.nn.Conv2d(3, 16, 1)
    x = torch.randn(4, 3, 6, 6)
    ref = quant(conv(x).float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = conv(x)
        assert z.dtype == torch.bfloat16
        out = quant(z)
    # bf16 features round the input; indices computed in float32 from the same bf16 values
    z32 = z.float()
    assert torch.equal(out.indices, quant(z32).indices)
    assert out.loss.dtype == torch.float32 and out.terms["distortion"].dtype == torch.float32
    agree = (out.indices == ref.indices).float().mean()
    assert agree > 0.95


@pytest.mark.parametrize("shape", ["cosine", "exponential"])
def test_temperature_schedule_advances_one_step_per_call(shape):
    q = DDCLQuantizer(8, 4, temperature=1.0, temperature_final=0.1, temperature_schedule=shape, schedule_steps=100)
    seen = []
    for _ in range(103):
        seen.append(q.temperature)
        q.step()
    expected = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, 100) / 100)) if shape == "cosine"
                else 0.1 ** (min(s, 100) / 100) for s in range(103)]
    assert seen == pytest.approx(expected, rel=1e-12)
    assert seen[0] == 1.0 and seen[100:] == pytest.approx([0.1] * 3)
    assert int(q.schedule_step) == 103


def test_temperature_schedule_is_saved_and_loaded(tmp_path):
    q = DDCLQuantizer(8, 4, temperature=0.2, temperature_final=0.01, temperature_schedule="cosine", schedule_steps=10)
    for _ in range(4):
        q.step()
    torch.save(q.state_dict(), tmp_path / "q.pt")
    fresh = DDCLQuantizer(8, 4)                                   # constant 0.01, step 0
    fresh.load_state_dict(torch.load(tmp_path / "q.pt", weights_only=True))
    assert (fresh.temperature_start, fresh.temperature_final, fresh.temperature_schedule, fresh.schedule_steps) \
        == (0.2, 0.01, "cosine", 10)
    assert int(fresh.schedule_step) == 4 and fresh.temperature == q.temperature
    assert fresh.describe() == {"mode": "straight_through", "temperature": q.temperature}
    # tensors only (safetensors, state-dict tooling), and exact whatever the module's dtype
    assert all(isinstance(v, torch.Tensor) for v in q.state_dict().values())
    halved = DDCLQuantizer(8, 4)
    halved.load_state_dict(q.half().state_dict())
    assert (halved.temperature_start, halved.temperature_final) == (0.2, 0.01)
    assert q.double().temperature == q.float().temperature == fresh.temperature


def test_log_stats_report_the_temperature_of_the_last_training_forward():
    q = DDCLQuantizer(8, 4, temperature=1.0, temperature_final=0.5, temperature_schedule="exponential",
                      schedule_steps=2, codebook_init="normal")
    assert q.log_stats()["temperature"] == 1.0
    q(torch.randn(3, 4, 2, 2))
    q.step()
    assert q.log_stats()["temperature"] == 1.0 and q.temperature == pytest.approx(0.5 ** 0.5)


def test_assigning_temperature_fixes_it():
    q = DDCLQuantizer(8, 4, temperature=1.0, temperature_final=0.5, temperature_schedule="cosine", schedule_steps=2)
    q.temperature = 0.3
    q.step()
    assert q.temperature == 0.3 and q.temperature_schedule == "constant"


@pytest.mark.parametrize("dropped, before", [
    (("cluster_mass", "cluster_usage", "cluster_sums", "distance_scale", "revived"), "the M-step codebook"),
    (("schedule_step",), "the temperature schedule was saved"), (("warmup_batches",), "the quantization warm-up"),
    (("twin_position",), "with revive_twins=True")])
def test_state_dicts_of_0_1_0_are_refused_naming_the_version(dropped, before):
    state = DDCLQuantizer(8, 4).state_dict()
    old = {k: v for k, v in state.items() if k not in dropped}
    if dropped == ("twin_position",):
        old["twin_position"] = torch.zeros((), dtype=torch.long)
    for strict in (True, False):
        with pytest.raises(RuntimeError, match=rf"saved by ddcl-vq 0\.1\.0 .*{before}.*; load it with ddcl-vq "
                                               r"0\.1\.x or retrain"):
            DDCLQuantizer(8, 4).load_state_dict(old, strict=strict)
    without_schedule = {k: v for k, v in state.items() if k != "schedule"}   # what the adapters save
    annealed = DDCLQuantizer(8, 4, temperature=1.0, temperature_final=0.1, temperature_schedule="cosine",
                             schedule_steps=10)
    annealed.load_state_dict(without_schedule)                                 # keeps its own schedule
    assert annealed.temperature_schedule == "cosine"


def test_bad_schedules_are_refused():
    with pytest.raises(ValueError, match="temperature_schedule"):
        DDCLQuantizer(8, 4, temperature_schedule="linear")
    with pytest.raises(ValueError, match="temperature_final"):
        DDCLQuantizer(8, 4, temperature_schedule="cosine", schedule_steps=10)
    with pytest.raises(ValueError, match="schedule_steps"):
        DDCLQuantizer(8, 4, temperature_schedule="cosine", temperature_final=0.1)


@pytest.mark.parametrize("cls", [HardVQ, EMAVQ])
def test_baselines_have_neutral_interface_defaults(cls):
    q = cls(8, 4)
    z = torch.randn(2, 4, 3, 3)
    state = {k: v.clone() for k, v in q.state_dict().items()}
    q.step()
    assert not q.has_soft_codes and q.soft_codes(z) is None
    assert q.log_stats() == {} and q.describe() == {}
    assert all(torch.equal(v, q.state_dict()[k]) for k, v in state.items())
    assert DDCLQuantizer(8, 4).has_soft_codes


def test_allowed_values_live_in_their_modules_and_hold_the_signature_defaults():
    """The allowed values are tuples in their modules (DDCL_CHOICES in ddcl_vq.ddcl.arguments, one per choice
    argument), not at the top level; the defaults only in the signatures, each one of its allowed values."""
    import inspect

    import ddcl_vq
    from ddcl_vq import hard, ibq
    from ddcl_vq.ddcl import arguments
    params = inspect.signature(_DDCLQuantizer).parameters
    for name, allowed in arguments.DDCL_CHOICES.items():
        assert params[name].default in allowed, name
    assert arguments.DDCL_CHOICES["mode"] is arguments.MODES and "auto" in arguments.IMPLEMENTATIONS
    assert inspect.signature(HardVQ).parameters["distance"].default in hard.HARDVQ_CHOICES["distance"]
    assert inspect.signature(ddcl_vq.IBQQuantizer).parameters["logits"].default in ibq.IBQ_LOGITS
    assert not {"MODES", "DDCL_CHOICES", "DISTANCES", "CODEBOOK_INITS"} & (set(dir(ddcl_vq)) | set(ddcl_vq.__all__))


def test_the_top_level_names_the_public_api():
    import ddcl_vq
    assert set(ddcl_vq.__all__) == {
        "Quantizer", "QuantizerOutput", "DDCLQuantizer", "HardVQ", "EMAVQ", "VQPQuantizer", "FSQQuantizer",
        "SimVQQuantizer", "LFQQuantizer", "IBQQuantizer", "FVQQuantizer", "CodebookUsage", "UsageStats",
        "USAGE_DEFINITIONS", "swap_quantizer", "TamingQuantizerAdapter", "VQPAdapter", "NotebookQuantizerAdapter",
        "DDCLReadout", "HierarchicalCompressor", "prototype_param_groups", "ResidualDDCL", "GroupedDDCL"}
    assert all(hasattr(ddcl_vq, name) for name in ddcl_vq.__all__) and ddcl_vq.__version__ == "0.2.0"


@pytest.mark.parametrize("name", list(__import__("ddcl_vq.ddcl.arguments").ddcl.arguments.DDCL_CHOICES))
def test_every_choice_argument_refuses_an_unknown_value(name):
    with pytest.raises(ValueError, match=rf"expected {name} in \(.*\), got 'nope'"):
        DDCLQuantizer(8, 4, **{name: "nope"})


@pytest.mark.parametrize("name", ["temperature_reference", "codebook_update", "revive_criterion", "revive_twins",
                                  "restart_step", "encoder_gradient"])
def test_retired_options_are_unknown_arguments(name):
    with pytest.raises(TypeError, match=name):
        DDCLQuantizer(8, 4, **{name: None})


@pytest.mark.parametrize("name, value, expected", [
    ("beta", -0.5, "beta >= 0"), ("beta", "big", "beta >= 0"),
    ("decay", 1.0, "0 <= decay < 1"), ("decay", True, "0 <= decay < 1"),
    ("revive_threshold", -0.1, "0 <= revive_threshold < 1"),
    ("chunk_size", 0, "chunk_size to be a positive int or None"), ("chunk_size", 2.0, "chunk_size"),
    ("chunk_threshold_bytes", -1, "chunk_threshold_bytes >= 0"),
    ("warmup_steps", 1.5, r"warmup_steps, an int >= 0 \(0 = none\)"),
])
def test_numeric_arguments_are_checked_by_the_table(name, value, expected):
    with pytest.raises(ValueError, match=rf"expected {expected}.*, got {re.escape(repr(value))}"):
        DDCLQuantizer(8, 4, **{name: value})


@pytest.mark.parametrize("num_codes", [64, 8192])  # the dense path and the truncated one (K > TRUNCATE_ABOVE)
def test_eval_forward_returns_the_soft_codes_of_the_same_pass(num_codes):
    torch.manual_seed(0)
    q = DDCLQuantizer(num_codes, 16)
    q(torch.randn(4, 16, 8, 8))
    assert q.train()(torch.randn(2, 16, 4, 4)).soft_codes is None  # training: not kept
    z = torch.randn(2, 16, 8, 8)
    out = q.eval()(z)
    assert out.soft_codes.shape == z.shape
    torch.testing.assert_close(out.soft_codes, q.soft_codes(z), atol=1e-4, rtol=1e-4)
    assert HardVQ(num_codes, 16).eval()(z).soft_codes is None
