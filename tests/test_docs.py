"""docs/ and the README agree with the repository: links resolve, the index lists every page, the
files, modules, commands and command options they name exist, no snippet hides behind an unknown
fence tag, and the table of DDCL defaults says what ``DDCLQuantizer``'s signature says."""
import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

from ddcl_vq import DDCLQuantizer
from ddcl_vq.cli import COMMANDS, ROUTES

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md"] + sorted(DOCS.glob("*.md"))
IDS = [p.relative_to(ROOT).as_posix() for p in PAGES]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", re.S | re.M)


def prose(text: str) -> str:
    """The page without its fenced blocks."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup and punctuation dropped, lower case, spaces -> '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set:
    seen, out = {}, set()
    for line in prose(page.read_text()).splitlines():
        m = re.match(r"#{1,6} (.*)", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def local_links(page: Path):
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(page.read_text())):
        if not re.match(r"[a-z]+:", target):
            yield target


def test_slug_follows_github():
    assert slug("How the default works (and the options that switch each part)") == \
        "how-the-default-works-and-the-options-that-switch-each-part"
    assert slug("The ablation study (`configs/study_ablation.yaml`)") == "the-ablation-study-configsstudy_ablationyaml"


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_local_links_resolve(page):
    for target in local_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        assert dest.exists(), f"{page.name}: link {target!r} points to a missing file"
        if anchor and dest.suffix == ".md":
            assert anchor in anchors(dest), f"{page.name}: link {target!r}: no heading {anchor!r} in {dest.name}"


def test_readme_and_index_list_every_page():
    pages = {p.name for p in DOCS.glob("*.md")} - {"README.md"}
    assert len(pages) >= 8
    readme = set(local_links(ROOT / "README.md"))
    index = set(local_links(DOCS / "README.md"))
    for name in sorted(pages):
        assert f"docs/{name}" in readme, f"README.md does not link docs/{name}"
        assert name in index, f"docs/README.md does not list {name}"


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_fences_are_python_bash_or_plain(page):
    """A ``py`` or ``Python`` tag would hide a snippet from tests/test_readme.py."""
    for tag, _ in FENCE.findall(page.read_text()):
        assert tag in ("", "bash", "python"), f"{page.name}: fence tag {tag!r}"


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_named_commands_exist(page):
    for _, block in FENCE.findall(page.read_text()):
        for command in re.findall(r"(?:^|[\s/])ddcl-vq ([a-z][a-z-]*)", block):
            assert command in COMMANDS, f"{page.name}: `ddcl-vq {command}` is not a command ({', '.join(COMMANDS)})"


def resolve(dotted: str):
    """The module or attribute a dotted ``ddcl_vq....`` name stands for (ImportError/AttributeError if none)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(dotted)


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_named_code_exists(page):
    """Every ``ddcl_vq.x.y`` a page names imports, and every repository file it names exists."""
    text = page.read_text()
    for dotted in sorted(set(re.findall(r"\b(ddcl_vq(?:\.\w+)+)", text))):
        try:
            resolve(dotted)
        except (ImportError, AttributeError) as err:
            pytest.fail(f"{page.name} names {dotted}, which does not resolve: {err}")
    folders = "ddcl_vq|tests|scripts|configs|docs"
    for path in sorted(set(re.findall(rf"(?<![\w/.])((?:{folders})/[\w/.-]*\w\.(?:py|sh|yaml))", text))):
        assert (ROOT / path).exists(), f"{page.name} names {path}, which does not exist"


def command_lines():
    """(page, command, the text after `ddcl-vq COMMAND`) for every command line in a fenced block."""
    for page in PAGES:
        for _, block in FENCE.findall(page.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                for command, rest in re.findall(r"(?:^|[\s/])ddcl-vq ([a-z][a-z-]*)([^#]*)", line):
                    yield page, command, rest


def subcommand(command: str, rest: str):
    """(name, the rest) when ``command`` has subcommands (``ddcl-vq prior train ...``), else (None, rest);
    an unknown subcommand fails here."""
    subcommands = getattr(importlib.import_module(COMMANDS[command][0]), "SUBCOMMANDS", None)
    if subcommands is None:
        return None, rest
    words = rest.split(None, 1)
    assert words and (words[0] in subcommands or (command, words[0]) in ROUTES), \
        f"`ddcl-vq {command} {rest.strip()}`: expected a subcommand ({', '.join(subcommands)})"
    return words[0], words[1] if len(words) > 1 else ""


def test_named_options_exist(capsys):
    """Every --option written after `ddcl-vq COMMAND` (or `ddcl-vq COMMAND SUBCOMMAND`) is in its --help."""
    helps, checked = {}, 0
    for page, command, rest in command_lines():
        if command not in COMMANDS:
            continue  # test_named_commands_exist says so
        sub, rest = subcommand(command, rest)
        name = f"{command} {sub}" if sub else command
        if name not in helps:
            routed = ROUTES.get((command, sub))
            with pytest.raises(SystemExit):
                if routed:
                    importlib.import_module(routed).main(["--help"])
                else:
                    importlib.import_module(COMMANDS[command][0]).main(([sub] if sub else []) + ["--help"])
            helps[name] = capsys.readouterr().out
        for option in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", rest):  # --no-e2e too
            assert re.search(rf"{option}(?![\w-])", helps[name]), \
                f"{page.name}: `ddcl-vq {name} {option}` is not an option of ddcl-vq {name}"
            checked += 1
    assert checked >= 20


def test_design_defaults_are_the_constructors():
    """Every `name=value` in the default and what-it-does columns of design.md's table of DDCL defaults
    is DDCLQuantizer's default for that argument (the alternatives column names other values)."""
    text = (DOCS / "design.md").read_text()
    table = text.split("## How the default works", 1)[1].split("\n\n", 2)[1]
    signature = inspect.signature(DDCLQuantizer).parameters
    checked = 0
    for row in table.splitlines()[2:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        for name, value in re.findall(r"`(\w+)=([^`]+)`", cells[1] + " " + cells[2]):
            assert name in signature, f"design.md names {name!r}, not an argument of DDCLQuantizer"
            assert signature[name].default == ast.literal_eval(value), \
                f"design.md says {name}={value}, DDCLQuantizer's default is {signature[name].default!r}"
            checked += 1
    assert checked >= 8


#: dotted names in backticks that look like config keys but are files or code (and the typo the
#: training page shows on purpose, with the error it gets)
NOT_KEYS = {"train.py", "train.lock", "model.safetensors", "model._vq_vae", "quantizer.temprature"}


def test_named_config_keys_exist():
    """Every training-config key a page names (`section.key` in prose backticks, or `section.key=value`
    after a command; `ddcl-vq prior` lines take prior keys) is a key of the training config."""
    from ddcl_vq.tokenizer.config import all_keys

    keys, checked = set(all_keys()), 0
    for page in PAGES:
        text = page.read_text()
        named = [k for span in re.findall(r"`([^`\n]+)`", prose(text))
                 for k in re.findall(r"(?<![\w./-])((?:run|data|model|quantizer|train|loss)\.\w+)", span)]
        for _, block in FENCE.findall(text):
            for line in block.replace("\\\n", " ").splitlines():
                if "ddcl-vq prior" not in line:
                    named += re.findall(r"(?:^|\s)'?((?:run|data|model|quantizer|train|loss)\.\w+)(?:\.\w+)*=", line)
        for key in named:
            if key not in NOT_KEYS:
                assert key in keys, f"{page.name} names config key {key!r}, which the training config does not have"
                checked += 1
    assert checked >= 50
