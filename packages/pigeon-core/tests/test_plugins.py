"""The plugin manager: built-ins and entry-point plugins registered through the hooks,
registries, disabled plugins."""

from __future__ import annotations

import importlib.metadata

import pluggy
import pytest

from pigeon.core import PluginManager, Registry
from pigeon.core._codecs import GZIP, NONE, Codec
from pigeon.core._replication import QuorumPolicy
from pigeon.core.errors import PluginError
from pigeon.core.metadata import EmbeddedMetadataStore

hookimpl = pluggy.HookimplMarker("pigeon")


def _rot13(data: bytes | memoryview) -> bytes:
    return bytes((b + 13) % 256 for b in bytes(data))


def _unrot13(data: bytes | memoryview, size: int) -> bytes:
    return bytes((b - 13) % 256 for b in bytes(data))


ROT = Codec("rot", 200, _rot13, _unrot13)


class RotPlugin:
    @hookimpl
    def pigeon_codecs(self, registry: Registry[Codec]) -> None:
        registry.register(ROT.name, ROT)


class GzipImpostor:
    @hookimpl
    def pigeon_codecs(self, registry: Registry[Codec]) -> None:
        registry.register("gzip", ROT)


def test_builtins_are_registered_through_the_hooks() -> None:
    pm = PluginManager(load_entry_points=False)
    assert pm.plugin_names() == ["builtin"]
    assert pm.codecs.get("none") is NONE
    assert pm.codecs.get("gzip") is GZIP
    assert list(pm.codecs) == ["gzip", "none"]
    assert pm.replication_policies.get("quorum") is QuorumPolicy
    assert list(pm.metadata_stores) == ["embedded"]
    assert pm.metadata_stores.get("embedded") == EmbeddedMetadataStore.from_url


def test_missing_name_lists_known_ones() -> None:
    pm = PluginManager(load_entry_points=False)
    with pytest.raises(PluginError, match=r"no codec named 'snappy'.*gzip, none"):
        pm.codecs.get("snappy")
    assert "snappy" not in pm.codecs and "gzip" in pm.codecs


def test_register_adds_a_codec() -> None:
    pm = PluginManager(load_entry_points=False)
    pm.register(RotPlugin(), name="rot")
    assert pm.codecs.get("rot") is ROT
    assert "rot" in pm.plugin_names()
    # the other registries are untouched
    assert list(pm.metadata_stores) == ["embedded"]


def test_extra_plugins_at_construction() -> None:
    pm = PluginManager(load_entry_points=False, extra_plugins=(RotPlugin(),))
    assert pm.codecs.get("rot") is ROT


def test_duplicate_codec_name_is_refused() -> None:
    pm = PluginManager(load_entry_points=False)
    with pytest.raises(PluginError, match="'gzip' is registered twice"):
        pm.register(GzipImpostor(), name="impostor")
    assert pm.codecs.get("gzip") is GZIP
    with pytest.raises(PluginError, match="'gzip' is registered twice"):
        PluginManager(load_entry_points=False, extra_plugins=(GzipImpostor(),))


def test_duplicate_plugin_registration_is_a_plugin_error() -> None:
    pm = PluginManager(load_entry_points=False)
    plugin = RotPlugin()
    pm.register(plugin, name="rot")
    with pytest.raises(PluginError, match="rot"):
        pm.register(RotPlugin(), name="rot")  # same name
    with pytest.raises(PluginError):
        pm.register(plugin, name="rot-again")  # same object
    assert pm.codecs.get("rot") is ROT


def test_registry_refuses_twice() -> None:
    registry: Registry[int] = Registry("thing")
    registry.register("a", 1)
    with pytest.raises(PluginError, match="thing 'a' is registered twice"):
        registry.register("a", 2)
    assert registry.items() == [("a", 1)]


# ------------------------------------------------------------------ entry points


def test_zstd_is_an_installed_entry_point() -> None:
    names = {ep.name for ep in importlib.metadata.entry_points(group="pigeon")}
    assert {"zstd", "broker", "bookie", "client"} <= names


def test_entry_point_plugins_load() -> None:
    pm = PluginManager(disabled=set())
    assert {"builtin", "zstd", "broker", "bookie", "client"} <= set(pm.plugin_names())
    assert "zstd" in pm.codecs


def test_disabled_env_blocks_an_entry_point_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIGEON_DISABLED_PLUGINS", " zstd , nonexistent")
    pm = PluginManager()
    assert "zstd" not in pm.codecs
    assert "zstd" not in pm.plugin_names()
    assert pm.disabled == {"zstd", "nonexistent"}
    # everything else still loads
    assert "gzip" in pm.codecs
    assert "broker" in pm.plugin_names()
    with pytest.raises(PluginError, match="no codec named 'zstd'"):
        pm.codecs.get("zstd")


def test_disabled_argument_beats_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIGEON_DISABLED_PLUGINS", "zstd")
    pm = PluginManager(disabled=set())
    assert "zstd" in pm.codecs
    pm = PluginManager(disabled={"zstd"})
    assert "zstd" not in pm.codecs


# ------------------------------------------------------------------ hookspec docs
