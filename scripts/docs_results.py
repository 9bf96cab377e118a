"""The results tables of README.md and docs/results.md, and docs/img/results_vs_k.png, from docs/results.csv.

    .venv/bin/python scripts/docs_results.py            # rewrite the tables between the markers, and the plot
    .venv/bin/python scripts/docs_results.py --check    # exit 1, naming the file, when a table differs from the CSV

A table lives between ``<!-- results:NAME -->`` and ``<!-- /results:NAME -->``: NAME is a ``table`` of the CSV or
``readme`` (hard-code PSNR and codes used against K for every quantizer). Edit the CSV, never the tables. A row whose
measured columns are empty shows its ``note`` (e.g. "not measured yet"), never a number.
"""
from __future__ import annotations

import argparse
import csv
import re
import sys
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
PNG_PATH = ROOT / "docs" / "img" / "results_vs_k.png"
PAGES = (ROOT / "README.md", ROOT / "docs" / "results.md")
#: column -> header; the columns from psnr to per_batch are measured (empty in a row not measured yet)
HEADERS = {
    "quantizer": "quantizer", "seeds": "seeds", "psnr": "PSNR hard (dB)", "ddcl_minus_peer": "DDCL − peer by seed (dB)",
    "lpips": "LPIPS hard", "ssim": "SSIM hard", "utilization": "codes used (%)", "dead_codes": "dead codes",
    "perplexity": "perplexity", "queue": "queue of 65,536 (%)", "per_batch": "per batch (%)", "ran_on": "ran on",
}
MEASURED = tuple(HEADERS)[2:-1]
#: the columns of each kind of table, after quantizer and seeds
KINDS = {"main": ("psnr", "ddcl_minus_peer", "lpips", "ssim", "utilization", "dead_codes", "perplexity"),
         "heldout": ("psnr", "ddcl_minus_peer", "lpips", "ssim", "utilization", "perplexity"),
         "large": ("psnr", "lpips", "ssim", "utilization", "queue", "per_batch", "dead_codes", "perplexity", "ran_on")}
#: the README table and the plot: a row (a line) per quantizer family, a column per K
README_ROWS = {
    "ddcl": "**DDCL (default)**", "vqp_kmeans_expiry": "vector-quantize-pytorch, k-means init + dead-code expiry",
    "vqp_default": "vector-quantize-pytorch, defaults", "ema_restart": "EMAVQ + dead-code restart", "hard": "HardVQ",
    "fsq": "FSQ, the paper's levels for K", "simvq_fair_no_rotation": "SimVQ, fair settings, plain straight-through",
    "ibq": "IBQ", "fvq": "FVQ",
}
BUDGETS = ({"fashion_k256": 256, "fashion_k1024": 1024, "fashion_k4096": 4096},  # batch 128, 1,000 steps
           {"large_k16384": 16384, "large_k65536": 65536, "large_k262144": 262144})  # batch 32, 500 steps


def load(path: Path = ROOT / "docs" / "results.csv") -> List[Dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return [{k: (v or "").strip() for k, v in row.items()} for row in csv.DictReader(f)]


def measured(row: Dict[str, str]) -> bool:
    return any(row[c] for c in MEASURED)


def leading(text: str) -> str:
    """The leading number of a cell: "24.39 ± 0.41" -> "24.39" ('' when there is none)."""
    m = re.match(r"\s*([−+-]?\d+(?:\.\d+)?)", text or "")
    return m.group(1) if m else ""


def kind_of(table: str) -> str:
    large = table.startswith(("large_", "budget4x_"))
    return "heldout" if table.startswith("heldout_") else "large" if large else "main"


def label(row: Dict[str, str]) -> str:
    text = f"**{row['quantizer']}**" if row["key"] == "ddcl" else row["quantizer"]
    return f"{text}: {row['note']}" if row["note"] and not measured(row) else text


def blocks(rows: Sequence[Dict[str, str]]) -> Dict[str, str]:
    """NAME -> its markdown table: every ``table`` of the CSV (its rows in the CSV's order), and ``readme``."""
    from ddcl_vq.studies.tables import markdown_table

    out = {}
    for name in dict.fromkeys(r["table"] for r in rows):
        headers = {**HEADERS, "utilization": "codes used, test split (%)"} if kind_of(name) == "large" else HEADERS
        columns = [("quantizer", "quantizer", label)] + [(c, headers[c], lambda r, c=c: r[c].replace("|", "\\|") or "—")
                                                         for c in ("seeds",) + KINDS[kind_of(name)]]
        out[name] = markdown_table([r for r in rows if r["table"] == name], columns)
    found = {(r["table"], r["key"]): r for r in reversed(rows)}

    def both(key: str, table: str) -> str:
        r = found.get((table, key))
        return "—" if r is None else f"{leading(r['psnr'])} / {leading(r['utilization'])}" if measured(r) \
            else r["note"] or "—"
    columns = [("label", "quantizer", "")] + [(t, f"K = {k:,}", lambda r, t=t: both(r["key"], t))
                                              for budget in BUDGETS for t, k in budget.items()]
    out["readme"] = markdown_table([{"key": k, "label": text} for k, text in README_ROWS.items()], columns)
    return out


def fill(text: str, generated: Mapping[str, str], tag: str, where: str) -> str:
    """``text`` with every ``<!-- TAG:NAME -->`` block holding ``generated[NAME]``; ValueError for an unknown NAME."""
    def replace(m: re.Match) -> str:
        if m.group(2) not in generated:
            raise ValueError(f"{where}: <!-- {tag}:{m.group(2)} --> names nothing the generator writes")
        return f"{m.group(1)}{generated[m.group(2)]}\n{m.group(3)}"
    return re.sub(rf"(<!-- {tag}:([\w.-]+) -->\n).*?(<!-- /{tag}:\2 -->)", replace, text, flags=re.S)


def expected(page: Path, rows: Sequence[Dict[str, str]]) -> str:
    """What ``page`` must hold: its text with every results block regenerated from the CSV's ``rows``."""
    return fill(page.read_text(encoding="utf-8"), blocks(rows), "results", str(page.relative_to(ROOT)))


def plot(rows: Sequence[Dict[str, str]], out: Path = PNG_PATH) -> None:
    """Hard-code PSNR and codes used against K, a line per quantizer and budget (the two budgets are not joined)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    found = {(r["table"], r["key"]): r for r in reversed(rows)}
    for i, (key, text) in enumerate(README_ROWS.items()):
        style = dict(color=plt.get_cmap("tab10")(i), marker="os^vDPX*hp"[i], linewidth=2.2 if key == "ddcl" else 1.2,
                     label=text.strip("*"))
        for budget in BUDGETS:
            points = [(k, found[t, key]) for t, k in budget.items() if (t, key) in found and measured(found[t, key])]
            if not points:
                continue
            for ax, column in zip(axes, ("psnr", "utilization")):
                ax.plot([k for k, _ in points], [float(leading(r[column]).replace("−", "-")) for _, r in points],
                        **style)
                style["label"] = None
    ticks = [k for budget in BUDGETS for k in budget.values()]
    for ax, ylabel in zip(axes, ("PSNR on hard codes (dB)", "codes used on the test split (%)")):
        ax.set(xlabel="codebook size K", ylabel=ylabel)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [f"{k:,}" for k in ticks], fontsize=8)
        ax.axvline(8192, color="0.5", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
    for x, text, align in ((7000, "batch 128,\n1,000 steps ", "right"), (9600, " batch 32,\n 500 steps", "left")):
        axes[0].text(x, 1.01, text, ha=align, va="bottom", fontsize=7.5, color="0.35",
                     transform=axes[0].get_xaxis_transform())  # x in data, y in axes fractions
    axes[1].set_ylim(0, 105)
    fig.legend(loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle("Fashion-MNIST, the default model, only the quantizer changed (docs/results.md)", fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 0.95))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, metadata={"Software": None})
    plt.close(fig)


def update(pages: Mapping[Path, Callable[[], str]], argv: Optional[Sequence[str]], doc: str, script: str,
           after: Callable[[], None] = lambda: None) -> int:
    """Write each page (path -> what it must hold) that differs, then call ``after``; with ``--check``, change
    nothing and exit 1 naming them."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a page is out of date")
    check = parser.parse_args(argv).check
    texts = {path: make() for path, make in pages.items()}
    stale = [path for path, text in texts.items() if path.read_text(encoding="utf-8") != text]
    names = ", ".join(str(path.relative_to(ROOT)) for path in stale)
    if check:
        print(f"out of date: {names}: run .venv/bin/python scripts/{script}" if stale else "up to date",
              file=sys.stderr)
        return int(bool(stale))
    for path in stale:
        path.write_text(texts[path], encoding="utf-8")
    after()
    print(f"written: {names or 'nothing changed'}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    rows = load()
    pages = {page: lambda page=page: expected(page, rows) for page in PAGES}
    return update(pages, argv, __doc__, "docs_results.py", after=lambda: plot(rows))


if __name__ == "__main__":
    sys.exit(main())
