"""A pydantic validation error as fedplug prints it: one line per problem, each naming the
dotted path in the user's file, an unknown key with the closest known key ("did you mean")."""

from __future__ import annotations

import difflib
import typing
from typing import Any

from pydantic import BaseModel, ValidationError


def format_validation_error(error: ValidationError, data: Any, prefix: str = "", model: Any = None) -> str:
    """One line per problem, each naming the exact dotted path in the user's file. With the
    pydantic ``model`` that was validated (default None), an unknown key also gets the
    closest known key: ``train.round: unknown key; did you mean train.rounds?``."""
    lines = []
    for item in error.errors():
        path = _user_path(item["loc"], data)
        if prefix:
            path = [prefix, *path] if path else [prefix]
        where = ".".join(str(part) for part in path) or "(top level)"
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown key (check the spelling; see `fedplug list` for parameters)"
            known = keys_at(model, item["loc"]) if model is not None else []
            close = difflib.get_close_matches(str(item["loc"][-1]), known, n=1, cutoff=0.6)
            if close and path:
                suggestion = ".".join(str(part) for part in [*path[:-1], close[0]])
                message = f"unknown key; did you mean {suggestion}? (see `fedplug list` for the keys)"
        lines.append(f"{where}: {message}")
    return "\n".join(dict.fromkeys(lines))


def keys_at(model: Any, loc: tuple[Any, ...]) -> list[str]:
    """The keys ``model`` accepts in the mapping that holds the key at pydantic's ``loc``
    (union tags included, as in ``("train", "aggregator", "fedavgm", "momentun")``);
    empty where the mapping is free-form (``algorithms``, ``faults.stragglers.factors``)."""
    node = model
    parts = list(loc[:-1])
    index = 0
    while index < len(parts):
        fields = getattr(node, "model_fields", None)
        if not isinstance(fields, dict) or parts[index] not in fields:
            return []
        candidates = _model_classes(fields[parts[index]].annotation)
        index += 1
        if len(candidates) > 1 and index < len(parts):
            tagged = [candidate for candidate in candidates if _tag_of(candidate) == parts[index]]
            if not tagged:
                return []
            candidates = tagged
            index += 1
        if len(candidates) != 1:
            return []
        node = candidates[0]
    fields = getattr(node, "model_fields", None)
    return [str(name) for name in fields] if isinstance(fields, dict) else []


def _model_classes(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models inside an annotation (``X``, ``X | None``, an annotated union)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for argument in typing.get_args(annotation):
        found += _model_classes(argument)
    return found


def _tag_of(model: type[BaseModel]) -> Any:
    """The ``name`` literal of a component config class (its union tag), else None."""
    field = model.model_fields.get("name")
    values = typing.get_args(field.annotation) if field is not None else ()
    return values[0] if len(values) == 1 else None


def _user_path(loc: tuple[Any, ...], data: Any) -> list[Any]:
    """Drop the union tags pydantic inserts (``aggregator.fedavgm.momentum``)."""
    path: list[Any] = []
    node = data
    parts = list(loc)
    index = 0
    while index < len(parts):
        part = parts[index]
        if isinstance(node, dict) and part not in node and node.get("name") == part:
            index += 1
            continue
        if isinstance(node, str) and part == node:  # shorthand `aggregator: fedavg`
            index += 1
            continue
        path.append(part)
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            node = None
        index += 1
    return path
