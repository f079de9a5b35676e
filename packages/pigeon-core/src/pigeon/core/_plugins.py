"""The plugin manager: an object owned by a node, never a module global."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

import pluggy

from pigeon.core import hookspecs
from pigeon.core.errors import PluginError

__all__ = ["PluginManager", "Registry"]

log = logging.getLogger(__name__)

T = TypeVar("T")

ENTRY_POINT_GROUP = "pigeon"
DISABLED_ENV = "PIGEON_DISABLED_PLUGINS"


class Registry(Generic[T]):
    """Name → object mapping filled by one registration hook."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str, item: T) -> None:
        if name in self._items:
            raise PluginError(f"{self.kind} {name!r} is registered twice")
        self._items[name] = item

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            known = ", ".join(sorted(self._items)) or "none"
            raise PluginError(
                f"no {self.kind} named {name!r} is registered (known: {known})"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))

    def items(self) -> list[tuple[str, T]]:
        return sorted(self._items.items())


class PluginManager:
    """Loads built-in and installed plugins and collects what they register.

    ``PIGEON_DISABLED_PLUGINS`` (comma-separated plugin names, i.e. entry-point names)
    keeps installed plugins from loading.
    """

    def __init__(
        self,
        *,
        load_entry_points: bool = True,
        disabled: set[str] | None = None,
        extra_plugins: tuple[object, ...] = (),
    ) -> None:
        from pigeon.core import _builtin

        if disabled is None:
            env = os.environ.get(DISABLED_ENV, "")
            disabled = {n.strip() for n in env.split(",") if n.strip()}
        self.disabled = disabled
        self.pm = pluggy.PluginManager("pigeon")
        self.pm.add_hookspecs(hookspecs)
        self.pm.register(_builtin, name="builtin")
        for plugin in extra_plugins:
            self.pm.register(plugin)
        if load_entry_points:
            for name in disabled:
                self.pm.set_blocked(name)
            try:
                self.pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
            except Exception as exc:  # a broken plugin must not take the node down silently
                raise PluginError(f"loading plugins failed: {exc}") from exc
        self.metadata_stores: Registry[object] = Registry("metadata store")
        self.replication_policies: Registry[object] = Registry("replication policy")
        self.codecs: Registry[object] = Registry("codec")
        self.authentication_providers: Registry[Any] = Registry("authentication provider")
        self.pm.hook.pigeon_metadata_stores(registry=self.metadata_stores)
        self.pm.hook.pigeon_replication_policies(registry=self.replication_policies)
        self.pm.hook.pigeon_codecs(registry=self.codecs)
        self.ledger_storages: Registry[Any] = Registry("ledger storage")
        self.pm.hook.pigeon_authentication_providers(registry=self.authentication_providers)
        self.pm.hook.pigeon_ledger_storages(registry=self.ledger_storages)
        self.offloaders: Registry[Any] = Registry("offloader")
        self.pm.hook.pigeon_offloaders(registry=self.offloaders)

    def plugin_names(self) -> list[str]:
        """Names of the loaded plugins (blocked ones are listed with a None plugin)."""
        return sorted(n for n, p in self.pm.list_name_plugin() if n and p is not None)

    def register(self, plugin: object, name: str | None = None) -> None:
        """Register a plugin object after start (tests, embedding applications)."""
        try:
            self.pm.register(plugin, name=name)
        except ValueError as exc:  # pluggy: this object or this name is registered already
            raise PluginError(f"cannot register plugin {name or plugin!r}: {exc}") from None
        for hook, reg in (
            ("pigeon_metadata_stores", self.metadata_stores),
            ("pigeon_replication_policies", self.replication_policies),
            ("pigeon_codecs", self.codecs),
            ("pigeon_authentication_providers", self.authentication_providers),
            ("pigeon_ledger_storages", self.ledger_storages),
            ("pigeon_offloaders", self.offloaders),
        ):
            impl = getattr(plugin, hook, None)
            if impl is not None:
                impl(registry=reg)
