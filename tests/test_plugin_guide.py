"""docs/plugins.md, the plugin guide, is true: its generated reference is current, lists
every method each slot's base class declares, and each example plugin on the page, taken
from the page as written, installs through an entry point, passes every check of
`fedplug check-plugin`, and does on the simulator what the page says it does (issue 43,
item 2)."""

from __future__ import annotations

import copy
import importlib
import importlib.metadata
import json
import re
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import SMALL_EXPERIMENT
from test_plugins import DummyDistribution, DummyEntryPoint

import fedplug.plugins
from fedplug import plugin_guide
from fedplug.components import ComponentHooks
from fedplug.config import validate_experiment
from fedplug.experiment import run_experiment
from fedplug.plugin_check import check_plugin
from fedplug.plugins import collect_registry, new_plugin_manager
from fedplug.registry import Registry
from fedplug.run.round_plan import clients_per_round, sample_clients

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "plugins.md"
EXAMPLE = re.compile(r"^```python\n# (?P<module>\w+)\.py\n(?P<code>.*?)^```$", re.DOTALL | re.MULTILINE)
ROUNDS = 2
EXAMPLES = {  # module on the page -> (registry kind, component name)
    "balanced_sampler": ("samplers", "class_balanced"),
    "smoothed_loss": ("loss_transforms", "label_smoothing"),
    "damped_avg": ("aggregators", "damped_avg"),
    "diverse_clients": ("groupers", "diverse_clients"),
    "round_robin": ("partitioners", "round_robin"),
}


def page_examples() -> dict[str, str]:
    """The page's example plugins: each ```python block whose first line names its file."""
    return {match["module"]: match["code"] for match in EXAMPLE.finditer(PAGE.read_text())}


def install_example(module_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[types.ModuleType, Registry]:
    """The page's ``module_name`` written to a file, imported, and installed as a plugin
    through a (fake) entry point, as ``pip install`` of its pyproject would; the registry
    built with it."""
    folder = tmp_path / "plugin"
    folder.mkdir()
    (folder / f"{module_name}.py").write_text(page_examples()[module_name])
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, module_name, raising=False)
    module = importlib.import_module(module_name)
    distribution = DummyDistribution(DummyEntryPoint(module_name.replace("_", "-"), module))
    with monkeypatch.context() as installed:  # only while the plugins load: torch reads the real ones
        installed.setattr(importlib.metadata, "distributions", lambda: [distribution])
        return module, collect_registry(new_plugin_manager(autoload=True))


def experiment(**train: Any) -> dict[str, Any]:
    """SMALL_EXPERIMENT at ROUNDS rounds with ``train`` entries set."""
    data = copy.deepcopy(SMALL_EXPERIMENT)
    data["train"].update(rounds=ROUNDS, **train)
    return data


def history(data: dict[str, Any], registry: Registry, out: Path) -> list[dict[str, Any]]:
    """The rounds ``metrics.json`` holds after a simulator run of ``data`` into ``out``."""
    run_experiment(validate_experiment(data, registry), out, registry=registry)
    return json.loads((out / "metrics.json").read_text())["history"]


# ------------------------------------------------------------------ the reference


def test_the_generated_reference_is_current(capsys: pytest.CaptureFixture[str]) -> None:
    assert plugin_guide.main(["--check", str(PAGE)]) == 0, (
        "docs/plugins.md is stale: run python -m fedplug.plugin_guide --write docs/plugins.md"
    )


def test_a_stale_reference_is_refused_and_written_back(tmp_path: Path) -> None:
    # Prepare: the page with its generated block emptied.
    page = tmp_path / "plugins.md"
    page.write_text(f"intro\n\n{plugin_guide.BEGIN}\nold text\n{plugin_guide.END}\n\noutro\n")
    # Execute / Assert
    assert plugin_guide.main(["--check", str(page)]) == 1
    assert plugin_guide.main(["--write", str(page)]) == 0
    assert plugin_guide.main(["--check", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("intro\n\n") and text.endswith("\n\noutro\n") and "old text" not in text


@pytest.mark.parametrize("slot", list(plugin_guide.SLOT_CLASSES))
def test_the_reference_lists_every_method_of_each_slot(slot: str) -> None:
    """Each public method of the slot's base class (its own and the shared hooks) is on
    the page with its signature, and the abstract ones are marked required."""
    cls = plugin_guide.SLOT_CLASSES[slot]
    section = "\n".join(plugin_guide.slot_section(slot))
    public = {name for owner in (cls, ComponentHooks) for name, value in vars(owner).items()
              if callable(value) and not name.startswith("_")}
    assert {"prepare", "client_needs", "setup_phase", "state_dict", "load_state_dict"} <= public
    for name in public:
        assert f"- `{plugin_guide.signature(getattr(cls, name), name)}`" in section, (slot, name)
    for name in cls.__abstractmethods__:
        assert f"`: **required**" in section.split(f"- `{name}(", 1)[1].split("\n", 1)[0], (slot, name)
    page = PAGE.read_text()
    assert section in page


def test_the_reference_shows_docstrings_and_client_needs_fields() -> None:
    page = PAGE.read_text()
    assert "- `client_context(client_id: int, class_counts: np.ndarray) -> Context`: optional. Per-client" in page
    assert "- `class_counts: bool`: Every client's class counts before round 1" in page
    assert "- `clients: list[int] | None`: The clients that trained in the round" in page
    block = page.split(plugin_guide.BEGIN, 1)[1]
    assert ":class:" not in block and ":meth:" not in block and "``" not in block  # reST made Markdown


# ------------------------------------------------------------------ the examples


def test_the_page_has_one_example_per_slot_and_the_partitioner() -> None:
    assert sorted(page_examples()) == sorted(EXAMPLES)


@pytest.mark.parametrize("module_name", sorted(EXAMPLES))
def test_each_example_installs_and_passes_check_plugin(
    module_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`fedplug check-plugin` of the installed example: every check passes (docs, config,
    simulator, deterministic, resume, engines and Flower)."""
    # Prepare: installed, and the registry the Flower nodes build their components from.
    kind, name = EXAMPLES[module_name]
    _, registry = install_example(module_name, tmp_path, monkeypatch)
    monkeypatch.setattr(fedplug.plugins, "default_registry", lambda: registry)
    assert registry.get(kind, name).plugin == module_name.replace("_", "-")
    # Execute
    outcomes = list(check_plugin(module_name.replace("_", "-"), registry=registry))
    # Assert
    checks = ["load", "docs", "config", "simulator", "deterministic", "resume", "engines", "flower"]
    assert [outcome.check for outcome in outcomes] == checks
    assert all(outcome.verdict == "PASS" for outcome in outcomes), [outcome.line() for outcome in outcomes]


def test_the_sampler_example_draws_every_epoch_of_every_client(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare: count the epochs it draws and check each draw.
    module, registry = install_example("balanced_sampler", tmp_path, monkeypatch)
    draws: list[tuple[int, np.ndarray]] = []
    drawn = module.ClassBalanced.epoch_indices

    def spy(self: Any, labels: np.ndarray, *args: Any) -> np.ndarray:
        indices = drawn(self, labels, *args)
        draws.append((len(labels), indices))
        return indices

    monkeypatch.setattr(module.ClassBalanced, "epoch_indices", spy)
    # Execute
    rounds = history(experiment(sampler={"name": "class_balanced"}), registry, tmp_path / "run")
    # Assert: one epoch for each client of each round, each a valid epoch of its client.
    assert len(draws) == sum(record["participants"] for record in rounds) == ROUNDS * clients_per_round(6, 0.5)
    assert all(len(indices) == size and indices.min() >= 0 and indices.max() < size for size, indices in draws)


def test_the_loss_example_is_cross_entropy_at_zero_and_changes_training_above(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, registry = install_example("smoothed_loss", tmp_path, monkeypatch)
    plain = history(experiment(), registry, tmp_path / "plain")
    zero = history(experiment(loss_transform={"name": "label_smoothing", "smoothing": 0.0}), registry, tmp_path / "zero")
    smoothed = history(experiment(loss_transform={"name": "label_smoothing", "smoothing": 0.3}), registry, tmp_path / "smooth")
    assert [record["loss"] for record in zero] == pytest.approx([record["loss"] for record in plain], abs=1e-6)
    assert all(abs(ours["loss"] - theirs["loss"]) > 1e-4 for ours, theirs in zip(smoothed, plain))


def test_the_aggregator_example_is_fedavg_at_step_one_and_damped_below(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, registry = install_example("damped_avg", tmp_path, monkeypatch)
    fedavg = history(experiment(), registry, tmp_path / "fedavg")
    full = history(experiment(aggregator={"name": "damped_avg", "step": 1.0}), registry, tmp_path / "full")
    damped = history(experiment(aggregator={"name": "damped_avg", "step": 0.3}), registry, tmp_path / "damped")
    assert [record["loss"] for record in full] == pytest.approx([record["loss"] for record in fedavg], abs=1e-5)
    assert all(abs(ours["loss"] - theirs["loss"]) > 1e-4 for ours, theirs in zip(damped, fedavg))


def test_the_grouper_example_trains_the_sampled_clients_with_the_most_classes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare
    _, registry = install_example("diverse_clients", tmp_path, monkeypatch)
    data = experiment(grouper={"name": "diverse_clients", "keep": 2})
    config = validate_experiment(data, registry)
    # Execute
    _, simulator = run_experiment(config, tmp_path / "run", registry=registry)
    rounds = json.loads((tmp_path / "run" / "metrics.json").read_text())["history"]
    # Assert: each round's record names the two of its sampled clients that hold the most
    # classes (by hand from the federation's class counts), and only those trained.
    classes_held = (simulator.federation.class_counts > 0).sum(axis=1)
    for index, record in enumerate(rounds):
        sampled = sample_clients(6, clients_per_round(6, 0.5), config.train.seed, index).tolist()
        expected = sorted(sorted(sampled, key=lambda client: -classes_held[client])[:2])
        assert record["clients"] == expected and record["participants"] == 2, (record["round"], sampled)
        assert record["chains"] is None  # each trained alone


def test_the_partitioner_example_deals_the_samples_out_evenly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Prepare
    _, registry = install_example("round_robin", tmp_path, monkeypatch)
    data = experiment()
    data["data"]["partition"] = {"name": "round_robin"}
    # Execute
    _, simulator = run_experiment(validate_experiment(data, registry), tmp_path / "run", registry=registry)
    # Assert: every client holds 600 / 6 samples (its local training and test splits together).
    federation = simulator.federation
    held = federation.client_sizes + federation.local_test_set()[2]
    assert held.tolist() == [100] * 6
