"""TLS and authentication of the RPC layer over loopback (serve_tcp/connect_tcp).

Real certificates made per run (``pigeon.core.testing.SecurityFiles``); each refusal is a typed
error on the client, one line on the server, and the server keeps serving."""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from test_connection import TIMEOUT, LookupService

from pigeon.core._rpc import Connection, connect_tcp, serve_tcp
from pigeon.core._schema import BookieFrame, BrokerFrame
from pigeon.core.auth import (
    AuthData,
    AuthenticationTLS,
    AuthenticationToken,
    Authenticator,
    TlsAuthenticationProvider,
    TokenAuthenticationProvider,
    client_authentication,
)
from pigeon.core.errors import (
    AuthenticationError,
    ConfigError,
    ConnectionClosed,
    ProtocolError,
    TlsError,
)
from pigeon.core.testing import SecurityFiles
from pigeon.core.testing.fuzz import fuzz_settings
from pigeon.core.tls import ServerTls, client_context
from pigeon.core.tokens import create_key_pair, create_token

KEY = b"0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> SecurityFiles:
    return SecurityFiles.create(tmp_path_factory.mktemp("certs"))


def server_tls(certs: SecurityFiles, **kwargs: Any) -> ServerTls:
    return ServerTls(
        certificate_file=str(certs.certificate_file),
        key_file=str(certs.key_file),
        trust_certs_file=str(certs.ca_file),
        **kwargs,
    )


@asynccontextmanager
async def secure_server(service: Any, **kwargs: Any) -> AsyncIterator[tuple[trio.Nursery, int]]:
    async with trio.open_nursery() as nursery:
        _host, port = await nursery.start(
            lambda task_status: serve_tcp(
                service, BrokerFrame, server_name="secure", task_status=task_status, **kwargs
            )
        )
        yield nursery, port
        nursery.cancel_scope.cancel()


def authenticator() -> Authenticator:
    return Authenticator([TokenAuthenticationProvider(KEY), TlsAuthenticationProvider()])


async def dial(
    nursery: trio.Nursery, port: int, *, role: str | None = None, **kwargs: Any
) -> tuple[Connection, dict[str, Any]]:
    """``connect_tcp`` to the loopback server as a broker client (``role``: with a
    token for it signed with KEY; ``kwargs``: more of ``connect_tcp``)."""
    if role is not None:
        kwargs["authentication"] = AuthenticationToken(create_token(role, KEY))
    return await connect_tcp("127.0.0.1", port, BrokerFrame, nursery, **kwargs)


async def test_tls_with_a_token_establishes_the_role_on_both_sides(certs: SecurityFiles) -> None:
    service = LookupService()
    tls = server_tls(certs)
    async with secure_server(service, tls=tls, authenticator=authenticator()) as (nursery, port):
        with trio.fail_after(TIMEOUT):
            conn, info = await dial(nursery, port, tls=certs.client_tls_context(), role="app")
            assert (await conn.request("lookup", {"topic": "a"}))["topic"] == "a"
        assert info["authRole"] == "app" and conn.role == "app"
        assert service.opened[0].role == "app"
        assert isinstance(service.opened[0].stream, trio.SSLStream)


async def test_large_payloads_over_tls_arrive_whole_in_a_few_reads_per_megabyte(
    certs: SecurityFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 4 MiB payload is 256 TLS records; the reader decrypts the records already received
    after each ``receive_some`` instead of one per call (and scheduler trip), and the
    payload still arrives whole, both ways."""
    reads = {"calls": 0}
    receive_some = trio.SSLStream.receive_some

    async def counted(self: trio.SSLStream[Any], max_bytes: int | None = None) -> Any:
        reads["calls"] += 1
        return await receive_some(self, max_bytes)

    monkeypatch.setattr(trio.SSLStream, "receive_some", counted)
    service = LookupService()
    size = 4 * 1024 * 1024
    payload = os.urandom(size)
    async with secure_server(service, tls=server_tls(certs)) as (nursery, port):
        with trio.fail_after(TIMEOUT * 4):
            tls = client_context(trust_certs_file=str(certs.ca_file))
            conn, _info = await connect_tcp("127.0.0.1", port, BrokerFrame, nursery, tls=tls)
            before = reads["calls"]
            entry_id, echoed = await conn.request(
                "send",
                {"producerId": 1},
                payload=payload,
                expect="sendReceipt",
                extract=lambda body, p: (body.entryId, bytes(p)),
            )
            calls = reads["calls"] - before
            assert (await conn.request("lookup", {"topic": "after"}))["topic"] == "after"
    assert entry_id == size and echoed == payload
    # 512 records crossed (256 each way): one receive_some each would be 512 calls
    assert calls < 256, calls


async def test_a_client_certificate_is_the_role_with_mutual_tls(certs: SecurityFiles) -> None:
    tls = server_tls(certs, require_client_cert=True)
    async with secure_server(LookupService(), tls=tls, authenticator=authenticator()) as (
        nursery,
        port,
    ):
        with trio.fail_after(TIMEOUT):
            conn, _ = await dial(nursery, port, tls=certs.client_tls_context("billing"))
        assert conn.role == "billing"
        # without a client certificate the handshake itself is refused
        with trio.fail_after(TIMEOUT), pytest.raises((TlsError, ConnectionClosed)):
            conn2, _ = await dial(nursery, port, tls=certs.client_tls_context())
            await conn2.request("lookup", {"topic": "a"})


@pytest.mark.parametrize(
    ("case", "error", "words"),
    [
        ("no credentials", AuthenticationError, "authentication is required"),
        ("garbage token", AuthenticationError, "not valid"),
        ("wrong signature", AuthenticationError, "signature"),
        ("expired token", AuthenticationError, "expired"),
        ("unknown method", AuthenticationError, "not enabled"),
        ("wrong CA", TlsError, "trusted CA"),
        ("hostname mismatch", TlsError, "does not name this host"),
        ("plaintext client", TlsError, "pigeon+ssl://"),
        ("bookie client", ProtocolError, "broker port"),
    ],
)
async def test_each_refusal_is_one_typed_line_and_the_server_serves_on(
    certs: SecurityFiles,
    case: str,
    error: type[Exception],
    words: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ctx = certs.client_tls_context()
    secret = "s3cr3t-" + "x" * 20
    kwargs: dict[str, Any] = {
        "no credentials": {"tls": ctx},
        "garbage token": {"tls": ctx, "authentication": AuthenticationToken(secret)},
        "wrong signature": {
            "tls": ctx,
            "authentication": AuthenticationToken(create_token("app", b"k" * 32)),
        },
        "expired token": {
            "tls": ctx,
            "authentication": AuthenticationToken(create_token("app", KEY, expiry_s=-10)),
        },
        "unknown method": {"tls": ctx, "authentication": _Other()},
        "wrong CA": {"tls": client_context(trust_certs_file=str(certs.other_ca_file))},
        "hostname mismatch": {"tls": ctx, "server_hostname": "elsewhere.example"},
        "plaintext client": {},
        "bookie client": {"tls": ctx, "frame": BookieFrame},
    }[case]
    frame = kwargs.pop("frame", BrokerFrame)
    caplog.set_level(logging.WARNING)
    logged = trio.Event()
    handler = _OnRecord(logged)
    logging.getLogger("pigeon.core._rpc").addHandler(handler)
    async with secure_server(
        LookupService(), tls=server_tls(certs), authenticator=authenticator()
    ) as (nursery, port):
        with trio.fail_after(TIMEOUT), pytest.raises(error) as info:
            await connect_tcp("127.0.0.1", port, frame, nursery, connect_timeout=5, **kwargs)
        assert words in str(info.value)
        assert "\n" not in str(info.value)
        # the server logged the refusal in one line, and never a secret
        with trio.fail_after(TIMEOUT):
            await logged.wait()
        assert all(secret not in r.getMessage() for r in caplog.records)
        assert not [r for r in caplog.records if r.exc_info]
        # and still serves a good client
        with trio.fail_after(TIMEOUT):
            conn, _ = await dial(nursery, port, tls=ctx, role="ok")
        assert conn.role == "ok"
    logging.getLogger("pigeon.core._rpc").removeHandler(handler)


class _OnRecord(logging.Handler):
    """Sets an event when a record is logged (the server's refusal line)."""

    def __init__(self, event: trio.Event) -> None:
        super().__init__(logging.WARNING)
        self.event = event

    def emit(self, record: logging.LogRecord) -> None:
        self.event.set()


class _Other:
    auth_method = "kerberos"

    def auth_data(self) -> bytes:
        return b"ticket"


async def test_an_expired_server_certificate_is_named(certs: SecurityFiles) -> None:
    cert, key = certs.expired_certificate()
    tls = ServerTls(certificate_file=str(cert), key_file=str(key))
    async with secure_server(LookupService(), tls=tls) as (nursery, port):
        with trio.fail_after(TIMEOUT), pytest.raises(TlsError, match="expired"):
            await dial(nursery, port, tls=certs.client_tls_context())


async def test_a_tls_client_on_a_plaintext_port_is_told_so() -> None:
    async with secure_server(LookupService()) as (nursery, port):
        with trio.fail_after(TIMEOUT), pytest.raises(TlsError, match="plaintext port"):
            await dial(nursery, port, tls=client_context(allow_insecure=True))


async def test_reload_serves_the_new_certificate_and_keeps_open_connections(
    certs: SecurityFiles, tmp_path: Path
) -> None:
    live, live_key = tmp_path / "live.pem", tmp_path / "live-key.pem"
    shutil.copy(certs.certificate_file, live)
    shutil.copy(certs.key_file, live_key)
    tls = ServerTls(certificate_file=str(live), key_file=str(live_key))
    ctx = certs.client_tls_context()
    async with secure_server(LookupService(), tls=tls) as (nursery, port):
        with trio.fail_after(TIMEOUT):
            before, _ = await dial(nursery, port, tls=ctx)
        first = _served_serial(before)
        # a broken file is refused and the current certificate stays
        live.write_text("not a certificate")
        assert tls.reload() is False
        # a new certificate from the same CA: new handshakes get it
        renewed, renewed_key = certs.issue("server2", "127.0.0.1", common_name="renewed")
        shutil.copy(renewed, live)
        shutil.copy(renewed_key, live_key)
        assert tls.reload() is True
        with trio.fail_after(TIMEOUT):
            after, _ = await dial(nursery, port, tls=ctx)
            assert _served_serial(after) != first
            # the connection opened before the reload still works
            assert (await before.request("lookup", {"topic": "old"}))["topic"] == "old"


def _served_serial(conn: Any) -> Any:
    stream = conn.stream
    assert isinstance(stream, trio.SSLStream)
    return stream.getpeercert()["serialNumber"]


async def test_sighup_reloads_every_listener_of_the_process(certs: SecurityFiles) -> None:
    from pigeon.core.tls import reload_on_sighup

    cert, key = str(certs.certificate_file), str(certs.key_file)
    first = ServerTls(certificate_file=cert, key_file=key)
    second = ServerTls(certificate_file=cert, key_file=key, what="bookie")
    reloaded = trio.Event()
    reload = second.reload

    def observed() -> bool:
        done = reload()
        reloaded.set()
        return done

    second.reload = observed  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        # two nodes in one process (pigeon standalone): one signal reloads both
        await nursery.start(reload_on_sighup, first)
        await nursery.start(reload_on_sighup, second)
        os.kill(os.getpid(), signal.SIGHUP)
        with trio.fail_after(TIMEOUT):
            await reloaded.wait()
        assert (first.reloads, second.reloads) == (1, 1)
        nursery.cancel_scope.cancel()


# ------------------------------------------------------------------ configuration


def test_server_context_errors_name_the_file(certs: SecurityFiles, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        ServerTls(certificate_file=str(tmp_path / "nope.pem"), key_file=str(tmp_path / "k"))
    bad = tmp_path / "bad.pem"
    bad.write_text("garbage")
    with pytest.raises(ConfigError, match="not a PEM certificate"):
        ServerTls(certificate_file=str(bad), key_file=str(bad))
    with pytest.raises(ConfigError, match="tls_trust_certs_file"):
        ServerTls(
            certificate_file=str(certs.certificate_file),
            key_file=str(certs.key_file),
            require_client_cert=True,
        )
    with pytest.raises(ConfigError, match="holds no PEM CA"):
        client_context(trust_certs_file=str(bad))


def test_hostname_verification_is_on_by_default() -> None:
    assert client_context().check_hostname is True
    assert client_context().verify_mode == ssl.CERT_REQUIRED
    assert client_context(verify_hostname=False).check_hostname is False
    assert client_context(allow_insecure=True).verify_mode == ssl.CERT_NONE


# ------------------------------------------------------------------ authentication


def test_token_provider_with_a_public_key() -> None:
    private, public = create_key_pair("ES256")
    provider = TokenAuthenticationProvider(public)
    assert provider.authenticate(AuthData("token", create_token("r", private).encode())) == "r"
    other = create_token("r", create_key_pair("ES256")[0]).encode()
    with pytest.raises(AuthenticationError, match=r"signature|not signed"):
        provider.authenticate(AuthData("token", other))
    with pytest.raises(AuthenticationError, match="no token"):
        provider.authenticate(AuthData("token", b""))
    with pytest.raises(AuthenticationError, match="ASCII"):
        provider.authenticate(AuthData("token", b"\xff\xfe"))


def test_token_file_is_read_again_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("first\n")
    auth = AuthenticationToken(f"file://{path}")
    assert auth.auth_data() == b"first"
    path.write_text("second-token\n")
    assert auth.auth_data() == b"second-token"
    assert "second" not in repr(auth) and str(path) in repr(auth)
    assert "abc" not in repr(AuthenticationToken("abc"))
    path.unlink()
    with pytest.raises(AuthenticationError, match="cannot read the token file"):
        auth.auth_data()
    assert AuthenticationToken(lambda: " t ").auth_data() == b"t"


def test_client_authentication_from_pulsar_style_settings() -> None:
    assert client_authentication("", "") is None
    token = client_authentication("token", "token:abc")
    assert token is not None and token.auth_data() == b"abc"
    tls = client_authentication("tls", "tls_cert_file:/c.pem,tls_key_file:/k.pem")
    assert isinstance(tls, AuthenticationTLS) and tls.private_key_path == "/k.pem"
    with pytest.raises(ConfigError):
        client_authentication("token", "abc")
    with pytest.raises(ConfigError):
        client_authentication("kerberos", "")


def test_authenticator_names_enabled_methods() -> None:
    auth = Authenticator([TokenAuthenticationProvider(KEY)])
    with pytest.raises(AuthenticationError, match="'tls' is not enabled"):
        auth.authenticate(AuthData("tls"))
    with pytest.raises(ConfigError, match="empty"):
        Authenticator([])


# ------------------------------------------------------------------ fuzzing

FUZZ = fuzz_settings("PIGEON_FUZZ_EXAMPLES", 40)


def _client_hello() -> bytes:
    ctx = client_context(allow_insecure=True)
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


HELLO = _client_hello()


@st.composite
def hostile_handshakes(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["random", "flipped", "truncated", "tls-then-junk"]))
    if kind == "random":
        return draw(st.binary(min_size=1, max_size=600))
    if kind == "truncated":
        return HELLO[: draw(st.integers(1, len(HELLO) - 1))]
    if kind == "tls-then-junk":
        return HELLO + draw(st.binary(min_size=1, max_size=200))
    data = bytearray(HELLO)
    for _ in range(draw(st.integers(1, 8))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data)


@FUZZ
@given(blob=hostile_handshakes())
def test_fuzzed_tls_handshakes_never_take_the_listener_down(
    certs: SecurityFiles, blob: bytes
) -> None:
    async def main() -> None:
        errors = _ErrorRecords()
        logging.getLogger("pigeon").addHandler(errors)
        try:
            async with secure_server(
                LookupService(), tls=server_tls(certs), authenticator=authenticator()
            ) as (nursery, port):
                with trio.fail_after(TIMEOUT):
                    stream = await trio.open_tcp_stream("127.0.0.1", port)
                    await stream.send_all(blob)
                    await stream.aclose()
                    conn, _ = await dial(nursery, port, tls=certs.client_tls_context(), role="ok")
                    assert (await conn.request("lookup", {"topic": "t"}))["topic"] == "t"
        finally:
            logging.getLogger("pigeon").removeHandler(errors)
        assert errors.records == []

    trio.run(main)


class _ErrorRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@FUZZ
@given(method=st.text(max_size=40), data=st.binary(max_size=400))
def test_fuzzed_credentials_are_refused_as_authentication_errors(method: str, data: bytes) -> None:
    auth = Authenticator([TokenAuthenticationProvider(KEY), TlsAuthenticationProvider()])
    with pytest.raises(AuthenticationError):
        auth.authenticate(AuthData(method, data))


class _Credentials:
    """Whatever a hostile client puts in its ``connect`` frame's auth fields."""

    def __init__(self, method: str, data: bytes) -> None:
        self.auth_method = method
        self.data = data

    def auth_data(self) -> bytes:
        return self.data


@fuzz_settings("PIGEON_FUZZ_EXAMPLES", 40)
@given(
    method=st.one_of(st.sampled_from(["token", "tls", ""]), st.text(max_size=40)),
    data=st.one_of(
        st.binary(max_size=600),
        st.builds(
            lambda t: t.encode(), st.sampled_from(["eyJ", "a.b.c", "eyJhbGciOiJub25lIn0.e30."])
        ),
    ),
)
def test_fuzzed_credentials_on_the_wire_are_refused_and_the_server_serves_on(
    method: str, data: bytes
) -> None:
    """The auth exchange over a real socket: an AuthenticationError for the client, a
    WARNING (never an ERROR) on the server, and the next client is served."""

    async def main() -> None:
        errors = _ErrorRecords()
        logging.getLogger("pigeon").addHandler(errors)
        try:
            async with secure_server(LookupService(), authenticator=authenticator()) as (
                nursery,
                port,
            ):
                with trio.fail_after(TIMEOUT):
                    with pytest.raises(AuthenticationError):
                        await dial(nursery, port, authentication=_Credentials(method, data))
                    conn, _ = await dial(nursery, port, role="ok")
                    assert conn.role == "ok"
        finally:
            logging.getLogger("pigeon").removeHandler(errors)
        assert errors.records == []

    trio.run(main)


@pytest.mark.parametrize("tls", [False, True])
def test_a_peer_that_never_says_connect_is_closed(
    certs: SecurityFiles,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    tls: bool,
) -> None:
    """Slowloris: sockets opened (and TLS-handshaken) without a ``connect`` are closed
    after the deadline, and other clients are served meanwhile."""
    import pigeon.core._rpc as rpc

    monkeypatch.setattr(rpc, "CONNECT_DEADLINE_S", 0.5)
    context = certs.client_tls_context() if tls else None
    extra: dict[str, Any] = {"tls": server_tls(certs)} if tls else {}

    async def main() -> None:
        async with secure_server(LookupService(), authenticator=authenticator(), **extra) as (
            nursery,
            port,
        ):
            with trio.fail_after(TIMEOUT):
                silent: list[trio.abc.Stream] = []
                for _ in range(20):
                    stream: trio.abc.Stream = await trio.open_tcp_stream("127.0.0.1", port)
                    if context is not None:
                        stream = trio.SSLStream(stream, context, server_hostname="localhost")
                        await stream.do_handshake()
                    silent.append(stream)
                conn, _ = await dial(
                    nursery,
                    port,
                    tls=context,
                    server_hostname="localhost" if tls else None,
                    role="ok",
                )
                assert (await conn.request("lookup", {"topic": "t"}))["topic"] == "t"
                for stream in silent:
                    try:
                        assert await stream.receive_some(1024) == b""
                    except trio.BrokenResourceError:
                        pass  # a TLS stream may end without close_notify
                    await trio.aclose_forcefully(stream)
                # the authenticated connection outlived the deadline
                assert (await conn.request("lookup", {"topic": "u"}))["topic"] == "u"

    with caplog.at_level(logging.WARNING, logger="pigeon"):
        trio.run(main)
    assert "no 'connect' within 0.5s" in caplog.text


def test_frames_before_connect_are_small(caplog: pytest.LogCaptureFixture) -> None:
    """Before ``connect`` a peer may announce no frame larger than 64 KiB (no 5 MiB
    buffer for an unauthenticated peer); after it, frames up to max_frame_size pass."""
    import struct

    async def main() -> None:
        async with secure_server(LookupService(), authenticator=authenticator()) as (
            nursery,
            port,
        ):
            with trio.fail_after(TIMEOUT):
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                await stream.send_all(struct.pack("<I", 4 * 1024 * 1024) + b"\0" * 1024)
                answer = b""
                while chunk := await stream.receive_some(65536):
                    answer += chunk
                assert b"exceeds max_frame_size 65536" in answer
                await stream.aclose()
                conn, _ = await dial(nursery, port, role="ok")
                big = "t" * (256 * 1024)
                assert (await conn.request("lookup", {"topic": big}))["topic"] == big

    with caplog.at_level(logging.WARNING, logger="pigeon"):
        trio.run(main)
    assert "exceeds max_frame_size 65536" in caplog.text


async def test_a_peer_that_closes_mid_handshake_is_retriable() -> None:
    """A node killed after reading the ClientHello (or a load balancer in between) is
    a lost connection, retried; not a TLS refusal that would stop the client for good."""

    async def hang_up(stream: trio.SocketStream) -> None:
        await stream.receive_some(1)
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        (listener,) = await nursery.start(
            functools.partial(trio.serve_tcp, hang_up, 0, host="127.0.0.1")
        )
        port = listener.socket.getsockname()[1]
        with trio.fail_after(TIMEOUT), pytest.raises(ConnectionClosed) as info:
            await connect_tcp(
                "127.0.0.1", port, BrokerFrame, nursery, tls=client_context(allow_insecure=True)
            )
        assert info.value.retriable and not isinstance(info.value, TlsError)
        nursery.cancel_scope.cancel()
