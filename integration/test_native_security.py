"""``pigeon standalone`` as a real process with TLS, tokens and authorization on the
native protocol: the plaintext and TLS ports side by side, the broker's certificate
replaced and reloaded on SIGHUP without dropping connections.

Certificates are made per run (``trustme``); the token key lives in a file (never on the
command line).  Every wait is bounded.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
import trustme

from pigeon.core.auth import AuthenticationToken
from pigeon.core.errors import AuthenticationError, AuthorizationError, TlsError
from pigeon.core.rpc import BrokerFrame, Connection, connect_tcp
from pigeon.core.testing.servers import HOST, Standalone, free_port
from pigeon.core.tls import client_context
from pigeon.core.tokens import create_secret_key, create_token

pytestmark = pytest.mark.integration

TOPIC = "persistent://public/default/secured"
#: longest wait for the server to log a certificate reload after SIGHUP
RELOAD_TIMEOUT = 10.0


@dataclass
class Secured:
    server: Standalone
    tls_port: int
    key: bytes
    ca_file: Path
    cert_file: Path

    def token(self, role: str) -> AuthenticationToken:
        return AuthenticationToken(create_token(role, self.key))

    async def connect(
        self, nursery: trio.Nursery, role: str | None = "admin", *, ca_file: Path | None = None
    ) -> Connection:
        conn, _info = await connect_tcp(
            HOST,
            self.tls_port,
            BrokerFrame,
            nursery,
            tls=client_context(trust_certs_file=str(ca_file or self.ca_file)),
            authentication=None if role is None else self.token(role),
        )
        return conn


@pytest.fixture
def secured(standalone_factory: Callable[..., Standalone], tmp_path: Path) -> Secured:
    ca = trustme.CA()
    cert_file, ca_file, key_file = (
        tmp_path / "broker.pem",
        tmp_path / "ca.pem",
        tmp_path / "secret.key",
    )
    ca.issue_cert(HOST, "localhost").private_key_and_cert_chain_pem.write_to_path(str(cert_file))
    ca.cert_pem.write_to_path(str(ca_file))
    key = create_secret_key()
    key_file.write_bytes(key)
    key_file.chmod(0o600)
    tls_port = free_port()
    config = tmp_path / "pigeon.toml"
    config.write_text(
        "[broker]\n"
        f"broker_service_port_tls = {tls_port}\n"
        f'tls_certificate_file = "{cert_file}"\n'
        f'tls_key_file = "{cert_file}"\n'
        "authentication_enabled = true\n"
        'authentication_providers = ["token"]\n'
        f'token_secret_key = "file://{key_file}"\n'
        "authorization_enabled = true\n"
        'superuser_roles = ["admin"]\n'
    )
    server = standalone_factory(extra_args=("--config", str(config))).start()
    return Secured(server, tls_port, key, ca_file, cert_file)


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
    new_ca = trustme.CA()
    new_ca_file = tmp_path / "new-ca.pem"
    new_ca.cert_pem.write_to_path(str(new_ca_file))
    async with trio.open_nursery() as nursery:
        with trio.fail_after(60):
            before = await secured.connect(nursery)
            await _produce(before)
            new_ca.issue_cert(HOST).private_key_and_cert_chain_pem.write_to_path(
                str(secured.cert_file)
            )
            assert secured.server.proc is not None
            secured.server.proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + RELOAD_TIMEOUT
            while "TLS certificate reloaded" not in secured.server.log_text():
                assert time.monotonic() < deadline, "no reload logged after SIGHUP"
                await trio.sleep(0.05)
            # the connection made before the reload still works
            await before.request("lookup", {"topic": TOPIC}, expect="lookupResult")
            # new connections get the new certificate
            after = await secured.connect(nursery, ca_file=new_ca_file)
            await after.request("lookup", {"topic": TOPIC}, expect="lookupResult")
            with pytest.raises(TlsError, match="not signed by a trusted CA"):
                await secured.connect(nursery)
        nursery.cancel_scope.cancel()
    assert secured.server.running
