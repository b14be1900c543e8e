"""Reading a config file and ``--set`` overrides into a plain dict: YAML with its limits
(a key given twice, nesting too deep, not a mapping), dotted overrides, and the merge of
overrides into a section. Nothing here needs the plugin registry, so a missing file or a
malformed ``--set`` is reported without importing torch (``fedplug run`` checks these
first); :mod:`fedplug.config` validates the dict and re-exports every name here."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from fedplug.errors import ConfigError
from fedplug.safe_files import read_regular_bytes

# Config field -> registry kind, for every field that selects a component by name.
COMPONENT_FIELDS = {
    "dataset": "datasets",
    "partition": "partitioners",
    "model": "models",
    "sampler": "samplers",
    "loss_transform": "loss_transforms",
    "aggregator": "aggregators",
    "grouper": "groupers",
}


def component_entry(value: Any) -> Any:
    """A component entry in its long form: ``aggregator: fedavg`` is short for
    ``aggregator: {name: fedavg}``. Anything but a string is returned as it is."""
    return {"name": value} if isinstance(value, str) else value


# ------------------------------------------------------------------ merging


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``override`` on top of ``base``; a component whose ``name`` changes is replaced
    whole (its old parameters belong to another algorithm)."""
    merged = dict(base)
    for key, value in override.items():
        old = merged.get(key)
        if isinstance(value, dict) and isinstance(old, dict) and value.get("name", old.get("name")) == old.get("name"):
            merged[key] = deep_merge(old, value)
        else:
            merged[key] = value
    return merged


def apply_override(data: dict[str, Any], assignment: str) -> dict[str, Any]:
    """Apply one ``dotted.key=value`` (value parsed as YAML) to a nested dict."""
    key, separator, raw = assignment.partition("=")
    if not separator or not key.strip():
        example = key.strip() if key.strip() and " " not in key.strip() else "train.rounds"
        raise ConfigError(
            f"--set {_shown(assignment)}: expected dotted.key=value; write --set {example}=VALUE "
            f"(or --set {example} VALUE), e.g. --set train.rounds=5"
        )
    if key.count(".") >= MAX_NESTING:
        raise ConfigError(
            f"--set {_shown(assignment)}: the key has {key.count('.') + 1} parts, more than {MAX_NESTING}; "
            "fedplug's keys have fewer than 10"
        )
    try:
        where = too_deep(raw)
        if where is not None:
            raise ConfigError(
                f"--set {_shown(assignment)}: the value is nested more than {MAX_NESTING} levels deep "
                f"(at column {where[1]}); fedplug's values nest fewer than 10"
            )
        value = yaml.safe_load(raw)
    except yaml.YAMLError as error:
        raise ConfigError(f"--set {_shown(assignment)}: the value is not valid YAML ({error})") from None
    return set_dotted(data, key.strip(), value)


def _shown(text: str, limit: int = 80) -> str:
    """``repr(text)``, cut to about ``limit`` characters (a huge ``--set`` stays one line)."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


def set_dotted(data: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    """``data`` with the dotted ``key`` set to ``value``, merged by :func:`deep_merge`.

    A name given to a component field switches the component
    (``train.aggregator=fedavgm``); a value under it tunes the component
    (``train.aggregator.momentum=0.5``).
    """
    keys = key.split(".")
    node: Any = data
    for depth, part in enumerate(keys[:-1]):
        if not isinstance(node, dict) or part not in node:
            break
        node = node[part]
        if isinstance(node, list):  # a composite's parts: the path goes on by index
            inside = _set_in_list(node, keys[depth + 1 :], value, key)
            return _replaced(data, keys[: depth + 1], inside)
    override: dict[str, Any] = {}
    node = override
    for part in keys[:-1]:
        node = node.setdefault(part, {})
    node[keys[-1]] = component_entry(value) if keys[-1] in COMPONENT_FIELDS else value
    return deep_merge(data, override)


def _set_in_list(items: list[Any], keys: list[str], value: Any, key: str) -> list[Any]:
    """``items`` (a list in a config: a composite's ``parts``, or the loss slot's list form,
    whose ``parts`` they are) with ``keys`` (an index, then a path inside that item) set
    to ``value``: ``train.loss_transform.parts.1.mu`` reaches the second part's ``mu``."""
    if keys and keys[0] == "parts":  # the list form of a composite is its parts
        keys = keys[1:]
    if not keys or not keys[0].isdigit() or int(keys[0]) >= len(items):
        where = f"an index below {len(items)}" if items else "no index (the list is empty)"
        raise ConfigError(f"{key}: the path reaches a list of {len(items)} items here; it takes {where}")
    index, rest = int(keys[0]), keys[1:]
    changed = list(items)
    if not rest:
        changed[index] = value
    else:
        item = component_entry(items[index])
        if not isinstance(item, dict):
            raise ConfigError(f"{key}: item {index} of the list is {items[index]!r}, which has no keys")
        changed[index] = set_dotted(item, ".".join(rest), value)
    return changed


def _replaced(data: dict[str, Any], keys: list[str], value: Any) -> dict[str, Any]:
    """A copy of ``data`` with the value at the path ``keys`` (which exists) replaced."""
    if len(keys) == 1:
        return {**data, keys[0]: value}
    return {**data, keys[0]: _replaced(data[keys[0]], keys[1:], value)}


# -------------------------------------------------------------------------- loading

MAX_NESTING = 50
"""The deepest nesting of mappings and lists a config file or ``--set`` value may have
(fedplug's own configs nest 6 levels). PyYAML builds a document recursively, so a few
hundred levels would end in a ``RecursionError``; :func:`too_deep` checks first."""


def too_deep(text: str) -> tuple[int, int] | None:
    """``(line, column)`` (1-based) where ``text``'s YAML nests more than
    :data:`MAX_NESTING` mappings or lists, or None. Reads PyYAML's event stream, which
    is not recursive, and stops at the first level too many.

    Raises:
        yaml.YAMLError: ``text`` is not valid YAML before that point.
    """
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_NESTING:
                return event.start_mark.line + 1, event.start_mark.column + 1
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
    return None



class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping, where PyYAML
    would silently keep the last value."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` may be overridden
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                first_line = seen.get(key)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if first_line is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first given at line {first_line + 1})", key_node.start_mark
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML mapping, with errors that say which file and line."""
    path = Path(path)
    try:
        # Not read_text(): a FIFO or device given as the config is refused, not waited on.
        text = read_regular_bytes(
            path, what="config file", advice="give a params file (a regular file)", error=ConfigError
        ).decode()
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"config file {str(path)!r} is not UTF-8 text (byte {error.start}: {error.reason}); save it as UTF-8"
        ) from None
    except OSError as error:
        raise ConfigError(f"cannot read config file {str(path)!r}: {error.strerror}") from None
    return parse_yaml(text, str(path))


def parse_yaml(text: str, source: str) -> dict[str, Any]:
    """The YAML mapping in ``text`` (``source`` names it in errors: a file, a run-config
    key), refused in one line when it is invalid, nested too deep, or not a mapping."""
    try:
        where = too_deep(text)
        if where is not None:
            raise ConfigError(
                f"{source}: nested more than {MAX_NESTING} levels deep at line {where[0]}, column {where[1]}; "
                "a fedplug config nests fewer than 10 levels"
            )
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error)
        raise ConfigError(f"{source}: not valid YAML{where}: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of sections (data:, train:, ...), got {type(data).__name__}")
    return data


def read_with_overrides(path: str | os.PathLike[str], overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The config file at ``path`` with each ``--set`` assignment applied, not yet
    validated (:func:`fedplug.config.load_experiment` validates it)."""
    data = read_yaml(path)
    for assignment in overrides:
        data = apply_override(data, assignment)
    return data
