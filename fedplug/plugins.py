"""Loading plugins: fedplug's built-ins and third-party packages alike.

Built-in components are plugins, loaded exactly like third-party ones (datasette's
``DEFAULT_PLUGINS``). Third-party plugins are found through the entry-point group
``fedplug``; set ``FEDPLUG_DISABLE_PLUGIN_AUTOLOAD=1`` to skip them (as pytest's
``PYTEST_DISABLE_PLUGIN_AUTOLOAD`` does), e.g. in tests.

Every error an installed plugin causes while it loads (its module fails to import, a hook
does not match its spec, a hook raises, returns a value or registers something invalid)
is one :class:`~fedplug.errors.PluginError` line that names the distribution and the
entry point (``name = value``) it came from, so the user knows which package to fix or
uninstall.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
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
    "fedplug.algorithms.composite_loss",
    "fedplug.algorithms.flower_strategies",
    "fedplug.tracking",
)


class PluginManager(pluggy.PluginManager):
    """pluggy's plugin manager, remembering where each installed plugin came from."""

    def __init__(self, project_name: str) -> None:
        super().__init__(project_name)
        self.sources: dict[str, str] = {}
        """Plugin name -> ``plugin 'name' (entry point 'name = value' of distribution
        'dist' 1.0)``, for each plugin loaded from an entry point."""
        self.entry_point_values: dict[str, str] = {}
        """Plugin name -> its entry point's value (``module:attribute``)."""


def describe_plugin(manager: pluggy.PluginManager, plugin_name: str) -> str:
    """How errors name a plugin: ``plugin 'name'``, with its entry point and
    distribution when it was installed."""
    return getattr(manager, "sources", {}).get(plugin_name, f"plugin {plugin_name!r}")


def one_line(error: BaseException) -> str:
    """``error``'s message on one line (pluggy's validation messages span several)."""
    return " ".join(str(error).split()) or type(error).__name__


def new_plugin_manager(*, autoload: bool | None = None) -> PluginManager:
    """A plugin manager with the built-ins and, unless switched off, installed plugins."""
    manager = PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    for module_name in BUILTIN_PLUGINS:
        manager.register(importlib.import_module(module_name), name=module_name)
    if autoload is None:
        autoload = not os.environ.get(AUTOLOAD_SWITCH)
    if autoload:
        load_entry_points(manager)
    try:
        manager.check_pending()
    except pluggy.PluginValidationError as error:  # a hook that no spec declares (a typo)
        name = manager.get_name(error.plugin) or repr(error.plugin)
        raise PluginError(
            f"{describe_plugin(manager, name)}: {one_line(error)}; {_fix(manager, name)}"
        ) from None
    return manager


def load_entry_points(manager: PluginManager) -> None:
    """Import and register every entry point of the group ``fedplug``, as pluggy's
    ``load_setuptools_entrypoints`` does, but naming the distribution and the entry point
    in every error: a module that fails to import (any exception), a hook whose
    signature does not match its spec, or a plugin name that two distributions claim."""
    import importlib.metadata

    for distribution in list(importlib.metadata.distributions()):
        for entry_point in distribution.entry_points:
            if entry_point.group != hookspecs.PROJECT_NAME:
                continue
            name = entry_point.name
            source = _entry_point_source(distribution, entry_point)
            if manager.has_plugin(name) or manager.is_blocked(name):
                if manager.entry_point_values.get(name) == entry_point.value:
                    continue  # the same distribution, found twice on sys.path
                raise PluginError(
                    f"{source}: the plugin name {name!r} is already taken by "
                    f"{describe_plugin(manager, name)}; uninstall one of them"
                )
            try:
                plugin = entry_point.load()
            except (Exception, SystemExit) as error:  # a broken or incompatible package
                raise PluginError(
                    f"{source} failed to import: {type(error).__name__}: {one_line(error)}; "
                    f"fix or uninstall {_distribution_name(distribution)}, or set "
                    f"{AUTOLOAD_SWITCH}=1 to run with the built-in components only"
                ) from error
            manager.sources[name] = source
            manager.entry_point_values[name] = entry_point.value
            try:
                manager.register(plugin, name=name)
            except (pluggy.PluginValidationError, ValueError) as error:
                raise PluginError(f"{source}: {one_line(error)}; {_fix(manager, name)}") from None


def _distribution_name(distribution: Any) -> str:
    name = getattr(distribution, "name", None)
    if not name:
        metadata = getattr(distribution, "metadata", None) or {}
        name = metadata.get("Name") or metadata.get("name")
    return str(name or "?")


def _entry_point_source(distribution: Any, entry_point: Any) -> str:
    version = getattr(distribution, "version", None)
    where = f"distribution {_distribution_name(distribution)!r}" + (f" {version}" if version else "")
    return f"plugin {entry_point.name!r} (entry point '{entry_point.name} = {entry_point.value}' of {where})"


def _fix(manager: pluggy.PluginManager, plugin_name: str) -> str:
    """What to do about a broken plugin: an installed one can be fixed, uninstalled or
    switched off; one registered in code must be fixed where it is registered."""
    if plugin_name in getattr(manager, "sources", {}):
        return f"fix or uninstall it, or set {AUTOLOAD_SWITCH}=1 to run with the built-in components only"
    return "fix the plugin"


def collect_registry(manager: pluggy.PluginManager) -> Registry:
    """Call every register hook through pluggy and gather what the plugins register."""
    registry = Registry(sources=getattr(manager, "sources", {}))
    for kind in KINDS:
        add = functools.partial(registry.add, kind)
        call_register_hook(manager, f"fedplug_register_{kind}", add)
    call_register_hook(manager, "fedplug_register_trackers", registry.register_tracker)
    return registry


def call_register_hook(
    manager: pluggy.PluginManager, hook_name: str, add: Callable[..., None]
) -> None:
    """Call ``hook_name`` once through pluggy (its order, ``tryfirst``/``trylast`` and
    hook wrappers apply) with a ``register`` callback that hands ``add`` the name of the
    plugin registering and the callback's arguments: ``add(plugin, *arguments)``.

    Each implementation is labelled with its plugin for the call (:func:`_labelled`):
    pluggy's hook wrappers and ``add_hookcall_monitoring`` see the hook call as a whole,
    not which implementation is running, and calling the plugins one at a time
    (``subset_hook_caller``) would run every wrapper once per plugin and put the order
    back in our hands.
    """
    hook = getattr(manager.hook, hook_name)
    running: list[str] = []  # the plugin whose implementation runs now; empty between them

    def register(*arguments: Any) -> None:
        if not running:
            raise PluginError(
                f"register(...) was called outside an implementation of {hook_name} "
                "(from a hook wrapper?); register components from a plain @hookimpl"
            )
        add(running[-1], *arguments)

    implementations = [
        implementation
        for implementation in hook.get_hookimpls()
        if not (implementation.wrapper or implementation.hookwrapper)
    ]
    originals = [implementation.function for implementation in implementations]
    for implementation in implementations:
        # HookImpl.function is typed Final; it is swapped for this call only and restored.
        implementation.function = _labelled(manager, implementation, hook_name, running)
    try:
        hook(register=register)
    finally:
        for implementation, function in zip(implementations, originals):
            implementation.function = function


def _labelled(
    manager: pluggy.PluginManager, implementation: Any, hook_name: str, running: list[str]
) -> Callable[..., None]:
    """``implementation``'s function, marking its plugin as ``running`` while it runs; a
    plugin whose hook raises or returns a value is named in the error (with its
    distribution and entry point when it was installed)."""
    function = implementation.function
    plugin_name = implementation.plugin_name
    source = describe_plugin(manager, plugin_name)

    @functools.wraps(function)
    def labelled(*args: Any, **kwargs: Any) -> None:
        running.append(plugin_name)
        try:
            result = function(*args, **kwargs)
        except Exception as error:  # a bug or a missing resource in the plugin
            if isinstance(error, FedplugError) and source in str(error):
                raise  # the registry's refusal of what the plugin registered: it names the plugin
            raise PluginError(
                f"{source}: {hook_name} raised {type(error).__name__}: {one_line(error)}; "
                f"{_fix(manager, plugin_name)}"
            ) from error
        finally:
            running.pop()
        if result is not None:
            raise PluginError(
                f"{source}: {hook_name} must call register(...) and return "
                f"None, but it returned {type(result).__name__}"
            )

    return labelled


@functools.cache
def default_registry() -> Registry:
    """The registry of the current environment, built once per process."""
    return collect_registry(new_plugin_manager())
