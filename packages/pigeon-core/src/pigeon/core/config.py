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
from typing import Any, Final, TypeVar

from pigeon.core.errors import ConfigError

__all__ = ["ENV_PREFIX", "SecurityConfig", "load_config"]

ENV_PREFIX = "PIGEON_"
T = TypeVar("T")

#: numeric field types: what the error says is expected, and the values refused before
#: conversion (a bool is no number; ``int(2.5)`` would silently truncate)
_NUMBERS: dict[type, tuple[str, type | tuple[type, ...]]] = {
    int: ("an integer", (bool, float)),
    float: ("a number", bool),
}


#: words in the keys whose values are credentials: a bad value of one is not echoed
_SECRET_WORDS: Final = ("secret", "token", "password", "authentication_parameters", "private")


def _is_secret(key: str) -> bool:
    return any(word in key for word in _SECRET_WORDS)


def _convert(key: str, value: Any, tp: Any, source: str) -> Any:
    def bad(expected: str) -> ConfigError:
        got = f"a {type(value).__name__} (not shown)" if _is_secret(key) else repr(value)
        return ConfigError(f"bad value for {key!r} (from {source}): expected {expected}, got {got}")

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
    if origin is list and typing.get_args(tp) == (str,):
        if isinstance(value, str):  # from the environment or a flag: comma-separated
            return [part.strip() for part in value.split(",") if part.strip()]
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise bad("a list of strings")
        return list(value)
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


@dataclasses.dataclass
class SecurityConfig:
    """TLS, authentication and authorization settings every node takes, with the names of
    Pulsar's ``broker.conf`` in snake_case (docs/security.md).  A broker's and a bookie's
    configuration include these keys in their own table."""

    #: refuse connections that do not authenticate (``authentication_providers``)
    authentication_enabled: bool = False
    #: the authentication providers enabled (``pigeon plugins`` lists them): token, tls
    authentication_providers: list[str] = dataclasses.field(default_factory=lambda: ["token"])
    #: the HS256 secret key tokens are checked with: ``file:///path`` or ``data:;base64,...``
    token_secret_key: str = dataclasses.field(default="", repr=False)
    #: the RS256/ES256 public key tokens are checked with (instead of a secret key)
    token_public_key: str = ""
    #: check every attach and admin call against the roles' permissions
    authorization_enabled: bool = False
    #: roles that may do everything (brokers' own roles belong here)
    superuser_roles: list[str] = dataclasses.field(default_factory=list)
    #: this node's TLS certificate (PEM; the chain may follow it) and private key
    tls_certificate_file: str = ""
    tls_key_file: str = ""
    #: CAs whose certificates this node trusts (client certificates, and the servers it
    #: dials when ``broker_client_trust_certs_file_path`` is empty)
    tls_trust_certs_file: str = ""
    #: mutual TLS: a client without a certificate signed by a trusted CA is refused
    tls_require_trusted_client_cert: bool = False
    #: the links this node dials (a broker to bookies) check the server's host name
    tls_hostname_verification_enabled: bool = True
    #: how this node authenticates where it dials: "" (not at all), token or tls
    broker_client_authentication_plugin: str = ""
    #: its parameters: ``file:///path`` or ``token:...`` for a token (prefer the file:
    #: ``ps`` shows no file contents), ``tls_cert_file:...,tls_key_file:...`` for tls
    broker_client_authentication_parameters: str = dataclasses.field(default="", repr=False)
    #: dial other nodes (bookies) over TLS
    broker_client_tls_enabled: bool = False
    #: CAs the dialled nodes' certificates must be signed by (default:
    #: ``tls_trust_certs_file``)
    broker_client_trust_certs_file_path: str = ""

    def validate_security(self) -> None:
        """One-line errors for settings that cannot work together (files are checked
        when the node loads them)."""
        if self.authentication_enabled and not self.authentication_providers:
            raise ConfigError(
                "bad value for 'authentication_providers': authentication is enabled but"
                " no provider is named"
            )
        if self.authorization_enabled and not self.authentication_enabled:
            raise ConfigError(
                "'authorization_enabled' needs 'authentication_enabled' (roles come from"
                " authentication)"
            )
        if bool(self.tls_certificate_file) != bool(self.tls_key_file):
            raise ConfigError("'tls_certificate_file' and 'tls_key_file' go together")
        if self.tls_require_trusted_client_cert and not self.tls_trust_certs_file:
            raise ConfigError(
                "'tls_require_trusted_client_cert' needs 'tls_trust_certs_file' (the CAs"
                " client certificates must be signed by)"
            )
        if self.broker_client_authentication_plugin not in ("", "token", "tls"):
            raise ConfigError(
                "bad value for 'broker_client_authentication_plugin':"
                f" {self.broker_client_authentication_plugin!r} is not '', 'token' or 'tls'"
            )

    def client_tls_context(self) -> Any:
        """The :class:`ssl.SSLContext` this node dials other nodes with, or None."""
        if not self.broker_client_tls_enabled:
            return None
        from pigeon.core.auth import AuthenticationTLS, client_authentication
        from pigeon.core.tls import client_context

        auth = client_authentication(
            self.broker_client_authentication_plugin,
            self.broker_client_authentication_parameters,
        )
        cert = key = ""
        if isinstance(auth, AuthenticationTLS):
            cert, key = auth.certificate_path, auth.private_key_path
        return client_context(
            trust_certs_file=self.broker_client_trust_certs_file_path or self.tls_trust_certs_file,
            certificate_file=cert,
            key_file=key,
            verify_hostname=self.tls_hostname_verification_enabled,
            what="broker_client_tls",
        )

    def client_authentication(self) -> Any:
        """The credentials this node presents where it dials, or None."""
        from pigeon.core.auth import client_authentication

        return client_authentication(
            self.broker_client_authentication_plugin,
            self.broker_client_authentication_parameters,
        )

    def server_tls(self, what: str) -> Any:
        """The :class:`pigeon.core.tls.ServerTls` of this node's TLS listeners, or None
        without a certificate."""
        if not self.tls_certificate_file:
            return None
        from pigeon.core.tls import ServerTls

        return ServerTls(
            certificate_file=self.tls_certificate_file,
            key_file=self.tls_key_file,
            trust_certs_file=self.tls_trust_certs_file,
            require_client_cert=self.tls_require_trusted_client_cert,
            what=what,
        )

    def authenticator(self, registry: Any) -> Any:
        """The :class:`pigeon.core.auth.Authenticator` of this node, or None when
        authentication is off."""
        if not self.authentication_enabled:
            return None
        from pigeon.core.auth import Authenticator

        return Authenticator.from_settings(self, registry)
