"""The native protocol's front door with TLS, token authentication and authorization.

A broker + bookie + embedded metadata store in the test's trio run, on real loopback
sockets (a plaintext client on the TLS port is told so only over a real socket), with a
certificate made per run (``SecurityFiles``).  Clients are raw protocol connections
(:func:`pigeon.core.rpc.connect_tcp`).
"""

from __future__ import annotations

import functools
import json
import logging
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jwt
import pytest
import trio

from pigeon.broker import BrokerConfig, run_standalone
from pigeon.broker._native import MAX_LOGGED_DENIALS
from pigeon.broker._policies import TenantInfo
from pigeon.core import TopicName
from pigeon.core.auth import (
    AuthData,
    AuthenticationToken,
    Authenticator,
    TokenAuthenticationProvider,
)
from pigeon.core.batch import encode_batch
from pigeon.core.codecs import NONE
from pigeon.core.errors import AuthenticationError, AuthorizationError, TlsError
from pigeon.core.rpc import BrokerFrame, Connection, connect_tcp
from pigeon.core.testing import SecurityFiles
from pigeon.core.tokens import create_secret_key, create_token

HOST = "127.0.0.1"
TOPIC = "persistent://public/default/secured"
SUPERUSER = "admin"


@dataclass
class Secured:
    service: Any
    key: bytes
    ca_file: Path
    tls: ssl.SSLContext
    nursery: trio.Nursery

    @property
    def port(self) -> int:
        return int(self.service.address[1])

    @property
    def tls_port(self) -> int:
        return int(self.service.address_tls[1])

    def token(self, role: str, **kwargs: Any) -> AuthenticationToken:
        return AuthenticationToken(create_token(role, self.key, **kwargs))

    async def connect(
        self, role: str | None = SUPERUSER, *, tls: bool = True, handler: Any = None
    ) -> Connection:
        conn, _info = await connect_tcp(
            HOST,
            self.tls_port if tls else self.port,
            BrokerFrame,
            self.nursery,
            handler=handler,
            tls=self.tls if tls else None,
            authentication=None if role is None else self.token(role),
            connect_timeout=10.0,
        )
        return conn


@pytest.fixture
async def secured(tmp_path: Path) -> AsyncIterator[Secured]:
    sec = SecurityFiles.create(tmp_path / "security")
    config = BrokerConfig(
        host=HOST,
        port=0,
        http_port=-1,
        broker_service_port_tls=0,
        maintenance_interval_s=3600.0,
        cursor_persist_interval_ms=50,
        tls_certificate_file=str(sec.certificate_file),
        tls_key_file=str(sec.key_file),
        authentication_enabled=True,
        authentication_providers=["token"],
        token_secret_key=sec.secret_key_url,
        authorization_enabled=True,
        superuser_roles=[SUPERUSER],
    )
    from pigeon.bookie import BookieConfig

    bookie = BookieConfig(port=0, fsync="never")
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            service = await nursery.start(
                functools.partial(run_standalone, tmp_path / "data", config, bookie)
            )
            yield Secured(service, sec.secret_key, sec.ca_file, sec.client_tls_context(), nursery)
            nursery.cancel_scope.cancel()


@dataclass
class Pushes:
    """A client handler that keeps what the broker pushed."""

    messages: list[bytes] = field(default_factory=list)
    closed: list[dict[str, Any]] = field(default_factory=list)
    changed: trio.Event = field(default_factory=trio.Event)

    def on_message(self, conn: Connection, req: Any) -> None:
        self.messages.append(bytes(req.payload))
        self._changed()

    def on_closedByBroker(self, conn: Connection, req: Any) -> None:
        b = req.body
        self.closed.append(
            {
                "producer": b.isProducer,
                "id": b.producerId if b.isProducer else b.consumerId,
                "reason": str(b.reason),
            }
        )
        self._changed()

    def _changed(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def wait_for(self, what: str, count: int) -> None:
        with trio.fail_after(10):
            while len(getattr(self, what)) < count:
                await self.changed.wait()


async def create_producer(conn: Connection, topic: str = TOPIC, producer_id: int = 1) -> Any:
    return await conn.request(
        "createProducer",
        {"producerId": producer_id, "topic": topic, "producerName": ""},
        expect="producerCreated",
    )


async def subscribe(
    conn: Connection,
    sub: str = "s",
    topic: str = TOPIC,
    consumer_id: int = 1,
    *,
    durable: bool = True,
) -> Any:
    return await conn.request(
        "subscribe",
        {
            "consumerId": consumer_id,
            "topic": topic,
            "subscription": sub,
            "subType": "exclusive",
            "initialPosition": "earliest",
            "durable": durable,
            "startOffset": -1,
        },
        expect="subscribed",
    )


async def send(conn: Connection, value: bytes, sequence_id: int = 0) -> Any:
    payload = encode_batch(
        [value],
        producer_name="p",
        sequence_id=sequence_id,
        publish_time=int(time.time() * 1000),
        codec=NONE,
    )
    return await conn.request(
        "send",
        {"producerId": 1, "sequenceId": sequence_id, "numMessages": 1},
        payload=payload,
        expect="sendReceipt",
    )


async def lookup(conn: Connection, topic: str = TOPIC) -> str:
    result = await conn.request("lookup", {"topic": topic}, expect="lookupResult")
    return str(result["brokerUrl"])


# ------------------------------------------------------------------ TLS


async def test_produce_and_consume_over_tls_next_to_the_plaintext_port(secured: Secured) -> None:
    assert secured.service.service_url_tls == f"pigeon+ssl://{HOST}:{secured.tls_port}"
    assert secured.service.service_url == f"pigeon://{HOST}:{secured.port}"
    pushes = Pushes()
    consumer = await secured.connect(handler=pushes)
    assert isinstance(consumer.stream, trio.SSLStream)
    await subscribe(consumer)
    consumer.send_nowait("flow", {"consumerId": 1, "permits": 10})
    producer = await secured.connect()
    await create_producer(producer)
    await send(producer, b"over-tls")
    # the plaintext port serves the same topic (with a token too)
    plain = await secured.connect(tls=False)
    assert not isinstance(plain.stream, trio.SSLStream)
    await create_producer(plain)
    await send(plain, b"over-plaintext")
    await pushes.wait_for("messages", 2)
    received = b"".join(pushes.messages)
    assert b"over-tls" in received
    assert b"over-plaintext" in received


async def test_a_plaintext_client_on_the_tls_port_is_told_to_use_pigeon_ssl(
    secured: Secured,
) -> None:
    with pytest.raises(TlsError, match=r"pigeon\+ssl://"):
        await connect_tcp(
            HOST,
            secured.tls_port,
            BrokerFrame,
            secured.nursery,
            authentication=secured.token(SUPERUSER),
        )


async def test_lookups_over_tls_answer_pigeon_ssl_urls_and_plaintext_ones_pigeon(
    secured: Secured,
) -> None:
    tls_conn = await secured.connect()
    plain = await secured.connect(tls=False)
    assert await lookup(tls_conn) == secured.service.service_url_tls
    assert await lookup(plain) == secured.service.service_url


async def test_a_lookup_over_tls_redirects_to_the_owners_tls_url(secured: Secured) -> None:
    name = TopicName.parse("persistent://public/default/elsewhere")
    ownership = secured.service.ownership
    # another broker holds the topic's bundle
    await secured.service.store.create(
        ownership.path_of(name),
        json.dumps(
            {
                "url": "pigeon://10.0.0.9:6650",
                "url_tls": "pigeon+ssl://10.0.0.9:6651",
                "address": "10.0.0.9:6650",
                "token": "other",
            }
        ).encode(),
    )
    assert await lookup(await secured.connect(), name.full) == "pigeon+ssl://10.0.0.9:6651"
    assert await lookup(await secured.connect(tls=False), name.full) == "pigeon://10.0.0.9:6650"


async def test_a_lookup_over_tls_of_a_topic_whose_owner_has_no_tls_port_says_so(
    secured: Secured,
) -> None:
    name = TopicName.parse("persistent://public/default/plain-only")
    await secured.service.store.create(
        secured.service.ownership.path_of(name),
        json.dumps({"url": "pigeon://10.0.0.9:6650", "token": "other"}).encode(),
    )
    with pytest.raises(TlsError, match=r"pigeon://10\.0\.0\.9:6650.*broker_service_port_tls"):
        await lookup(await secured.connect(), name.full)


async def test_the_broker_registers_its_tls_url(secured: Secured) -> None:
    brokers = await secured.service.ownership.brokers()
    assert [b.get("url_tls") for b in brokers.values()] == [secured.service.service_url_tls]


# ------------------------------------------------------------------ authentication


def _wrong_signature(secured: Secured) -> AuthenticationToken:
    return AuthenticationToken(create_token(SUPERUSER, create_secret_key()))


def _expired(secured: Secured) -> AuthenticationToken:
    token = jwt.encode({"sub": SUPERUSER, "exp": int(time.time()) - 10}, secured.key, "HS256")
    return AuthenticationToken(token)


@pytest.mark.parametrize(
    ("credentials", "why"),
    [
        (lambda s: None, "authentication is required"),
        (lambda s: AuthenticationToken("garbage"), "not valid"),
        (_wrong_signature, "signature does not match"),
        (_expired, "expired"),
    ],
    ids=["no-token", "garbage", "wrong-signature", "expired"],
)
@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plaintext"])
async def test_bad_credentials_are_an_authentication_error(
    secured: Secured, credentials: Any, why: str, tls: bool
) -> None:
    presented = credentials(secured)
    with pytest.raises(AuthenticationError, match=why) as caught:
        await connect_tcp(
            HOST,
            secured.tls_port if tls else secured.port,
            BrokerFrame,
            secured.nursery,
            tls=secured.tls if tls else None,
            authentication=presented,
        )
    if presented is not None:  # the token is never echoed
        assert presented.auth_data().decode() not in caught.value.message


# ------------------------------------------------------------------ authorization


async def test_a_role_without_permission_is_refused_naming_role_and_action(
    secured: Secured, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pigeon.broker._native")
    conn = await secured.connect("app")
    for _ in range(3):
        with pytest.raises(AuthorizationError, match=r"role 'app' may not produce"):
            await create_producer(conn)
    with pytest.raises(AuthorizationError, match=r"role 'app' may not consume"):
        await subscribe(conn)
    with pytest.raises(AuthorizationError, match=r"role 'app' may not look up"):
        await lookup(conn)
    with pytest.raises(AuthorizationError, match=r"role 'app' may not list"):
        await conn.request("listTopics", {"namespace": "public/default"}, expect="topicList")
    with pytest.raises(AuthorizationError, match=r"role 'app' may not produce"):
        await conn.request("createTopic", {"topic": TOPIC + "-new", "partitions": 0}, expect="ok")
    assert not conn.closed  # refused, never dropped
    denials = [r for r in caplog.records if "authorization denied" in r.getMessage()]
    # one line per denial and connection, not one per request
    assert sum(r.getMessage().endswith(f"may not produce on {TOPIC}") for r in denials) == 1
    assert len(denials) == 5
    assert all("'app'" in r.getMessage() for r in denials)

    await secured.service.authorization.grant("public/default", "app", ["produce", "consume"])
    await create_producer(conn)
    await subscribe(conn)
    assert await lookup(conn) == secured.service.service_url_tls
    topics = await conn.request("listTopics", {"namespace": "public/default"}, expect="topicList")
    assert TOPIC in topics["topics"]


async def test_readers_need_the_consume_permission(secured: Secured) -> None:
    conn = await secured.connect("app")
    with pytest.raises(AuthorizationError, match=r"role 'app' may not consume"):
        await subscribe(conn, "reader-1", durable=False)
    await secured.service.authorization.grant_topic(TopicName.parse(TOPIC), "app", ["consume"])
    await subscribe(conn, "reader-1", durable=False)


async def test_a_client_probing_many_topics_floods_no_log(
    secured: Secured, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pigeon.broker._native")
    conn = await secured.connect("app")
    for i in range(MAX_LOGGED_DENIALS + 10):
        with pytest.raises(AuthorizationError):
            await lookup(conn, f"{TOPIC}-{i}")
    lines = [r for r in caplog.records if "authorization denied" in r.getMessage()]
    assert len(lines) == MAX_LOGGED_DENIALS + 1
    assert "not logged" in lines[-1].getMessage()


async def test_a_produce_grant_does_not_allow_consuming(secured: Secured) -> None:
    await secured.service.authorization.grant("public/default", "writer", ["produce"])
    conn = await secured.connect("writer", tls=False)
    await create_producer(conn)
    with pytest.raises(AuthorizationError, match=r"role 'writer' may not consume"):
        await subscribe(conn)


async def test_tenant_admins_rule_their_own_tenant_only(secured: Secured) -> None:
    policies = secured.service.policies
    await policies.create_tenant("tenant-a", TenantInfo(admin_roles=["alice"]))
    await policies.create_tenant("tenant-b", TenantInfo(admin_roles=["bob"]))
    await policies.create_namespace("tenant-a/ns")
    await policies.create_namespace("tenant-b/ns")
    conn = await secured.connect("alice")
    await create_producer(conn, "persistent://tenant-a/ns/t")
    await subscribe(conn, "any", "persistent://tenant-a/ns/t")
    await conn.request("listTopics", {"namespace": "tenant-a/ns"}, expect="topicList")
    with pytest.raises(AuthorizationError, match=r"role 'alice' may not produce"):
        await create_producer(conn, "persistent://tenant-b/ns/t", producer_id=2)
    with pytest.raises(AuthorizationError, match=r"role 'alice' may not consume"):
        await subscribe(conn, "any", "persistent://tenant-b/ns/t", consumer_id=2)
    with pytest.raises(AuthorizationError, match=r"role 'alice' may not list"):
        await conn.request("listTopics", {"namespace": "tenant-b/ns"}, expect="topicList")


async def test_a_superuser_may_do_everything(secured: Secured) -> None:
    conn = await secured.connect(SUPERUSER)
    await conn.request("createTopic", {"topic": TOPIC + "-p", "partitions": 2}, expect="ok")
    await create_producer(conn)
    await subscribe(conn)
    await lookup(conn)
    await conn.request("listTopics", {"namespace": "public/default"}, expect="topicList")
    await conn.request("getLastMessageId", {"consumerId": 1}, expect="lastMessageId")
    await conn.request("seek", {"consumerId": 1, "offset": 0}, expect="ok")
    await conn.request("unsubscribe", {"consumerId": 1}, expect="ok")


async def test_revoked_consumers_may_not_seek_or_unsubscribe(secured: Secured) -> None:
    authz = secured.service.authorization
    await authz.grant("public/default", "app", ["consume"])
    conn = await secured.connect("app")
    await subscribe(conn)
    await conn.request("getLastMessageId", {"consumerId": 1}, expect="lastMessageId")
    await authz.revoke("public/default", "app")
    with pytest.raises(AuthorizationError, match=r"role 'app' may not consume"):
        await conn.request("seek", {"consumerId": 1, "offset": 0}, expect="ok")
    with pytest.raises(AuthorizationError, match=r"role 'app' may not consume"):
        await conn.request("unsubscribe", {"consumerId": 1}, expect="ok")
    with pytest.raises(AuthorizationError, match=r"role 'app' may not consume"):
        await conn.request("getLastMessageId", {"consumerId": 1}, expect="lastMessageId")


async def test_subscription_auth_mode_prefix_restricts_subscription_names(
    secured: Secured,
) -> None:
    await secured.service.authorization.grant("public/default", "app", ["consume"])
    await secured.service.policies.set("public/default", {"subscription_auth_mode": "prefix"})
    conn = await secured.connect("app")
    with pytest.raises(AuthorizationError, match=r"start with 'app'.*'other-sub'"):
        await subscribe(conn, "other-sub")
    await subscribe(conn, "app-sub")
    # a superuser is not restricted
    await subscribe(await secured.connect(SUPERUSER), "other-sub")


# ------------------------------------------------------------------ token expiry


class _Later:
    """A wall clock ``seconds`` ahead of the real one."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def now_ms(self) -> int:
        return int((time.time() + self.seconds) * 1000)


async def test_connections_are_closed_when_their_token_expires(secured: Secured) -> None:
    pushes = Pushes()
    expiring, _ = await connect_tcp(
        HOST,
        secured.tls_port,
        BrokerFrame,
        secured.nursery,
        handler=pushes,
        tls=secured.tls,
        authentication=secured.token(SUPERUSER, expiry_s=600),
    )
    await create_producer(expiring)
    await subscribe(expiring)
    lasting = await secured.connect(SUPERUSER)  # a token without exp
    await secured.service.maintain_once()
    assert not expiring.closed  # not expired yet

    secured.service.clock = _Later(601)
    await secured.service.maintain_once()
    await pushes.wait_for("closed", 2)
    assert {(c["producer"], c["id"]) for c in pushes.closed} == {(True, 1), (False, 1)}
    assert all("expired" in c["reason"] for c in pushes.closed)
    with trio.fail_after(10):
        await expiring.closed_event.wait()
    assert not lasting.closed
    await create_producer(lasting)
    # a fresh token gets a new connection
    fresh = await secured.connect(SUPERUSER)
    await create_producer(fresh)


def test_the_token_provider_reports_when_a_token_expires() -> None:
    key = create_secret_key()
    authenticator = Authenticator([TokenAuthenticationProvider(key)])
    expiring = AuthData("token", create_token("r", key, expiry_s=60).encode())
    lasting = AuthData("token", create_token("r", key).encode())
    assert authenticator.authenticate(expiring) == "r"
    expires = authenticator.expires_at(expiring)
    assert expires is not None
    assert time.time() + 50 < expires <= time.time() + 61
    assert authenticator.expires_at(lasting) is None


async def test_a_role_with_topic_grants_only_lists_those_topics(secured: Secured) -> None:
    """listTopics shows a role granted single topics only those (it could not look up
    the others either); a namespace-wide grant shows every topic."""
    admin = await secured.connect()
    other = TOPIC + "-other"
    for topic in (TOPIC, other):
        await admin.request("createTopic", {"topic": topic, "partitions": 0}, expect="ok")
    await secured.service.authorization.grant_topic(TopicName.parse(TOPIC), "app", ["consume"])
    conn = await secured.connect("app")
    listed = await conn.request("listTopics", {"namespace": "public/default"}, expect="topicList")
    assert list(listed["topics"]) == [TOPIC]
    await secured.service.authorization.grant("public/default", "app", ["consume"])
    listed = await conn.request("listTopics", {"namespace": "public/default"}, expect="topicList")
    assert {TOPIC, other} <= set(listed["topics"])
