"""Configuration: TOML file, then ``PIGEON_*`` environment, then command-line flags.

Each node describes its settings as a dataclass with defaults; :func:`load_config` fills
one from the three sources, later sources winning, converts strings from the environment
to the field's type, and raises :class:`pigeon.core.errors.ConfigError` naming the bad
key and where it came from.  Example TOML::

    [broker]
    port = 6650
    max_message_size = 5242880

    [bookie]
    fsync = "always"
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from pigeon.core.errors import ConfigError

__all__ = ["ENV_PREFIX", "load_config"]

ENV_PREFIX = "PIGEON_"
T = TypeVar("T")

#: numeric field types: what the error says is expected, and the values refused before
#: conversion (a bool is no number; ``int(2.5)`` would silently truncate)
_NUMBERS: dict[type, tuple[str, type | tuple[type, ...]]] = {
    int: ("an integer", (bool, float)),
    float: ("a number", bool),
}


def _convert(key: str, value: Any, tp: Any, source: str) -> Any:
    def bad(expected: str) -> ConfigError:
        return ConfigError(
            f"bad value for {key!r} (from {source}): expected {expected}, got {value!r}"
        )

    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(
                f"bad value for {key!r} (from {source}): {value!r} is not one of "
                + ", ".join(repr(c) for c in choices)
            )
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
            return False
        raise bad("a boolean")
    if tp in _NUMBERS:
        expected, refused = _NUMBERS[tp]
        if isinstance(value, refused):
            raise bad(expected)
        try:
            return tp(value)
        except (TypeError, ValueError):
            raise bad(expected) from None
    if tp is str:
        if not isinstance(value, str):
            raise bad("a string")
        return value
    return value


def load_config(
    cls: type[T],
    *,
    path: str | os.PathLike[str] | None = None,
    section: str | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> T:
    """Build a ``cls`` dataclass from a TOML file, the environment and overrides.

    ``overrides`` whose value is ``None`` are ignored (unset command-line flags).
    Unknown keys in the file or the overrides are errors; after filling, the dataclass's
    ``validate()`` method (if any) runs and may raise ConfigError.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    hints = typing.get_type_hints(cls)
    fields = {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}
    values: dict[str, Any] = {}

    def put(key: str, value: Any, source: str) -> None:
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise ConfigError(
                f"unknown configuration key {key!r} (from {source}); known keys: {known}"
            )
        values[key] = _convert(key, value, fields[key], source)

    if path is not None:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"configuration file {str(p)!r} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"configuration file {str(p)!r} is not valid TOML: {exc}") from None
        table: Any = data.get(section, {}) if section else data
        if not isinstance(table, dict):
            raise ConfigError(f"[{section}] in {str(p)!r} must be a table")
        for key, value in table.items():
            if section is None and isinstance(value, dict):
                continue  # other sections
            put(key, value, f"{p.name}" + (f" [{section}]" if section else ""))
    environ = os.environ if env is None else env
    for key in fields:
        name = ENV_PREFIX + key.upper()
        if name in environ:
            put(key, environ[name], name)
    for key, value in (overrides or {}).items():
        if value is not None:
            put(key, value, "command line")
    obj = cls(**values)
    validate = getattr(obj, "validate", None)
    if validate is not None:
        validate()
    return obj
