"""The library installs beside the torch an environment already has (issue 61).

- pyproject.toml's core dependencies are torch and einops, nothing else; every other package the
  commands import is in the ``train`` extra, the same set as ``ddcl_vq.cli.TRAIN_EXTRA``;
- ``import ddcl_vq`` and the library's modules load no package of that extra;
- the wheel that ``pip wheel . --no-deps`` builds installs, with a plain ``pip install``, into a fresh
  venv holding torch 2.13.0 (the ``train`` extra pins 2.14) without replacing that torch; there the
  README's quantizer snippet runs, ``import ddcl_vq`` imports nothing of the extra, and a command says
  in one line which extra to install (exit 2).

The venv with only torch 2.13.0 and einops is built once (about a minute: ``pip install torch==2.13.0``
takes the local file) under ``$TMPDIR/ddcl-vq-test-venvs``, keyed by the Python and torch versions, and
copied for each run: the wheel goes into the copy, never into the cached venv.
"""
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from test_readme import python_snippets

from ddcl_vq.cli import TRAIN_EXTRA

ROOT = Path(__file__).resolve().parents[1]
#: a torch release other than the ``train`` extra's 2.14 pin (DDCL_VQ_TEST_TORCH picks another)
OTHER_TORCH = os.environ.get("DDCL_VQ_TEST_TORCH", "2.13.0")
VENVS = Path(tempfile.gettempdir()) / "ddcl-vq-test-venvs"
#: packages of the optional extras (vqp, digits, dev) that a command imports only when asked for them
OPTIONAL = {"vector_quantize_pytorch", "diffusers", "sklearn"}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(requirements) -> list:
    return [normalized(re.match(r"[A-Za-z0-9._-]+", r).group(0)) for r in requirements]


@pytest.fixture(scope="module")
def project():
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_core_dependencies_are_torch_and_einops(project):
    from packaging.requirements import Requirement

    assert requirement_names(project["dependencies"]) == ["torch", "einops"], project["dependencies"]
    torch_spec = Requirement(project["dependencies"][0]).specifier
    # the oldest and the newest torch the tests run on both satisfy it
    assert OTHER_TORCH in torch_spec and "2.14.1" in torch_spec, torch_spec


def test_train_extra_is_what_the_commands_import(project):
    extras = project["optional-dependencies"]
    train = requirement_names(extras["train"])
    assert "torch" in train and "torchvision" in train
    assert set(train) - {"torch"} == {normalized(d) for d in TRAIN_EXTRA.values()}
    assert normalized("ddcl-vq[train]") in [normalized(r) for r in extras["dev"]], "the dev extra installs everything"
    # every third-party package imported anywhere under ddcl_vq/ is torch, einops, the train extra or an optional one
    imported = {}
    for path in (ROOT / "ddcl_vq").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and not node.level and node.module else []
            for name in names:
                imported.setdefault(name.split(".")[0], path.relative_to(ROOT).as_posix())
    known = {"ddcl_vq", "torch", "einops", *TRAIN_EXTRA, *OPTIONAL}
    unlisted = {top: path for top, path in imported.items() if top not in sys.stdlib_module_names and top not in known}
    assert not unlisted, f"imported but in no extra (pyproject.toml and ddcl_vq.cli.TRAIN_EXTRA): {unlisted}"


def library_modules() -> list:
    """ddcl_vq's own modules, ddcl_vq.ddcl and ddcl_vq.adapters: what ``pip install ddcl-vq`` is for."""
    out = ["ddcl_vq"]
    for path in sorted((ROOT / "ddcl_vq").glob("*.py")):
        if path.stem not in ("__init__", "__main__", "cli"):
            out.append(f"ddcl_vq.{path.stem}")
    for sub in ("ddcl", "adapters"):
        out += [f"ddcl_vq.{sub}"] + [f"ddcl_vq.{sub}.{p.stem}" for p in sorted((ROOT / "ddcl_vq" / sub).glob("*.py"))
                                     if p.stem != "__init__"]
    return out


NO_EXTRA_CODE = """
import importlib, sys
import torch, einops
before = {m.split('.')[0] for m in sys.modules}
for name in sys.argv[2:]:
    importlib.import_module(name)
loaded = {m.split('.')[0] for m in sys.modules} - before
bad = sorted(loaded & set(sys.argv[1].split(',')))
assert not bad, f'importing the library loaded packages of the train extra: {bad}'
"""


def test_library_imports_nothing_of_the_train_extra():
    """In the development venv (every extra installed): nothing beyond what torch itself loads."""
    modules = [*library_modules(), "ddcl_vq.cli"]
    out = subprocess.run([sys.executable, "-c", NO_EXTRA_CODE, ",".join(TRAIN_EXTRA), *modules], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]


def clean_env() -> dict:
    """The environment for a command in another venv: none of this venv's paths."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")}
    return {**env, "OMP_NUM_THREADS": "1"}


def base_venv() -> Path:
    """The cached venv with torch ``OTHER_TORCH`` and einops only (built once, never changed)."""
    key = f"py{sys.version_info[0]}{sys.version_info[1]}-torch{OTHER_TORCH}-einops"
    base = VENVS / key
    if (base / "ready").is_file():
        return base
    VENVS.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{key}.building-", dir=VENVS))
    try:
        subprocess.run([sys.executable, "-m", "venv", str(work)], check=True, capture_output=True, timeout=300)
        try:
            out = subprocess.run([str(work / "bin" / "python"), "-m", "pip", "install", "--only-binary", ":all:",
                                  f"torch=={OTHER_TORCH}", "einops"],
                                 capture_output=True, text=True, timeout=1800, env=clean_env())
        except subprocess.TimeoutExpired:
            pytest.skip(f"installing torch=={OTHER_TORCH} took over 30 minutes here")
        if out.returncode != 0:
            pytest.skip(f"torch=={OTHER_TORCH} does not install here: {out.stderr.strip().splitlines()[-1:]}")
        (work / "ready").write_text(out.stdout)
        try:
            os.rename(work, base)
        except OSError:  # another run built it meanwhile
            if not (base / "ready").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return base


def run(cmd, **kwargs):
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=clean_env(), **kwargs)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv, pip's output): the built wheel installed with plain pip into a copy of the cached venv."""
    tmp = tmp_path_factory.mktemp("packaging")
    base = base_venv()
    src = tmp / "src"  # a copy: setuptools writes build/ and *.egg-info next to the sources
    shutil.copytree(ROOT / "ddcl_vq", src / "ddcl_vq", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out = run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "-w", tmp / "dist"], cwd=src, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    wheel = next((tmp / "dist").glob("ddcl_vq-*.whl"))
    venv = tmp / "venv"
    subprocess.run(["cp", "-a", str(base), str(venv)], check=True, timeout=600)
    python = venv / "bin" / "python"  # never the copy's bin/pip: its first line names the cached venv's python
    out = run([python, "-m", "pip", "install", wheel], cwd=tmp, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert not list(base.glob("lib/python*/site-packages/ddcl_vq*")), "the cached venv was changed"
    return venv, out.stdout


def test_the_wheel_installs_beside_another_torch(installed):
    venv, pip_output = installed
    done = [line for line in pip_output.splitlines() if line.startswith("Successfully installed")]
    assert done and [p.rsplit("-", 1)[0] for p in done[0].split()[2:]] == ["ddcl-vq"], done  # torch, einops: there
    assert "Uninstalling torch" not in pip_output, pip_output
    out = run([venv / "bin" / "python", "-c", "import torch, ddcl_vq; print(torch.__version__, ddcl_vq.__file__)"],
              cwd=venv, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    version, location = out.stdout.split()
    assert version.split("+")[0] == OTHER_TORCH, f"torch was replaced: {version}"
    assert Path(location).is_relative_to(venv), location
    check = run([venv / "bin" / "python", "-m", "pip", "check"], cwd=venv, timeout=300)
    assert check.returncode == 0, check.stdout + check.stderr


def test_readme_quantizer_snippet_runs_there(installed, tmp_path):
    venv, _ = installed
    snippets = [(line, code) for line, code in python_snippets(ROOT / "README.md") if "DDCLQuantizer(" in code]
    assert snippets, "README.md has no quantizer snippet"
    line, code = snippets[0]
    assert "vector_quantize_pytorch" not in code
    script = tmp_path / "readme.py"
    script.write_text("\n" * (line - 1) + code)  # a traceback names the README's line
    out = run([venv / "bin" / "python", script], cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]


def test_import_there_loads_no_extra(installed, tmp_path):
    venv, _ = installed
    code = ("import importlib.util, sys\n"
            "present = sorted(m for m in sys.argv[1].split(',') if importlib.util.find_spec(m) is not None)\n"
            "assert not present, f'the venv should hold torch and einops only: {present}'\n" + NO_EXTRA_CODE)
    out = run([venv / "bin" / "python", "-c", code, ",".join(TRAIN_EXTRA), *library_modules(), "ddcl_vq.cli"],
              cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def test_a_command_there_names_its_extra(installed, tmp_path):
    venv, _ = installed
    script = venv / "bin" / "ddcl-vq"
    out = run([script, "--help"], cwd=tmp_path, timeout=300)
    assert out.returncode == 0 and "train" in out.stdout, out.stderr[-3000:]
    for argv in (["train", "--help"], ["evaluate", "runs/x"]):
        out = run([script, *argv], cwd=tmp_path, timeout=300)
        assert out.returncode == 2, out.stderr[-3000:]
        assert "Traceback" not in out.stderr, out.stderr[-3000:]
        # torch 2.13 itself warns on stderr that NumPy is missing; ours is the one line naming the command
        ours = [line for line in out.stderr.splitlines() if line.startswith("ddcl-vq")]
        assert len(ours) == 1 and re.fullmatch(
            rf"ddcl-vq: the command '{argv[0]}' needs the toolkit's extra: pip install 'ddcl-vq\[train\]' "
            r"\(missing: [\w-]+\)", ours[0]), out.stderr


def test_a_missing_package_of_the_extra_is_one_line(tmp_path):
    """The same in the development venv, with PyYAML (which the train command's module imports) hidden."""
    code = ("import sys\nsys.modules['yaml'] = None\n"
            "from ddcl_vq.cli import main\nsys.exit(main(['train', '--help']))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip().splitlines() == [
        "ddcl-vq: the command 'train' needs the toolkit's extra: pip install 'ddcl-vq[train]' (missing: pyyaml)"]


def test_another_missing_package_is_not_blamed_on_the_extra():
    from ddcl_vq.cli import missing_extra

    assert missing_extra("train", ModuleNotFoundError("No module named 'nope'", name="nope")) is None
    assert "(missing: scikit-image)" in missing_extra("train", ModuleNotFoundError(name="skimage.metrics"))
