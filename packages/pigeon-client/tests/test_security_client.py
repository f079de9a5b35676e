"""The client over TLS and with credentials (issue 15), on all three faces, against a small
in-process broker (``_fake_broker``) that runs ``pigeon.core``'s real TLS and token
authentication.

* ``pigeon+ssl://`` connects when the broker's CA is trusted; a wrong CA, a certificate
  for another host or a plaintext port fail at once with TlsError (no retry loop);
  ``tls_validate_hostname=False`` and ``tls_allow_insecure_connection`` relax that.
* A token (string, callable, ``file:///``) is presented on every connection, a rotated
  token file on the next one; a refused token is AuthenticationError at once from
  ``create_producer`` on every face, a role the broker refuses AuthorizationError.
* A producer that was attached and whose re-attach is refused fails its pending sends
  with that error; a consumer's receive raises it.
* No repr or error shows a token.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from _fake_broker import Running, fake_broker, server_tls

import pigeon.client.asyncio as aio
import pigeon.client.trio as ptrio
from pigeon.client import (
    AuthenticationError,
    AuthenticationTLS,
    AuthenticationToken,
    AuthorizationError,
    Client,
    TlsError,
)
from pigeon.core.auth import Authenticator, TlsAuthenticationProvider
from pigeon.core.errors import InvalidArgument
from pigeon.core.testing import SecurityFiles

#: far longer than any test here may take: an error that is retried would hit it
OPERATION_TIMEOUT = 60.0
#: how long a refusal may take to surface (it must not go through a retry loop)
FAST = 10.0


@pytest.fixture(scope="module")
def plain_broker() -> Iterator[Running]:
    with fake_broker(tokens=True) as running:
        yield running


def produce_one(client: Client, topic: str = "t") -> None:
    with client.create_producer(topic) as producer:
        producer.send(b"x")


def timed(fn: Any, *args: Any, **kwargs: Any) -> float:
    start = time.monotonic()
    fn(*args, **kwargs)
    return time.monotonic() - start


# ---------------------------------------------------------------------------- TLS


def test_pigeon_ssl_with_the_brokers_ca_produces(tls_broker: Running, certs: SecurityFiles) -> None:
    before = tls_broker.broker.sent
    with Client(
        tls_broker.url,
        authentication=AuthenticationToken(tls_broker.token("alice")),
        tls_trust_certs_file_path=str(certs.ca_file),
    ) as client:
        produce_one(client)
    assert tls_broker.broker.sent == before + 1
    assert tls_broker.broker.roles[-1] == "alice"


def _refused(url: str, error: type[Exception], match: str | None, **kw: Any) -> None:
    def run() -> None:
        with (
            Client(url, operation_timeout=OPERATION_TIMEOUT, **kw) as client,
            pytest.raises(error, match=match),
        ):
            produce_one(client)

    assert timed(run) < FAST


def test_a_wrong_ca_is_a_tls_error_at_once(tls_broker: Running, certs: SecurityFiles) -> None:
    _refused(
        tls_broker.url,
        TlsError,
        "not signed by a trusted CA",
        authentication=AuthenticationToken(tls_broker.token("alice")),
        tls_trust_certs_file_path=str(certs.other_ca_file),
    )


def test_without_a_trust_file_the_system_cas_do_not_trust_a_private_ca(
    tls_broker: Running,
) -> None:
    _refused(tls_broker.url, TlsError, "not signed by a trusted CA")


def test_a_certificate_for_another_host_is_a_tls_error(certs: SecurityFiles) -> None:
    tls = server_tls(certs, certs.issue("broker-example", "broker.example"))
    with fake_broker(tls=tls) as running:
        _refused(
            running.url,
            TlsError,
            "does not name this host",
            tls_trust_certs_file_path=str(certs.ca_file),
        )
        # hostname verification off: the CA is still checked, the name is not
        with Client(
            running.url, tls_trust_certs_file_path=str(certs.ca_file), tls_validate_hostname=False
        ) as client:
            produce_one(client)
        _refused(
            running.url,
            TlsError,
            "not signed by a trusted CA",
            tls_trust_certs_file_path=str(certs.other_ca_file),
            tls_validate_hostname=False,
        )


def test_allow_insecure_connection_accepts_any_certificate(
    tls_broker: Running, certs: SecurityFiles
) -> None:
    with Client(
        tls_broker.url,
        authentication=AuthenticationToken(tls_broker.token("alice")),
        tls_trust_certs_file_path=str(certs.other_ca_file),
        tls_allow_insecure_connection=True,
    ) as client:
        produce_one(client)


def test_pigeon_ssl_against_a_plaintext_port_is_a_tls_error(plain_broker: Running) -> None:
    url = plain_broker.url.replace("pigeon://", "pigeon+ssl://")
    _refused(url, TlsError, "TLS", tls_allow_insecure_connection=True)


def test_plaintext_against_a_tls_port_is_told_to_use_tls(tls_broker: Running) -> None:
    url = tls_broker.url.replace("pigeon+ssl://", "pigeon://")
    _refused(url, TlsError, "pigeon\\+ssl://")


def test_a_missing_trust_file_is_an_error_when_the_client_is_made(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="no such file"):
        Client("pigeon+ssl://127.0.0.1:1", tls_trust_certs_file_path=str(tmp_path / "none.pem"))


def test_tls_authentication_needs_a_tls_url(certs: SecurityFiles) -> None:
    with pytest.raises(InvalidArgument, match="pigeon\\+ssl://"):
        Client(
            "pigeon://127.0.0.1:1",
            authentication=AuthenticationTLS(str(certs.certificate_file), str(certs.key_file)),
        )


def test_a_plaintext_owner_url_is_never_followed_from_tls(
    tls_broker: Running, certs: SecurityFiles
) -> None:
    """A lookup answering pigeon:// to a pigeon+ssl:// client: the token would go in
    clear, so the client refuses instead of downgrading."""
    good = tls_broker.url
    plain = good.replace("pigeon+ssl://", "pigeon://").replace("127.0.0.1", "localhost")
    tls_broker.call(lambda: setattr(tls_broker.broker, "url", plain))
    try:
        _refused(
            good,
            TlsError,
            "plaintext",
            authentication=AuthenticationToken(tls_broker.token("alice")),
            tls_trust_certs_file_path=str(certs.ca_file),
        )
    finally:
        tls_broker.call(lambda: setattr(tls_broker.broker, "url", good))


# ---------------------------------------------------------------------------- tokens


def test_a_token_string_and_a_callable_are_presented(plain_broker: Running) -> None:
    with Client(plain_broker.url, authentication=AuthenticationToken(plain_broker.token("s"))) as c:
        produce_one(c)
    assert plain_broker.broker.roles[-1] == "s"
    with Client(
        plain_broker.url, authentication=AuthenticationToken(lambda: plain_broker.token("c"))
    ) as c:
        produce_one(c)
    assert plain_broker.broker.roles[-1] == "c"


def test_a_bad_token_is_an_authentication_error_at_once_sync(plain_broker: Running) -> None:
    _refused(plain_broker.url, AuthenticationError, None, authentication=AuthenticationToken("bad"))
    _refused(plain_broker.url, AuthenticationError, None)  # no credentials at all


def test_a_bad_token_is_an_authentication_error_at_once_asyncio(plain_broker: Running) -> None:
    async def main() -> None:
        async with aio.Client(
            plain_broker.url,
            authentication=aio.AuthenticationToken("bad"),
            operation_timeout=OPERATION_TIMEOUT,
        ) as client:
            with pytest.raises(AuthenticationError):
                await client.create_producer("t")
            with pytest.raises(AuthenticationError):
                await client.subscribe("t", "s")

    assert timed(asyncio.run, main()) < FAST


async def test_a_bad_token_is_an_authentication_error_at_once_trio(
    plain_broker: Running,
) -> None:
    with trio.fail_after(FAST):
        async with ptrio.Client(
            plain_broker.url,
            authentication=ptrio.AuthenticationToken("bad"),
            operation_timeout=OPERATION_TIMEOUT,
        ) as client:
            with pytest.raises(AuthenticationError):
                await client.create_producer("t")
            with pytest.raises(AuthenticationError):
                await client.create_reader("t")


async def test_a_good_token_produces_on_the_trio_face(
    tls_broker: Running, certs: SecurityFiles
) -> None:
    with trio.fail_after(FAST):
        async with ptrio.Client(
            tls_broker.url,
            authentication=ptrio.AuthenticationToken(tls_broker.token("trio")),
            tls_trust_certs_file_path=str(certs.ca_file),
        ) as client:
            producer = await client.create_producer("t")
            await producer.send(b"x")
            await producer.close()
    assert tls_broker.broker.roles[-1] == "trio"


def test_a_refused_role_is_an_authorization_error_at_once(plain_broker: Running) -> None:
    plain_broker.call(lambda: setattr(plain_broker.broker, "allowed", {"alice"}))
    try:
        auth = AuthenticationToken(plain_broker.token("mallory"))
        _refused(plain_broker.url, AuthorizationError, "mallory", authentication=auth)

        def subscribe() -> None:
            with (
                Client(plain_broker.url, authentication=auth) as client,
                pytest.raises(AuthorizationError, match="consume"),
            ):
                client.subscribe("t", "s")

        assert timed(subscribe) < FAST
    finally:
        plain_broker.call(lambda: setattr(plain_broker.broker, "allowed", None))


def _write_token(path: Path, token: str, stamp: int) -> None:
    path.write_text(token + "\n")
    os.utime(path, (stamp, stamp))  # a different modification time for each version


def test_a_rotated_token_file_is_read_again_on_reconnect(
    plain_broker: Running, tmp_path: Path
) -> None:
    path = tmp_path / "token"
    _write_token(path, plain_broker.token("first"), 1_000_000)
    broker = plain_broker.broker
    with (
        Client(plain_broker.url, authentication=AuthenticationToken(f"file://{path}")) as client,
        client.create_producer("rotate") as producer,
    ):
        producer.send(b"1")
        assert broker.roles[-1] == "first"
        opened = len(broker.connections)
        _write_token(path, plain_broker.token("second"), 2_000_000)
        plain_broker.call(broker.drop_connections)
        producer.send(b"2", timeout=FAST)  # re-attached on a new connection
        assert len(broker.connections) > opened
        assert set(broker.roles[opened:]) == {"second"}


def test_a_reattach_refused_fails_the_pending_sends_instead_of_retrying(
    plain_broker: Running,
) -> None:
    token = {"value": plain_broker.token("alice")}
    broker = plain_broker.broker
    with (
        Client(
            plain_broker.url,
            authentication=AuthenticationToken(lambda: token["value"]),
            operation_timeout=OPERATION_TIMEOUT,
        ) as client,
        client.create_producer("t", send_timeout=OPERATION_TIMEOUT) as producer,
        client.subscribe("t", "sub") as consumer,
    ):
        producer.send(b"1")
        token["value"] = "revoked"
        plain_broker.call(broker.drop_connections)
        start = time.monotonic()
        with pytest.raises(AuthenticationError):
            producer.send(b"2")
        with pytest.raises(AuthenticationError):
            consumer.receive(timeout=OPERATION_TIMEOUT)
        assert time.monotonic() - start < FAST


# ---------------------------------------------------------------------------- secrets


def test_no_repr_or_error_shows_the_token(plain_broker: Running, tmp_path: Path) -> None:
    secret = plain_broker.token("alice")
    auth = AuthenticationToken(secret)
    assert secret not in repr(auth) and secret not in str(auth)
    assert "<callable>" in repr(AuthenticationToken(lambda: secret))
    missing = tmp_path / "missing"
    with (
        Client(plain_broker.url, authentication=AuthenticationToken(f"file://{missing}")) as c,
        pytest.raises(AuthenticationError, match="cannot read the token file") as info,
    ):
        produce_one(c)
    assert "missing" in str(info.value)
    wrong = secret[:-4] + ("AAAA" if not secret.endswith("AAAA") else "BBBB")
    with (
        Client(plain_broker.url, authentication=AuthenticationToken(wrong)) as c,
        pytest.raises(AuthenticationError) as info,
    ):
        produce_one(c)
    assert wrong not in str(info.value) and wrong[-20:] not in str(info.value)


def test_authentication_must_be_credentials() -> None:
    with pytest.raises(InvalidArgument, match="AuthenticationToken"):
        Client("pigeon://127.0.0.1:1", authentication="a-token")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- mTLS, owners


@pytest.fixture(scope="module")
def client_cert(certs: SecurityFiles) -> AuthenticationTLS:
    cert, key = certs.client_certificate("writer")
    return AuthenticationTLS(str(cert), str(key))


@pytest.fixture(scope="module")
def mtls_broker(certs: SecurityFiles) -> Iterator[Running]:
    tls = server_tls(certs, trust_certs_file=str(certs.ca_file), require_client_cert=True)
    with fake_broker(tls=tls, authenticator=Authenticator([TlsAuthenticationProvider()])) as r:
        yield r


def test_a_client_certificate_is_the_role(
    mtls_broker: Running, certs: SecurityFiles, client_cert: AuthenticationTLS
) -> None:
    with Client(
        mtls_broker.url, authentication=client_cert, tls_trust_certs_file_path=str(certs.ca_file)
    ) as client:
        produce_one(client)
    assert mtls_broker.broker.roles[-1] == "writer"


def test_a_missing_client_certificate_is_a_tls_error_at_once(
    mtls_broker: Running, certs: SecurityFiles
) -> None:
    with (
        Client(
            mtls_broker.url, tls_trust_certs_file_path=str(certs.ca_file), operation_timeout=3.0
        ) as client,
        pytest.raises(TlsError),
    ):
        produce_one(client)


def test_the_owner_is_dialled_over_tls_by_the_host_name_its_url_gives(
    tls_broker: Running, certs: SecurityFiles, tmp_path: Path
) -> None:
    """The lookup broker (certificate for 127.0.0.1) sends the client to an owner whose
    certificate names only ``localhost``: the client dials it over TLS, checks that name,
    and presents its token there too."""
    tls = server_tls(certs, certs.issue("owner", "localhost"))
    lookup = tls_broker.broker
    with fake_broker(tls=tls, tokens=True, secret=tls_broker.secret) as owner:
        owner_url = owner.url.replace("127.0.0.1", "localhost")
        owner.call(lambda: setattr(owner.broker, "url", owner_url))
        tls_broker.call(lambda: setattr(lookup, "url", owner_url))
        try:
            with Client(
                tls_broker.url,
                authentication=AuthenticationToken(tls_broker.token("roaming")),
                tls_trust_certs_file_path=str(certs.ca_file),
            ) as client:
                produce_one(client)
        finally:
            tls_broker.call(lambda: setattr(lookup, "url", tls_broker.url))
        assert owner.broker.sent == 1
        assert owner.broker.roles == ["roaming"]


async def test_a_refused_resubscribe_ends_receive_on_the_trio_face(plain_broker: Running) -> None:
    token = {"value": plain_broker.token("alice")}
    broker = plain_broker.broker
    with trio.fail_after(FAST):
        async with ptrio.Client(
            plain_broker.url,
            authentication=ptrio.AuthenticationToken(lambda: token["value"]),
            operation_timeout=OPERATION_TIMEOUT,
        ) as client:
            consumer = await client.subscribe("t", "trio-sub")
            token["value"] = "revoked"
            await trio.to_thread.run_sync(plain_broker.call, broker.drop_connections)
            with pytest.raises(AuthenticationError):
                await consumer.receive(timeout=OPERATION_TIMEOUT)
            await consumer.close()
