"""Bounded YAML: config files and override values are read with limits, so that a hostile or broken file fails at once
with one line instead of taking minutes and gigabytes.

- size: at most :data:`MAX_BYTES` of text;
- nesting: at most :data:`MAX_DEPTH` levels of mappings and lists (checked on the parser's event stream, before anything
  is built, so deep nesting cannot exhaust the recursion limit);
- aliases: the document, with every alias (``*name``) expanded, holds at most :data:`MAX_VALUES` values (an "alias bomb"
  of a few hundred bytes expands to billions), and no alias may refer to a mapping or list that contains it (a recursive
  document);
- duplicate keys: a key twice in one mapping is refused, naming the key and both lines (YAML readers keep the last one
  without a word).

Errors never print the document's values. Safe loading only (``yaml.SafeLoader``: no ``!!python`` tags).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import yaml

from ddcl_vq.common.settings import ConfigError

MAX_BYTES = 1 << 20        # 1 MiB: a config is a few hundred bytes
MAX_DEPTH = 64             # mappings and lists nested in each other
MAX_VALUES = 100_000       # scalars, mappings and lists, aliases expanded


def _check_events(text: str, what: str) -> None:
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise ConfigError(f"{what} nests mappings and lists more than {MAX_DEPTH} levels deep (line "
                                  f"{event.start_mark.line + 1}); a config needs a few")
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


def _expanded_size(root: yaml.Node, what: str) -> int:
    """How many values the document holds with every alias expanded (shared nodes counted each
    time they are used); ConfigError for a recursive alias or more than MAX_VALUES values."""
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


def _check_duplicate_keys(root: yaml.Node, what: str) -> None:
    """ConfigError for a mapping that has the same (scalar) key twice."""
    seen_nodes = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            keys: Dict[tuple, int] = {}
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                    ident = (key.tag, key.value)
                    if ident in keys:
                        raise ConfigError(f"{what} has the key {key.value!r} twice in one mapping (lines "
                                          f"{keys[ident]} and {key.start_mark.line + 1}); YAML would keep the "
                                          "last one without a word: remove one")
                    keys[ident] = key.start_mark.line + 1
                stack += [key, value]
        elif isinstance(node, yaml.SequenceNode):
            stack += node.value


def load_yaml_text(text: str, what: str) -> Any:
    """The YAML document in ``text`` (None when empty), read within the limits above; yaml.YAMLError
    for text that is not YAML, ConfigError (naming ``what``) when a limit is exceeded."""
    if len(text) > MAX_BYTES:
        raise ConfigError(f"{what} is {len(text):,} characters long, more than the {MAX_BYTES:,} a config may have")
    _check_events(text, what)
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_size(node, what)
        _check_duplicate_keys(node, what)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def read_yaml(path: Path, what: str) -> Any:
    """The YAML document in ``path`` ({} when empty); any reason it cannot be read is a ConfigError."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{what} {str(path)!r} does not exist")
    if path.is_dir():
        raise ConfigError(f"{what} {str(path)!r} is a directory, expected a YAML file")
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise ConfigError(f"{what} {str(path)!r} is {size:,} bytes, more than the {MAX_BYTES:,} a config may have")
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)  # a file that grew since stat, or a FIFO: still bounded
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = err.object[:err.start].count(b"\n") + 1
        raise ConfigError(f"{what} {str(path)!r} is not UTF-8 text (byte {err.object[err.start]:#04x} on line "
                          f"{line}); save it as UTF-8") from None
    except OSError as err:
        raise ConfigError(f"{what} {str(path)!r} cannot be read: {err.strerror or err}") from None
    try:
        return load_yaml_text(text, f"{what} {str(path)!r}") or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{what} {str(path)!r} is not valid YAML: {str(err).splitlines()[0]}") from None


def read_yaml_mapping(path: Path, what: str) -> Dict[str, Any]:
    """:func:`read_yaml` for a file whose top level must be a mapping (a config or a study file)."""
    raw = read_yaml(path, what)
    if not isinstance(raw, dict):
        raise ConfigError(f"{what} {str(path)!r}: expected a mapping at the top, got {type(raw).__name__}")
    return raw
