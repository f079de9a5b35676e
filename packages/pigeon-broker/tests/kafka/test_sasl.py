"""The Kafka front door's SASL state machine and mechanisms, the ``[kafka]`` security
settings, and the per-connection authorization cache (no sockets)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from pigeon.broker._authz import Authorization
from pigeon.broker._config import BrokerConfig, KafkaConfig
from pigeon.broker._kafka import AUTHZ_RECHECK_S, KafkaConnection, KafkaFrontDoor
from pigeon.broker._kafka_sasl import (
    ILLEGAL_SASL_STATE,
    SASL_AUTHENTICATION_FAILED,
    UNSUPPORTED_SASL_MECHANISM,
    SaslFailure,
    SaslSession,
    check_mechanisms,
    oauthbearer_token,
    plain_token,
)
from pigeon.broker._policies import NamespacePolicies, TenantInfo
from pigeon.core.errors import AuthorizationError, ConfigError

# ------------------------------------------------------------------ mechanisms


@pytest.mark.parametrize(
    ("message", "token"),
    [
        (b"\0user\0tok.en.x", "tok.en.x"),
        (b"authz\0public/default\0token:abc.def.ghi", "abc.def.ghi"),
        (b"\0\0  xyz  ", "xyz"),
    ],
)
def test_plain_password_is_the_token(message: bytes, token: str) -> None:
    assert plain_token(message) == token


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (b"user-and-password", "malformed SASL PLAIN"),
        (b"\0user\0", "empty"),
        (b"\0user\0token:", "empty"),
        (b"\0user\0\xff\xfe", "not UTF-8"),
        (b"a\0b\0c\0d", "malformed SASL PLAIN"),
    ],
)
def test_bad_plain_messages_name_the_reason_not_the_secret(message: bytes, reason: str) -> None:
    with pytest.raises(SaslFailure, match=reason) as info:
        plain_token(message)
    assert info.value.code == SASL_AUTHENTICATION_FAILED


@pytest.mark.parametrize(
    "message",
    [
        b"n,,\x01auth=Bearer abc.def\x01\x01",
        b"n,a=someone,\x01host=h\x01auth=Bearer abc.def\x01port=1\x01\x01",
        b"n,,\x01auth=bearer abc.def\x01\x01",
    ],
)
def test_oauthbearer_initial_response_carries_the_token(message: bytes) -> None:
    assert oauthbearer_token(message) == "abc.def"


@pytest.mark.parametrize(
    "message",
    [
        b"auth=Bearer abc",  # no gs2 header
        b"n,,\x01auth=Bearer abc\x01",  # not terminated
        b"n,,\x01auth=Basic abc\x01\x01",
        b"n,,\x01auth=Bearer \x01\x01",
        b"n,,\x01host=x\x01\x01",
        b"x,,\x01auth=Bearer abc\x01\x01",
    ],
)
def test_malformed_oauthbearer_is_refused(message: bytes) -> None:
    with pytest.raises(SaslFailure, match="OAUTHBEARER") as info:
        oauthbearer_token(message)
    assert "abc" not in info.value.message


def test_check_mechanisms() -> None:
    assert check_mechanisms(["plain", "OAUTHBEARER", "PLAIN"]) == ("PLAIN", "OAUTHBEARER")
    assert check_mechanisms("OAUTHBEARER") == ("OAUTHBEARER",)
    with pytest.raises(ConfigError, match="'SCRAM-SHA-256' is not supported"):
        check_mechanisms(["SCRAM-SHA-256"])
    with pytest.raises(ConfigError, match="at least one"):
        check_mechanisms([])


# ------------------------------------------------------------------ the state machine


def test_session_answers_only_sasl_and_api_versions_until_authenticated() -> None:
    session = SaslSession(["PLAIN"])
    assert session.allows(18) and session.allows(17) and session.allows(36)
    assert not session.allows(0) and not session.allows(3)
    with pytest.raises(SaslFailure) as info:
        session.token(b"\0u\0t")  # authenticate before the handshake
    assert info.value.code == ILLEGAL_SASL_STATE
    assert session.handshake("OAUTHBEARER", 1) == UNSUPPORTED_SASL_MECHANISM
    assert session.handshake("PLAIN", 1) == 0
    assert session.handshake("PLAIN", 1) == ILLEGAL_SASL_STATE
    assert not session.expects_raw
    assert session.token(b"\0u\0token:t") == "t"
    assert not session.authenticated and not session.allows(0)
    session.succeeded("alice")
    assert session.authenticated and session.role == "alice" and session.allows(0)
    assert session.handshake("OAUTHBEARER", 1) == ILLEGAL_SASL_STATE  # same mechanism
    assert session.handshake("PLAIN", 1) == 0  # re-authentication (KIP-368)
    assert session.reauthenticating and session.allows(0)  # the role holds meanwhile


def test_handshake_v0_expects_a_bare_token() -> None:
    session = SaslSession(["PLAIN", "OAUTHBEARER"])
    assert session.handshake("PLAIN", 0) == 0
    assert session.expects_raw
    with pytest.raises(SaslFailure):
        session.token(b"\0u\0t")  # a SaslAuthenticate is out of order now
    assert session.token(b"\0u\0t", raw=True) == "t"


def test_oversized_credentials_are_refused_unread() -> None:
    session = SaslSession(["PLAIN"])
    session.handshake("PLAIN", 1)
    with pytest.raises(SaslFailure, match="too large"):
        session.token(b"\0u\0" + b"x" * 100_000)


# ------------------------------------------------------------------ configuration


def test_security_protocol_and_mechanisms_are_checked() -> None:
    config = KafkaConfig(security_protocol="sasl_ssl", sasl_enabled_mechanisms=["plain"])
    config.validate()
    assert config.security_protocol == "SASL_SSL" and config.sasl and config.tls
    assert config.sasl_enabled_mechanisms == ["PLAIN"]
    with pytest.raises(ConfigError, match="'security_protocol' in \\[kafka\\]: 'TLS'"):
        KafkaConfig(security_protocol="TLS").validate()
    with pytest.raises(ConfigError, match="sasl_enabled_mechanisms"):
        KafkaConfig(sasl_enabled_mechanisms=["GSSAPI"]).validate()


def test_ssl_needs_the_broker_certificate_and_sasl_needs_tokens() -> None:
    broker = BrokerConfig()
    with pytest.raises(ConfigError, match="tls_certificate_file"):
        KafkaConfig(security_protocol="SSL").validate_security(broker)
    with pytest.raises(ConfigError, match="authentication_enabled"):
        KafkaConfig(security_protocol="SASL_PLAINTEXT").validate_security(broker)
    broker.authentication_enabled = True
    KafkaConfig(security_protocol="SASL_PLAINTEXT").validate_security(broker)
    KafkaConfig().validate_security(broker)  # PLAINTEXT: nothing needed


# ------------------------------------------------------------------ authorization cache


class _Door:
    """What KafkaConnection.authorize uses of its door: counts the decisions asked."""

    def __init__(self, allowed: set[tuple[str, str]]) -> None:
        self.allowed = allowed
        self.asked: list[tuple[str, str]] = []
        self.core = SimpleNamespace(authorization=SimpleNamespace(enabled=True))

    async def check(self, role: Any, action: str, topic: str, subscription: str) -> None:
        self.asked.append((action, topic))
        if (action, topic) not in self.allowed:
            raise AuthorizationError(f"role {role!r} may not {action} {topic}")


async def test_decisions_are_kept_per_connection_and_rechecked(
    caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    door = _Door({("produce", "orders")})
    conn = KafkaConnection(door, None, "peer:1", role="app")  # type: ignore[arg-type]
    for _ in range(100):
        await conn.authorize("produce", "orders")
        with pytest.raises(AuthorizationError, match="may not consume topic 'orders'"):
            await conn.authorize("consume", "orders")
    assert door.asked == [("produce", "orders"), ("consume", "orders")]
    denials = [r for r in caplog.records if "kafka request denied" in r.getMessage()]
    assert len(denials) == 1
    door.allowed.add(("consume", "orders"))  # granted: open connections see it in time
    await trio.sleep(AUTHZ_RECHECK_S)
    await conn.authorize("consume", "orders")
    assert door.asked[-1] == ("consume", "orders") and len(door.asked) == 3


async def test_authorization_off_asks_nothing() -> None:
    door = _Door(set())
    door.core.authorization.enabled = False
    conn = KafkaConnection(door, None, "peer:1")  # type: ignore[arg-type]
    await conn.authorize("produce", "orders")
    assert door.asked == []


# ------------------------------------------------------------------ the decisions


class _Policies:
    """A PolicyStore with one namespace and one tenant, in memory."""

    def __init__(self, policies: NamespacePolicies, admins: list[str]) -> None:
        self.policies = policies
        self.tenant_info = TenantInfo(admin_roles=admins)

    async def get(self, namespace: str) -> NamespacePolicies:
        assert namespace == "public/default"
        return self.policies

    async def get_tenant(self, tenant: str) -> TenantInfo:
        assert tenant == "public"
        return self.tenant_info


def _door(policies: NamespacePolicies) -> KafkaFrontDoor:
    door = object.__new__(KafkaFrontDoor)
    door.config = KafkaConfig()
    authz = Authorization(
        _Policies(policies, admins=["ops"]),  # type: ignore[arg-type]
        enabled=True,
        superuser_roles=["root"],
    )
    door.core = SimpleNamespace(authorization=authz)  # type: ignore[assignment]
    return door


@pytest.mark.parametrize(
    ("role", "action", "topic", "subscription", "allowed"),
    [
        ("root", "admin", "orders", "", True),
        ("ops", "admin", "orders", "", True),  # a tenant admin creates and deletes topics
        ("writer", "admin", "orders", "", False),
        ("writer", "produce", "orders", "", True),
        ("writer", "consume", "orders", "", False),
        ("writer", "lookup", "orders", "", True),
        ("reader", "produce", "orders", "", False),
        ("reader", "consume", "orders", "", True),
        ("reader", "consume", "orders", "reader-app", True),
        ("reader", "consume", "orders", "billing", False),  # prefix mode
        ("reader", "group", "", "reader-app", True),
        ("reader", "group", "", "billing", False),
        ("writer", "group", "", "writer-app", False),  # no consume right anywhere
        ("audit", "consume", "audit-log", "", True),  # a topic grant
        ("audit", "consume", "orders", "", False),
        ("audit", "group", "", "audit-1", True),
        ("audit", "lookup", "orders", "", False),
        (None, "lookup", "orders", "", False),
        (None, "group", "", "x", False),
    ],
)
async def test_kafka_actions_map_onto_pulsar_permissions(
    role: str | None, action: str, topic: str, subscription: str, allowed: bool
) -> None:
    door = _door(
        NamespacePolicies(
            permissions={"writer": ["produce"], "reader": ["consume"]},
            topic_permissions={"audit-log": {"audit": ["consume"]}},
            subscription_auth_mode="prefix",
        )
    )
    if allowed:
        await door.check(role, action, topic, subscription)
    else:
        with pytest.raises(AuthorizationError):
            await door.check(role, action, topic, subscription)


def test_join_group_subscriptions_are_read_from_the_consumer_protocol() -> None:
    from aiokafka.coordinator.protocol import ConsumerProtocolMemberMetadata

    from pigeon.broker._kafka import _subscribed_topics

    metadata = ConsumerProtocolMemberMetadata(0, ["orders", "audit-log"], b"").encode()
    request = SimpleNamespace(
        protocols=[
            SimpleNamespace(metadata=metadata),
            SimpleNamespace(metadata=b"\x00"),  # does not parse: left out
            SimpleNamespace(metadata=metadata),
        ]
    )
    assert _subscribed_topics(request) == ["orders", "audit-log"]


async def test_a_revoked_grant_reaches_an_open_connection_within_the_recheck_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """An open connection keeps producing on its decision until AUTHZ_RECHECK_S passed,
    then is refused (the real Authorization over namespace policies)."""
    policies = NamespacePolicies(permissions={"app": ["produce"]})
    door = _door(policies)
    conn = KafkaConnection(door, None, "peer:1", role="app")  # type: ignore[arg-type]
    await conn.authorize("produce", "orders")
    del policies.permissions["app"]  # revoked (pigeon admin namespaces revoke-permission)
    await trio.sleep(AUTHZ_RECHECK_S - 1)
    await conn.authorize("produce", "orders")  # the decision still holds
    await trio.sleep(1)
    with pytest.raises(AuthorizationError, match="role 'app' may not produce"):
        await conn.authorize("produce", "orders")
    policies.permissions["app"] = ["produce"]  # granted again: as quickly
    await trio.sleep(AUTHZ_RECHECK_S)
    await conn.authorize("produce", "orders")
