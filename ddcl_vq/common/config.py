"""Settings: one way to read, declare and validate what every command is told.

YAML is read bounded (:data:`MAX_BYTES`, :data:`MAX_DEPTH`, :data:`MAX_VALUES`, no recursive alias, no key twice).
Typed settings are dataclass fields filled from YAML mappings and ``dotted.key=value`` overrides or from command-line
options (:class:`Options`): an unknown key names the nearest valid one, a wrong value what was expected and what came.
Every error is a :class:`ConfigError`.
"""
from __future__ import annotations

import argparse
import collections.abc
import dataclasses
import difflib
import math
import re
import typing
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import AbstractSet, Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import yaml

from ddcl_vq.common.errors import DEBUG_FLAG, UserError

class ConfigError(UserError, ValueError):
    """A setting's key or value is invalid; the message names the setting."""


def config_key(key: str) -> str:
    """How errors name a key of a config file: ``config key 'train.lr'``."""
    return f"config key {key!r}"


#: the seeds torch.manual_seed accepts (a negative seed is the same seed as seed + 2**64)
SEED_RANGE = (-2 ** 63, 2 ** 64 - 1)


@dataclass(frozen=True)
class Rules:
    """Constraints beyond the type, keyed by dotted setting name (list values: every element)."""

    choices: Mapping[str, Sequence[Any]] = field(default_factory=dict)
    positive: AbstractSet[str] = frozenset()       # > 0
    non_negative: AbstractSet[str] = frozenset()   # >= 0
    seeds: AbstractSet[str] = frozenset()          # within SEED_RANGE (what torch.manual_seed takes)


# ----------------------------------------------------------------------------- keys
def leaves(obj: Any, prefix: str = "") -> Iterator[Tuple[str, Any]]:
    """(dotted name, value) for every leaf of a dataclass instance (nested dataclasses and ``section`` dicts walked)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from leaves(value, f"{prefix}{f.name}.")
        elif f.metadata.get("section") and isinstance(value, dict):
            yield from ((f"{prefix}{f.name}.{key}", v) for key, v in value.items())
        else:
            yield prefix + f.name, value


def keys_of(obj: Any, prefix: str = "") -> List[str]:
    """The dotted names of every leaf setting of a dataclass instance."""
    return [key for key, _ in leaves(obj, prefix)]


def did_you_mean(key: str, candidates: Sequence[str]) -> str:
    """What an unknown-key error suggests: the close key (``did you mean 'model.channels'?``: by its last part, in
    its section first), else the valid keys of ``key``'s section, else the sections — never a far-off key."""
    section = key.rsplit(".", 1)[0] if "." in key else ""
    close = difflib.get_close_matches(key.split(".")[-1], sorted({k.split(".")[-1] for k in candidates}), n=1,
                                      cutoff=0.6)
    if close:
        same = [k for k in candidates if k.split(".")[-1] == close[0]]
        return f"did you mean {([k for k in same if section and k.startswith(section + '.')] or same)[0]!r}?"
    whole = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.8)
    if whole:
        return f"did you mean {whole[0]!r}?"
    depth = key.count(".")
    same = [k.split(".")[-1] for k in candidates if section and k.startswith(section + ".") and k.count(".") == depth]
    if same:
        return f"no key is close; the keys of {section!r} are {', '.join(same)}"
    tops = sorted({k.split(".")[0] for k in candidates})
    return f"no key is close; the sections are {', '.join(tops)}" if tops else "no key is close"


# ----------------------------------------------------------------------------- values
#: a float in YAML 1.2 and Python that PyYAML (YAML 1.1) reads as a string: 1e-3, 1e+9, 2E5, 1.0e3
_FLOAT_TEXT = re.compile(r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+")

#: the largest integer a float holds exactly: 1e3 is read as 1000 for an int setting, 1e300 is not
_EXACT_INT = 2 ** 53


def _optional(annotation: Any) -> Tuple[Any, bool]:
    """(the type inside Optional[...], whether None is allowed)."""
    if typing.get_origin(annotation) is typing.Union and type(None) in typing.get_args(annotation):
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        return (inner[0] if len(inner) == 1 else typing.Union[tuple(inner)]), True
    return annotation, False


def type_name(annotation: Any) -> str:
    annotation, _ = _optional(annotation)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (list, List, collections.abc.Sequence):
        return f"a list of {type_name(args[0])}" if args and args[0] is not Any else "a list"
    if origin in (dict, Dict) or annotation is dict or dataclasses.is_dataclass(annotation):
        return "a mapping"
    return getattr(annotation, "__name__", str(annotation))


def coerce(key: str, value: Any, annotation: Any, name: Callable[[str], str] = config_key) -> Any:
    """``value`` checked against ``annotation`` (bool, int, float, str, Any, Optional, List[...],
    Dict[str, ...], a dataclass); ints are accepted for floats. Returns the typed value."""
    annotation, nullable = _optional(annotation)
    if value is None and nullable:
        return None
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return value
    if annotation in (bool, str):
        if isinstance(value, annotation):
            return value
    elif annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        number = float(value) if isinstance(value, str) and _FLOAT_TEXT.fullmatch(value.strip()) else value
        if isinstance(number, float):  # 1e3 or 1000.0: the learning-rate notation, for a count
            if number.is_integer() and abs(number) <= _EXACT_INT:
                return int(number)
            raise ConfigError(f"{name(key)}: expected an integer, got {value!r} (not a whole number"
                              f"{', or too large to be exact' if abs(number) > _EXACT_INT else ''})")
    elif annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _FLOAT_TEXT.fullmatch(value.strip()):
            return float(value)  # 1e-3: YAML 1.1 makes it a string, people write learning rates so
    elif origin in (list, List, collections.abc.Sequence) or annotation is list:
        if isinstance(value, list):
            inner = args[0] if args else Any
            return [coerce(f"{key}[{i}]", v, inner, name) for i, v in enumerate(value)]
    elif origin in (dict, Dict) or annotation is dict:
        if isinstance(value, dict):
            inner = args[1] if len(args) == 2 else Any
            return {k: coerce(f"{key}.{k}", v, inner, name) for k, v in value.items()}
    elif dataclasses.is_dataclass(annotation):
        if isinstance(value, dict):
            obj = annotation()
            apply(obj, value, prefix=key + ".", name=name)
            return obj
    else:  # pragma: no cover - schemas use only the types above
        return value
    raise ConfigError(f"{name(key)}: expected {type_name(annotation)}, got {value!r} ({type(value).__name__})")


def apply(obj: Any, raw: Any, *, prefix: str = "", name: Callable[[str], str] = config_key,
          candidates: Optional[Sequence[str]] = None) -> None:
    """Set the fields of dataclass ``obj`` from the mapping ``raw`` (nested mappings into nested
    dataclasses). ``candidates``: the valid keys an unknown one is compared with (default: ``obj``'s)."""
    if not isinstance(raw, dict):
        where = name(prefix.rstrip(".")) if prefix else "the settings"
        raise ConfigError(f"{where}: expected a mapping, got {raw!r}")
    candidates = [prefix + k for k in keys_of(obj)] if candidates is None else candidates
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for field_name, value in raw.items():
        key = prefix + str(field_name)
        if field_name not in names:
            raise ConfigError(f"unknown {name(key)}; {did_you_mean(key, candidates)}")
        current = getattr(obj, field_name)
        if dataclasses.is_dataclass(current):
            apply(current, value, prefix=key + ".", name=name, candidates=candidates)
        else:
            setattr(obj, field_name, coerce(key, value, hints[field_name], name))


def check(obj: Any, rules: Rules, name: Callable[[str], str] = config_key) -> None:
    """Check every leaf of ``obj`` against ``rules`` (None passes: it means "not set")."""
    for key, value in leaves(obj):
        items = [v for v in (value if isinstance(value, list) else [value]) if v is not None]
        if key in rules.choices:
            bad = [v for v in items if v not in rules.choices[key]]
            if bad:
                got = value if not isinstance(value, list) else bad
                raise ConfigError(f"{name(key)}: expected one of {list(rules.choices[key])}, got {got!r}")
        if key in rules.positive and not all(v > 0 for v in items):
            raise ConfigError(f"{name(key)}: expected a value > 0, got {value!r}")
        if key in rules.non_negative and not all(v >= 0 for v in items):
            raise ConfigError(f"{name(key)}: expected a value >= 0, got {value!r}")
        if key in rules.seeds and not all(SEED_RANGE[0] <= v <= SEED_RANGE[1] for v in items):
            raise ConfigError(f"{name(key)}: expected a seed torch accepts, an integer from -2**63 to 2**64 - 1, "
                              f"got {value!r}")


def check_finite(obj: Any, name: Callable[[str], str] = config_key) -> None:
    """ConfigError for a float leaf (or list element) of ``obj`` that is inf or nan (never a setting)."""
    for key, value in leaves(obj):
        bad = [v for v in (value if isinstance(value, list) else [value])
               if isinstance(v, float) and not math.isfinite(v)]
        if bad:
            raise ConfigError(f"{name(key)}: expected a finite number, got {bad[0]!r}")


def build(cls: type, raw: Mapping[str, Any], rules: Rules = Rules(), name: Callable[[str], str] = config_key):
    """``cls()`` with ``raw`` applied and ``rules`` checked."""
    obj = cls()
    apply(obj, dict(raw), name=name)
    check(obj, rules, name)
    return obj


# ----------------------------------------------------------------------------- command-line options
def option(default: Any = MISSING, help: str = "", *, default_factory: Any = MISSING, flag: Optional[str] = None,
           metavar: Optional[str] = None, nargs: Any = None, sep: Optional[str] = None, positional: bool = False,
           hidden: bool = False, default_text: Optional[str] = None) -> Any:
    """A field of a command's options dataclass (a bool is a switch, a field without a default a required option).
    ``flag``: default ``--`` + the name with ``-`` for ``_``; ``sep``: a list given as one value split at ``sep``;
    ``default_text``: how --help states the default; ``hidden``: left out of --help."""
    meta = dict(help=help, flag=flag, metavar=metavar, nargs=nargs, sep=sep, positional=positional, hidden=hidden,
                default_text=default_text)
    return field(default=default, default_factory=default_factory, metadata={"option": meta})


def _fmt(value: Any, sep: str) -> str:
    return sep.join(str(v) for v in value) if isinstance(value, (list, tuple)) else str(value)


class Options:
    """A command's options: ``cls`` is a dataclass of :func:`option` fields; ``presets``: ``{switch: {field: value}}``,
    what a switch (``--quick``) sets unless given explicitly. ``parse(argv)`` -> a validated ``cls`` instance."""

    def __init__(self, cls: type, *, prog: str, description: str = "", epilog: Optional[str] = None,
                 rules: Rules = Rules(), presets: Optional[Mapping[str, Mapping[str, Any]]] = None,
                 intermixed: bool = False):
        self.cls, self.prog, self.description, self.epilog = cls, prog, description, epilog
        self.rules, self.presets, self.intermixed = rules, dict(presets or {}), intermixed
        self.hints = typing.get_type_hints(cls)
        self.fields = {f.name: f for f in dataclasses.fields(cls)}

    def meta(self, name: str) -> Dict[str, Any]:
        return self.fields[name.split("[")[0]].metadata.get("option", {})

    def flag(self, name: str) -> str:
        meta, name = self.meta(name), name.split("[")[0]
        if meta.get("positional"):
            return meta.get("metavar") or name
        return meta.get("flag") or "--" + name.replace("_", "-")

    def label(self, name: str) -> str:
        """How errors name an option: ``option --max-seconds`` / ``argument RUN_DIR``."""
        return f"{'argument' if self.meta(name).get('positional') else 'option'} {self.flag(name)}"

    def _default(self, f: dataclasses.Field) -> Any:
        return f.default_factory() if f.default is MISSING and f.default_factory is not MISSING else f.default

    def _help(self, name: str) -> str:
        meta, default = self.meta(name), self._default(self.fields[name])
        if meta.get("hidden"):
            return argparse.SUPPRESS
        text, sep, parts = meta.get("help", ""), meta.get("sep") or ",", []
        if meta.get("default_text"):
            parts.append(f"default: {meta['default_text']}")
        elif not (default is MISSING or default is None or default is False or meta.get("positional")):
            parts.append(f"default: {_fmt(default, sep)}")
        parts += [f"--{switch}: {_fmt(preset[name], sep)}" for switch, preset in self.presets.items() if name in preset]
        if parts:
            text = f"{text} ({'; '.join(parts)})" if text else "; ".join(parts)
        return text.replace("%", "%%")

    def parser(self) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(prog=self.prog, description=self.description, epilog=self.epilog,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        for name, f in self.fields.items():
            meta, default = self.meta(name), self._default(f)
            annotation, _ = _optional(self.hints[name])
            kwargs: Dict[str, Any] = {"help": self._help(name)}
            if meta.get("metavar"):
                kwargs["metavar"] = meta["metavar"]
            elif name in self.rules.choices:
                kwargs["metavar"] = "{" + ",".join(map(str, self.rules.choices[name])) + "}"
            if meta.get("nargs") is not None:
                kwargs["nargs"] = meta["nargs"]
            if meta.get("positional"):
                p.add_argument(name, **kwargs, **({} if default is MISSING else {"default": default}))
            elif annotation is bool:
                kwargs.pop("metavar", None)
                p.add_argument(self.flag(name), dest=name, action="store_true", default=argparse.SUPPRESS, **kwargs)
            else:
                p.add_argument(self.flag(name), dest=name, required=default is MISSING, default=argparse.SUPPRESS,
                               **kwargs)
        # read (and removed from argv) by errors.entry_point; listed here so that --help shows it
        p.add_argument(DEBUG_FLAG, dest="_debug", action="store_true", default=argparse.SUPPRESS,
                       help="on an error, show the full traceback instead of one line")
        return p

    def _from_text(self, name: str, raw: Any) -> Any:
        annotation, _ = _optional(self.hints[name])
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
        if origin in (list, List):
            sep = self.meta(name).get("sep")
            items = [s.strip() for s in raw.split(sep) if s.strip()] if sep and isinstance(raw, str) else list(raw)
            if sep and isinstance(raw, str) and not items:  # --arms ',' is no selection, not "every arm"
                raise ConfigError(f"{self.label(name)}: expected at least one value, got {raw!r}")
            return [self._scalar(name, s, args[0] if args else str) for s in items]
        return self._scalar(name, raw, annotation)

    def _scalar(self, name: str, raw: Any, annotation: Any) -> Any:
        if annotation in (bool, str, Any) or not isinstance(raw, str):
            return raw
        if annotation is int and _FLOAT_TEXT.fullmatch(raw.strip()):
            return raw  # 1e3: coerce() reads it as 1000, or says why not
        try:
            return annotation(raw)
        except ValueError:
            raise ConfigError(f"{self.label(name)}: expected {type_name(annotation)}, got {raw!r}") from None

    def parse(self, argv: Optional[Sequence[str]]) -> Any:
        parser = self.parser()
        ns = parser.parse_intermixed_args(argv) if self.intermixed else parser.parse_args(argv)
        given = {k: v for k, v in vars(ns).items() if k != "_debug"}
        values: Dict[str, Any] = {}
        for switch, preset in self.presets.items():
            if given.get(switch):
                values.update(preset)
        values.update({name: self._from_text(name, raw) for name, raw in given.items()})
        return self.make(**values)

    def make(self, **values: Any) -> Any:
        """A validated ``cls`` instance from typed values (what ``parse`` does after reading argv)."""
        obj = self.cls(**{k: coerce(k, v, self.hints[k], self.label) for k, v in values.items()})
        check_finite(obj, self.label)  # "no limit" options use 0 or None
        check(obj, self.rules, self.label)
        return obj


# ----------------------------------------------------------------------------- YAML
MAX_BYTES = 1 << 20        # 1 MiB: a config is a few hundred bytes
MAX_DEPTH = 64             # mappings and lists nested in each other
MAX_VALUES = 100_000       # scalars, mappings and lists, aliases expanded


def _expanded_size(root: yaml.Node, what: str) -> int:
    """How many values the document holds with every alias expanded; ConfigError for a recursive alias, more than
    MAX_VALUES values, or a mapping with the same key twice."""
    sizes: Dict[int, int] = {}
    open_nodes = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise ConfigError(f"{what} has a recursive alias (line {node.start_mark.line + 1}: a mapping or list "
                              "that contains itself)")
        open_nodes.add(key)
        lines: Dict[tuple, int] = {}  # a mapping's keys: the line each is on
        for name, _ in node.value if isinstance(node, yaml.MappingNode) else []:
            if isinstance(name, yaml.ScalarNode) and name.tag != "tag:yaml.org,2002:merge":
                if (name.tag, name.value) in lines:
                    raise ConfigError(f"{what} has the key {name.value!r} twice in one mapping (lines "
                                      f"{lines[name.tag, name.value]} and {name.start_mark.line + 1}); YAML would "
                                      "keep the last one without a word: remove one")
                lines[name.tag, name.value] = name.start_mark.line + 1
        total = 1
        children = (node.value if isinstance(node, yaml.SequenceNode) else
                    [item for pair in node.value for item in pair] if isinstance(node, yaml.MappingNode) else [])
        for child in children:
            total += size(child)
            if total > MAX_VALUES:
                raise ConfigError(f"{what} expands to more than {MAX_VALUES:,} values once its aliases (*name) are "
                                  "expanded (an alias bomb?); write the values out")
        open_nodes.discard(key)
        sizes[key] = total
        return total

    return size(root)


def load_yaml_text(text: str, what: str) -> Any:
    """The YAML document in ``text`` (None when empty), read within the limits above; yaml.YAMLError
    for text that is not YAML, ConfigError (naming ``what``) when a limit is exceeded."""
    if len(text) > MAX_BYTES:
        raise ConfigError(f"{what} is {len(text):,} characters long, more than the {MAX_BYTES:,} a config may have")
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise ConfigError(f"{what} nests mappings and lists more than {MAX_DEPTH} levels deep (line "
                                  f"{event.start_mark.line + 1}); a config needs a few")
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_size(node, what)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def read_yaml_mapping(path: Path, what: str) -> Dict[str, Any]:
    """The YAML mapping in ``path`` ({} when empty), a config or a study file; any reason it cannot be read, or a
    top level that is not a mapping, is a ConfigError."""
    path = Path(path)
    where = f"{what} {str(path)!r}"
    if not path.exists():
        raise ConfigError(f"{where} does not exist")
    if path.is_dir():
        raise ConfigError(f"{where} is a directory, expected a YAML file")
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise ConfigError(f"{where} is {size:,} bytes, more than the {MAX_BYTES:,} a config may have")
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)  # a file that grew since stat, or a FIFO: still bounded
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = err.object[:err.start].count(b"\n") + 1
        raise ConfigError(f"{where} is not UTF-8 text (byte {err.object[err.start]:#04x} on line {line}); save it "
                          "as UTF-8") from None
    except OSError as err:
        raise ConfigError(f"{where} cannot be read: {err.strerror or err}") from None
    try:
        raw = load_yaml_text(text, where) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{where} is not valid YAML: {str(err).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping at the top, got {type(raw).__name__}")
    return raw


# ----------------------------------------------------------------------------- config files and overrides
def parse_override(text: str) -> tuple[str, Any]:
    """``dotted.key=value`` -> (key, the value read as YAML; the text itself when it is not YAML)."""
    if "=" not in text:
        raise ConfigError(f"expected an override of the form dotted.key=value, got {text!r}")
    key, raw = text.split("=", 1)
    try:
        value = load_yaml_text(raw, f"override {key.strip()!r}") if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def apply_overrides(raw: Dict[str, Any], overrides: Sequence[str], keys: Sequence[str],
                    unknown: Optional[Callable[[str], ConfigError]] = None,
                    open_sections: Sequence[str] = ()) -> Dict[str, Any]:
    """A copy of ``raw`` with every ``dotted.key=value`` override set. ``keys``: the valid keys; ``unknown``: the
    error for another one (default: naming the nearest valid key); ``open_sections``: sections whose sub-keys
    pass as they are (``quantizer``: checked when the config is resolved)."""
    if raw is not None and not isinstance(raw, dict):
        raise ConfigError(f"the settings: expected a mapping at the top, got {type(raw).__name__}")
    raw = yaml.safe_load(yaml.safe_dump(raw or {}))  # deep copy
    valid = set(keys)
    for text in overrides:
        key, value = parse_override(text)
        parts = key.split(".")
        if key not in valid and ".".join(parts[:-1]) not in open_sections:
            hint = did_you_mean(key, sorted(valid))
            raise unknown(key) if unknown else ConfigError(f"unknown {config_key(key)}; {hint}")
        node = raw
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"config key {key!r}: {part!r} is not a section")
        node[parts[-1]] = value
    return raw


def differences(old: Any, new: Any) -> List[Tuple[str, Any, Any]]:
    """(dotted key, old value, new value) for every setting that differs between two resolved configs."""
    a, b = dict(leaves(old)), dict(leaves(new))
    return [(key, a.get(key), b.get(key)) for key in dict.fromkeys([*a, *b]) if a.get(key) != b.get(key)]


def dump_config(cfg: Any) -> str:
    """A resolved config (a dataclass) as YAML, in its fields' order."""
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
