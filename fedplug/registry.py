"""The registry of named components that plugins fill through their hooks."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, Callable

from fedplug.components import ComponentConfig
from fedplug.errors import ConfigError, PluginError

KINDS = (
    "datasets",
    "partitioners",
    "models",
    "samplers",
    "loss_transforms",
    "aggregators",
    "groupers",
)


@dataclass(frozen=True)
class Registration:
    """One named component: its config class, its factory and the plugin it came from."""

    kind: str
    name: str
    config_class: type[ComponentConfig]
    factory: Callable[..., Any]
    plugin: str

    @property
    def summary(self) -> str:
        """First line of the config class's docstring."""
        doc = (self.config_class.__doc__ or "").strip()
        return doc.splitlines()[0] if doc else ""


@dataclass(frozen=True)
class TrackerRegistration:
    """One named tracker backend (``tracking.backends``): its factory and plugin."""

    name: str
    factory: Callable[..., Any]
    plugin: str


class Registry:
    """Components by kind and name, and tracker backends by name.

    Args:
        sources: plugin name -> how errors name that plugin, for the plugins installed
            from entry points (``plugin 'name' (entry point 'name = value' of
            distribution 'dist' 1.0)``); any other plugin is ``plugin 'name'``.
    """

    def __init__(self, sources: dict[str, str] | None = None) -> None:
        self._entries: dict[str, dict[str, Registration]] = {kind: {} for kind in KINDS}
        self._trackers: dict[str, TrackerRegistration] = {}
        self._sources: dict[str, str] = dict(sources or {})

    def describe(self, plugin: str) -> str:
        """How errors name ``plugin``: with its distribution and entry point when known."""
        return self._sources.get(plugin, f"plugin {plugin!r}")

    def register_tracker(self, plugin: str, name: str, factory: Callable[..., Any]) -> None:
        """Add one tracker backend (``fedplug_register_trackers``)."""
        where = f"{self.describe(plugin)} registering tracker {name!r}"
        if not isinstance(name, str) or not name:
            raise PluginError(f"{where}: the name must be a non-empty string")
        existing = self._trackers.get(name)
        if existing is not None:
            raise PluginError(
                f"{where}: the name is already registered by {self.describe(existing.plugin)}; "
                "rename one of them"
            )
        if not callable(factory):
            raise PluginError(f"{where}: the factory must be callable, got {factory!r}")
        self._trackers[name] = TrackerRegistration(name, factory, plugin)

    def tracker_entries(self) -> list[TrackerRegistration]:
        return [self._trackers[name] for name in sorted(self._trackers)]

    def tracker(self, name: str) -> Callable[..., Any]:
        """The factory of tracker backend ``name``."""
        try:
            return self._trackers[name].factory
        except KeyError:
            raise ConfigError(
                f"tracking.backends: unknown tracker {name!r}; registered: "
                f"{', '.join(sorted(self._trackers)) or 'none'}"
            ) from None

    def register(
        self,
        kind: str,
        plugin: str,
        name: str,
        config_class: type[ComponentConfig],
        factory: Callable[..., Any],
    ) -> None:
        """Add one component; reject what would make the registry ambiguous or unusable."""
        where = f"{self.describe(plugin)} registering {kind[:-1]} {name!r}"
        if not isinstance(name, str) or not name:
            raise PluginError(f"{where}: the name must be a non-empty string")
        existing = self._entries[kind].get(name)
        if existing is not None:
            raise PluginError(
                f"{where}: the name is already registered by {self.describe(existing.plugin)}; "
                "rename one of them"
            )
        if not (isinstance(config_class, type) and issubclass(config_class, ComponentConfig)):
            raise PluginError(
                f"{where}: the config class must subclass fedplug.components.ComponentConfig, "
                f"got {config_class!r}"
            )
        annotation = config_class.model_fields["name"].annotation
        if typing.get_origin(annotation) is not typing.Literal or typing.get_args(annotation) != (
            name,
        ):
            raise PluginError(
                f"{where}: {config_class.__name__}.name must be declared as Literal[{name!r}]"
            )
        if not callable(factory):
            raise PluginError(f"{where}: the factory must be callable, got {factory!r}")
        self._entries[kind][name] = Registration(kind, name, config_class, factory, plugin)

    def names(self, kind: str) -> list[str]:
        return sorted(self._entries[kind])

    def entries(self, kind: str) -> list[Registration]:
        return [self._entries[kind][name] for name in self.names(kind)]

    def get(self, kind: str, name: str) -> Registration:
        try:
            return self._entries[kind][name]
        except KeyError:
            raise ConfigError(
                f"unknown {kind[:-1].replace('_', ' ')} {name!r}; "
                f"registered: {', '.join(self.names(kind))}"
            ) from None

    def build(self, kind: str, config: ComponentConfig, *args: Any, **kwargs: Any) -> Any:
        """Call the factory registered under ``config.name``."""
        return self.get(kind, config.name).factory(config, *args, **kwargs)
