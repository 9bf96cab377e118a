"""The README's promises: its first two commands, CI running the test command, its snippets."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def readme_commands():
    block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_readme_starts_with_two_commands():
    first_block_start = README.index("```bash")
    assert README[:first_block_start].count("\n") <= 2, "the two commands must come first"
    cmds = readme_commands()
    assert len(cmds) == 2
    assert "train --config" in cmds[0] and "pytest" in cmds[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert readme_commands()[1] in ci.splitlines()


def test_python_snippets_run():
    snippets = re.findall(r"```python\n(.*?)```", README, re.S)
    assert snippets
    for code in snippets:
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
