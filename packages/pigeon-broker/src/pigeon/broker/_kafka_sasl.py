"""SASL for the Kafka front door: the per-connection state machine and the mechanisms'
byte layouts (no I/O; :mod:`pigeon.broker._kafka` moves the bytes).

A Kafka client authenticates right after ApiVersions (KIP-43, KIP-152)::

    SaslHandshake(mechanism)        -> error_code, mechanisms offered
    SaslAuthenticate(auth_bytes)    -> error_code, error_message, auth_bytes, session_lifetime

Until SaslAuthenticate succeeds only ApiVersions, SaslHandshake and SaslAuthenticate are
answered; any other request closes the connection, as a Kafka broker does.  A client of
SaslHandshake v0 sends its token next as a bare size-prefixed frame, without a Kafka
request header (the Kafka 0.10 layout), and is answered by an empty bare frame.

Re-authentication (KIP-368): SaslAuthenticate v1+ answers ``session_lifetime`` — the
time left until the token's ``exp`` (0: it never expires, see :func:`session_lifetime_ms`).
A client that knows KIP-368 (librdkafka ≥ 2.2, the Java client) sends SaslHandshake and
SaslAuthenticate again on the same connection before then, with the same mechanism and
a token of the same role; one that does not has its connection closed on its first
request after the expiry, and authenticates afresh on a new one.

Both mechanisms carry a PigeonMQ token (validated by the ``token`` authentication
provider; the role is its subject):

* ``PLAIN`` (RFC 4616): ``[authzid] NUL username NUL password``.  The password is the
  token, optionally written ``token:<jwt>`` (as Kafka-on-Pulsar takes it); the username
  is not checked (Kafka-on-Pulsar has it name a tenant/namespace: here the namespace is
  ``[kafka] namespace``), so any value will do.
* ``OAUTHBEARER`` (RFC 7628): the client's initial response
  ``gs2-header \\x01 auth=Bearer <token> \\x01 [key=value \\x01 ...] \\x01``, the
  gs2-header being ``n,,`` or ``n,a=<authzid>,``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from pigeon.core.errors import ConfigError

__all__ = [
    "MECHANISMS",
    "OPEN_APIS",
    "SASL_AUTHENTICATE_KEY",
    "SASL_HANDSHAKE_KEY",
    "SASL_VERSIONS",
    "SaslFailure",
    "SaslSession",
    "check_mechanisms",
    "oauthbearer_token",
    "plain_token",
    "session_lifetime_ms",
]

SASL_HANDSHAKE_KEY: Final = 17
SASL_AUTHENTICATE_KEY: Final = 36
#: served only when the listener's security protocol is SASL_PLAINTEXT or SASL_SSL
SASL_VERSIONS: Final[dict[int, tuple[int, int]]] = {
    SASL_HANDSHAKE_KEY: (0, 1),
    SASL_AUTHENTICATE_KEY: (0, 2),
}
#: the APIs answered before a SASL client authenticated (ApiVersions and SASL's own)
OPEN_APIS: Final = frozenset({18, SASL_HANDSHAKE_KEY, SASL_AUTHENTICATE_KEY})
MECHANISMS: Final = ("PLAIN", "OAUTHBEARER")

#: Kafka's error codes of the handshake
UNSUPPORTED_SASL_MECHANISM: Final = 33
ILLEGAL_SASL_STATE: Final = 34
SASL_AUTHENTICATION_FAILED: Final = 58

#: a token (a JWT) is far smaller; larger credentials are refused unread
MAX_AUTH_BYTES: Final = 64 * 1024


class SaslFailure(Exception):
    """Credentials that do not parse, or a SASL step out of order; the message names
    the reason, never the credentials."""

    def __init__(self, message: str, *, code: int = SASL_AUTHENTICATION_FAILED) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def check_mechanisms(names: Iterable[str]) -> tuple[str, ...]:
    """The mechanisms named (upper case, in order, without repeats).

    :raises ConfigError: an unknown mechanism, or none.
    """
    if isinstance(names, str):
        names = [n for n in names.split(",")]
    out: list[str] = []
    for raw in names:
        name = str(raw).strip().upper()
        if not name:
            continue
        if name not in MECHANISMS:
            raise ConfigError(
                f"bad value for 'sasl_enabled_mechanisms' in [kafka]: {str(raw)!r} is not"
                f" supported (supported: {', '.join(MECHANISMS)})"
            )
        if name not in out:
            out.append(name)
    if not out:
        raise ConfigError(
            "bad value for 'sasl_enabled_mechanisms' in [kafka]: name at least one of"
            f" {', '.join(MECHANISMS)}"
        )
    return tuple(out)


def _text(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise SaslFailure(f"the {what} is not UTF-8 text") from None


def plain_token(auth_bytes: bytes) -> str:
    """The token of a PLAIN message ``[authzid] NUL username NUL password``."""
    fields = bytes(auth_bytes).split(b"\0")
    if len(fields) != 3:
        raise SaslFailure(
            "malformed SASL PLAIN message: expected [authzid] NUL username NUL password"
        )
    token = _text(fields[2], "SASL PLAIN password").strip()
    if token.startswith("token:"):
        token = token[len("token:") :]
    if not token:
        raise SaslFailure("the SASL PLAIN password is empty: it must be a token")
    return token


def oauthbearer_token(auth_bytes: bytes) -> str:
    """The bearer token of an OAUTHBEARER client initial response (RFC 7628 §3.1)."""
    text = _text(bytes(auth_bytes), "SASL OAUTHBEARER message")
    head, sep, rest = text.partition("\x01")
    if not sep or not head.startswith(("n,", "y,")) or head.count(",") < 2:
        raise SaslFailure(
            "malformed SASL OAUTHBEARER message: expected a gs2 header such as 'n,,'"
            " followed by \\x01auth=Bearer <token>\\x01\\x01"
        )
    if not rest.endswith("\x01\x01") and rest != "\x01":
        raise SaslFailure("malformed SASL OAUTHBEARER message: it must end with \\x01\\x01")
    for pair in rest.split("\x01"):
        key, eq, value = pair.partition("=")
        if eq and key == "auth":
            scheme, _, token = value.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise SaslFailure(
                    "malformed SASL OAUTHBEARER message: auth must be 'Bearer <token>'"
                )
            return token.strip()
    raise SaslFailure("malformed SASL OAUTHBEARER message: no auth=Bearer <token> in it")


def session_lifetime_ms(expires_at: float | None, now: float) -> int:
    """SaslAuthenticate's ``session_lifetime_ms`` for credentials expiring at
    ``expires_at`` (Unix seconds; None: never) authenticated at ``now``: the
    milliseconds left (at least 1: 0 would mean "never"), or 0 when they never expire."""
    if expires_at is None:
        return 0
    return max(1, int((expires_at - now) * 1000))


_PARSERS = {"PLAIN": plain_token, "OAUTHBEARER": oauthbearer_token}


class SaslSession:
    """Where one connection is in the SASL exchange.

    ``handshake`` → ``authenticate`` → ``done`` (``raw`` instead of ``authenticate``
    after a v0 handshake); a v1 handshake once ``done`` starts a re-authentication
    (``done`` → ``authenticate`` → ``done``, KIP-368) during which the role stays.
    :meth:`token` hands out the credentials to check; the caller reports the outcome with
    :meth:`succeeded` (any failure closes the connection).
    """

    def __init__(self, mechanisms: Iterable[str]) -> None:
        self.mechanisms = tuple(mechanisms)
        self.state = "handshake"
        self.mechanism: str | None = None
        self.role: str | None = None
        #: has the client authenticated through SaslAuthenticate (not a v0 bare frame)?
        self.versioned = False

    @property
    def authenticated(self) -> bool:
        return self.state == "done"

    @property
    def reauthenticating(self) -> bool:
        """Is a re-authentication (KIP-368) under way?"""
        return self.role is not None and self.state == "authenticate"

    @property
    def expects_raw(self) -> bool:
        """Is the next frame a bare token (after a v0 handshake)?"""
        return self.state == "raw"

    def allows(self, api_key: int) -> bool:
        """May a request of ``api_key`` be answered now?"""
        return self.role is not None or api_key in OPEN_APIS

    def handshake(self, mechanism: str, version: int) -> int:
        """Kafka's error code for a SaslHandshake naming ``mechanism`` (0: go on); once
        authenticated through SaslAuthenticate, a v1 handshake naming the same mechanism
        starts a re-authentication."""
        if self.state == "done" and self.versioned and version >= 1:
            if mechanism != self.mechanism:
                return ILLEGAL_SASL_STATE  # Kafka: re-authenticate with the same mechanism
            self.state = "authenticate"
            return 0
        if self.state != "handshake":
            return ILLEGAL_SASL_STATE
        if mechanism not in self.mechanisms:
            return UNSUPPORTED_SASL_MECHANISM
        self.mechanism = mechanism
        self.state = "raw" if version == 0 else "authenticate"
        return 0

    def token(self, auth_bytes: bytes, *, raw: bool = False) -> str:
        """The token in a SaslAuthenticate's ``auth_bytes`` (or a v0 bare frame).

        :raises SaslFailure: out of order, or credentials that do not parse.
        """
        if self.state != ("raw" if raw else "authenticate"):
            raise SaslFailure(
                "SaslAuthenticate before a SaslHandshake"
                if self.state == "handshake"
                else "SaslAuthenticate out of order",
                code=ILLEGAL_SASL_STATE,
            )
        assert self.mechanism is not None
        if len(auth_bytes) > MAX_AUTH_BYTES:
            raise SaslFailure(f"SASL credentials of {len(auth_bytes)} bytes are too large")
        return _PARSERS[self.mechanism](auth_bytes)

    def succeeded(self, role: str, *, raw: bool = False) -> None:
        """The credentials established ``role``.

        :raises SaslFailure: a re-authentication named another role (Kafka refuses to
            change principals on a connection).
        """
        if self.role is not None and role != self.role:
            raise SaslFailure(
                f"re-authentication as role {role!r} on a connection of role {self.role!r}:"
                " a connection keeps its role"
            )
        self.role = role
        self.versioned = not raw
        self.state = "done"
