"""The layout promises of docs/design.md: one package whose folders are its import paths, arrows only
pointing down, no cycles.

- ``ddcl_vq``'s own modules and ``ddcl_vq/adapters`` (the library, what users copy) import nothing from
  the feature folders; ``models`` only the library; ``common`` the library and models; then
  ``tokenizer``, ``prior``, ``studies`` and the ``ddcl-vq`` dispatcher (``cli``), each only what is
  above it in that list; the import graph (imports inside functions included) has no cycle.
- Code outside the library asks the Quantizer interface instead of testing for a concrete class.
"""
import ast
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import TINY_MODEL

ROOT = Path(__file__).resolve().parents[1]
#: the layers, lowest first: a module may import its own layer and those before it
LAYERS = ["library", "models", "common", "tokenizer", "prior", "studies", "cli"]
FEATURES = ("models", "common", "tokenizer", "prior", "studies")
CONCRETE_QUANTIZERS = {"DDCLQuantizer", "HardVQ", "EMAVQ", "VQPQuantizer"}
TINY = TINY_MODEL + ["quantizer.num_codes=32", "data.batch_size=32", "train.eval_images=0", "train.log_every=1"]


def project_modules() -> dict:
    """Module name -> source file, for every module under ddcl_vq/."""
    out = {}
    for path in sorted((ROOT / "ddcl_vq").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, modules: dict) -> set:
    """Project modules that ``name`` imports anywhere in its file (function-level imports included)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[:len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            # "from pkg import mod" imports the module pkg.mod; "from mod import name" imports mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for target in targets:
            while target and target not in modules and target.split(".")[0] == "ddcl_vq":
                target = target.rpartition(".")[0]
            if target in modules and target != name:
                found.add(target)
    return found


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in FEATURES:
        return parts[1]
    return "cli" if module in ("ddcl_vq.cli", "ddcl_vq.__main__") else "library"


def test_imports_point_down():
    modules = project_modules()
    bad = [f"{name} ({layer_of(name)}) imports {target} ({layer_of(target)}): arrows only point down "
           + " -> ".join(LAYERS[::-1])
           for name, path in modules.items() for target in imports_of(name, path, modules)
           if LAYERS.index(layer_of(target)) > LAYERS.index(layer_of(name))]
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    modules = project_modules()
    graph = {name: sorted(t for t in imports_of(name, path, modules) if t in modules)
             for name, path in modules.items()}
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in graph:
        if node not in state:
            visit(node)
    assert not cycles, "\n".join(cycles)


def test_no_isinstance_on_a_concrete_quantizer_outside_ddcl_vq():
    offenders = []
    for name, path in project_modules().items():
        if layer_of(name) == "library":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "issubclass") \
                    and len(node.args) == 2:
                names = {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} | \
                        {n.attr for n in ast.walk(node.args[1]) if isinstance(n, ast.Attribute)}
                if names & CONCRETE_QUANTIZERS:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, "ask the Quantizer interface instead: " + ", ".join(offenders)


def test_import_ddcl_vq_loads_nothing_from_the_feature_folders():
    code = ("import sys, ddcl_vq\n"
            f"bad = [m for m in sys.modules if m.split('.')[:2] in [['ddcl_vq', f] for f in {FEATURES!r}] "
            "or m.startswith('torchvision')]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


@pytest.fixture
def user_project(tmp_path):
    """A user's code base with its own ``models/`` package, ``train.py`` and ``eval.py``: importing
    any of them fails loudly, so the toolkit must never pick them up."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("raise ImportError('the user\\'s models package')\n")
    (tmp_path / "train.py").write_text("raise ImportError('the user\\'s train.py')\n")
    (tmp_path / "eval.py").write_text("raise ImportError('the user\\'s eval.py')\n")
    return tmp_path


def test_user_models_package_and_train_py_do_not_collide(user_project):
    env = {**os.environ, "PYTHONPATH": str(user_project), "OMP_NUM_THREADS": "1"}
    run = user_project / "runs" / "two_steps"
    script = Path(sys.executable).with_name("ddcl-vq")
    out = subprocess.run([str(script), "train", "--config", str(ROOT / "configs" / "fashion_ddcl.yaml"), "--quiet",
                          *TINY, "train.steps=2", f"run.dir={run}"],
                         cwd=user_project, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (run / "checkpoints" / "last.pt").is_file()
    code = ("import sys\n"
            "from ddcl_vq.models import VQVAE, Encoder, Decoder\n"
            "import ddcl_vq.tokenizer.config, ddcl_vq.cli\n"
            "assert not {'models', 'train', 'eval'} & set(sys.modules), sorted(sys.modules)\n"
            "try:\n"
            "    import models\n"
            "except ImportError as err:\n"
            "    assert 'the user' in str(err), err\n"
            "else:\n"
            "    raise AssertionError('expected the user\\'s own models package')\n")
    subprocess.run([sys.executable, "-c", code], cwd=user_project, env=env, check=True, timeout=120)
    assert not (user_project / "models" / "__pycache__").exists()
    assert sorted(p.name for p in user_project.iterdir()) == ["eval.py", "models", "runs", "train.py"]


def test_wheel_installs_only_ddcl_vq_at_the_top(tmp_path):
    src = tmp_path / "src"  # a copy: setuptools writes build/ and *.egg-info next to the sources
    shutil.copytree(ROOT / "ddcl_vq", src / "ddcl_vq", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(src)], check=True, capture_output=True, timeout=300)
    wheel = next(tmp_path.glob("ddcl_vq-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        zf.extractall(tmp_path / "site")
        entry_points = next(zf.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"ddcl_vq"}, top
    assert "ddcl-vq = ddcl_vq.cli:main" in entry_points
    for name, path in project_modules().items():
        assert name.replace(".", "/") + ("/__init__.py" if path.name == "__init__.py" else ".py") in names, name
    # the unpacked wheel, first on the path, imports and runs on its own files
    code = ("import sys; sys.path.insert(0, sys.argv[1])\n"
            "import ddcl_vq.models, ddcl_vq.tokenizer.train, ddcl_vq.cli\n"
            "for m in (ddcl_vq.models, ddcl_vq.tokenizer.train, ddcl_vq.cli):\n"
            "    assert m.__file__.startswith(sys.argv[1]), m.__file__\n"
            "assert ddcl_vq.cli.main(['--help']) == 0\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "site")], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "readout-study" in out.stdout


def test_the_development_install_is_the_source_folder():
    """scripts/setup.sh installs editable: every module imports from its file under ddcl_vq/."""
    names = ["ddcl_vq.ddcl.quantizer", "ddcl_vq.models.vqvae", "ddcl_vq.tokenizer.train", "ddcl_vq.studies.compare"]
    code = "import importlib, sys\nprint('\\n'.join(importlib.import_module(n).__file__ for n in sys.argv[1:]))\n"
    out = subprocess.run([sys.executable, "-c", code, *names], cwd="/", capture_output=True, text=True,
                         timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    for name, file in zip(names, out.stdout.split()):
        assert Path(file).resolve() == ROOT / (name.replace(".", "/") + ".py"), (name, file)


def _calls(tree: ast.AST, attr: str):
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == attr]


def test_training_loops_run_in_the_skeleton_and_its_helpers_are_defined_once():
    """Every loop that trains runs inside the skeleton (common/skeleton.py): no evaluation, export, token or bench
    module calls an optimizer's or a schedule's step(), and the helpers every loop shares — RNG state, the
    learning-rate schedule, dropping the metrics lines a killed run wrote past its checkpoint — have one definition."""
    training = {"tokenizer/train.py", "tokenizer/losses.py", "prior/train.py", "prior/classifier_train.py",
                "studies/readout/train.py"}
    for name, path in project_modules().items():
        if layer_of(name) == "library" or str(path.relative_to(ROOT / "ddcl_vq")) in training:
            continue
        tree = ast.parse(path.read_text(), str(path))
        stepped = [c for c in _calls(tree, "step") if not c.args and not c.keywords]  # optimizer.step(), scheduler.step()
        assert not stepped, f"{path.relative_to(ROOT)}:{stepped[0].lineno if stepped else ''} calls step()"
    defined: dict = {}
    for path in sorted((ROOT / "ddcl_vq").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef):
                defined.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    for helper in ("rng_state", "set_rng_state", "lr_schedule", "keep_logged_steps", "setup_distributed"):
        assert len(defined.get(helper, [])) == 1, (helper, defined.get(helper))
    for duplicate in ("_rng_state", "_set_rng_state", "lr_factor"):
        assert duplicate not in defined, (duplicate, defined[duplicate])
    # every loop runs inside the skeleton
    for loop in ("ddcl_vq/tokenizer/train.py", "ddcl_vq/prior/train.py", "ddcl_vq/studies/readout/train.py"):
        assert "TrainingRun(" in (ROOT / loop).read_text(), loop
