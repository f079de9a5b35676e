"""The Kafka listener closes connections that do not authenticate in time (a broker,
bookie and metadata store in the test's trio run, on loopback sockets)."""

from __future__ import annotations

import base64
import functools
import io
import logging
import struct
from pathlib import Path
from typing import Any

import pytest
import trio

from pigeon.broker import BrokerConfig, run_standalone
from pigeon.broker._config import KafkaConfig
from pigeon.core.tokens import create_secret_key, create_token

HOST = "127.0.0.1"


def _request(api_key: int, version: int, correlation_id: int, body: Any) -> bytes:
    from kio.schema.request_header.v1.header import RequestHeader
    from kio.serial import entity_writer

    buf = io.BytesIO()
    header = RequestHeader(
        request_api_key=api_key,
        request_api_version=version,
        correlation_id=correlation_id,
        client_id="raw",
    )
    entity_writer(RequestHeader)(buf, header)
    entity_writer(type(body))(buf, body)
    return struct.pack(">i", len(buf.getvalue())) + buf.getvalue()


async def _read_frame(stream: trio.SocketStream) -> bytes:
    data = b""
    while len(data) < 4 or len(data) < 4 + struct.unpack(">i", data[:4])[0]:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise EOFError(f"closed after {len(data)} bytes")
        data += chunk
    return data[4:]


async def test_connections_that_do_not_authenticate_in_time_are_closed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from kio.schema.api_versions.v0.request import ApiVersionsRequest
    from kio.schema.sasl_authenticate.v1.request import SaslAuthenticateRequest
    from kio.schema.sasl_handshake.v1.request import SaslHandshakeRequest

    import pigeon.broker._kafka as kafka
    from pigeon.bookie import BookieConfig

    monkeypatch.setattr(kafka, "AUTHENTICATION_DEADLINE_S", 0.5)
    key = create_secret_key()
    config = BrokerConfig(
        host=HOST,
        port=0,
        http_port=-1,
        maintenance_interval_s=3600.0,
        authentication_enabled=True,
        token_secret_key="data:;base64," + base64.b64encode(key).decode(),
        authorization_enabled=True,
        superuser_roles=["admin"],
    )
    config.kafka = KafkaConfig(port=0, security_protocol="SASL_PLAINTEXT")
    caplog.set_level(logging.WARNING, logger="pigeon")
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            service = await nursery.start(
                functools.partial(
                    run_standalone,
                    tmp_path / "data",
                    config,
                    BookieConfig(port=0, fsync="never"),
                )
            )
            port = service.kafka.address[1]
            good = await trio.open_tcp_stream(HOST, port)
            await good.send_all(_request(17, 1, 1, SaslHandshakeRequest(mechanism="PLAIN")))
            await _read_frame(good)
            plain = b"\0u\0" + create_token("admin", key).encode()
            await good.send_all(_request(36, 1, 2, SaslAuthenticateRequest(auth_bytes=plain)))
            assert (await _read_frame(good))[4:6] == b"\0\0"  # authenticated
            idle = [await trio.open_tcp_stream(HOST, port) for _ in range(10)]
            await idle[0].send_all(_request(18, 0, 1, ApiVersionsRequest()))
            assert (await _read_frame(idle[0]))[4:6] == b"\0\0"  # answered, not authenticated
            with trio.fail_after(10):
                for stream in idle:
                    with pytest.raises(EOFError):
                        await _read_frame(stream)
                    await stream.aclose()
            # the authenticated connection, older than the deadline, is served on
            await good.send_all(_request(18, 0, 3, ApiVersionsRequest()))
            assert (await _read_frame(good))[:4] == (3).to_bytes(4, "big")
            await good.aclose()
            nursery.cancel_scope.cancel()
    assert "not authenticated within 0.5s" in caplog.text
