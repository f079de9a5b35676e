"""The hook specifications: each is documented (parameters, firstresult or not, when it
is called) and implemented by a built-in or installed plugin (datasette style)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest

from pigeon.core import PluginManager, hookspecs


def _hookspecs() -> list[tuple[str, Any]]:
    return [
        (name, fn)
        for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
        if name.startswith("pigeon_")
    ]


def _ids(value: object) -> str:
    return value if isinstance(value, str) else ""


def test_hookspecs_exist() -> None:
    assert len(_hookspecs()) >= 4
    # every pigeon_ function is a real hookspec, not a forgotten helper
    for name, fn in _hookspecs():
        assert hasattr(fn, "pigeon_spec"), name


@pytest.mark.parametrize(("name", "fn"), _hookspecs(), ids=_ids)
def test_hookspec_is_documented(name: str, fn: Any) -> None:
    doc = inspect.getdoc(fn)
    assert doc, f"hook {name} has no docstring"
    for param in inspect.signature(fn).parameters:
        assert f":param {param}:" in doc, f"hook {name} does not document {param!r}"
    assert "called" in doc.lower(), f"hook {name} does not say when it is called"
    assert "firstresult" in doc, f"hook {name} does not say whether it is firstresult"


@pytest.mark.parametrize(("name", "fn"), _hookspecs(), ids=_ids)
def test_hookspec_is_implemented(name: str, fn: Any) -> None:
    pm = PluginManager(disabled=set())
    impls = getattr(pm.pm.hook, name).get_hookimpls()
    assert impls, f"no built-in or installed plugin implements {name}"


def test_no_plugin_implements_an_unknown_hook() -> None:
    """A typo in a hookimpl name (pigeon_codec instead of pigeon_codecs) is caught."""
    pm = PluginManager(disabled=set())
    pm.pm.check_pending()
