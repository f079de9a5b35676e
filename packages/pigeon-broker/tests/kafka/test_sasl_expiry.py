"""Token expiry on Kafka connections (KIP-368): SaslAuthenticate answers the session's
lifetime, a client re-authenticates on its connection before it ends, and a connection
still on expired credentials is closed at its next request, or by the sweep."""

from __future__ import annotations

import datetime
import io
import logging
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing
from kio.schema.metadata.v1.request import MetadataRequest
from kio.schema.request_header.v1.header import RequestHeader
from kio.schema.sasl_authenticate.v1.request import SaslAuthenticateRequest
from kio.schema.sasl_handshake.v1.request import SaslHandshakeRequest
from kio.serial import entity_writer

from pigeon.broker._config import KafkaConfig
from pigeon.broker._kafka import KafkaConnection, KafkaFrontDoor
from pigeon.broker._kafka_sasl import SaslSession, session_lifetime_ms
from pigeon.core.auth import Authenticator, TokenAuthenticationProvider
from pigeon.core.runtime import WallClock
from pigeon.core.tokens import create_secret_key, create_token

KEY = create_secret_key()


def test_session_lifetime_is_the_time_left_until_exp() -> None:
    assert session_lifetime_ms(None, 1000.0) == 0  # never expires: no re-authentication
    assert session_lifetime_ms(1015.0, 1000.0) == 15_000
    assert session_lifetime_ms(1000.25, 1000.0) == 250
    assert session_lifetime_ms(1000.0, 1000.0) == 1  # 0 would mean "never"


def _door() -> KafkaFrontDoor:
    door = object.__new__(KafkaFrontDoor)
    door.config = KafkaConfig(security_protocol="SASL_PLAINTEXT")
    door.extra_versions = {17: (0, 1), 36: (0, 2)}
    door.handlers = {
        17: door._sasl_handshake,
        36: door._sasl_authenticate,
        3: _metadata,
    }
    door.conns = set()
    door.core = SimpleNamespace(  # type: ignore[assignment]
        authenticator=Authenticator([TokenAuthenticationProvider(KEY)]),
        clock=WallClock(),
        authorization=SimpleNamespace(enabled=False),
    )
    return door


async def _metadata(conn: KafkaConnection, request: Any) -> Any:
    return "metadata"


def _conn(door: KafkaFrontDoor) -> KafkaConnection:
    conn = KafkaConnection(door, None, "peer:1")  # type: ignore[arg-type]
    conn.sasl = SaslSession(["PLAIN", "OAUTHBEARER"])
    door.conns.add(conn)
    return conn


def _frame(api_key: int, version: int, body: Any) -> bytearray:
    buf = io.BytesIO()
    header = RequestHeader(
        request_api_key=api_key, request_api_version=version, correlation_id=7, client_id="t"
    )
    entity_writer(RequestHeader)(buf, header)
    entity_writer(type(body))(buf, body)
    return bytearray(buf.getvalue())


class _Sent:
    def __init__(self) -> None:
        self.answers: list[Any] = []

    async def send(self, item: tuple[int, Any]) -> None:
        self.answers.append(item[1])


async def _authenticate(
    door: KafkaFrontDoor, conn: KafkaConnection, token: str, sent: _Sent
) -> Any:
    assert await door._request(conn, _frame(17, 1, SaslHandshakeRequest(mechanism="PLAIN")), sent)
    auth = SaslAuthenticateRequest(auth_bytes=b"\0u\0" + token.encode())
    keep = await door._request(conn, _frame(36, 1, auth), sent)
    answer = sent.answers[-1]
    assert keep == (answer.error_code == 0)
    return answer


async def test_authenticate_answers_the_time_left_and_reauthentication_extends_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    door, sent = _door(), _Sent()
    conn = _conn(door)
    answer = await _authenticate(door, conn, create_token("app", KEY, expiry_s=15), sent)
    assert answer.error_code == 0
    # exp is whole seconds: the time left is between 14 and 15 s
    assert 13_900 <= answer.session_lifetime / datetime.timedelta(milliseconds=1) <= 15_000
    assert conn.role == "app" and conn.auth_expires is not None
    first = conn.auth_expires
    # KIP-368: the same connection authenticates again with a newer token of its role
    answer = await _authenticate(door, conn, create_token("app", KEY, expiry_s=60), sent)
    assert answer.error_code == 0 and conn.auth_expires >= first + 44
    assert 58_900 <= answer.session_lifetime / datetime.timedelta(milliseconds=1) <= 60_000
    assert any("kafka client re-authenticated" in r.getMessage() for r in caplog.records)
    # a token that never expires: lifetime 0, no expiry kept
    answer = await _authenticate(door, conn, create_token("app", KEY), sent)
    assert answer.session_lifetime == datetime.timedelta(0) and conn.auth_expires is None


async def test_reauthentication_may_not_change_the_role() -> None:
    door, sent = _door(), _Sent()
    conn = _conn(door)
    await _authenticate(door, conn, create_token("app", KEY, expiry_s=60), sent)
    answer = await _authenticate(door, conn, create_token("root", KEY, expiry_s=60), sent)
    assert answer.error_code == 58  # SASL_AUTHENTICATION_FAILED, then closed
    assert "keeps its role" in answer.error_message and conn.flush_on_close
    assert conn.role == "app"


async def test_a_request_on_expired_credentials_closes_the_connection(
    caplog: pytest.LogCaptureFixture, autojump_clock: trio.testing.MockClock
) -> None:
    caplog.set_level(logging.INFO)
    door, sent = _door(), _Sent()
    conn = _conn(door)
    token = create_token("app", KEY, expiry_s=5)
    await _authenticate(door, conn, token, sent)
    metadata = _frame(3, 1, MetadataRequest(topics=()))
    assert await door._request(conn, metadata, sent)
    assert sent.answers[-1] == "metadata"
    await trio.sleep(6)  # the token expired (the broker's clock moved on)
    answered = len(sent.answers)
    assert not await door._request(conn, metadata, sent)  # closed, not answered
    assert len(sent.answers) == answered and conn.closed
    closes = [r for r in caplog.records if "credentials expired" in r.getMessage()]
    assert len(closes) == 1 and "role=app" in closes[0].getMessage()
    assert token not in caplog.text
    assert door.close_expired(door.now()) == 0  # already closed: no second line
    assert len([r for r in caplog.records if "credentials expired" in r.getMessage()]) == 1


async def test_the_sweep_closes_idle_connections_on_expired_credentials(
    autojump_clock: trio.testing.MockClock,
) -> None:
    door, sent = _door(), _Sent()
    idle, fresh, forever = _conn(door), _conn(door), _conn(door)
    await _authenticate(door, idle, create_token("app", KEY, expiry_s=5), sent)
    await _authenticate(door, fresh, create_token("app", KEY, expiry_s=3600), sent)
    await _authenticate(door, forever, create_token("app", KEY), sent)
    await trio.sleep(6)
    assert door.close_expired(door.now()) == 1
    assert idle.closed and not fresh.closed and not forever.closed
