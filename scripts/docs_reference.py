"""The tables of docs/reference/config.md, the commands of docs/reference/cli.md and the report definitions and
multi-codebook argument tables of docs/reference/quantizer.md, generated from the code.

    .venv/bin/python scripts/docs_reference.py            # rewrite the blocks between the markers
    .venv/bin/python scripts/docs_reference.py --check    # exit 1, naming the page, when one differs from the code

A block lives between ``<!-- reference:NAME -->`` and ``<!-- /reference:NAME -->``. config.md: a table per section of
the typed settings (each key's type, default, allowed values and the trailing comment, or the quantizer class's
docstring, that explains it); cli.md: the ``--help`` of every command and subcommand of ``ddcl-vq``.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import re
import sys
import typing
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from docs_results import ROOT, fill, update  # noqa: E402 - the marked blocks and --check, as for the results

#: what the model keys are (the encoders have no Args: docstring)
MODEL_NOTES = {
    "arch": "`vqvae` (the small model) or `vqgan` (diffusers' encoder/decoder: docs/guide/vqgan.md)",
    "channels": "channels of the small VQ-VAE's encoder and decoder",
    "num_res_blocks": "residual blocks (per resolution in the VQGAN)",
    "num_downsamples": "stride-2 halvings: 32×32 images give 8×8 latents at 2",
    "latent_dim": "D, the codebook's dimension", "res_hidden": "hidden channels of a residual block",
    "ch": "channels of the first block", "ch_mult": "channel multiplier per resolution",
    "attn_resolutions": "resolutions whose blocks have attention",
    "z_channels": "channels of the encoder's output, before the 1×1 conv to D", "norm_groups": "GroupNorm groups",
}
#: the keys the config adds to the quantizer classes' arguments: (default, what it sets)
QUANTIZER_NOTES = {"type": "the quantizer class (`ddcl_vq.models.vqvae.QUANTIZER_TYPES`)",
                   "num_codes": "K, the codebook size",
                   "…": "any keyword argument of the vector-quantize-pytorch class the quantizer wraps "
                        "(`VectorQuantize`, `FSQ`, `SimVQ`, `LFQ`), as it is; for residual_ddcl and grouped_ddcl, "
                        "`DDCLQuantizer`'s (`quantizer.temperature`, …), given to every level or group"}


def cell(text: str) -> str:
    return (text or "").replace("|", "\\|").replace("\n", " ")


def first_sentence(text: str) -> str:
    text = re.split(r"(?<=\.)\s+(?=[A-Z])", " ".join(text.split()), maxsplit=1)[0].rstrip(".")
    return re.sub(r":\w+:`~?([^`]*)`", r"`\1`", text.replace("``", "`"))  # :meth:`step` -> `step`


def described(cls: type, key: str) -> str:
    """The first sentence of ``key``'s entry in the ``Args:`` section of ``cls``'s docstring ('' when none)."""
    args = (inspect.getdoc(cls) or "").partition("\nArgs:\n")[2].split("\n\n")[0]
    m = re.search(rf"^    (?:\w+, )*{key}(?:, \w+)*: (.*?)(?=\n    \S|\Z)", args, re.M | re.S)
    return first_sentence(m.group(1)) if m else ""


def fields_of(obj: Any, prefix: str = "") -> Iterator[Tuple[str, Any, Any, str]]:
    """(dotted key, annotation, default, what it sets: its trailing ``# comment`` or its option's help) for every
    leaf of the dataclass instance ``obj``."""
    source = inspect.getsource(type(obj))
    comments = dict(reversed(re.findall(r"^\s+(\w+)\s*:[^#\n]*#\s*(.+?)\s*$", source, re.M)))
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from fields_of(value, f"{prefix}{f.name}.")
        else:
            text = comments.get(f.name) or f.metadata.get("option", {}).get("help", "")  # an option's --help
            yield prefix + f.name, hints[f.name], value, text


def allowed(key: str, rules: Any) -> str:
    parts = [", ".join(f"`{yaml_text(v)}`" for v in rules.choices[key])] if key in rules.choices else []
    parts += [text for keys, text in ((rules.positive, "> 0"), (rules.non_negative, "≥ 0"),
                                      (rules.seeds, "a seed (−2⁶³ to 2⁶⁴ − 1)")) if key in keys]
    return "; ".join(parts)


def yaml_text(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10 ** 6, allow_unicode=True).split("\n...")[0].strip()


def table(obj: Any, rules: Any, prefix: str = "") -> str:
    """The markdown table of the leaves of dataclass instance ``obj`` (their keys after ``prefix``)."""
    from ddcl_vq.common.config import type_name
    from ddcl_vq.studies.tables import markdown_table

    head = ["key", "type", "default", "allowed", "what it sets"]
    rows = []
    for key, annotation, default, comment in fields_of(obj, prefix):
        comment = "" if re.fullmatch(r"\w+( \| \w+)+", comment) else comment  # the allowed values again
        row = [f"`{key}`", type_name(annotation), f"`{yaml_text(default)}`", allowed(key, rules), comment]
        rows.append(dict(zip(head, map(cell, row))))
    return markdown_table(rows, [(h, h, "") for h in head])


def section_table(section: str, notes: Dict[str, str], column: str) -> str:
    """The keys of the model or quantizer section: every arch's or type's (as resolved: the defaults filled), which
    take each (``column``), a default that differs between them per arch or type."""
    from ddcl_vq.common.config import type_name
    from ddcl_vq.models.vqvae import QUANTIZER_TYPES, architecture
    from ddcl_vq.studies.tables import markdown_table
    from ddcl_vq.tokenizer import config

    by, classes, resolve = (("arch", {a: architecture(a)[0] for a in config.ARCHS}, config.resolve_model)
                            if section == "model" else ("type", QUANTIZER_TYPES, config.resolve_quantizer))
    rows: Dict[str, Dict[str, Any]] = {}
    for label, cls in classes.items():
        hints, peer = typing.get_type_hints(cls.__init__), config.constructor_keys(cls)[1] != []
        for key, value in {**resolve({by: label}), **({"…": ""} if peer else {})}.items():
            row = rows.setdefault(key, {"type": type_name(hints.get(key, type(value))) if value != "" else "",
                                        "defaults": {}, "text": notes.get(key) or described(cls, key)})
            row["defaults"][label] = value
    head = ["key", "type", "default", column, "what it sets"]  # the allowed values: the classes' own checks
    out = []
    for key, row in rows.items():
        values, first = row["defaults"], list(row["defaults"].values())[0]
        default = (f"`{yaml_text(first)}`" if all(v == first for v in values.values()) or key in ("type", "arch")
                   else ", ".join(f"{label} `{yaml_text(v)}`" for label, v in values.items()))
        users = "all" if len(values) == len(classes) else ", ".join(values)
        out.append(dict(zip(head, map(cell, [f"`{section}.{key}`", row["type"], "" if key == "…" else default, users,
                                            row["text"]]))))
    return markdown_table(out, [(h, h, "") for h in head])


def config_blocks() -> Dict[str, str]:
    """``train.SECTION``, ``prior.SECTION``, ``study``, ``arms``, ``parts``, ``prior_study`` -> its table."""
    from ddcl_vq.prior import train as prior
    from ddcl_vq.studies import prior_study, study
    from ddcl_vq.tokenizer import config

    cfg, pcfg, rules = config.Config(), prior.PriorConfig(), study.STUDY_RULES
    blocks = {f"train.{name}": table(getattr(cfg, name), config.RULES, f"{name}.") for name in cfg.to_dict()
              if name not in ("model", "quantizer")}
    blocks.update({f"train.{s}": section_table(s, notes, column) for s, notes, column in (
        ("model", MODEL_NOTES, "model.arch"), ("quantizer", QUANTIZER_NOTES, "quantizer types"))})
    blocks.update({f"prior.{name}": table(getattr(pcfg, name), prior.RULES, f"{name}.") for name in pcfg.to_dict()})
    return {**blocks, "study": table(study.StudyFile(), rules), "arms": table(study.ArmSpec(), rules),
            "parts": table(study.Part(), rules), "prior_study": table(prior_study.PriorStudyFile(), prior_study.RULES)}


def commands() -> Iterator[Tuple[str, str, Any]]:
    """(command as typed, one-line help, its Options) for every command and subcommand of ``ddcl-vq``."""
    from ddcl_vq.cli import COMMANDS, ROUTES

    for name, (module_name, text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        if not hasattr(module, "SUBCOMMANDS"):
            yield f"ddcl-vq {name}", text, module.OPTIONS
            continue
        subs = {sub: getattr(module, sub.upper()) for sub in module.SUBCOMMANDS}
        subs.update({sub: importlib.import_module(routed).OPTIONS for (cmd, sub), routed in ROUTES.items()
                     if cmd == name})
        for sub, options in subs.items():
            yield f"ddcl-vq {name} {sub}", first_sentence(options.description.split("\n\n")[0]), options


def cli_blocks() -> Dict[str, str]:
    """``commands`` -> a table of the commands, then each one's ``--help``."""
    entries = list(commands())
    out = ["| command | what it does |", "|---|---|"]
    out += [f"| [`{command}`](#{command.replace(' ', '-')}) | {cell(text)} |" for command, text, _ in entries]
    for command, text, options in entries:
        parser = options.parser()  # --help at a fixed width, not the terminal's
        parser.formatter_class = functools.partial(parser.formatter_class, width=110)
        out += ["", f"## {command}", "", text, "", "```", parser.format_help().strip(), "```"]
    return {"commands": "\n".join(out)}


def argument_table(cls: type) -> str:
    """A markdown table of ``cls``'s constructor: every argument (``**options`` too), its default, and the first
    sentence of its entry in the ``Args:`` section of the class docstring."""
    rows = ["| argument | default | what it does |", "|---|---|---|"]
    for name, p in inspect.signature(cls).parameters.items():
        if p.kind is p.VAR_KEYWORD:
            shown, key, default = f"**{name}", re.escape(f"**{name}"), "—"
        else:
            shown, key, default = name, name, "—" if p.default is p.empty else f"`{p.default!r}`"
        rows.append(f"| `{shown}` | {default} | {cell(described(cls, key))} |")
    return "\n".join(rows)


def definition_blocks() -> Dict[str, str]:
    """quantizer.md: the definitions the reports print (``ddcl_vq.USAGE_DEFINITIONS``; reconstruction and geometry;
    per level), and the argument tables of the multi-codebook quantizers (from their docstrings)."""
    from ddcl_vq import USAGE_DEFINITIONS, GroupedDDCL, ResidualDDCL
    from ddcl_vq.tokenizer.metrics import GEOMETRY_DEFINITIONS, PER_LEVEL_DEFINITIONS, RECON_DEFINITIONS
    return {"usage_definitions": f"```\n{USAGE_DEFINITIONS}\n```",
            "report_definitions": f"```\n{RECON_DEFINITIONS}\n{GEOMETRY_DEFINITIONS}\n```",
            "per_level_definitions": f"```\n{PER_LEVEL_DEFINITIONS}\n```",
            "residual_arguments": argument_table(ResidualDDCL), "grouped_arguments": argument_table(GroupedDDCL)}


def expected(page: Path, make: Callable[[], Dict[str, str]]) -> str:
    """What ``page`` must hold: its text with every block ``make`` writes in place (ValueError for one it lacks)."""
    blocks = make()
    text = fill(page.read_text(encoding="utf-8"), blocks, "reference", str(page.relative_to(ROOT)))
    missing = [name for name in blocks if f"<!-- reference:{name} -->" not in text]
    if missing:
        raise ValueError(f"{page.name} has no <!-- reference:NAME --> block for {', '.join(missing)}")
    return text


PAGES = {ROOT / "docs" / "reference" / name: functools.partial(expected, ROOT / "docs" / "reference" / name, make)
         for name, make in (("config.md", config_blocks), ("cli.md", cli_blocks), ("quantizer.md", definition_blocks))}


def main(argv: Optional[Sequence[str]] = None) -> int:
    return update(PAGES, argv, __doc__, "docs_reference.py")


if __name__ == "__main__":
    sys.exit(main())
