"""Loading plugins: fedplug's built-ins and third-party packages alike.

Built-in components are plugins, loaded exactly like third-party ones (datasette's
``DEFAULT_PLUGINS``). Third-party plugins are found through the entry-point group
``fedplug``; set ``FEDPLUG_DISABLE_PLUGIN_AUTOLOAD=1`` to skip them (as pytest's
``PYTEST_DISABLE_PLUGIN_AUTOLOAD`` does), e.g. in tests.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import Any

import pluggy

from fedplug import hookspecs
from fedplug.errors import FedplugError, PluginError
from fedplug.registry import KINDS, Registry

AUTOLOAD_SWITCH = "FEDPLUG_DISABLE_PLUGIN_AUTOLOAD"

BUILTIN_PLUGINS = (
    "fedplug.data.datasets",
    "fedplug.data.partitions",
    "fedplug.data.flwr_partitions",
    "fedplug.models.zoo",
    "fedplug.algorithms.uniform",
    "fedplug.algorithms.fedavg",
    "fedplug.algorithms.fedprox",
    "fedplug.algorithms.fedavgm",
    "fedplug.algorithms.fedopt",
    "fedplug.algorithms.fednova",
    "fedplug.algorithms.scaffold",
    "fedplug.algorithms.iwds",
    "fedplug.algorithms.fedshift",
    "fedplug.algorithms.fedgsp",
    "fedplug.algorithms.feddisk",
    "fedplug.algorithms.flower_strategies",
    "fedplug.tracking",
)


def new_plugin_manager(*, autoload: bool | None = None) -> pluggy.PluginManager:
    """A plugin manager with the built-ins and, unless switched off, installed plugins."""
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    for module_name in BUILTIN_PLUGINS:
        manager.register(importlib.import_module(module_name), name=module_name)
    if autoload is None:
        autoload = not os.environ.get(AUTOLOAD_SWITCH)
    if autoload:
        try:
            manager.load_setuptools_entrypoints(hookspecs.PROJECT_NAME)
        except Exception as error:  # an installed package that cannot be imported
            raise PluginError(
                f"an installed fedplug plugin failed to load ({type(error).__name__}: {error}); fix or "
                f"uninstall it, or set {AUTOLOAD_SWITCH}=1 to run with the built-in components only"
            ) from error
    try:
        manager.check_pending()
    except pluggy.PluginValidationError as error:
        raise PluginError(f"plugin {error.plugin!r}: {error}") from None
    return manager


def collect_registry(manager: pluggy.PluginManager) -> Registry:
    """Call every plugin's register hooks and gather what they register."""
    registry = Registry()
    for kind in KINDS:
        for implementation, plugin_name in _implementations(manager, f"fedplug_register_{kind}"):

            def register(name: Any, config_class: Any, factory: Any, *, _kind=kind, _plugin=plugin_name) -> None:
                registry.register(_kind, _plugin, name, config_class, factory)

            _call_hook(implementation, plugin_name, f"fedplug_register_{kind}", register)
    collect_trackers(manager, registry)
    return registry


def collect_trackers(manager: pluggy.PluginManager, registry: Registry) -> None:
    """Call every plugin's ``fedplug_register_trackers`` and add what it registers."""
    for implementation, plugin_name in _implementations(manager, "fedplug_register_trackers"):

        def register(name: Any, factory: Any, *, _plugin: str = plugin_name) -> None:
            registry.register_tracker(_plugin, name, factory)

        _call_hook(implementation, plugin_name, "fedplug_register_trackers", register)


def _implementations(manager: pluggy.PluginManager, hook_name: str) -> list[tuple[Any, str]]:
    """Each implementation of ``hook_name`` with the name of the plugin it belongs to."""
    return [
        (implementation, manager.get_name(implementation.plugin) or repr(implementation.plugin))
        for implementation in getattr(manager.hook, hook_name).get_hookimpls()
    ]


def _call_hook(implementation: Any, plugin_name: str, hook_name: str, register: Any) -> None:
    """Call one register hook; a plugin that raises or returns a value is named in the error."""
    try:
        result = implementation.function(register=register)
    except FedplugError:
        raise
    except Exception as error:  # a bug or a missing resource in the plugin
        raise PluginError(
            f"plugin {plugin_name!r}: {hook_name} raised {type(error).__name__}: {error}; fix or "
            f"uninstall it, or set {AUTOLOAD_SWITCH}=1 to run with the built-in components only"
        ) from error
    if result is not None:
        raise PluginError(
            f"plugin {plugin_name!r}: {hook_name} must call register(...) and return "
            f"None, but it returned {type(result).__name__}"
        )


@functools.cache
def default_registry() -> Registry:
    """The registry of the current environment, built once per process."""
    return collect_registry(new_plugin_manager())
