"""fedplug on Flower's public API only: every ``flwr`` import in adapters/ is from a
public module and names something that module exports; the private pieces the
in-process grid needs live in ``fedplug/flower_internals.py`` and are checked here,
so a Flower upgrade that moves one fails this file with the symbol's name."""

from __future__ import annotations

import ast
import importlib
import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from fedplug.flower_internals import (
    INTERNALS,
    Internal,
    flower_version,
    missing_internals,
)

REPOSITORY = Path(__file__).resolve().parents[1]
PUBLIC_MODULES = ("flwr.app", "flwr.serverapp", "flwr.clientapp", "flwr.simulation")
OLDEST_PUBLIC_API = (1, 22)
"""The first Flower whose public modules hold everything fedplug imports (the Message
API's strategies Krum, Bulyan, QFedAvg and the DP wrappers arrived in 1.22)."""


def is_flower(module: str) -> bool:
    """Flower itself (``flwr.*``), not flwr-datasets (``flwr_datasets``)."""
    return module == "flwr" or module.startswith("flwr.")


def flower_imports() -> list[tuple[str, str, str]]:
    """``(file, module, name)`` of every ``from flwr... import name`` / ``import flwr...``
    in adapters/ (internals.py imports by name through importlib, on purpose)."""
    found = []
    for path in sorted((REPOSITORY / "adapters").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and is_flower(node.module or ""):
                found += [(path.name, node.module or "", alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):
                found += [
                    (path.name, alias.name, "")
                    for alias in node.names
                    if is_flower(alias.name)
                ]
    return found


def test_every_flwr_import_is_from_a_public_module() -> None:
    private = [
        f"{file}: from {module} import {name}"
        for file, module, name in flower_imports()
        if not module.startswith(PUBLIC_MODULES)
    ]
    assert not private, "Flower internals outside fedplug/flower_internals.py:\n" + "\n".join(
        private
    )


def test_every_public_name_fedplug_imports_exists() -> None:
    missing = []
    for file, module, name in flower_imports():
        if not name:
            continue
        try:
            imported = importlib.import_module(module)
        except ImportError:
            missing.append(f"{file}: module {module}")
            continue
        if not hasattr(imported, name):
            missing.append(f"{file}: {module}.{name}")
    assert not missing, f"Flower {version('flwr')} lacks: " + ", ".join(missing)


def test_the_internals_the_loopback_grid_needs_are_where_internals_py_says() -> None:
    missing = missing_internals()
    assert not missing, (
        f"Flower {version('flwr')} moved {', '.join(missing)}: update INTERNALS in "
        "fedplug/flower_internals.py"
    )


def test_an_internal_moved_by_an_upgrade_is_named() -> None:
    # Prepare: a symbol that "moved" in the installed version.
    INTERNALS["Ghost"] = Internal("Ghost", ((flower_version(), "flwr.supercore.ghost"),))
    try:
        # Execute / Assert
        assert missing_internals() == ["flwr.supercore.ghost.Ghost"]
        from fedplug.flower_internals import internal

        with pytest.raises(ImportError, match=r"has no flwr\.supercore\.ghost\.Ghost"):
            internal("Ghost")
    finally:
        del INTERNALS["Ghost"]


def test_the_pin_admits_the_installed_flower_and_starts_at_the_public_api() -> None:
    project = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())
    (requirement,) = [
        entry
        for entry in project["project"]["optional-dependencies"]["flower"]
        if entry.startswith("flwr[")
    ]
    lower = re.search(r">=\s*(\d+)\.(\d+)", requirement)
    upper = re.search(r"<\s*(\d+)", requirement)
    assert lower is not None and upper is not None, requirement
    assert (int(lower[1]), int(lower[2])) == OLDEST_PUBLIC_API
    assert OLDEST_PUBLIC_API <= flower_version() < (int(upper[1]), 0)
    constraints = (REPOSITORY / "constraints.txt").read_text()
    assert f"flwr=={version('flwr')}" in constraints  # the tested version
