"""docs/ and the README agree with the repository: links resolve, the index lists every page, the
files, modules, commands and command options they name exist, no snippet hides behind an unknown
fence tag, the tables of DDCL defaults say what ``DDCLQuantizer``'s signature says, and the generated
parts (the results tables from docs/results.csv, docs/reference/config.md and cli.md) are what their
generators write. docs/lab/ is the research log: its links must resolve, but its commands, keys and
paths are those of the version that ran them."""
import ast
import importlib
import importlib.util
import inspect
import re
from pathlib import Path

import pytest

from ddcl_vq import DDCLQuantizer
from ddcl_vq.cli import COMMANDS, ROUTES

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LAB = DOCS / "lab"
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md"] + sorted(DOCS.rglob("*.md"))
IDS = [p.relative_to(ROOT).as_posix() for p in PAGES]
#: the pages that describe this version (the lab's research log describes the versions that ran it)
CURRENT = [p for p in PAGES if LAB not in p.parents]
CURRENT_IDS = [p.relative_to(ROOT).as_posix() for p in CURRENT]
#: generated from the code by scripts/docs_reference.py (tested below against the generator)
GENERATED = {DOCS / "reference" / "config.md", DOCS / "reference" / "cli.md"}


def script(name: str):
    """scripts/NAME.py as a module (the docs generators)."""
    spec = importlib.util.spec_from_file_location(f"scripts_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
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
    """docs/README.md lists every page under docs/; the README links the index, every guide and
    reference page, the results and the design."""
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")} - {"README.md"}
    assert len(pages) >= 15
    readme = {target.partition("#")[0] for target in local_links(ROOT / "README.md")}
    index = {target.partition("#")[0] for target in local_links(DOCS / "README.md")}
    for name in sorted(pages):
        assert name in index, f"docs/README.md does not list {name}"
        if name.startswith(("guide/", "reference/")) or name in ("results.md", "design.md"):
            assert f"docs/{name}" in readme, f"README.md does not link docs/{name}"
    assert "docs/README.md" in readme


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_fences_are_python_bash_or_plain(page):
    """A ``py`` or ``Python`` tag would hide a snippet from tests/test_readme.py."""
    for tag, _ in FENCE.findall(page.read_text()):
        assert tag in ("", "bash", "python"), f"{page.name}: fence tag {tag!r}"


@pytest.mark.parametrize("page", CURRENT, ids=CURRENT_IDS)
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


@pytest.mark.parametrize("page", CURRENT, ids=CURRENT_IDS)
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
    for page in CURRENT:
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
    after a command; `ddcl-vq prior` lines take prior keys) is a key of the training config: of its model.arch
    or quantizer.type (a peer's: its vector-quantize-pytorch class's keyword arguments)."""
    from ddcl_vq.models.vqvae import QUANTIZER_TYPES
    from ddcl_vq.tokenizer.config import all_keys, constructor_keys, resolve_model, resolve_quantizer

    keys, checked = set(all_keys()) | {f"model.{k}" for k in resolve_model({"arch": "vqgan"})}, 0
    for qtype, cls in QUANTIZER_TYPES.items():
        keys |= {f"quantizer.{k}" for k in [*resolve_quantizer({"type": qtype}), *(constructor_keys(cls)[1] or [])]}
    for page in CURRENT:
        if page in GENERATED:
            continue  # config.md holds the prior's keys too; it is the code's own list (test below)
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


#: what belongs to the research log (docs/lab/) and not to a page about this version
HISTORY = {
    "a date": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
    "'today'": re.compile(r"\btoday'?s?\b", re.I),
    "a screen's environment variable": re.compile(r"DDCL_SCREEN_"),
    "docs/patches": re.compile(r"docs/patches"),
}


@pytest.mark.parametrize("page", CURRENT, ids=CURRENT_IDS)
def test_no_history_outside_the_lab(page):
    """Dates, 'today', the screens' switches and patches live in docs/lab/; results.md names no reports/
    folder (its commands run from a clean checkout)."""
    text = page.read_text()
    for what, pattern in HISTORY.items():
        m = pattern.search(text)
        assert not m, f"{page.name} holds {what} ({m.group(0)!r}): history goes to docs/lab/"
    if page == DOCS / "results.md":
        assert "reports/" not in text, "results.md names a reports/ folder: name the command that makes it"


def test_results_tables_are_the_csv():
    """The README's and results.md's results tables are what scripts/docs_results.py makes of docs/results.csv,
    and every table of the CSV is on results.md."""
    gen = script("docs_results")
    rows = gen.load()
    for page in gen.PAGES:
        assert page.read_text() == gen.expected(page, rows), \
            f"{page.name}: a results table differs from docs/results.csv; run .venv/bin/python scripts/docs_results.py"
    results = (DOCS / "results.md").read_text()
    for name in dict.fromkeys(r["table"] for r in rows):
        assert f"<!-- results:{name} -->" in results, f"results.md has no table {name!r} of docs/results.csv"
    assert "<!-- results:readme -->" in (ROOT / "README.md").read_text()
    for r in rows:  # a number without its seeds cannot be traced to a run
        assert not gen.measured(r) or r["seeds"], f"docs/results.csv: {r['table']} {r['quantizer']!r} has no seeds"
        assert gen.measured(r) or r["note"], f"docs/results.csv: {r['table']} {r['quantizer']!r} has neither figures nor a note"


def test_results_tables_name_their_commands():
    """Every results table on results.md follows a command block (with a --quick smoke test) in its section."""
    text = (DOCS / "results.md").read_text()
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        if "<!-- results:" not in section:
            continue
        blocks = [block for tag, block in FENCE.findall(section) if tag == "bash"]
        assert blocks and any("ddcl-vq study" in b for b in blocks), f"results.md, {section.splitlines()[0]!r}: no command"
        assert any("--quick" in b for b in blocks), f"results.md, {section.splitlines()[0]!r}: no smoke test"


def test_reference_pages_are_generated():
    """docs/reference/config.md and cli.md are what scripts/docs_reference.py makes of the code."""
    gen = script("docs_reference")
    for path, make in gen.PAGES.items():
        assert path.read_text() == make(), \
            f"{path.relative_to(ROOT)} differs from the code; run .venv/bin/python scripts/docs_reference.py"


def test_quantizer_reference_is_the_signature():
    """reference/quantizer.md's argument table lists every argument of DDCLQuantizer with its default."""
    text = (DOCS / "reference" / "quantizer.md").read_text()
    table = prose(text.split("## DDCLQuantizer", 1)[1]).split("| argument |", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for row in table.splitlines()[2:]:
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[1].strip("`")
    for name, param in inspect.signature(DDCLQuantizer).parameters.items():
        assert name in rows, f"reference/quantizer.md: DDCLQuantizer's argument {name!r} is not in the table"
        if param.default is inspect.Parameter.empty:
            assert rows[name] == "—", f"reference/quantizer.md: {name} has no default, the table says {rows[name]!r}"
        else:
            assert ast.literal_eval(rows[name]) == param.default, \
                f"reference/quantizer.md says {name}={rows[name]}, DDCLQuantizer's default is {param.default!r}"
    assert set(rows) <= set(inspect.signature(DDCLQuantizer).parameters), "reference/quantizer.md names a retired argument"
