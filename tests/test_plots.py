"""compare's plots at every run length and its table's default columns (issue 61)."""
from ddcl_vq.studies.plots import plot_psnr_vs_utilization, plot_usage_histograms, plot_usage_over_training
from ddcl_vq.studies.tables import COLUMNS, markdown_table

WINDOW = [{"step": s, "utilization_window": 0.5, "perplexity_window": 10.0 + s} for s in (100, 200, 300)]


def test_usage_over_training_says_why_a_run_has_no_curve(tmp_path):
    assert plot_usage_over_training([WINDOW], ["long"], tmp_path / "a.png", [100]) is None
    note = plot_usage_over_training([WINDOW, WINDOW[:1], [{"step": 25}]], ["long", "one", "none"],
                                    tmp_path / "b.png", [100, 100, 100])
    assert "one usage window only" in note and "one (100 steps logged, usage_window 100)" in note
    assert "no usage window logged, no curve: none (25 steps logged" in note
    note = plot_usage_over_training([[{"step": 2}]], ["tiny"], tmp_path / "c.png", [None])
    assert note.startswith("no curve: no run logged a usage window") and (tmp_path / "c.png").stat().st_size > 0


def test_psnr_vs_utilization_and_histograms_take_any_quantizer_and_one_code(tmp_path):
    rows = [{"name": f"r{i}", "type": t, "utilization": 0.5, "hard_psnr": 20.0}
            for i, t in enumerate(["ddcl", "hard", "fsq", "ibq", "unknown", "other"] * 4)]
    plot_psnr_vs_utilization(rows, tmp_path / "p.png")
    ev = {"usage_counts": [100] + [0] * 255, "codebook": {"active_codes": 1, "perplexity": 1.0}}
    plot_usage_histograms([ev], ["collapsed"], tmp_path / "h.png")
    assert (tmp_path / "p.png").stat().st_size > 0 and (tmp_path / "h.png").stat().st_size > 0


def test_the_table_shows_the_results_tables_columns_and_the_files_keep_the_rest():
    header = markdown_table([]).splitlines()[0]
    assert header == ("| run | quantizer | K | settings | PSNR hard (dB) | LPIPS hard | SSIM hard | utilization | "
                      "dead codes | perplexity |")
    assert len(COLUMNS) == 18  # every column is still defined (and in table.csv / table.json, which hold every key)
