"""The registry of named components that plugins fill through their hooks."""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fedplug.errors import ConfigError, PluginError

if TYPE_CHECKING:  # imported where it is used: `fedplug --help` imports this module, not torch
    from fedplug.component_config import ComponentConfig

KINDS = (
    "datasets",
    "partitioners",
    "models",
    "samplers",
    "loss_transforms",
    "aggregators",
    "groupers",
)


def literal_name(config_class: type[ComponentConfig]) -> str | None:
    """``"fedavgm"`` for a config class declaring ``name: Literal["fedavgm"]``; None when
    its ``name`` is not a Literal of exactly one string."""
    annotation = config_class.model_fields["name"].annotation
    arguments = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal and len(arguments) == 1:
        return arguments[0] if isinstance(arguments[0], str) else None
    return None


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
            raise self._taken("tracker", name, plugin, existing.plugin)
        if not callable(factory):
            raise PluginError(f"{where}: the factory must be callable, got {factory!r}")
        self._trackers[name] = TrackerRegistration(name, factory, plugin)

    def _taken(self, what: str, name: str, plugin: str, first: str) -> PluginError:
        """The error for two plugins registering one name. Which registers first is
        pluggy's order (``tryfirst``, ``trylast``, the latest registered plugin first), so
        the error leads with the installed plugin when only one of them is: it is the one
        the user can rename or uninstall."""
        lead, other = plugin, first
        if other in self._sources and lead not in self._sources:
            lead, other = other, lead
        return PluginError(
            f"{self.describe(lead)} registering {what} {name!r}: the name is also registered "
            f"by {self.describe(other)}; rename one of them"
        )

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

    def add(self, kind: str, plugin: str, *arguments: Any) -> None:
        """Add what one ``register(...)`` call of ``plugin`` passed: ``(config_class,
        factory)``, named by the config class, or the old ``(name, config_class,
        factory)``."""
        if len(arguments) == 3:
            self.register(kind, plugin, *arguments)
            return
        if len(arguments) != 2:
            raise PluginError(
                f"{self.describe(plugin)} registering {kind[:-1]}: register takes "
                f"(ConfigClass, factory), or the old (name, ConfigClass, factory); "
                f"got {len(arguments)} arguments"
            )
        config_class, factory = arguments
        name = self._declared_name(kind, plugin, config_class)
        self.register(kind, plugin, name, config_class, factory)

    def _declared_name(self, kind: str, plugin: str, config_class: Any) -> str:
        """The one string of ``config_class.name: Literal[...]``: the component's name."""
        from fedplug.component_config import ComponentConfig

        class_name = getattr(config_class, "__name__", repr(config_class))
        where = f"{self.describe(plugin)} registering {kind[:-1]} by config class {class_name}"
        if not (isinstance(config_class, type) and issubclass(config_class, ComponentConfig)):
            raise PluginError(
                f"{where}: the config class must subclass fedplug.components.ComponentConfig"
            )
        name = literal_name(config_class)
        if name is None:
            annotation = config_class.model_fields["name"].annotation
            shown = annotation.__name__ if isinstance(annotation, type) else repr(annotation)
            raise PluginError(
                f"{where}: {class_name}.name is {shown.replace('typing.', '')}; "
                f"declare it as Literal['its-name'] (one string) to name the {kind[:-1]}"
            )
        return name

    def register(
        self,
        kind: str,
        plugin: str,
        name: str,
        config_class: type[ComponentConfig],
        factory: Callable[..., Any],
    ) -> None:
        """Add one component; reject what would make the registry ambiguous or unusable."""
        from fedplug.component_config import ComponentConfig

        where = f"{self.describe(plugin)} registering {kind[:-1]} {name!r}"
        if not isinstance(name, str) or not name:
            raise PluginError(f"{where}: the name must be a non-empty string")
        existing = self._entries[kind].get(name)
        if existing is not None:
            raise self._taken(kind[:-1], name, plugin, existing.plugin)
        if not (isinstance(config_class, type) and issubclass(config_class, ComponentConfig)):
            raise PluginError(
                f"{where}: the config class must subclass fedplug.components.ComponentConfig, "
                f"got {config_class!r}"
            )
        if literal_name(config_class) != name:
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
