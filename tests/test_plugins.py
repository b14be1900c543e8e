"""The plugin system: built-ins and third-party plugins load the same way, every hook is
documented and exercised, and misbehaving plugins are rejected with their name."""

from __future__ import annotations

import importlib.metadata
import inspect
import sys
import types
from pathlib import Path
from typing import Iterable, Literal

import pytest
import torch

from fedplug import hookspecs
from fedplug.components import Aggregator, ClientUpdate, ComponentConfig, WeightedMean
from fedplug.config import validate_experiment
from fedplug.errors import PluginError
from fedplug.experiment import run_experiment
from fedplug.hookspecs import hookimpl
from fedplug.plugins import collect_registry, new_plugin_manager
from fedplug.registry import KINDS, Registry

HOOK_NAMES = sorted(name for name in vars(hookspecs) if name.startswith("fedplug_"))


class DummyEntryPoint:
    """Stands in for an installed package's entry point (as in pytest's own tests)."""

    def __init__(self, name: str, module: types.ModuleType, group: str = "fedplug") -> None:
        self.name, self.group, self.value, self._module = name, group, module.__name__, module

    def load(self) -> types.ModuleType:
        return self._module


class DummyDistribution:
    def __init__(self, entry_point: DummyEntryPoint) -> None:
        self.entry_points = [entry_point]
        self.metadata = {"name": f"fedplug-{entry_point.name}", "version": "1.0"}
        self.version = "1.0"

    @property
    def name(self) -> str:
        return self.metadata["name"]


def install_fake_plugin(monkeypatch, name: str, module: types.ModuleType) -> None:
    monkeypatch.setitem(sys.modules, module.__name__, module)
    distribution = DummyDistribution(DummyEntryPoint(name, module))
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: [distribution])


# -------------------------------------------------------------- a third-party plugin


class TrimmedMeanConfig(ComponentConfig):
    """Coordinate-wise mean after dropping the largest update norm (a toy robust rule)."""

    name: Literal["trimmed_mean"]
    scale: float = 1.0


class TrimmedMean(Aggregator):
    def __init__(self, config: TrimmedMeanConfig, num_clients: int) -> None:
        super().__init__(num_clients)
        self.calls = 0

    def aggregate(self, global_vector: torch.Tensor, updates: Iterable[ClientUpdate]) -> torch.Tensor:
        updates = list(updates)
        largest = max(range(len(updates)), key=lambda i: float((updates[i].vector - global_vector).norm()))
        mean = WeightedMean()
        for index, update in enumerate(updates):
            if index != largest or len(updates) == 1:
                mean.add(update.vector, 1.0)
        TrimmedMean.rounds_seen = getattr(TrimmedMean, "rounds_seen", 0) + 1
        return mean.mean()


def make_plugin_module() -> types.ModuleType:
    module = types.ModuleType("fedplug_trimmed_mean")

    @hookimpl
    def fedplug_register_aggregators(register):
        register("trimmed_mean", TrimmedMeanConfig, TrimmedMean)

    module.fedplug_register_aggregators = fedplug_register_aggregators
    return module


def test_installed_third_party_plugin_is_loaded_and_runs(monkeypatch, small_experiment, tmp_path):
    install_fake_plugin(monkeypatch, "trimmed-mean", make_plugin_module())
    registry = collect_registry(new_plugin_manager(autoload=True))
    entry = registry.get("aggregators", "trimmed_mean")
    assert entry.plugin == "trimmed-mean"

    small_experiment["train"]["aggregator"] = {"name": "trimmed_mean"}
    config = validate_experiment(small_experiment, registry)
    TrimmedMean.rounds_seen = 0
    result, _ = run_experiment(config, tmp_path / "run", registry=registry)
    assert TrimmedMean.rounds_seen == config.train.rounds
    assert len(result.history) == config.train.rounds


def test_autoload_switch_skips_installed_plugins(monkeypatch):
    install_fake_plugin(monkeypatch, "trimmed-mean", make_plugin_module())
    monkeypatch.setenv("FEDPLUG_DISABLE_PLUGIN_AUTOLOAD", "1")
    registry = collect_registry(new_plugin_manager())
    assert "trimmed_mean" not in registry.names("aggregators")
    assert "fedavg" in registry.names("aggregators")  # built-ins load regardless


def test_third_party_parameters_validate_like_builtins(monkeypatch, small_experiment):
    install_fake_plugin(monkeypatch, "trimmed-mean", make_plugin_module())
    registry = collect_registry(new_plugin_manager(autoload=True))
    small_experiment["train"]["aggregator"] = {"name": "trimmed_mean", "scael": 2}
    with pytest.raises(Exception, match=r"train.aggregator.scael: unknown key"):
        validate_experiment(small_experiment, registry)


# -------------------------------------------------------------- hostile plugins


def _manager_with(module: types.ModuleType):
    manager = new_plugin_manager(autoload=False)
    manager.register(module, name=module.__name__)
    return manager


def test_plugin_registering_a_taken_name_is_rejected_with_both_names():
    module = types.ModuleType("evil_plugin")

    @hookimpl
    def fedplug_register_aggregators(register):
        register("fedavg", TrimmedMeanConfig, TrimmedMean)

    module.fedplug_register_aggregators = fedplug_register_aggregators
    with pytest.raises(PluginError, match=r"evil_plugin.*'fedavg'.*already registered by plugin 'fedplug.algorithms.fedavg'"):
        collect_registry(_manager_with(module))


def test_plugin_returning_a_value_from_a_hook_is_rejected():
    module = types.ModuleType("chatty_plugin")

    @hookimpl
    def fedplug_register_samplers(register):
        return ["not", "how", "it", "works"]

    module.fedplug_register_samplers = fedplug_register_samplers
    with pytest.raises(PluginError, match=r"chatty_plugin.*must call register.*returned list"):
        collect_registry(_manager_with(module))


def test_plugin_with_a_non_config_class_is_rejected():
    module = types.ModuleType("sloppy_plugin")

    @hookimpl
    def fedplug_register_samplers(register):
        register("sloppy", dict, lambda config: None)

    module.fedplug_register_samplers = fedplug_register_samplers
    with pytest.raises(PluginError, match=r"sloppy_plugin.*must subclass fedplug.components.ComponentConfig"):
        collect_registry(_manager_with(module))


def test_plugin_whose_config_name_does_not_match_is_rejected():
    registry = Registry()
    with pytest.raises(PluginError, match=r"Literal\['other'\]"):
        registry.register("aggregators", "p", "other", TrimmedMeanConfig, TrimmedMean)


def test_misspelt_hook_fails_loudly():
    module = types.ModuleType("typo_plugin")

    @hookimpl
    def fedplug_register_agregators(register):
        """misspelt"""

    module.fedplug_register_agregators = fedplug_register_agregators
    manager = new_plugin_manager(autoload=False)
    manager.register(module, name="typo_plugin")
    import pluggy

    with pytest.raises(pluggy.PluginValidationError):
        manager.check_pending()


# -------------------------------------------------------------- documented and exercised


def test_one_hook_per_registry_kind():
    # Plus the trackers' hook: trackers have no config class, so they are not a KIND.
    assert HOOK_NAMES == sorted([*(f"fedplug_register_{kind}" for kind in KINDS), "fedplug_register_trackers"])


@pytest.mark.parametrize("hook_name", HOOK_NAMES)
def test_every_hook_is_documented(hook_name):
    hook = getattr(hookspecs, hook_name)
    doc = inspect.getdoc(hook) or ""
    assert len(doc.split()) >= 20, f"{hook_name} needs a docstring that says when it is called and what it gets"
    assert "register" in inspect.signature(hook).parameters
    readme = Path(__file__).resolve().parents[1] / "README.md"
    assert hook_name in readme.read_text(), f"README.md does not document {hook_name}"


def test_every_hook_is_implemented_and_exercised_by_a_run(small_experiment, tmp_path):
    manager = new_plugin_manager(autoload=False)
    for hook_name in HOOK_NAMES:
        assert getattr(manager.hook, hook_name).get_hookimpls(), f"no built-in implements {hook_name}"
    registry = collect_registry(manager)
    used: set[str] = set()
    original_get = registry.get

    def recording_get(kind, name):
        used.add(kind)
        return original_get(kind, name)

    registry.get = recording_get  # type: ignore[method-assign]
    config = validate_experiment(small_experiment, registry)
    run_experiment(config, None, registry=registry)
    assert used == set(KINDS)
