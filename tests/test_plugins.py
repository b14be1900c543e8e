"""The plugin system: built-ins and third-party plugins load the same way, every hook is
documented and exercised, and misbehaving plugins are rejected with their name."""

from __future__ import annotations

import importlib.metadata
import inspect
import sys
import types
import typing
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
        register(TrimmedMeanConfig, TrimmedMean)

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
    from fedplug.algorithms.fedavg import FedAvgConfig

    module = types.ModuleType("evil_plugin")

    @hookimpl
    def fedplug_register_aggregators(register):
        register(FedAvgConfig, TrimmedMean)

    module.fedplug_register_aggregators = fedplug_register_aggregators
    with pytest.raises(PluginError, match=r"aggregator 'fedavg': the name is also registered by") as error:
        collect_registry(_manager_with(module))
    assert "plugin 'evil_plugin'" in str(error.value)
    assert "plugin 'fedplug.algorithms.fedavg'" in str(error.value)


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


def _aggregator_plugin(name: str, register_call, **marks) -> types.ModuleType:
    """A plugin module ``name`` whose ``fedplug_register_aggregators`` (with ``marks``
    such as ``tryfirst=True``) calls ``register_call(register)``."""
    module = types.ModuleType(name)

    @hookimpl(**marks)
    def fedplug_register_aggregators(register):
        register_call(register)

    module.fedplug_register_aggregators = fedplug_register_aggregators
    return module


def test_register_names_the_component_by_its_config_class():
    registry = collect_registry(
        _manager_with(_aggregator_plugin("one_name", lambda register: register(TrimmedMeanConfig, TrimmedMean)))
    )
    entry = registry.get("aggregators", "trimmed_mean")
    assert (entry.config_class, entry.factory, entry.plugin) == (TrimmedMeanConfig, TrimmedMean, "one_name")


def test_the_old_three_argument_register_still_works():
    old_form = _aggregator_plugin(
        "old_form", lambda register: register("trimmed_mean", TrimmedMeanConfig, TrimmedMean)
    )
    entry = collect_registry(_manager_with(old_form)).get("aggregators", "trimmed_mean")
    assert (entry.config_class, entry.plugin) == (TrimmedMeanConfig, "old_form")


class LooseNameConfig(ComponentConfig):
    """A config whose name is any string: it cannot name a component."""


class TwoNamesConfig(ComponentConfig):
    """A config that answers to two names."""

    name: Literal["left", "right"]


@pytest.mark.parametrize(
    ("config_class", "shown"), [(LooseNameConfig, "name is str"), (TwoNamesConfig, "Literal['left', 'right']")]
)
def test_a_config_class_without_one_literal_name_cannot_name_a_component(config_class, shown):
    plugin = _aggregator_plugin("vague_plugin", lambda register: register(config_class, TrimmedMean))
    with pytest.raises(PluginError) as error:
        collect_registry(_manager_with(plugin))
    message = str(error.value)
    assert message.startswith(f"plugin 'vague_plugin' registering aggregator by config class {config_class.__name__}")
    assert shown in message
    assert "declare it as Literal['its-name'] (one string)" in message


def test_register_with_a_wrong_number_of_arguments_says_both_forms():
    plugin = _aggregator_plugin("terse_plugin", lambda register: register(TrimmedMean))
    with pytest.raises(PluginError, match=r"plugin 'terse_plugin' registering aggregator: register takes "
                       r"\(ConfigClass, factory\), or the old \(name, ConfigClass, factory\); got 1 arguments"):
        collect_registry(_manager_with(plugin))


# -------------------------------------------------------------- pluggy's call loop


class TwinConfig(ComponentConfig):
    """An aggregator that two plugins both register."""

    name: Literal["twin"] = "twin"


@pytest.mark.parametrize(
    ("early_marks", "late_marks", "first", "second"),
    [
        ({}, {}, "late", "early"),  # pluggy calls the plugin registered last first
        ({"tryfirst": True}, {}, "early", "late"),
        ({}, {"trylast": True}, "early", "late"),
    ],
    ids=["last-registered-first", "tryfirst", "trylast"],
)
def test_tryfirst_and_trylast_decide_which_plugin_registers_first(early_marks, late_marks, first, second):
    def register_twin(register):
        register(TwinConfig, TrimmedMean)

    manager = new_plugin_manager(autoload=False)
    manager.register(_aggregator_plugin("early", register_twin, **early_marks), name="early")
    manager.register(_aggregator_plugin("late", register_twin, **late_marks), name="late")
    with pytest.raises(PluginError) as error:
        collect_registry(manager)
    # Neither plugin is installed, so the error leads with the one that registered second.
    assert str(error.value) == (
        f"plugin {second!r} registering aggregator 'twin': the name is also registered by "
        f"plugin {first!r}; rename one of them"
    )


@pytest.mark.parametrize("style", ["wrapper", "hookwrapper"])
def test_a_hook_wrapper_sees_the_register_call_around_every_implementation(style):
    calls: list[object] = []
    watcher = types.ModuleType("watching_plugin")

    if style == "wrapper":

        @hookimpl(wrapper=True)
        def fedplug_register_aggregators(register):
            calls.append(("before", callable(register)))
            result = yield
            calls.append(("after", result))
            return result

    else:

        @hookimpl(hookwrapper=True)
        def fedplug_register_aggregators(register):
            calls.append(("before", callable(register)))
            outcome = yield
            calls.append(("after", outcome.get_result()))

    watcher.fedplug_register_aggregators = fedplug_register_aggregators

    def register_trimmed_mean(register):
        calls.append("implementation")
        register(TrimmedMeanConfig, TrimmedMean)

    manager = _manager_with(_aggregator_plugin("trimmed", register_trimmed_mean))
    manager.register(watcher, name="watching_plugin")
    registry = collect_registry(manager)
    assert calls == [("before", True), "implementation", ("after", [])]
    assert registry.get("aggregators", "trimmed_mean").plugin == "trimmed"
    assert "fedavg" in registry.names("aggregators")  # the built-ins ran inside the wrapper too


def test_a_hook_wrapper_that_registers_is_told_to_use_a_plain_hookimpl():
    module = types.ModuleType("wrapping_registrar")

    @hookimpl(wrapper=True)
    def fedplug_register_aggregators(register):
        register(TrimmedMeanConfig, TrimmedMean)
        return (yield)

    module.fedplug_register_aggregators = fedplug_register_aggregators
    with pytest.raises(PluginError, match=r"outside an implementation of fedplug_register_aggregators"):
        collect_registry(_manager_with(module))


# -------------------------------------------------------------- typed registration


def _protocol_arguments(protocol) -> tuple[list[object], dict[str, object]]:
    """Placeholders for every argument of ``protocol.__call__``: the positional-only ones
    by position, the keyword-only ones by name."""
    parameters = list(inspect.signature(protocol.__call__).parameters.values())[1:]  # self
    positional = [object() for parameter in parameters if parameter.kind is parameter.POSITIONAL_ONLY]
    keywords = {parameter.name: None for parameter in parameters if parameter.kind is parameter.KEYWORD_ONLY}
    return positional, keywords


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_is_typed_by_its_factory_protocol_and_the_builtins_match_it(kind):
    factory_protocol = hookspecs.FACTORIES[kind]
    hints = typing.get_type_hints(getattr(hookspecs, f"fedplug_register_{kind}"))
    assert hints["register"] == hookspecs.Register[factory_protocol]
    positional, keywords = _protocol_arguments(factory_protocol)
    entries = collect_registry(new_plugin_manager(autoload=False)).entries(kind)
    assert entries
    for entry in entries:
        # TypeError when the factory cannot be called as its kind's Protocol says
        inspect.signature(entry.factory).bind(*positional, **keywords)


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


# -------------------------------------------------------------- load errors name their source


class FakeEntryPoint:
    """An installed distribution's ``fedplug`` entry point ``name = value``."""

    group = "fedplug"

    def __init__(self, name: str, value: str, load) -> None:
        self.name, self.value, self._load = name, value, load

    def load(self):
        return self._load()


class FakeDistribution:
    def __init__(self, name: str, version: str, *entry_points: FakeEntryPoint) -> None:
        self.name, self.version = name, version
        self.metadata = {"Name": name, "Version": version}
        self.entry_points = list(entry_points)


ACME = "plugin 'acme' (entry point 'acme = fedplug_acme.hooks:plugin' of distribution 'fedplug-acme' 2.1)"
"""How every load error names the fake distribution's plugin."""


def _module_with(**hooks) -> types.ModuleType:
    module = types.ModuleType("fedplug_acme.hooks")
    for name, function in hooks.items():
        setattr(module, name, hookimpl(specname=name)(function) if name.startswith("fedplug_register_") else function)
    return module


def _raise(error: BaseException):
    def load():
        raise error

    return load


def _register_fedavg(register):
    from fedplug.algorithms.fedavg import FedAvg, FedAvgConfig

    register("fedavg", FedAvgConfig, FedAvg)


def _hook_with_extra_argument(register, verbose):
    """Declares an argument the hookspec does not have."""


def _hook_that_raises(register):
    raise KeyError("ACME_LICENSE")


LOAD_ERRORS = {
    # id: (what the entry point loads, a phrase of the error)
    "import-raises": (_raise(RuntimeError("CUDA driver too old")), "failed to import: RuntimeError: CUDA driver too old"),
    "import-exits": (_raise(SystemExit("unsupported platform")), "failed to import: SystemExit: unsupported platform"),
    "hook-signature": (
        lambda: _module_with(fedplug_register_aggregators=_hook_with_extra_argument),
        "Argument(s) {'verbose'} are declared in the hookimpl but can not be found in the hookspec",
    ),
    "hook-misspelt": (
        lambda: _module_with(fedplug_register_agregators=lambda register: None),
        "unknown hook 'fedplug_register_agregators'",
    ),
    "hook-raises": (
        lambda: _module_with(fedplug_register_aggregators=_hook_that_raises),
        "fedplug_register_aggregators raised KeyError: 'ACME_LICENSE'",
    ),
    "hook-returns": (
        lambda: _module_with(fedplug_register_samplers=lambda register: ["a", "list"]),
        "must call register(...) and return None, but it returned list",
    ),
    "registers-a-non-config": (
        lambda: _module_with(fedplug_register_samplers=lambda register: register("acme", dict, print)),
        "must subclass fedplug.components.ComponentConfig",
    ),
    "registers-a-taken-name": (
        lambda: _module_with(fedplug_register_aggregators=_register_fedavg),
        "the name is also registered by plugin 'fedplug.algorithms.fedavg'",
    ),
    "registers-a-bad-tracker": (
        lambda: _module_with(fedplug_register_trackers=lambda register: register("acme", 42)),
        "registering tracker 'acme': the factory must be callable",
    ),
}


def _cli_with_installed(monkeypatch, capsys, *distributions: FakeDistribution) -> tuple[int, str, str]:
    """``fedplug list`` in-process with only ``distributions`` installed (autoload on)."""
    import functools

    import fedplug.plugins
    from fedplug.cli import main

    fedplug.plugins.default_registry()  # let the built-ins import what they import, first
    monkeypatch.delenv("FEDPLUG_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: list(distributions))
    fresh = functools.cache(lambda: collect_registry(new_plugin_manager()))
    monkeypatch.setattr(fedplug.plugins, "default_registry", fresh)
    capsys.readouterr()
    code = main(["list"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("load, phrase", list(LOAD_ERRORS.values()), ids=list(LOAD_ERRORS))
def test_every_plugin_load_error_is_one_line_naming_distribution_and_entry_point(
    monkeypatch, capsys, load, phrase
):
    acme = FakeDistribution("fedplug-acme", "2.1", FakeEntryPoint("acme", "fedplug_acme.hooks:plugin", load))
    code, out, err = _cli_with_installed(monkeypatch, capsys, acme)
    assert code == 2 and out == ""
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"fedplug: error: {ACME}"), err
    assert phrase in err, err
    assert "Traceback" not in err


def test_two_distributions_claiming_one_entry_point_name_are_both_named(monkeypatch, capsys):
    first = FakeDistribution(
        "fedplug-acme", "2.1", FakeEntryPoint("acme", "fedplug_acme.hooks:plugin", lambda: _module_with())
    )
    second = FakeDistribution(
        "acme-fork", "0.1", FakeEntryPoint("acme", "acme_fork:plugin", lambda: _module_with())
    )
    code, out, err = _cli_with_installed(monkeypatch, capsys, first, second)
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert "plugin 'acme' (entry point 'acme = acme_fork:plugin' of distribution 'acme-fork' 0.1)" in err
    assert f"already taken by {ACME}" in err


def test_the_same_distribution_found_twice_loads_once(monkeypatch, capsys):
    """A package on two ``sys.path`` entries (an editable install beside a wheel) lists its
    entry point twice; pluggy loads it once, and so must fedplug."""
    entry = FakeEntryPoint("trimmed-mean", "fedplug_trimmed_mean:plugin", make_plugin_module)
    twice = [FakeDistribution("fedplug-trimmed-mean", "1.0", entry) for _ in range(2)]
    code, out, err = _cli_with_installed(monkeypatch, capsys, *twice)
    assert code == 0, err
    assert "trimmed_mean" in out
    from fedplug.cli import main

    assert main(["list", "aggregators"]) == 0  # a kind's details name each component's plugin
    assert capsys.readouterr().out.count("[trimmed-mean]") == 1


@pytest.mark.slow
def test_a_plugin_that_fails_to_import_stops_the_cli_with_one_line_naming_it(tmp_path, small_experiment):
    """A real installed distribution (a ``.dist-info`` on ``PYTHONPATH``) whose module
    imports a package that is not there: ``fedplug run`` exits 2 with one line naming the
    distribution, the entry point and the error."""
    import subprocess

    import yaml

    site = tmp_path / "site"
    info = site / "fedplug_gnn-0.3.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fedplug-gnn\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text("[fedplug]\ngnn = fedplug_gnn.hooks:plugin\n")
    (site / "fedplug_gnn").mkdir()
    (site / "fedplug_gnn" / "__init__.py").write_text("")
    (site / "fedplug_gnn" / "hooks.py").write_text("import torch_scatter_not_installed\n")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(small_experiment))
    env = {**__import__("os").environ, "PYTHONPATH": str(site)}
    env.pop("FEDPLUG_DISABLE_PLUGIN_AUTOLOAD", None)
    completed = subprocess.run(
        [sys.executable, "-m", "fedplug.cli", "run", "params.yaml", "--out", "out"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert completed.returncode == 2
    assert completed.stdout == ""
    assert completed.stderr.splitlines() == [
        "fedplug: error: plugin 'gnn' (entry point 'gnn = fedplug_gnn.hooks:plugin' of "
        "distribution 'fedplug-gnn' 0.3) failed to import: ModuleNotFoundError: No module named "
        "'torch_scatter_not_installed'; fix or uninstall fedplug-gnn, or set "
        "FEDPLUG_DISABLE_PLUGIN_AUTOLOAD=1 to run with the built-in components only"
    ]
    assert not (tmp_path / "out").exists()
