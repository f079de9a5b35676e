"""Authentication: who is on the other end of a connection (its **role**).

Both sides of every PigeonMQ link use this module:

* the **dialling side** hands :func:`pigeon.core.rpc.connect_tcp` a
  :class:`ClientAuthentication` (:class:`AuthenticationToken`, :class:`AuthenticationTLS`);
  its ``auth_method`` and ``auth_data()`` travel in the ``connect`` handshake, asked for
  afresh on every new connection (so a token file that changed is read again);
* the **accepting side** hands :func:`pigeon.core.rpc.serve_tcp` an
  :class:`Authenticator`: the providers the node enables (``authentication_providers``,
  registered through the ``pigeon_authentication_providers`` hook), which turn an
  :class:`AuthData` into a role or raise :class:`AuthenticationError`.  The role is kept on
  the connection (``conn.role``) for authorization, checked once per attach.

Built-in providers: ``token`` (a JWT from ``pigeon tokens``: HS256 with
``token_secret_key``, RS256/ES256 with ``token_public_key``; ``exp`` enforced; the role is
``sub``) and ``tls`` (the verified client certificate's common name).  Secrets are never
part of an error message or a log line.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from pigeon.core.errors import AuthenticationError, ConfigError

__all__ = [
    "AuthData",
    "AuthenticationProvider",
    "AuthenticationTLS",
    "AuthenticationToken",
    "Authenticator",
    "ClientAuthentication",
    "TlsAuthenticationProvider",
    "TokenAuthenticationProvider",
    "certificate_common_name",
    "client_authentication",
]


# ----------------------------------------------------------------- the accepting side


@dataclass(frozen=True, slots=True)
class AuthData:
    """What a peer presented when it connected."""

    #: the method the peer named in its handshake (``token``, ``tls``, or "" for none)
    method: str
    #: the credentials of that method (a token's bytes; empty for ``tls``)
    data: bytes = b""
    #: the peer's verified TLS certificate (``ssl.SSLSocket.getpeercert()``), or None
    peer_certificate: Mapping[str, Any] | None = None
    #: ``host:port`` of the peer, for log lines
    peer_address: str = ""


@runtime_checkable
class AuthenticationProvider(Protocol):
    """One way of establishing a role, registered by name through
    ``pigeon_authentication_providers``; ``factory(settings)`` builds it from the node's
    configuration (an object with the ``token_*`` / ``tls_*`` attributes of
    :class:`pigeon.broker.BrokerConfig`)."""

    #: the ``auth_method`` a client names in its handshake to use this provider
    auth_method: str

    def authenticate(self, auth: AuthData) -> str:
        """The role of the peer; raises :class:`AuthenticationError` (without the
        secret in its message) when the credentials do not establish one."""
        ...


def certificate_common_name(certificate: Mapping[str, Any] | None) -> str | None:
    """The subject's commonName of a certificate as ``getpeercert()`` gives it."""
    if not certificate:
        return None
    for rdn in certificate.get("subject", ()):
        for key, value in rdn:
            if key == "commonName" and value:
                return str(value)
    return None


class TokenAuthenticationProvider:
    """``token``: a JWT signed with the secret key (HS256) or the private key whose
    public key is configured (RS256/ES256); role = ``sub``, ``exp`` enforced."""

    auth_method = "token"

    def __init__(self, key: bytes) -> None:
        from pigeon.core import tokens

        self._validate = tokens.validate_token
        self._key = key
        tokens.check_key(key)

    @classmethod
    def from_settings(cls, settings: Any) -> TokenAuthenticationProvider:
        from pigeon.core.tokens import load_key

        secret = getattr(settings, "token_secret_key", "")
        public = getattr(settings, "token_public_key", "")
        if bool(secret) == bool(public):
            raise ConfigError(
                "the token authentication provider needs exactly one of 'token_secret_key'"
                " (HS256) and 'token_public_key' (RS256/ES256)"
            )
        return cls(load_key(secret or public))

    def authenticate(self, auth: AuthData) -> str:
        if not auth.data:
            raise AuthenticationError("no token was presented")
        try:
            token = bytes(auth.data).decode("ascii")
        except UnicodeDecodeError:
            raise AuthenticationError("the token is not valid: not ASCII text") from None
        return self._validate(token, self._key)

    def expires_at(self, auth: AuthData) -> float | None:
        """The ``exp`` (Unix seconds) of a token :meth:`authenticate` accepted; None
        when it never expires."""
        import jwt

        try:
            claims = jwt.decode(bytes(auth.data), options={"verify_signature": False})
        except jwt.PyJWTError:
            return None
        exp = claims.get("exp")
        return float(exp) if isinstance(exp, int | float) else None


class TlsAuthenticationProvider:
    """``tls``: the role is the common name of the client's certificate, which the TLS
    handshake verified against ``tls_trust_certs_file``."""

    auth_method = "tls"

    @classmethod
    def from_settings(cls, settings: Any) -> TlsAuthenticationProvider:
        return cls()

    def authenticate(self, auth: AuthData) -> str:
        name = certificate_common_name(auth.peer_certificate)
        if name is None:
            raise AuthenticationError(
                "tls authentication needs a client certificate with a common name, verified"
                " over a TLS connection"
            )
        return name


class Authenticator:
    """The providers a node enables, by the method a peer names.

    A peer that names no method is authenticated by the ``tls`` provider when it is
    enabled and the peer showed a verified certificate, and refused otherwise.
    """

    def __init__(self, providers: Iterable[AuthenticationProvider]) -> None:
        self.providers = {p.auth_method: p for p in providers}
        if not self.providers:
            raise ConfigError("authentication is enabled but 'authentication_providers' is empty")

    @classmethod
    def from_settings(cls, settings: Any, registry: Any) -> Authenticator:
        """Build the providers ``settings.authentication_providers`` names from the
        plugin registry (``PluginManager.authentication_providers``)."""
        names = list(getattr(settings, "authentication_providers", ()) or ())
        providers = []
        for name in names:
            if name not in registry:
                known = ", ".join(sorted(registry)) or "none"
                raise ConfigError(
                    f"unknown authentication provider {name!r} in 'authentication_providers'"
                    f" (known: {known})"
                )
            providers.append(registry.get(name)(settings))
        return cls(providers)

    @property
    def methods(self) -> list[str]:
        return sorted(self.providers)

    def authenticate(self, auth: AuthData) -> str:
        method = auth.method
        if not method and "tls" in self.providers and auth.peer_certificate:
            method = "tls"
        if not method:
            raise AuthenticationError(
                f"authentication is required: connect with credentials ({', '.join(self.methods)})"
            )
        provider = self.providers.get(method)
        if provider is None:
            raise AuthenticationError(
                f"authentication method {method!r} is not enabled here"
                f" (enabled: {', '.join(self.methods)})"
            )
        return provider.authenticate(auth)

    def expires_at(self, auth: AuthData) -> float | None:
        """When the credentials :meth:`authenticate` accepted expire (Unix seconds), for
        providers that know (``expires_at(auth)``, as the ``token`` provider's); None:
        never."""
        method = auth.method or ("tls" if auth.peer_certificate else "")
        expires = getattr(self.providers.get(method), "expires_at", None)
        return None if expires is None else expires(auth)


# ------------------------------------------------------------------ the dialling side


@runtime_checkable
class ClientAuthentication(Protocol):
    """Credentials a client presents in the ``connect`` handshake."""

    #: the provider name the server authenticates with (``token``, ``tls``)
    auth_method: str

    def auth_data(self) -> bytes:
        """The credentials, asked for on every new connection."""
        ...


@dataclass(eq=False)
class AuthenticationToken:
    """Token authentication, as Pulsar's ``AuthenticationToken``.

    ``token`` is the token itself, a callable returning it (asked on every connection),
    or ``file:///path`` / a :class:`~pathlib.Path`: a file read again whenever it changed
    (its modification time), so a rotated token is used by the next connection.
    """

    token: str | Path | Callable[[], str] = field(repr=False)
    auth_method: str = field(default="token", init=False)
    _cached: tuple[float, int, bytes] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        token = self.token
        if isinstance(token, str) and not token.startswith("file://") and not token.strip():
            raise ConfigError("AuthenticationToken needs a token, a callable or file:///path")

    def __repr__(self) -> str:  # never the token
        return f"AuthenticationToken({self._source()})"

    def _source(self) -> str:
        token = self.token
        if isinstance(token, Path):
            return f"file://{token}"
        if isinstance(token, str) and token.startswith("file://"):
            return token
        return "<callable>" if callable(token) else "<token>"

    def auth_data(self) -> bytes:
        token = self.token
        if callable(token):
            return str(token()).strip().encode()
        if isinstance(token, Path) or token.startswith("file://"):
            return self._read(Path(str(token).removeprefix("file://")))
        return token.strip().encode()

    def _read(self, path: Path) -> bytes:
        try:
            st = os.stat(path)
            if self._cached is not None and self._cached[:2] == (st.st_mtime, st.st_size):
                return self._cached[2]
            data = path.read_bytes().strip()
        except OSError as exc:
            raise AuthenticationError(
                f"cannot read the token file {str(path)!r}: {exc.strerror}"
            ) from None
        self._cached = (st.st_mtime, st.st_size, data)
        return data


@dataclass(eq=False)
class AuthenticationTLS:
    """Client-certificate authentication, as Pulsar's ``AuthenticationTLS``: the
    certificate and key are presented in the TLS handshake (the client's TLS settings
    load them) and the server's ``tls`` provider takes the certificate's common name as
    the role."""

    certificate_path: str
    private_key_path: str
    auth_method: str = field(default="tls", init=False)

    def auth_data(self) -> bytes:
        return b""


def client_authentication(auth_plugin: str, auth_params: str) -> ClientAuthentication | None:
    """Client credentials from Pulsar-style settings (``auth_plugin`` = ``token`` or
    ``tls``, ``auth_params`` = ``token:...`` / ``file:///path`` for a token, or
    ``tls_cert_file:...,tls_key_file:...`` for a certificate); None without a plugin."""
    if not auth_plugin:
        return None
    if auth_plugin == "token":
        if auth_params.startswith("token:"):
            return AuthenticationToken(auth_params.removeprefix("token:"))
        if auth_params.startswith("file://"):
            return AuthenticationToken(auth_params)
        raise ConfigError(
            "token authentication parameters must be 'token:<token>' or 'file:///path'"
        )
    if auth_plugin == "tls":
        params = dict(part.split(":", 1) for part in auth_params.split(",") if ":" in part)
        try:
            return AuthenticationTLS(params["tls_cert_file"], params["tls_key_file"])
        except KeyError:
            raise ConfigError(
                "tls authentication parameters must be 'tls_cert_file:<path>,tls_key_file:<path>'"
            ) from None
    raise ConfigError(f"unknown authentication plugin {auth_plugin!r} (token, tls)")
