"""``pigeon standalone`` as a real process with TLS, tokens and authorization on the
native protocol: the plaintext and TLS ports side by side, the broker's certificate
replaced and reloaded on SIGHUP without dropping connections.

Certificates are made per run (``SecurityFiles``); the token key lives in a file (never on the
command line).  Every wait is bounded.
"""

from __future__ import annotations

import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from pigeon.core.auth import AuthenticationToken
from pigeon.core.errors import AuthenticationError, AuthorizationError, TlsError
from pigeon.core.rpc import BrokerFrame, Connection, connect_tcp
from pigeon.core.testing.servers import HOST, SecurityFiles, Standalone, free_port, write_toml
from pigeon.core.tls import client_context

pytestmark = pytest.mark.integration

TOPIC = "persistent://public/default/secured"
#: longest wait for the server to log a certificate reload after SIGHUP
RELOAD_TIMEOUT = 10.0


@dataclass
class Secured:
    server: Standalone
    tls_port: int
    security: SecurityFiles

    def token(self, role: str) -> AuthenticationToken:
        return AuthenticationToken(self.security.token(role))

    async def connect(
        self, nursery: trio.Nursery, role: str | None = "admin", *, ca_file: Path | None = None
    ) -> Connection:
        conn, _info = await connect_tcp(
            HOST,
            self.tls_port,
            BrokerFrame,
            nursery,
            tls=client_context(trust_certs_file=str(ca_file or self.security.ca_file)),
            authentication=None if role is None else self.token(role),
        )
        return conn


@pytest.fixture
def secured(standalone_factory: Callable[..., Standalone], tmp_path: Path) -> Secured:
    sec = SecurityFiles.create(tmp_path / "security")
    tls_port = free_port()
    broker = {
        "broker_service_port_tls": tls_port,
        "tls_certificate_file": str(sec.certificate_file),
        "tls_key_file": str(sec.key_file),
        "authentication_enabled": True,
        "authentication_providers": ["token"],
        "token_secret_key": sec.secret_key_url,
        "authorization_enabled": True,
        "superuser_roles": ["admin"],
    }
    config = write_toml(tmp_path / "pigeon.toml", {"broker": broker})
    server = standalone_factory(extra_args=("--config", str(config))).start()
    return Secured(server, tls_port, sec)


async def _produce(conn: Connection) -> Any:
    return await conn.request(
        "createProducer",
        {"producerId": 1, "topic": TOPIC, "producerName": ""},
        expect="producerCreated",
    )


async def test_tls_and_plaintext_ports_both_authenticate_and_authorize(secured: Secured) -> None:
    async with trio.open_nursery() as nursery:
        with trio.fail_after(30):
            conn = await secured.connect(nursery)
            await _produce(conn)
            lookup = await conn.request("lookup", {"topic": TOPIC}, expect="lookupResult")
            assert lookup["brokerUrl"] == f"pigeon+ssl://{HOST}:{secured.tls_port}"
            plain, _ = await connect_tcp(
                HOST,
                secured.server.port,
                BrokerFrame,
                nursery,
                authentication=secured.token("admin"),
            )
            lookup = await plain.request("lookup", {"topic": TOPIC}, expect="lookupResult")
            assert lookup["brokerUrl"] == secured.server.url
            with pytest.raises(AuthenticationError, match="authentication is required"):
                await secured.connect(nursery, role=None)
            with pytest.raises(TlsError, match=r"pigeon\+ssl://"):
                await connect_tcp(HOST, secured.tls_port, BrokerFrame, nursery)
            nobody = await secured.connect(nursery, "nobody")
            with pytest.raises(AuthorizationError, match="role 'nobody' may not produce"):
                await _produce(nobody)
            assert not nobody.closed
        nursery.cancel_scope.cancel()
    log = secured.server.log_text()
    assert log.count("authorization denied") == 1
    for token_part in secured.token("nobody").auth_data().decode().split("."):
        assert token_part not in log


async def test_sighup_reloads_the_certificate_without_dropping_connections(
    secured: Secured, tmp_path: Path
) -> None:
    new = SecurityFiles.create(tmp_path / "new", hosts=(HOST,))
    async with trio.open_nursery() as nursery:
        with trio.fail_after(60):
            before = await secured.connect(nursery)
            await _produce(before)
            shutil.copy(new.certificate_file, secured.security.certificate_file)
            shutil.copy(new.key_file, secured.security.key_file)
            assert secured.server.proc is not None
            secured.server.proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + RELOAD_TIMEOUT
            while "TLS certificate reloaded" not in secured.server.log_text():
                assert time.monotonic() < deadline, "no reload logged after SIGHUP"
                await trio.sleep(0.05)
            # the connection made before the reload still works
            await before.request("lookup", {"topic": TOPIC}, expect="lookupResult")
            # new connections get the new certificate
            after = await secured.connect(nursery, ca_file=new.ca_file)
            await after.request("lookup", {"topic": TOPIC}, expect="lookupResult")
            with pytest.raises(TlsError, match="not signed by a trusted CA"):
                await secured.connect(nursery)
        nursery.cancel_scope.cancel()
    assert secured.server.running
