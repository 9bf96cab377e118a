"""The formulas the docs give for ``loss`` and ``terms`` are the values the code returns (issue 61).

The loss table of docs/reference/quantizer.md (between ``<!-- formulas:loss -->`` markers) is read here and every row
is evaluated from the returned ``terms``; every other loss formula in docs/guide and docs/reference (an expression of
the term names over D) must be one this file checks, so a doc and the code cannot drift apart unnoticed.
"""
import ast
import re
from pathlib import Path

import pytest
import torch

from ddcl_vq import DDCLQuantizer, DDCLReadout, EMAVQ, HardVQ

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference" / "quantizer.md"
DOCS = sorted((ROOT / "docs" / "guide").glob("*.md")) + sorted((ROOT / "docs" / "reference").glob("*.md"))
TERM_NAMES = ("distortion", "commitment", "codebook", "ols", "variance")


def evaluate(formula: str, names: dict) -> float:
    """A doc formula (``(codebook + β·commitment) / D``) evaluated with ``names``: only names, numbers, + − · / and
    parentheses are allowed."""
    text = formula.replace("β", "beta").replace("λ", "lam").replace("·", "*").replace("−", "-")
    tree = ast.parse(text, mode="eval")
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Expression, ast.BinOp, ast.Name, ast.Load, ast.Constant, ast.Add, ast.Sub,
                                 ast.Mult, ast.Div)):
            raise AssertionError(f"not a plain formula: {formula!r} ({type(node).__name__})")
        if isinstance(node, ast.Name) and node.id not in names:
            raise AssertionError(f"{formula!r} names {node.id!r}, which the test does not know")
    return float(eval(compile(tree, "<doc formula>", "eval"), {"__builtins__": {}}, dict(names)))


def loss_table():
    """The rows of the reference's loss table: [(quantizer cell, formula)]."""
    text = REFERENCE.read_text()
    block = text.split("<!-- formulas:loss -->")[1].split("<!-- /formulas:loss -->")[0]
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in block.strip().splitlines()[2:]]
    return [(who, formula) for who, formula in rows]


def batch(n=96, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, d, generator=g, dtype=torch.float64) * torch.linspace(0.5, 2.0, d, dtype=torch.float64))


def build(who: str):
    """The quantizer a table row names, float64, channel-last D = 8, with β away from its default (and a DDCL β ramp
    part-way), and the names its formula may use besides the terms."""
    kw = dict(channel_dim=-1)
    if who.startswith("`DDCLQuantizer`"):
        mode = re.search(r'mode="(\w+)"', who).group(1)
        q = DDCLQuantizer(16, 8, mode=mode, beta=0.4, beta_final=1.0, schedule_steps=10, warmup_steps=0, **kw)
        return q.double(), lambda: {"beta": 0.4 + 0.6 * min(int(q.schedule_step) / 10, 1.0)}
    if who == "`HardVQ`":
        return HardVQ(16, 8, beta=0.4, **kw).double(), lambda: {"beta": 0.4}
    if who == "`EMAVQ`":
        return EMAVQ(16, 8, beta=0.4, **kw).double(), lambda: {"beta": 0.4}
    if who == "`DDCLReadout`":
        return DDCLReadout(8, 16, loss_weight=0.3).double(), lambda: {"lam": 0.3}
    raise AssertionError(f"the loss table names {who!r}, which tests/test_formulas.py does not build")


def returned(q, z):
    """(loss, terms) as returned; the readout's terms are fields of its output."""
    if isinstance(q, DDCLReadout):
        out = q(z.reshape(4, -1, 8))
        return out.loss, {"distortion": out.distortion, "ols": out.ols, "variance": out.variance}
    out = q(z)
    return out.loss, out.terms


def test_the_reference_has_a_loss_table_naming_every_mode():
    rows = dict(loss_table())
    assert {who for who in rows if who.startswith("`DDCLQuantizer`")} == {
        f'`DDCLQuantizer`, `mode="{m}"`' + (" (the default)" if m == "straight_through" else "")
        for m in ("straight_through", "soft", "soft_straight_through")}
    assert rows['`DDCLQuantizer`, `mode="straight_through"` (the default)'] == "β·commitment / D"


@pytest.mark.parametrize("who, formula", loss_table())
def test_each_documented_loss_is_the_returned_loss(who, formula):
    q, extra = build(who)
    for training, seed in ((True, 1), (True, 2), (True, 3), (False, 4)):   # training forwards, then eval mode
        q.train(training)
        loss, terms = returned(q, batch(seed=seed))
        names = {k: float(v) for k, v in terms.items()} | extra() | {"D": 8}
        assert float(loss.detach()) == pytest.approx(evaluate(formula, names), rel=1e-9, abs=1e-12), (who, training)
        if hasattr(q, "step"):
            q.step()


def test_the_ddcl_terms_are_their_documented_definitions():
    """distortion = mean_i Σ_k q_ik ‖z_i − w_k‖² with q = softmax(−d / s), s = τ·d̄ (τ·D before any training batch),
    ols = mean_i ‖z_i − ẑ_i‖², variance = mean_i Σ_k q_ik ‖w_k − ẑ_i‖², commitment = mean_i ‖z_i − w_{k*}‖²."""
    q = DDCLQuantizer(16, 8, channel_dim=-1, codebook_init="normal", warmup_steps=0).double()
    for trained in (False, True):
        if trained:
            q.train()(batch(seed=5))
            assert float(q.distance_scale) > 0
        scale = q.temperature * (float(q.distance_scale) if trained else 8)
        assert q.softmax_scale() == pytest.approx(scale)
        z = batch(seed=6)
        out = q.eval()(z)
        w = q.codebook.detach()
        d = torch.cdist(z, w) ** 2
        p = torch.softmax(-d / scale, dim=1)
        soft = p @ w
        expect = {"distortion": (p * d).sum(1).mean(), "ols": ((z - soft) ** 2).sum(1).mean(),
                  "variance": (p * ((w[None] - soft[:, None]) ** 2).sum(2)).sum(1).mean(),
                  "commitment": d.min(1).values.mean()}
        for name, value in expect.items():
            assert float(out.terms[name]) == pytest.approx(float(value), rel=1e-9), name
        assert float(out.terms["distortion"]) == pytest.approx(float(out.terms["ols"] + out.terms["variance"]), rel=1e-9)


def test_hardvq_terms_are_the_nearest_code_distance():
    q = HardVQ(16, 8, channel_dim=-1).double().eval()
    z = batch(seed=7)
    out = q(z)
    nearest = (torch.cdist(z, q.codebook.detach()) ** 2).min(1).values.mean()
    assert float(out.terms["codebook"]) == pytest.approx(float(nearest), rel=1e-9)
    assert float(out.terms["commitment"]) == pytest.approx(float(nearest), rel=1e-9)


def test_the_readout_softmax_is_over_d_over_tau_d():
    """readout.md: q_t = softmax_k(−‖x_t − w_k‖²/(τ·D))."""
    r = DDCLReadout(8, 16, temperature=0.1).double().eval()
    x = batch(seed=8).reshape(4, -1, 8)
    out = r(x)
    d = torch.cdist(x.reshape(-1, 8), r.prototypes.detach()) ** 2
    torch.testing.assert_close(out.assignments.reshape(-1, 16), torch.softmax(-d / (0.1 * 8), dim=1))


# ------------------------------------------------------------------ every loss formula in the docs is a checked one
def _swapped(mode: str, weight: float):
    vqp = pytest.importorskip("vector_quantize_pytorch")
    from ddcl_vq import swap_quantizer
    adapter = swap_quantizer(vqp.VectorQuantize(dim=8, codebook_size=16, commitment_weight=weight), mode=mode,
                             warmup_steps=0)
    adapter(batch(seed=9).reshape(4, -1, 8).float())
    out = adapter.last_output
    return float(out.loss), {k: float(v) for k, v in out.terms.items()} | {"beta": weight, "D": 8}


def _readout(weight: float):
    r = DDCLReadout(8, 16, loss_weight=weight).double()
    out = r(batch(seed=10).reshape(4, -1, 8))
    return float(out.loss), {"distortion": float(out.distortion), "lam": weight, "D": 8, "CE": 0.0}


#: (doc, formula as written) -> what it is checked against: (the returned loss, the names for the formula)
CHECKED = {
    ("guide/swapping.md", "β·commitment / D"): lambda: _swapped("straight_through", 0.7),
    ("guide/swapping.md", "distortion / D"): lambda: _swapped("soft", 0.7),
    ("guide/readout.md", "λ·distortion/D"): lambda: _readout(0.3),
    ("guide/readout.md", "CE + distortion/D"): lambda: _readout(1.0),            # the study's λ = 1 (CE + loss)
    ("reference/cli.md", "CE + λ·distortion/D"): lambda: _readout(0.3),
}


def doc_formulas():
    """(doc, formula) for every expression of a term name over D in docs/guide and docs/reference, outside the
    reference's loss table (read above)."""
    pattern = re.compile(r"\(?[\w(][\wβλ·+\-− ]*\)?\s*/\s*D\b")
    found = set()
    for path in DOCS:
        text = path.read_text()
        if path == REFERENCE:
            text = re.sub(r"<!-- formulas:loss -->.*?<!-- /formulas:loss -->", "", text, flags=re.S)
        for m in pattern.finditer(text):
            formula = m.group(0).strip()
            if formula.startswith("(") and ")" not in formula:
                formula = formula[1:]                                # "(λ·distortion/D, ..." in prose
            formula = re.sub(r"^.*?\b(?:in|over|loss)\s+(?=\S)", "", formula) if not formula.startswith("(") else formula
            if any(name in formula for name in TERM_NAMES):
                found.add((str(path.relative_to(ROOT / "docs")), formula))
    return found


def test_every_loss_formula_in_the_docs_is_checked():
    table = {formula for _, formula in loss_table()}
    unchecked = {(doc, f) for doc, f in doc_formulas() if (doc, f) not in CHECKED and not (
        doc == "reference/quantizer.md" and f in table)}
    assert not unchecked, f"loss formulas in the docs that tests/test_formulas.py does not check: {sorted(unchecked)}"
    missing = [key for key in CHECKED if key[1] not in (ROOT / "docs" / key[0]).read_text()]
    assert not missing, f"formulas this test checks that the docs no longer state: {missing}"


@pytest.mark.parametrize("doc, formula", sorted(CHECKED))
def test_each_loss_formula_in_the_guides_is_the_returned_loss(doc, formula):
    loss, names = CHECKED[(doc, formula)]()
    assert loss == pytest.approx(evaluate(formula, names), rel=1e-6)
