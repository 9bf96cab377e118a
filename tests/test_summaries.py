"""What ``ddcl-vq train`` and ``ddcl-vq evaluate`` print (issue 61): by default a summary that fits on one screen
(at most 12 lines, one of them pointing to the definitions); with ``--verbose`` the definitions themselves."""
import json

from conftest import TINY

from ddcl_vq.tokenizer import evaluate as evaluate_cmd
from ddcl_vq.tokenizer import train as train_cmd
from ddcl_vq.tokenizer.metrics import DEFINITIONS_HINT

DEFINED = ("utilization     = (codes with count > 0) / K", "psnr            = mean over images")


def test_train_and_evaluate_summaries_fit_on_a_screen_and_verbose_defines_them(tmp_path, capsys):
    run = tmp_path / "run"
    assert train_cmd.main(["--config", "configs/fashion_ddcl.yaml", *TINY, f"run.dir={run}",
                           "train.eval_images=64"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert 3 <= len(out) <= 12 and out[0].startswith("done: 6 steps") and DEFINITIONS_HINT in out
    assert not any(d in line for d in DEFINED for line in out)
    verbose = train_cmd.format_summary(json.loads((run / "summary.json").read_text()), run, verbose=True)
    assert all(d in verbose for d in DEFINED) and DEFINITIONS_HINT not in verbose

    assert evaluate_cmd.main([str(run), "--max-images", "64"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) <= 12 and DEFINITIONS_HINT in out and out[-1].startswith("wrote ")
    assert any(line.startswith("hard codes: MSE ") for line in out) and not any(d in l for d in DEFINED for l in out)
    assert evaluate_cmd.main([str(run), "--max-images", "64", "--verbose"]) == 0
    verbose = capsys.readouterr().out
    assert all(d in verbose for d in DEFINED) and "| codes | MSE |" in verbose


def test_the_linked_reference_holds_the_definitions():
    from pathlib import Path
    from ddcl_vq import USAGE_DEFINITIONS
    from ddcl_vq.tokenizer.metrics import GEOMETRY_DEFINITIONS, RECON_DEFINITIONS
    page, anchor = DEFINITIONS_HINT.split(", or ")[1].split("#")
    text = (Path(__file__).resolve().parents[1] / page).read_text()
    assert "## What the reports print" in text and anchor == "what-the-reports-print"
    assert all(block in text for block in (USAGE_DEFINITIONS, RECON_DEFINITIONS, GEOMETRY_DEFINITIONS))
