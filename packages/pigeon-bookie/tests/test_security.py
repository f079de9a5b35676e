"""A bookie with TLS and token authentication: only brokers and bookies (its
``superuser_roles``) read and write entries, over TLS, and leader-follower forwarding
presents the forwarding bookie's own role."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from test_forward import replicated_add
from test_service import GIB, TIMEOUT, payload

from pigeon.bookie import BookieConfig, BookieServer
from pigeon.core.auth import AuthenticationToken
from pigeon.core.config import load_config
from pigeon.core.errors import (
    AuthenticationError,
    AuthorizationError,
    ConfigError,
    ConnectionClosed,
    TlsError,
)
from pigeon.core.replication import BookieClient
from pigeon.core.testing.servers import NODE_ROLE, SecurityFiles, write_toml


@pytest.fixture(scope="module")
def sec(tmp_path_factory: pytest.TempPathFactory) -> SecurityFiles:
    return SecurityFiles.create(tmp_path_factory.mktemp("sec"))


@asynccontextmanager
async def secure_bookie(
    tmp_path: Path, sec: SecurityFiles, **options: Any
) -> AsyncIterator[tuple[BookieServer, str]]:
    """A bookie on a free port with TLS and token authentication (``sec.node_table()``)."""
    settings = sec.node_table() | options
    config = BookieConfig(data_dir=str(tmp_path / "bookie"), port=0, fsync="never", **settings)
    server = BookieServer(config)
    server.disk_usage = lambda: (100 * GIB, 50 * GIB)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)
            try:
                yield server, server.advertised
            finally:
                nursery.cancel_scope.cancel()


@asynccontextmanager
async def client_of(**options: Any) -> AsyncIterator[BookieClient]:
    client = BookieClient(name="test", **options)
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run)
        try:
            yield client
        finally:
            client.close()
            nursery.cancel_scope.cancel()


async def test_a_broker_with_the_ca_and_a_superuser_token_adds_and_reads(
    tmp_path: Path, sec: SecurityFiles
) -> None:
    async with (
        secure_bookie(tmp_path, sec) as (server, addr),
        client_of(
            tls=sec.client_tls_context(), authentication=AuthenticationToken(sec.token(NODE_ROLE))
        ) as client,
    ):
        for entry in range(3):
            await client.add_entry(addr, 1, entry, entry - 1, payload(1, entry))
        got = await client.read_entries(addr, 1, 0, 10)
        assert [(i, bytes(d)) for i, d in got] == [(i, payload(1, i)) for i in range(3)]
        conn = await client.connection(addr)
        assert conn.role == NODE_ROLE
        assert server.tls is not None


async def test_no_token_is_an_authentication_error(tmp_path: Path, sec: SecurityFiles) -> None:
    async with (
        secure_bookie(tmp_path, sec) as (_server, addr),
        client_of(tls=sec.client_tls_context()) as client,
    ):
        with pytest.raises(AuthenticationError, match="authentication is required"):
            await client.read_entries(addr, 1, 0, 0)


async def test_a_role_that_is_not_a_superuser_is_refused_every_request(
    tmp_path: Path, sec: SecurityFiles, caplog: pytest.LogCaptureFixture
) -> None:
    """A valid client token (an application's role) never reads entries off a bookie."""
    token = sec.token("app")
    async with (
        secure_bookie(tmp_path, sec) as (_server, addr),
        client_of(tls=sec.client_tls_context(), authentication=AuthenticationToken(token)) as c,
    ):
        with caplog.at_level(logging.WARNING, logger="pigeon.bookie"):
            with pytest.raises(AuthorizationError, match="role 'app' may not use a bookie"):
                await c.read_entries(addr, 1, 0, 0)
            with pytest.raises(AuthorizationError):
                await c.add_entry(addr, 1, 0, -1, b"x")
            with pytest.raises(AuthorizationError):
                await c.fence(addr, 1)
            with pytest.raises(AuthorizationError):
                await c.delete_segment(addr, 1)
        # one line per connection, not per request; never the token
        refusals = [r for r in caplog.records if "not a superuser" in r.getMessage()]
        assert len(refusals) == 1
        assert token not in caplog.text


async def test_a_plaintext_client_is_told_the_port_takes_tls(
    tmp_path: Path, sec: SecurityFiles
) -> None:
    async with (
        secure_bookie(tmp_path, sec) as (_server, addr),
        client_of(authentication=AuthenticationToken(sec.token(NODE_ROLE))) as client,
    ):
        with pytest.raises(TlsError, match="takes TLS only"):
            await client.read_entries(addr, 1, 0, 0)


async def test_a_client_that_does_not_trust_the_ca_fails_the_handshake(
    tmp_path: Path, sec: SecurityFiles
) -> None:
    other = SecurityFiles.create(tmp_path / "other")
    async with (
        secure_bookie(tmp_path, sec) as (_server, addr),
        client_of(
            tls=other.client_tls_context(),
            authentication=AuthenticationToken(sec.token(NODE_ROLE)),
        ) as client,
    ):
        with pytest.raises(TlsError, match="not signed by a trusted CA"):
            await client.read_entries(addr, 1, 0, 0)


async def test_leader_follower_forwarding_between_secure_bookies(
    tmp_path: Path, sec: SecurityFiles
) -> None:
    """The leader dials its followers over TLS with its own role (broker_client_*)."""
    async with AsyncExitStack() as stack:
        _l, leader = await stack.enter_async_context(secure_bookie(tmp_path / "l", sec))
        _f, follower = await stack.enter_async_context(secure_bookie(tmp_path / "f", sec))
        client = await stack.enter_async_context(
            client_of(
                tls=sec.client_tls_context(),
                authentication=AuthenticationToken(sec.token(NODE_ROLE)),
            )
        )
        for entry in range(3):
            copies, lost = await replicated_add(
                client, leader, 7, entry, payload(7, entry), [follower], acks=1
            )
            assert (copies, lost) == (2, [])
        got = await client.read_entries(follower, 7, 0, 10)
        assert [(i, bytes(d)) for i, d in got] == [(i, payload(7, i)) for i in range(3)]


async def test_a_leader_without_credentials_fails_the_add_naming_the_follower(
    tmp_path: Path, sec: SecurityFiles
) -> None:
    """A leader bookie with no credentials of its own: the follower refuses it, and the
    add fails with that refusal (a misconfiguration is told, not taken for a lost
    follower and replaced over and over)."""
    async with AsyncExitStack() as stack:
        no_creds = {
            "broker_client_authentication_plugin": "",
            "broker_client_authentication_parameters": "",
        }
        _l, leader = await stack.enter_async_context(secure_bookie(tmp_path / "l", sec, **no_creds))
        _f, follower = await stack.enter_async_context(secure_bookie(tmp_path / "f", sec))
        client = await stack.enter_async_context(
            client_of(
                tls=sec.client_tls_context(),
                authentication=AuthenticationToken(sec.token(NODE_ROLE)),
            )
        )
        with pytest.raises(AuthenticationError, match=f"{follower}: authentication is required"):
            await replicated_add(client, leader, 7, 0, payload(7, 0), [follower], acks=1)


def test_security_keys_load_from_the_bookie_table_and_the_environment(
    tmp_path: Path, sec: SecurityFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_toml(tmp_path / "bookie.toml", {"bookie": sec.node_table()})
    monkeypatch.setenv("PIGEON_SUPERUSER_ROLES", "broker-a, broker-b")
    config = load_config(BookieConfig, path=path, section="bookie")
    assert config.tls_certificate_file == str(sec.certificate_file)
    assert config.authentication_enabled
    assert config.superuser_roles == ["broker-a", "broker-b"]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"authentication_enabled": True, "token_secret_key": "data:;base64,AAAA"},
            "needs 'superuser_roles'",
        ),
        ({"tls_certificate_file": "/nonexistent/cert.pem"}, "go together"),
        (
            {"tls_certificate_file": "/nonexistent/cert.pem", "tls_key_file": "/nonexistent/k"},
            "bookie: cannot read .*: no such file",
        ),
        (
            {
                "authentication_enabled": True,
                "superuser_roles": ["b"],
                "authentication_providers": ["kerberos"],
            },
            "unknown authentication provider 'kerberos'",
        ),
        (
            {
                "authentication_enabled": True,
                "superuser_roles": ["b"],
                "token_secret_key": "file:///nonexistent/secret.key",
            },
            "cannot read the key file",
        ),
    ],
)
def test_bad_security_settings_are_one_line_config_errors(
    tmp_path: Path, settings: dict[str, Any], message: str
) -> None:
    config = BookieConfig(data_dir=str(tmp_path / "b"), **settings)
    with pytest.raises(ConfigError, match=message) as info:
        BookieServer(config)
    assert "\n" not in str(info.value)


async def test_sighup_reloads_the_certificate_without_dropping_connections(
    tmp_path: Path, sec: SecurityFiles
) -> None:
    """A renewed certificate (another CA here) is served to new connections after
    SIGHUP; a connection opened before keeps working."""
    own = SecurityFiles.create(tmp_path / "own")
    renewed = SecurityFiles.create(tmp_path / "renewed")
    options = {
        "tls_certificate_file": str(own.certificate_file),
        "tls_key_file": str(own.key_file),
    }
    token = AuthenticationToken(sec.token(NODE_ROLE))
    async with (
        secure_bookie(tmp_path, sec, **options) as (server, addr),
        client_of(tls=own.client_tls_context(), authentication=token) as before,
        client_of(tls=renewed.client_tls_context(), authentication=token) as after,
    ):
        await before.add_entry(addr, 1, 0, -1, b"zero")
        with pytest.raises(TlsError):
            await after.read_entries(addr, 1, 0, 0)
        renewed.certificate_file.replace(own.certificate_file)
        renewed.key_file.replace(own.key_file)
        assert server.tls is not None
        os.kill(os.getpid(), signal.SIGHUP)
        for _ in range(500):  # the signal arrives through trio's wakeup: at most 5 s
            if server.tls.reloads:
                break
            await trio.sleep(0.01)
        assert server.tls.reloads == 1
        assert [bytes(d) for _, d in await after.read_entries(addr, 1, 0, 0)] == [b"zero"]
        await before.add_entry(addr, 1, 1, 0, b"one")  # the old connection still serves


async def test_mutual_tls_roles_are_the_certificates_common_names(
    tmp_path: Path, sec: SecurityFiles
) -> None:
    """``authentication_providers = ["tls"]``: a broker's client certificate is its
    role; a client certificate of another role is refused every request."""
    from pigeon.core.auth import AuthenticationTLS
    from pigeon.core.tls import client_context

    options = {
        "authentication_providers": ["tls"],
        "tls_require_trusted_client_cert": True,
        "superuser_roles": ["broker-1"],
    }

    def as_role(role: str) -> dict[str, Any]:
        cert, key = sec.client_certificate(role)
        tls = client_context(
            trust_certs_file=str(sec.ca_file), certificate_file=str(cert), key_file=str(key)
        )
        return {"tls": tls, "authentication": AuthenticationTLS(str(cert), str(key))}

    async with (
        secure_bookie(tmp_path, sec, **options) as (_server, addr),
        client_of(**as_role("broker-1")) as broker,
        client_of(**as_role("app")) as app,
        client_of(tls=sec.client_tls_context()) as anonymous,
    ):
        await broker.add_entry(addr, 1, 0, -1, b"zero")
        assert (await broker.connection(addr)).role == "broker-1"
        with pytest.raises(AuthorizationError, match="role 'app'"):
            await app.read_entries(addr, 1, 0, 0)
        # no client certificate: refused in the handshake (over TLS 1.3 the client only
        # sees the connection end; pigeon.core does not name the alert yet)
        with pytest.raises((TlsError, ConnectionClosed)):
            await anonymous.read_entries(addr, 1, 0, 0)


async def test_requests_pipelined_behind_a_non_superuser_connect_are_refused(
    tmp_path: Path, sec: SecurityFiles
) -> None:
    """An application's valid token with reads and writes sent in the same packet as
    its connect (before the refusal could land): every one is refused, nothing stored
    or read."""
    from pigeon.core._framing import FrameDecoder, build_message, encode_frame
    from pigeon.core._schema import PROTOCOL_VERSION, BookieFrame, frame_name

    def frame(kind: str, fields: Any, request_id: int) -> bytes:
        return b"".join(
            bytes(p) for p in encode_frame(build_message(BookieFrame, request_id, kind, fields))
        )

    async with (
        secure_bookie(tmp_path, sec) as (_server, addr),
        client_of(
            tls=sec.client_tls_context(), authentication=AuthenticationToken(sec.token(NODE_ROLE))
        ) as node,
    ):
        await node.add_entry(addr, 1, 0, -1, payload(1, 0))
        host, port = addr.rsplit(":", 1)
        stream = trio.SSLStream(
            await trio.open_tcp_stream(host, int(port)),
            sec.client_tls_context(),
            server_hostname=host,
        )
        connect = {
            "protocolVersion": PROTOCOL_VERSION,
            "clientName": "app",
            "frameType": frame_name(BookieFrame),
            "authMethod": "token",
            "authData": sec.token("app").encode(),
        }
        read = {"segmentId": 1, "firstEntryId": 0, "lastEntryId": 0}
        await stream.send_all(
            frame("connect", connect, 1)
            + frame("readEntries", read, 2)
            + frame("addEntry", {"segmentId": 2, "entryId": 0, "lac": -1}, 3)
            + frame("deleteSegment", {"segmentId": 1}, 4)
        )
        decoder, answers = FrameDecoder(), []
        with trio.fail_after(TIMEOUT):
            while len(answers) < 4:
                data = await stream.receive_some(65536)
                assert data, f"closed after {answers}"
                decoder.feed(data)
                for raw in decoder.frames():
                    with BookieFrame.from_bytes(bytes(raw)) as msg:
                        kind = msg.which()
                        text = str(msg.error.message) if kind == "error" else ""
                        answers.append((msg.requestId, kind, text))
        await trio.aclose_forcefully(stream)
        assert answers[0][:2] == (1, "connected")
        for request_id, kind, text in answers[1:]:
            assert kind == "error" and "may not use a bookie" in text, (request_id, kind)
        got = await node.read_entries(addr, 1, 0, 0)
        assert [bytes(d) for _, d in got] == [payload(1, 0)]
