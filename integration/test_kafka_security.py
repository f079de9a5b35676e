"""Kafka clients against a secured Kafka listener: SSL, SASL (PLAIN and OAUTHBEARER
carrying PigeonMQ tokens) and authorization, with real clients (confluent-kafka,
kafka-python, aiokafka, kcat) and a real ``pigeon standalone`` process.

Roles: ``admin`` is a superuser; ``nobody`` has no grants (authorization is on).
Every client wait is bounded.
"""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _kafka import DEADLINE_S, Security, standalone, start_standalone, topic_name
from _kafka import consume as kafka_consume
from _kafka import produce as kafka_produce

from pigeon.core.testing.servers import Standalone, StandaloneError

confluent_kafka = pytest.importorskip("confluent_kafka")
from confluent_kafka import KafkaError, KafkaException, Producer  # noqa: E402

pytestmark = pytest.mark.integration

#: a client that fails must say so within this many seconds
FAIL_S = 20.0


def delivery_errors(bootstrap: str, topic: str, values: Iterable[bytes], **conf: Any) -> list[Any]:
    """Produce ``values`` with confluent-kafka (``conf``: its settings; a record fails
    after FAIL_S) and return each delivery report's error (None: delivered)."""
    producer = Producer(
        {"bootstrap.servers": bootstrap, "message.timeout.ms": int(FAIL_S * 1000), **conf}
    )
    reports: list[Any] = []
    for value in values:
        producer.produce(topic, value, on_delivery=lambda e, m: reports.append(e))
    producer.flush(FAIL_S + 5)
    return reports


@pytest.fixture(scope="module")
def security(tmp_path_factory: pytest.TempPathFactory) -> Security:
    return Security.create(tmp_path_factory.mktemp("security"))


@pytest.fixture(scope="module")
def sasl_ssl(security: Security, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    with standalone(tmp_path_factory.mktemp("sasl-ssl"), security.config("SASL_SSL")) as sa:
        yield sa


@pytest.fixture(scope="module")
def sasl_plaintext(
    security: Security, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Standalone]:
    base = tmp_path_factory.mktemp("sasl-plaintext")
    with standalone(base, security.config("SASL_PLAINTEXT")) as sa:
        yield sa


def test_confluent_sasl_ssl_plain_produces_and_consumes(
    sasl_ssl: Standalone, security: Security
) -> None:
    topic = topic_name()
    conf = security.confluent("SASL_SSL", security.token("admin"))
    reports = kafka_produce(
        sasl_ssl.kafka_bootstrap, topic, [{"value": f"v{i}".encode()} for i in range(20)], **conf
    )
    assert sorted(m.offset() for m in reports) == list(range(20))
    got = kafka_consume(sasl_ssl.kafka_bootstrap, topic, 20, commit=True, **conf)
    assert [m.value() for m in got] == [f"v{i}".encode() for i in range(20)]
    log = sasl_ssl.log_text()
    assert "kafka client authenticated" in log and "role=admin" in log
    assert security.token("admin") not in log


def test_confluent_oauthbearer_with_oauth_cb(sasl_ssl: Standalone, security: Security) -> None:
    topic = topic_name()
    token = security.token("admin", expiry_s=3600)

    def oauth_cb(_config: Any) -> tuple[str, float]:
        return token, time.time() + 3600

    conf = {
        **security.confluent("SASL_SSL", token, mechanism="OAUTHBEARER"),
        "oauth_cb": oauth_cb,
    }
    kafka_produce(sasl_ssl.kafka_bootstrap, topic, [{"value": b"bearer"}], **conf)
    got = kafka_consume(sasl_ssl.kafka_bootstrap, topic, 1, **conf)
    assert got[0].value() == b"bearer"


def test_wrong_password_fails_cleanly_and_quickly(sasl_ssl: Standalone, security: Security) -> None:
    errors: list[Any] = []
    conf = {
        **security.confluent("SASL_SSL", "not-a-token"),
        "error_cb": errors.append,
        "message.timeout.ms": int(FAIL_S * 1000),
    }
    producer = Producer({"bootstrap.servers": sasl_ssl.kafka_bootstrap, **conf})
    start = time.monotonic()
    while not errors and time.monotonic() - start < FAIL_S:
        producer.poll(0.2)
    assert errors, "no error reported within the deadline"
    assert errors[0].code() == KafkaError._AUTHENTICATION
    assert "authentication failed" in errors[0].str().lower()
    assert "not-a-token" not in errors[0].str()
    assert "kafka SASL authentication failed" in sasl_ssl.log_text()
    assert "not-a-token" not in sasl_ssl.log_text()


def test_role_without_produce_right_gets_topic_authorization_failed(
    sasl_ssl: Standalone, security: Security
) -> None:
    topic = topic_name()
    kafka_produce(
        sasl_ssl.kafka_bootstrap,
        topic,
        [{"value": b"x"}],
        **security.confluent("SASL_SSL", security.token("admin")),
    )
    reports = delivery_errors(
        sasl_ssl.kafka_bootstrap,
        topic,
        [f"denied-{i}".encode() for i in range(5)],
        **security.confluent("SASL_SSL", security.token("nobody")),
    )
    assert len(reports) == 5
    assert {e.code() for e in reports} == {KafkaError.TOPIC_AUTHORIZATION_FAILED}
    denials = [
        line
        for line in sasl_ssl.log_text().splitlines()
        if "kafka request denied" in line and topic in line and "role=nobody" in line
    ]
    assert len(denials) == 1, denials  # once per connection, topic and action


def test_kafka_python_sasl_plaintext_plain(sasl_plaintext: Standalone, security: Security) -> None:
    kafka = pytest.importorskip("kafka")
    topic = topic_name()
    auth = {
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": "PLAIN",
        "sasl_plain_username": "ignored",
        "sasl_plain_password": security.token("admin"),
    }
    producer = kafka.KafkaProducer(bootstrap_servers=sasl_plaintext.kafka_bootstrap, **auth)
    for i in range(10):
        producer.send(topic, value=f"kp-{i}".encode())
    producer.flush(DEADLINE_S)
    producer.close()
    consumer = kafka.KafkaConsumer(
        topic,
        bootstrap_servers=sasl_plaintext.kafka_bootstrap,
        group_id="kafka-python-sasl",
        auto_offset_reset="earliest",
        consumer_timeout_ms=int(DEADLINE_S * 1000),
        **auth,
    )
    got = []
    for msg in consumer:
        got.append(msg.value)
        if len(got) == 10:
            break
    consumer.close()
    assert got == [f"kp-{i}".encode() for i in range(10)]


def test_aiokafka_sasl_ssl(sasl_ssl: Standalone, security: Security) -> None:
    aiokafka = pytest.importorskip("aiokafka")
    topic = topic_name()
    context = ssl.create_default_context(cafile=str(security.ca_file))
    auth = {
        "security_protocol": "SASL_SSL",
        "ssl_context": context,
        "sasl_mechanism": "PLAIN",
        "sasl_plain_username": "public/default",
        "sasl_plain_password": "token:" + security.token("admin"),
    }

    async def scenario() -> list[bytes]:
        async with asyncio.timeout(DEADLINE_S):
            producer = aiokafka.AIOKafkaProducer(bootstrap_servers=sasl_ssl.kafka_bootstrap, **auth)
            await producer.start()
            try:
                for i in range(10):
                    await producer.send_and_wait(topic, f"ak-{i}".encode())
            finally:
                await producer.stop()
            consumer = aiokafka.AIOKafkaConsumer(
                topic,
                bootstrap_servers=sasl_ssl.kafka_bootstrap,
                group_id="aiokafka-sasl",
                auto_offset_reset="earliest",
                **auth,
            )
            await consumer.start()
            got: list[bytes] = []
            try:
                async for msg in consumer:
                    got.append(msg.value)
                    if len(got) == 10:
                        break
            finally:
                await consumer.stop()
            return got

    assert asyncio.run(scenario()) == [f"ak-{i}".encode() for i in range(10)]


@pytest.mark.skipif(shutil.which("kcat") is None, reason="kcat is not installed")
def test_kcat_sasl_ssl(sasl_ssl: Standalone, security: Security) -> None:
    topic = topic_name()
    auth = [
        "-X",
        "security.protocol=SASL_SSL",
        "-X",
        f"ssl.ca.location={security.ca_file}",
        "-X",
        "sasl.mechanisms=PLAIN",
        "-X",
        "sasl.username=public/default",
        "-X",
        f"sasl.password=token:{security.token('admin')}",
    ]
    lines = "".join(f"kcat-{i}\n" for i in range(5))
    subprocess.run(
        ["kcat", "-b", sasl_ssl.kafka_bootstrap, "-t", topic, "-P", *auth],
        input=lines.encode(),
        check=True,
        timeout=DEADLINE_S,
    )
    out = subprocess.run(
        ["kcat", "-b", sasl_ssl.kafka_bootstrap, "-t", topic, "-C", "-e", "-f", "%s\n", *auth],
        check=True,
        timeout=DEADLINE_S,
        capture_output=True,
    )
    assert out.stdout.decode().splitlines() == [f"kcat-{i}" for i in range(5)]


def test_ssl_with_mtls_role(security: Security, tmp_path: Path) -> None:
    """SSL without SASL: the client certificate's common name is the role."""
    config = security.config("SSL", providers=("token", "tls"), mtls=True)
    admin_cert, admin_key = security.client_certificate("admin")
    nobody_cert, nobody_key = security.client_certificate("nobody")
    with standalone(tmp_path / "ssl", config) as sa:

        def conf(cert: Path, key: Path) -> dict[str, Any]:
            return {
                "security.protocol": "SSL",
                "ssl.ca.location": str(security.ca_file),
                "ssl.certificate.location": str(cert),
                "ssl.key.location": str(key),
            }

        topic = topic_name()
        kafka_produce(
            sa.kafka_bootstrap, topic, [{"value": b"mtls"}], **conf(admin_cert, admin_key)
        )
        got = kafka_consume(sa.kafka_bootstrap, topic, 1, **conf(admin_cert, admin_key))
        assert got[0].value() == b"mtls"
        reports = delivery_errors(
            sa.kafka_bootstrap, topic, [b"no"], **conf(nobody_cert, nobody_key)
        )
        assert [e.code() for e in reports] == [KafkaError.TOPIC_AUTHORIZATION_FAILED]
        # a client without a certificate does not get through the handshake
        errors: list[Any] = []
        bare = Producer(
            {
                "bootstrap.servers": sa.kafka_bootstrap,
                "security.protocol": "SSL",
                "ssl.ca.location": str(security.ca_file),
                "error_cb": errors.append,
            }
        )
        start = time.monotonic()
        while not errors and time.monotonic() - start < FAIL_S:
            bare.poll(0.2)
        assert errors, "a client without a certificate was not refused"
        assert "kafka TLS handshake failed" in sa.log_text()


def test_plaintext_client_on_sasl_listener_is_refused(
    sasl_plaintext: Standalone,
) -> None:
    """A client that skips SASL gets nothing but ApiVersions: its connection closes."""
    # librdkafka reconnects until the record's message.timeout.ms: 5 s, not FAIL_S (a
    # listener that served it would deliver in well under a second)
    reports = delivery_errors(
        sasl_plaintext.kafka_bootstrap, topic_name(), [b"x"], **{"message.timeout.ms": 5000}
    )
    assert reports and reports[0] is not None
    assert "kafka request before authentication" in sasl_plaintext.log_text()


def test_sasl_without_authentication_is_a_config_error(security: Security, tmp_path: Path) -> None:
    config = security.config("SASL_SSL", authentication=False)
    with pytest.raises(StandaloneError) as info:
        start_standalone(tmp_path / "bad", config)
    assert "ConfigError" in str(info.value) and "authentication_enabled" in str(info.value)


def test_role_without_rights_may_not_consume_look_up_or_create(
    sasl_ssl: Standalone, security: Security
) -> None:
    from confluent_kafka import Consumer
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = topic_name()
    admin_conf = security.confluent("SASL_SSL", security.token("admin"))
    kafka_produce(sasl_ssl.kafka_bootstrap, topic, [{"value": b"secret"}], **admin_conf)
    nobody = security.confluent("SASL_SSL", security.token("nobody"))
    # Metadata: the topic is answered TOPIC_AUTHORIZATION_FAILED
    admin = AdminClient({"bootstrap.servers": sasl_ssl.kafka_bootstrap, **nobody})
    meta = admin.list_topics(topic, timeout=FAIL_S)
    assert meta.topics[topic].error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    # CreateTopics needs a tenant admin
    futures = admin.create_topics([NewTopic(topic_name(), 1)], operation_timeout=FAIL_S)
    with pytest.raises(KafkaException) as info:
        next(iter(futures.values())).result(timeout=FAIL_S)
    assert info.value.args[0].code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    # a consumer group is refused, and so is a plain fetch
    consumer = Consumer(
        {
            "bootstrap.servers": sasl_ssl.kafka_bootstrap,
            "group.id": "nobody-group",
            "auto.offset.reset": "earliest",
            **nobody,
        }
    )
    try:
        consumer.subscribe([topic])
        codes = set()
        deadline = time.monotonic() + FAIL_S
        while not codes and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None:
                assert msg.error() is not None, "a record reached a role without rights"
                codes.add(msg.error().code())
        assert codes & {
            KafkaError.TOPIC_AUTHORIZATION_FAILED,
            KafkaError.GROUP_AUTHORIZATION_FAILED,
        }, codes
    finally:
        consumer.close()


def _request(api_key: int, version: int, correlation_id: int, body: Any) -> bytes:
    """A Kafka request frame (request header v1: these versions are not flexible)."""
    import io

    from kio.schema.request_header.v1.header import RequestHeader
    from kio.serial import entity_writer

    buf = io.BytesIO()
    entity_writer(RequestHeader)(
        buf,
        RequestHeader(
            request_api_key=api_key,
            request_api_version=version,
            correlation_id=correlation_id,
            client_id="raw",
        ),
    )
    entity_writer(type(body))(buf, body)
    return len(buf.getvalue()).to_bytes(4, "big") + buf.getvalue()


def _read_frame(sock: Any) -> bytes:
    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError(f"closed after {len(data)} of {n} bytes")
            data += chunk
        return data

    return exactly(int.from_bytes(exactly(4), "big"))


def test_kafka_0_10_sasl_bare_token_and_requests_before_authentication(
    sasl_plaintext: Standalone, security: Security
) -> None:
    """SaslHandshake v0 then the token as a bare frame; a request before authenticating
    closes the connection."""
    import socket

    from kio.schema.metadata.v1.request import MetadataRequest
    from kio.schema.sasl_handshake.v0.request import SaslHandshakeRequest

    host, port = sasl_plaintext.kafka_bootstrap.split(":")
    with socket.create_connection((host, int(port)), timeout=FAIL_S) as sock:
        sock.sendall(_request(17, 0, 1, SaslHandshakeRequest(mechanism="PLAIN")))
        answer = _read_frame(sock)
        assert answer[:4] == (1).to_bytes(4, "big") and answer[4:6] == b"\0\0"  # no error
        token = b"\0user\0token:" + security.token("admin").encode()
        sock.sendall(len(token).to_bytes(4, "big") + token)
        assert _read_frame(sock) == b""  # authenticated: an empty bare frame
        sock.sendall(_request(3, 1, 2, MetadataRequest(topics=())))
        assert _read_frame(sock)[:4] == (2).to_bytes(4, "big")
    with socket.create_connection((host, int(port)), timeout=FAIL_S) as sock:
        sock.sendall(_request(3, 1, 7, MetadataRequest(topics=())))
        with pytest.raises(ConnectionError):
            _read_frame(sock)
    with socket.create_connection((host, int(port)), timeout=FAIL_S) as sock:
        sock.sendall(_request(17, 0, 1, SaslHandshakeRequest(mechanism="PLAIN")))
        _read_frame(sock)
        sock.sendall((9).to_bytes(4, "big") + b"\0u\0wrong!")
        with pytest.raises(ConnectionError):
            _read_frame(sock)


def test_failed_sasl_authenticate_is_answered_then_closed(
    sasl_plaintext: Standalone,
) -> None:
    """No second guess on the same connection: the failure is answered (58, with the
    reason) and the connection closes."""
    import socket

    from kio.schema.sasl_authenticate.v1.request import SaslAuthenticateRequest
    from kio.schema.sasl_handshake.v1.request import SaslHandshakeRequest

    host, port = sasl_plaintext.kafka_bootstrap.split(":")
    with socket.create_connection((host, int(port)), timeout=FAIL_S) as sock:
        sock.sendall(_request(17, 1, 1, SaslHandshakeRequest(mechanism="PLAIN")))
        _read_frame(sock)
        wrong = SaslAuthenticateRequest(auth_bytes=b"\0u\0token:wrong-token")
        sock.sendall(_request(36, 1, 2, wrong))
        answer = _read_frame(sock)
        assert answer[:4] == (2).to_bytes(4, "big")
        assert answer[4:6] == (58).to_bytes(2, "big")  # SASL_AUTHENTICATION_FAILED
        assert b"authentication failed" in answer and b"wrong-token" not in answer
        sock.sendall(_request(36, 1, 3, wrong))
        with pytest.raises(ConnectionError):
            _read_frame(sock)


def _authenticated(bootstrap: str, token: str) -> Any:
    """A socket authenticated with SASL PLAIN (handshake v1, authenticate v1)."""
    import socket

    from kio.schema.sasl_authenticate.v1.request import SaslAuthenticateRequest
    from kio.schema.sasl_handshake.v1.request import SaslHandshakeRequest

    host, port = bootstrap.split(":")
    sock = socket.create_connection((host, int(port)), timeout=FAIL_S)
    sock.sendall(_request(17, 1, 1, SaslHandshakeRequest(mechanism="PLAIN")))
    _read_frame(sock)
    credentials = b"\0u\0" + token.encode()
    sock.sendall(_request(36, 1, 2, SaslAuthenticateRequest(auth_bytes=credentials)))
    assert _read_frame(sock)[4:6] == b"\0\0", "authentication failed"
    return sock


def test_group_requests_of_a_role_without_rights_are_group_authorization_failed(
    sasl_plaintext: Standalone, security: Security
) -> None:
    import datetime

    from kio.schema.join_group.v0.request import JoinGroupRequest, JoinGroupRequestProtocol
    from kio.schema.offset_fetch.v2.request import OffsetFetchRequest

    subscription = b"\0\0" + (1).to_bytes(4, "big") + (6).to_bytes(2, "big") + b"orders"
    subscription += b"\xff\xff\xff\xff"  # user data: null

    def join(group: str) -> JoinGroupRequest:
        return JoinGroupRequest(
            group_id=group,
            session_timeout=datetime.timedelta(seconds=10),
            member_id="",
            protocol_type="consumer",
            protocols=(JoinGroupRequestProtocol(name="range", metadata=subscription),),
        )

    with _authenticated(sasl_plaintext.kafka_bootstrap, security.token("nobody")) as sock:
        sock.sendall(_request(11, 0, 3, join("nobody-group")))
        assert _read_frame(sock)[4:6] == (30).to_bytes(2, "big")  # GROUP_AUTHORIZATION_FAILED
        sock.sendall(_request(9, 2, 4, OffsetFetchRequest(group_id="nobody-group", topics=())))
        assert _read_frame(sock)[-2:] == (30).to_bytes(2, "big")
    with _authenticated(sasl_plaintext.kafka_bootstrap, security.token("admin")) as sock:
        sock.sendall(_request(9, 2, 4, OffsetFetchRequest(group_id="admin-group", topics=())))
        assert _read_frame(sock)[-2:] == b"\0\0"
    denials = [
        line
        for line in sasl_plaintext.log_text().splitlines()
        if "kafka request denied" in line and "role=nobody action=group" in line
    ]
    assert len(denials) == 1, denials  # JoinGroup and OffsetFetch: one line


# ------------------------------------------------------------------ token expiry (KIP-368)

#: the lifetime of the short-lived tokens of the expiry tests.  librdkafka refreshes a
#: token at 80 % of the lifetime its oauth_cb gives and re-authenticates at 90 % of the
#: session_lifetime_ms the broker answers, so each step has ~1 s of slack at 10 s (the
#: oauth_cb gives the token's own exp, whole seconds, not a later time)
SHORT_TOKEN_S = 10


def test_oauthbearer_client_reauthenticates_across_token_expiry(
    sasl_ssl: Standalone, security: Security
) -> None:
    """confluent-kafka keeps producing for more than two token lifetimes: the broker
    answers session_lifetime_ms, librdkafka re-authenticates its connections with the
    token its oauth_cb refreshed, and no connection is closed on expired credentials."""
    topic = topic_name()
    issued: list[float] = []

    def oauth_cb(_config: Any) -> tuple[str, float]:
        import jwt

        issued.append(time.time())
        token = security.token("admin", expiry_s=SHORT_TOKEN_S)
        return token, float(jwt.decode(token, options={"verify_signature": False})["exp"])

    log_start = len(sasl_ssl.log_text())
    producer = Producer(
        {
            "bootstrap.servers": sasl_ssl.kafka_bootstrap,
            **security.confluent("SASL_SSL", "", mechanism="OAUTHBEARER"),
            "oauth_cb": oauth_cb,
            "linger.ms": 5,
            "message.timeout.ms": int(FAIL_S * 1000),
        }
    )
    reports: list[Any] = []
    sent = 0
    start = time.monotonic()
    while time.monotonic() - start < 2 * SHORT_TOKEN_S + 5:  # ~25 s: two expiries
        producer.produce(topic, f"v{sent}".encode(), on_delivery=lambda e, m: reports.append(e))
        sent += 1
        producer.poll(0.1)  # oauth_cb runs in poll: a refresh waits for it
    assert producer.flush(FAIL_S) == 0, "deliveries still pending"
    assert len(reports) == sent and not [e for e in reports if e is not None], reports[:3]
    assert len(issued) >= 3, issued  # the first token and at least two refreshes
    log = sasl_ssl.log_text()[log_start:]
    assert "kafka client re-authenticated" in log, log[-3000:]
    assert "credentials expired" not in log, log[-3000:]
    assert "session_lifetime_ms=" in log


def test_raw_client_on_expired_token_is_closed_with_one_log_line(
    sasl_plaintext: Standalone, security: Security
) -> None:
    """A client that does not re-authenticate: SaslAuthenticate v1 told it the session's
    lifetime; after the token's exp its connection is closed (at its next request, or by
    the broker's sweep), with one log line naming the connection and role."""
    import socket

    import jwt
    from kio.schema.metadata.v1.request import MetadataRequest
    from kio.schema.sasl_authenticate.v1.request import SaslAuthenticateRequest
    from kio.schema.sasl_handshake.v1.request import SaslHandshakeRequest

    expiry_s = 4  # room for the requests before exp on a loaded machine
    token = security.token("admin", expiry_s=expiry_s)
    expires = float(jwt.decode(token, options={"verify_signature": False})["exp"])
    host, port = sasl_plaintext.kafka_bootstrap.split(":")
    with socket.create_connection((host, int(port)), timeout=FAIL_S) as sock:
        name = "{}:{}".format(*sock.getsockname()[:2])
        sock.sendall(_request(17, 1, 1, SaslHandshakeRequest(mechanism="PLAIN")))
        _read_frame(sock)
        credentials = b"\0u\0" + token.encode()
        sock.sendall(_request(36, 1, 2, SaslAuthenticateRequest(auth_bytes=credentials)))
        answer = _read_frame(sock)
        assert answer[4:6] == b"\0\0"
        lifetime_ms = int.from_bytes(answer[-8:], "big", signed=True)
        assert 0 < lifetime_ms <= expiry_s * 1000, lifetime_ms
        sock.sendall(_request(3, 1, 3, MetadataRequest(topics=())))
        assert _read_frame(sock)[:4] == (3).to_bytes(4, "big")  # served until exp
        time.sleep(max(0.0, expires - time.time()) + 0.2)
        with pytest.raises(OSError) as info:  # closed (reset or end of stream), not answered
            sock.sendall(_request(3, 1, 4, MetadataRequest(topics=())))
            _read_frame(sock)
        assert not isinstance(info.value, TimeoutError), "the connection stayed open"
    deadline = time.monotonic() + FAIL_S
    lines: list[str] = []
    while not lines and time.monotonic() < deadline:
        lines = [
            line
            for line in sasl_plaintext.log_text().splitlines()
            if "credentials expired" in line and f"conn={name} " in line
        ]
        time.sleep(0.05)
    assert len(lines) == 1 and "role=admin" in lines[0], lines
    assert token not in sasl_plaintext.log_text()


# ------------------------------------------------------------------ real grants


def test_granted_role_produces_then_consumes_then_is_revoked(
    sasl_ssl: Standalone, security: Security
) -> None:
    """A role that is no superuser, granted through the admin API (superuser token):
    produce only (its consumer is refused), then produce and consume; revoked, a new
    connection is refused at once (open ones within AUTHZ_RECHECK_S: unit tested)."""
    import uuid

    from confluent_kafka import Consumer

    from pigeon.client import AuthenticationToken
    from pigeon.client._admin_client import AdminClient

    role = f"app-{uuid.uuid4().hex[:8]}"
    topic = topic_name()
    admin = AdminClient(
        f"http://127.0.0.1:{sasl_ssl.http_port}",
        auth=AuthenticationToken(security.token("admin")),
    )
    app = security.confluent("SASL_SSL", security.token(role))
    kafka_produce(
        sasl_ssl.kafka_bootstrap,
        topic,
        [{"value": b"first"}],
        **security.confluent("SASL_SSL", security.token("admin")),
    )

    def refused_codes() -> set[int]:
        consumer = Consumer(
            {
                "bootstrap.servers": sasl_ssl.kafka_bootstrap,
                "group.id": f"{role}-group",
                "auto.offset.reset": "earliest",
                **app,
            }
        )
        try:
            consumer.subscribe([topic])
            codes: set[int] = set()
            deadline = time.monotonic() + FAIL_S
            while not codes and time.monotonic() < deadline:
                msg = consumer.poll(0.5)
                if msg is not None:
                    assert msg.error() is not None, "a record reached a role without consume"
                    codes.add(msg.error().code())
            return codes
        finally:
            consumer.close()

    def produce_errors() -> set[Any]:
        reports = delivery_errors(sasl_ssl.kafka_bootstrap, topic, [b"by-app"], **app)
        assert len(reports) == 1
        return {e.code() if e is not None else None for e in reports}

    assert produce_errors() == {KafkaError.TOPIC_AUTHORIZATION_FAILED}  # nothing granted
    admin.grant_permission("public/default", role, ["produce"])
    assert produce_errors() == {None}
    assert refused_codes() & {
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.GROUP_AUTHORIZATION_FAILED,
    }
    admin.grant_permission("public/default", role, ["produce", "consume"])
    got = kafka_consume(sasl_ssl.kafka_bootstrap, topic, 2, group=f"{role}-reader", **app)
    assert [m.value() for m in got] == [b"first", b"by-app"]
    admin.revoke_permission("public/default", role)
    assert produce_errors() == {KafkaError.TOPIC_AUTHORIZATION_FAILED}
    log = sasl_ssl.log_text()
    # denials are logged naming the role and the action (its metadata requests too)
    assert f"role={role} action=lookup" in log and f"role={role} action=group" in log


def test_a_role_without_group_rights_may_not_see_or_disturb_other_groups(
    sasl_plaintext: Standalone, security: Security
) -> None:
    """DescribeGroups, ListGroups, Heartbeat and LeaveGroup need the group right: a role
    without it neither learns another role's members (client ids, hosts, assignments)
    nor removes them from their group."""
    import datetime
    import uuid

    from kio.schema.describe_groups.v0.request import DescribeGroupsRequest
    from kio.schema.heartbeat.v0.request import HeartbeatRequest
    from kio.schema.join_group.v0.request import JoinGroupRequest, JoinGroupRequestProtocol
    from kio.schema.leave_group.v0.request import LeaveGroupRequest
    from kio.schema.list_groups.v0.request import ListGroupsRequest

    group = f"admin-{uuid.uuid4().hex[:8]}"
    bootstrap = sasl_plaintext.kafka_bootstrap
    with _authenticated(bootstrap, security.token("admin")) as admin:
        admin.sendall(
            _request(
                11,
                0,
                3,
                JoinGroupRequest(
                    group_id=group,
                    session_timeout=datetime.timedelta(seconds=30),
                    member_id="",
                    protocol_type="consumer",
                    protocols=(JoinGroupRequestProtocol(name="range", metadata=b""),),
                ),
            )
        )
        joined = _read_frame(admin)
        assert joined[4:6] == b"\0\0", joined
        at = 10  # correlation id, error code, generation id
        for _ in range(3):  # protocol name, leader, member id
            length = int.from_bytes(joined[at : at + 2], "big")
            member_id = joined[at + 2 : at + 2 + length].decode()
            at += 2 + length
        generation = int.from_bytes(joined[6:10], "big")
        assert member_id
        with _authenticated(bootstrap, security.token("nobody")) as nobody:
            nobody.sendall(_request(15, 0, 4, DescribeGroupsRequest(groups=(group,))))
            described = _read_frame(nobody)
            assert described[8:10] == (30).to_bytes(2, "big")  # GROUP_AUTHORIZATION_FAILED
            assert member_id.encode() not in described
            nobody.sendall(_request(16, 0, 5, ListGroupsRequest()))
            assert group.encode() not in _read_frame(nobody)
            beat = HeartbeatRequest(group_id=group, generation_id=generation, member_id=member_id)
            nobody.sendall(_request(12, 0, 6, beat))
            assert _read_frame(nobody)[4:6] == (30).to_bytes(2, "big")
            nobody.sendall(
                _request(13, 0, 7, LeaveGroupRequest(group_id=group, member_id=member_id))
            )
            assert _read_frame(nobody)[4:6] == (30).to_bytes(2, "big")
        admin.sendall(_request(12, 0, 8, beat))
        assert _read_frame(admin)[4:6] == b"\0\0"  # still a member
        admin.sendall(_request(16, 0, 9, ListGroupsRequest()))
        assert group.encode() in _read_frame(admin)
        admin.sendall(_request(15, 0, 10, DescribeGroupsRequest(groups=(group,))))
        assert member_id.encode() in _read_frame(admin)


def test_large_requests_before_authentication_are_refused_at_once(
    sasl_plaintext: Standalone, security: Security
) -> None:
    """Before SASL completes a request may be at most 512 KiB (Kafka's
    sasl.server.max.receive.size): a peer announcing 50 MiB is cut off at once instead
    of having a 50 MiB buffer allocated for it; authenticated clients send large ones."""
    import socket

    host, port = sasl_plaintext.kafka_bootstrap.split(":")
    for size in (50 * 1024 * 1024, 600 * 1024):
        with socket.create_connection((host, int(port)), timeout=FAIL_S) as sock:
            sock.sendall(size.to_bytes(4, "big") + b"\0\x12\0\0" + b"x" * 1024)
            with pytest.raises(ConnectionError):
                _read_frame(sock)
    assert "bytes before the client authenticated" in sasl_plaintext.log_text()
    topic = topic_name()
    conf = security.confluent("SASL_PLAINTEXT", security.token("admin"))
    value = b"v" * (700 * 1024)
    reports = kafka_produce(sasl_plaintext.kafka_bootstrap, topic, [{"value": value}], **conf)
    assert [m.offset() for m in reports] == [0]


def test_fetching_all_committed_offsets_leaves_out_topics_the_role_may_not_read(
    sasl_plaintext: Standalone, security: Security
) -> None:
    """OffsetFetch without topics answers the group's committed topics the role may
    consume, not the names of the others (as Kafka leaves out unauthorized topics)."""
    import datetime
    import json
    import urllib.request

    from kio.schema.offset_commit.v2.request import (
        OffsetCommitRequest,
        OffsetCommitRequestPartition,
        OffsetCommitRequestTopic,
    )
    from kio.schema.offset_fetch.v2.request import OffsetFetchRequest

    readable, secret = topic_name("readable"), topic_name("secret")
    conf = security.confluent("SASL_PLAINTEXT", security.token("admin"))
    for topic in (readable, secret):
        kafka_produce(sasl_plaintext.kafka_bootstrap, topic, [{"value": b"v"}], **conf)
    group = f"shared-{readable}"
    commit = OffsetCommitRequest(
        group_id=group,
        generation_id_or_member_epoch=-1,
        member_id="",
        retention_time=datetime.timedelta(milliseconds=-1),
        topics=tuple(
            OffsetCommitRequestTopic(
                name=topic,
                partitions=(
                    OffsetCommitRequestPartition(
                        partition_index=0, committed_offset=1, committed_metadata=""
                    ),
                ),
            )
            for topic in (readable, secret)
        ),
    )
    with _authenticated(sasl_plaintext.kafka_bootstrap, security.token("admin")) as admin:
        admin.sendall(_request(8, 2, 3, commit))
        # each topic: one partition (count 1), index 0, error 0
        assert _read_frame(admin).count(b"\0\0\0\x01" + b"\0" * 6) == 2
    url = (
        f"http://127.0.0.1:{sasl_plaintext.http_port}/admin/v2/topics/persistent/public/"
        f"default/{readable}/permissions/reader"
    )
    grant = urllib.request.Request(
        url,
        data=json.dumps(["consume"]).encode(),
        method="POST",
        headers={
            "Authorization": f"Bearer {security.token('admin')}",
            "Content-Type": "application/json",
        },
    )
    with urllib.request.urlopen(grant, timeout=FAIL_S) as answer:
        assert answer.status == 204
    with _authenticated(sasl_plaintext.kafka_bootstrap, security.token("reader")) as reader:
        reader.sendall(_request(9, 2, 4, OffsetFetchRequest(group_id=group, topics=None)))
        fetched = _read_frame(reader)
    assert readable.encode() in fetched
    assert secret.encode() not in fetched


def test_init_producer_id_needs_a_produce_right_somewhere(
    sasl_plaintext: Standalone, security: Security
) -> None:
    """InitProducerId (Kafka's IDEMPOTENT_WRITE) is CLUSTER_AUTHORIZATION_FAILED for a
    role that may produce nowhere: it could otherwise bump (fence) another producer's
    epoch."""
    import datetime

    from kio.schema.init_producer_id.v0.request import InitProducerIdRequest

    request = InitProducerIdRequest(
        transactional_id=None, transaction_timeout=datetime.timedelta(seconds=60)
    )
    with _authenticated(sasl_plaintext.kafka_bootstrap, security.token("nobody")) as nobody:
        nobody.sendall(_request(22, 0, 3, request))
        assert _read_frame(nobody)[8:10] == (31).to_bytes(2, "big")
    with _authenticated(sasl_plaintext.kafka_bootstrap, security.token("admin")) as admin:
        admin.sendall(_request(22, 0, 3, request))
        assert _read_frame(admin)[8:10] == b"\0\0"
