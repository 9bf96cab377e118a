"""Every command: settings declared and checked one way, errors the user can fix as one line.

- each command's options are a dataclass read by ddcl_vq.common.config.Options (types, choices,
  bounds, presets such as --quick), as the training config and the study file are;
- every error a user can fix is a UserError, which each command (and the dispatcher) prints as
  ``ddcl-vq CMD: error: <message>`` with exit status 2;
- machine information is read in one place, ddcl_vq.common.machine.
"""
import importlib
import re
from pathlib import Path

import pytest
import yaml

from ddcl_vq import cli
from ddcl_vq.tokenizer.evaluate import EvaluateError
from ddcl_vq.studies.study import load_study
from ddcl_vq.studies.study import StudyError
from ddcl_vq.common.checkpoint import CheckpointError
from ddcl_vq.tokenizer.config import ConfigError
from ddcl_vq.common.data import DataUnavailable
from ddcl_vq.common.errors import UserError
from ddcl_vq.common.config import Options, Rules, option

ROOT = Path(__file__).resolve().parents[1]


def test_every_user_error_derives_from_one_base_class():
    for cls in (ConfigError, DataUnavailable, CheckpointError, EvaluateError, StudyError):
        assert issubclass(cls, UserError), cls
    assert issubclass(ConfigError, ValueError) and issubclass(DataUnavailable, RuntimeError)


def test_every_command_main_reports_user_errors():
    for name, (module, _) in cli.COMMANDS.items():
        main = importlib.import_module(module).main
        assert hasattr(main, "__wrapped__"), f"{module}.main is not wrapped in ddcl_vq.common.errors.entry_point"
    sources = [p for p in (ROOT / "ddcl_vq").rglob("*.py") if p.parent.name != "ddcl_vq" and p.parent.name != "adapters"]
    catching = [str(p.relative_to(ROOT)) for p in sources if re.search(r"except \((ConfigError|EvaluateError)",
                                                                      p.read_text())]
    assert not catching, f"commands catch error tuples themselves: {catching}"


@pytest.mark.parametrize("argv, message", [
    (["train", "--config", "configs/fashion_ddcl.yaml", "--print-config", "train.stesp=3"],
     "unknown config key 'train.stesp'; did you mean 'train.steps'?"),
    (["train", "--config", "configs/fashion_ddcl.yaml", "--stop-after", "0"], "option --stop-after: expected a value > 0"),
    (["evaluate", "no/such/run"], "run directory 'no/such/run' does not exist"),
    (["evaluate", "no/such/run", "--split", "val"], "option --split: expected one of ['train', 'test'], got 'val'"),
    (["compare", "no/such/run", "--out", "x", "--max-images", "-1"], "option --max-images: expected a value >= 0"),
    (["study", "--config", "configs/study_dynamics.yaml", "--list", "--jobs", "0"], "option --jobs"),
    (["study", "--config", "no/such.yaml"], "study file 'no/such.yaml' does not exist"),
    (["bench", "--repeats", "x"], "option --repeats: expected int, got 'x'"),
    (["bench", "--shapes", "8,8"], "option --shapes: expected N,D,K"),
    (["bench", "--memory", "peak"], "option --memory: expected one of ['rss', 'subprocess', 'none'], got 'peak'"),
    (["readout-study", "--arms", "mean,nope"], "option --arms: expected one of"),
    (["readout-study", "--windows", "2,0"], "option --windows: expected a value > 0"),
])
def test_user_errors_are_one_line_and_exit_2(argv, message, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"ddcl-vq {argv[0]}: error: "), err
    assert message in err[0]


def test_presets_fill_what_is_not_given_and_defaults_show_in_help():
    from dataclasses import dataclass
    from typing import List, Optional

    @dataclass(kw_only=True)
    class Demo:
        quick: bool = option(False, "small")
        steps: int = option(100, "steps")
        lr: float = option(0.1, "rate")
        names: List[str] = option(default_factory=lambda: ["a"], sep=",", help="names")
        cap: Optional[int] = option(None, "cap", default_text="none")

    opts = Options(Demo, prog="demo", presets={"quick": {"steps": 5, "lr": 1}},
                   rules=Rules(choices={"names": ("a", "b")}, positive={"steps", "cap"}))
    assert opts.parse([]) == Demo()
    assert opts.parse(["--quick"]) == Demo(quick=True, steps=5, lr=1.0)
    assert opts.parse(["--quick", "--steps", "7", "--names", "b,a"]) == Demo(quick=True, steps=7, lr=1.0,
                                                                            names=["b", "a"])
    with pytest.raises(ConfigError, match=r"option --cap: expected a value > 0, got 0"):
        opts.parse(["--cap", "0"])
    with pytest.raises(ConfigError, match=r"option --lr: expected float, got 'fast'"):
        opts.parse(["--lr", "fast"])
    text = opts.parser().format_help()
    assert "(default: 100; --quick: 5)" in text and "(default: none)" in text


def test_bench_quick_preset_and_explicit_options():
    from ddcl_vq.studies.bench.cli import OPTIONS
    quick = OPTIONS.parse(["--quick"])
    assert (quick.repeats, quick.max_seconds, quick.budget_seconds, quick.warmup) == (2, 20.0, 5.0, 1)
    full = OPTIONS.parse(["--quick", "--repeats", "3", "--impls", "hardvq", "vqp"])
    assert (full.repeats, full.max_seconds, full.impls) == (3, 20.0, ["hardvq", "vqp"])
    assert OPTIONS.parse([]).repeats == 5


def test_readout_options_keep_their_names_and_defaults():
    from ddcl_vq.studies.readout.cli import parse_args
    opts = parse_args(["--quick", "--arms", "mean,ddcl", "--steps", "9"])
    assert (opts.steps, opts.batch_size, opts.lr, opts.arms, opts.windows) == (9, 64, 2e-3, ["mean", "ddcl"],
                                                                              [2] * 6)
    assert parse_args([]).train_size == 60000


def test_study_file_is_checked_like_a_config(tmp_path):
    path = tmp_path / "s.yaml"

    def load(raw):
        path.write_text(yaml.safe_dump(raw))
        return load_study(path)

    arms = [{"name": "a", "overrides": {"quantizer.type": "hard"}}]
    study = load({"arms": arms, "eval": {"max_images": 10}, "name": None})
    assert (study.name, study.eval.max_images, study.eval.split) == ("s", 10, "test")
    with pytest.raises(ConfigError, match=r"study s.yaml: unknown key 'eval.max_image'; did you mean 'eval.max_images'"):
        load({"arms": arms, "eval": {"max_image": 10}})
    with pytest.raises(ConfigError, match=r"study s.yaml: key 'eval.batch_size': expected int, got 'big'"):
        load({"arms": arms, "eval": {"batch_size": "big"}})
    with pytest.raises(ConfigError, match=r"study s.yaml: key 'eval.split': expected one of \['train', 'test'\]"):
        load({"arms": arms, "eval": {"split": "val"}})
    with pytest.raises(ConfigError, match=r"unknown key 'arms\[0\].overide'; did you mean 'arms\[0\].overrides'"):
        load({"arms": [{"name": "a", "overide": {}}]})
    with pytest.raises(ConfigError, match=r"arm #1: expected \{name: ..., overrides: ...\}"):
        load({"arms": [{"overrides": {}}]})
    with pytest.raises(ConfigError, match=r"'sweep' must map dotted keys to non-empty lists"):
        load({"arms": arms, "sweep": {"quantizer.num_codes": []}})
    with pytest.raises(ConfigError, match=r"key 'sweep.quantizer.num_codes': expected a list, got 8"):
        load({"arms": arms, "sweep": {"quantizer.num_codes": 8}})


def test_machine_information_is_read_in_one_place():
    readers = []
    for path in (ROOT / "ddcl_vq").rglob("*.py"):
        text = path.read_text()
        if ("/proc/cpuinfo" in text or "getloadavg" in text or "platform.processor" in text) \
                and path != ROOT / "ddcl_vq" / "common" / "machine.py":
            readers.append(str(path.relative_to(ROOT)))
    assert not readers, readers
    from ddcl_vq.common.machine import describe_machine, machine_info
    info = machine_info()
    assert {"cpu", "cores", "threads", "loadavg", "torch", "python", "cuda", "date"} <= set(info)
    assert f"{info['cores']} CPU cores" in describe_machine(info)
