"""The package's layers, checked on the source: a module imports only from its own layer
or the layers below it, and no runtime reaches into another runtime.

The layers, bottom to top (docs/round.md, "Where things live"):

1. **foundation**: errors, files and folders, the cost model, deadlines, memory limits.
2. **interfaces**: the component interfaces and configs, the registry and plugin loading, message schemas,
   screening, faults, the setup-phase contract, and the data and model libraries.
3. **run**: ``fedplug.run``, the run lifecycle every runtime shares (the round core, the
   run state, evaluation, local training, vectors).
4. **algorithms**: the built-in components, written against the interfaces and the run.
5. **runtimes**: the simulator, the Flower and FedML adapters, and tracking (which every
   runtime reports to). A runtime never imports another runtime.
6. **front ends**: the experiment runner, the command line, studies, reports, comparisons.

Imports under ``if TYPE_CHECKING:`` are annotations, not dependencies, and are not
counted. Imports inside functions are counted: they run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LAYERS: dict[str, int] = {
    **dict.fromkeys(
        ["errors", "config_errors", "memory", "deadline", "cost_model", "output_folder", "output_ownership", "project",
         "flower_internals", "safe_files", "threads"], 1
    ),
    **dict.fromkeys(
        ["", "components", "component_config", "aggregation", "analysis", "registry", "plugins", "hookspecs",
         "config", "config_files", "screening", "faults", "setup_phase", "data", "models", "run_folder", "schema",
         "schema_strategies"],
        2,
    ),
    "run": 3,
    "algorithms": 4,
    **dict.fromkeys(["simulation", "adapters", "tracking"], 5),
    **dict.fromkeys(["experiment", "cli", "study", "report", "compare", "plugin_check", "plugin_guide", "dvc_plots"], 6),
}
"""Each top-level part of ``fedplug`` (``fedplug.adapters`` is the ``adapters/`` folder) and
its layer; ``""`` is the package's ``__init__``."""

RUNTIMES = {"simulation", "adapters"}
"""Parts that move models and messages: none may import another."""


def module_files() -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    files = {}
    for path in [*ROOT.glob("fedplug/**/*.py"), *ROOT.glob("adapters/**/*.py")]:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[0] == "adapters":
            parts = ["fedplug", *parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def part(module: str) -> str:
    """The top-level part of a dotted ``fedplug`` module name (``""`` for the package)."""
    return module.split(".")[1] if "." in module else ""


def runtime_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """``(line, module)`` of every absolute ``fedplug`` import outside ``if TYPE_CHECKING:``."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(child) for statement in node.body for child in ast.walk(statement))
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [(node.lineno, name) for name in names if name == "fedplug" or name.startswith("fedplug.")]
    return found


def problems_in(module: str, path: Path) -> list[str]:
    """Every import of ``module`` (its source at ``path``) that runs up a layer or from one
    runtime into another."""
    problems = []
    source = part(module)
    for line, imported in runtime_imports(ast.parse(path.read_text(), str(path))):
        target = part(imported)
        where = f"{path.name}:{line} ({module}) imports {imported}"
        if LAYERS[target] > LAYERS[source]:
            problems.append(f"{where}: layer {LAYERS[target]} ({target}) above layer {LAYERS[source]} ({source})")
        elif source in RUNTIMES and target in RUNTIMES and source != target:
            problems.append(f"{where}: one runtime importing another")
    return problems


def test_every_part_of_the_package_has_a_layer():
    unplaced = sorted({part(module) for module in module_files()} - set(LAYERS))
    assert not unplaced, f"add these parts of fedplug to LAYERS in {Path(__file__).name}: {unplaced}"


def test_no_import_runs_up_a_layer_or_across_runtimes():
    problems = [problem for module, path in sorted(module_files().items()) for problem in problems_in(module, path)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("module", "source", "complaint"),
    [
        ("fedplug.run.fake", "from fedplug.simulation.simulator import Simulator\n", "above layer 3"),
        ("fedplug.adapters.fake", "def f():\n    from fedplug.simulation import sequential\n", "one runtime"),
        ("fedplug.components", "import fedplug.experiment\n", "above layer 2"),
    ],
)
def test_the_check_finds_an_import_up_a_layer(tmp_path, module, source, complaint):
    path = tmp_path / "fake.py"
    path.write_text(source)
    (problem,) = problems_in(module, path)
    assert complaint in problem


def test_annotation_only_imports_are_not_dependencies(tmp_path):
    path = tmp_path / "fake.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from fedplug.experiment import x\n")
    assert problems_in("fedplug.components", path) == []



def test_every_package_is_installed():
    # pyproject.toml lists the packages (adapters/ installs as fedplug.adapters): one left
    # out works in the editable install and is missing from a wheel.
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {
        module for module, path in module_files().items() if path.name == "__init__.py"
    } | {"fedplug"}
    assert on_disk - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
