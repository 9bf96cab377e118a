"""The README's promises: its first two commands, CI running the test command, a front door short
enough to read, and the Python snippets of the README and of every page in docs/.

A fenced block tagged ``python`` runs here (the README and docs/, but the research log in docs/lab/), in
a fresh namespace, with its line numbers in the page (a failure points at the page's line); ``bash`` and untagged blocks are shown, not run (they
train for minutes or need a run directory). tests/test_docs.py checks that no other tag hides a
snippet from this test.
"""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
#: the README and every page in docs/ but the research log (docs/lab/, whose snippets ran on older versions)
PAGES = [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").rglob("*.md") if "lab" not in p.relative_to(ROOT / "docs").parts)
MAX_README_LINES = 120


def readme_commands():
    block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def python_snippets(page: Path):
    """(first line number of the code in the page, code) for every ```python block."""
    text = page.read_text()
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)]


SNIPPETS = [(page, line, code) for page in PAGES for line, code in python_snippets(page)]


def test_readme_starts_with_two_commands():
    first_block_start = README.index("```bash")
    assert README[:first_block_start].count("\n") <= 2, "the two commands must come first"
    cmds = readme_commands()
    assert len(cmds) == 2
    assert "train --config" in cmds[0] and "pytest" in cmds[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert readme_commands()[1] in ci.splitlines()


def test_readme_is_a_short_front_door():
    lines = README.count("\n")  # what `wc -l README.md` prints
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; move detail to docs/ (at most {MAX_README_LINES})"


def test_readme_and_docs_have_snippets():
    pages = {page.relative_to(ROOT).as_posix() for page, _, _ in SNIPPETS}
    assert "README.md" in pages
    assert {"docs/guide/swapping.md", "docs/guide/export.md", "docs/guide/readout.md", "docs/reference/quantizer.md"} <= pages


@pytest.mark.parametrize("page, line, code", SNIPPETS,
                         ids=[f"{p.relative_to(ROOT).as_posix()}:{line}" for p, line, _ in SNIPPETS])
def test_python_snippets_run(page, line, code):
    # padded with newlines so a traceback names the snippet's line in the page
    exec(compile("\n" * (line - 1) + code, str(page), "exec"), {"__name__": "readme"})
