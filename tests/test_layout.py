"""The layout's promises (DESIGN.md): no import cycle among the project's modules (imports
inside functions included), ddcl_vq imports nothing of the rest, and code outside ddcl_vq
asks the Quantizer interface instead of testing for a concrete quantizer class."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ddcl_vq", "models", "train", "eval")
CONCRETE_QUANTIZERS = {"DDCLQuantizer", "HardVQ", "EMAVQ", "VQPQuantizer"}


def project_modules():
    """module name -> (path, is_package) for every .py file of the project's packages."""
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            mods[".".join(parts)] = (path, is_pkg)
    return mods


def imports_of(name, path, is_pkg, mods):
    """Project modules that ``name`` imports anywhere in its file."""
    package = name if is_pkg else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            targets = [mod] + [f"{mod}.{alias.name}" for alias in node.names]
        for target in targets:
            # the deepest project module the import names (a.b.c -> a.b.c, else a.b, else a)
            parts = target.split(".")
            for i in range(len(parts), 0, -1):
                candidate = ".".join(parts[:i])
                if candidate in mods:
                    if candidate != name:
                        found.add(candidate)
                    break
    return found


def test_no_import_cycles():
    mods = project_modules()
    graph = {name: imports_of(name, path, is_pkg, mods) for name, (path, is_pkg) in mods.items()}
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_ddcl_vq_imports_nothing_of_the_rest():
    mods = project_modules()
    for name, (path, is_pkg) in mods.items():
        if name.split(".")[0] == "ddcl_vq":
            outside = {m for m in imports_of(name, path, is_pkg, mods) if m.split(".")[0] != "ddcl_vq"}
            assert not outside, f"{name} imports {sorted(outside)}"


def test_no_isinstance_on_a_concrete_quantizer_outside_ddcl_vq():
    offenders = []
    for name, (path, _) in project_modules().items():
        if name.split(".")[0] == "ddcl_vq":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "issubclass") \
                    and len(node.args) == 2:
                names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} | \
                        {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
                if names & CONCRETE_QUANTIZERS:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, "ask the Quantizer interface instead: " + ", ".join(offenders)
