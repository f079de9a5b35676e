"""``pigeon standalone`` with TLS and token authentication: its bookie takes the broker's
security settings, the broker reaches it in-process (a trusted link: no TLS, no token),
the broker would dial its port over TLS with its own (or a minted) role, and nobody else
reads entries off the bookie port."""

from __future__ import annotations

import functools
import logging
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from standalone_support import batch_of

from pigeon.bookie import BookieConfig
from pigeon.broker import BrokerConfig, run_standalone
from pigeon.broker._cli import _broker_config
from pigeon.broker._node import STANDALONE_ROLE, standalone_bookie_security
from pigeon.core.auth import AuthenticationToken
from pigeon.core.errors import (
    AuthenticationError,
    AuthorizationError,
    ConfigError,
    PigeonError,
    TlsError,
)
from pigeon.core.replication import BookieClient
from pigeon.core.rpc import BrokerFrame, connect_tcp
from pigeon.core.testing.servers import (
    HOST,
    NODE_ROLE,
    SecurityFiles,
    Standalone,
    clean_env,
    free_port,
    server_command,
    write_toml,
)
from pigeon.core.tokens import create_key_pair

TIMEOUT = 30
#: a client role the tests give superuser rights on the broker
ADMIN = "admin"
CLIENT_KEYS = ("broker_client_authentication_plugin", "broker_client_authentication_parameters")


@pytest.fixture(scope="module")
def sec(tmp_path_factory: pytest.TempPathFactory) -> SecurityFiles:
    return SecurityFiles.create(tmp_path_factory.mktemp("sec"))


def broker_table(sec: SecurityFiles, *, own_credentials: bool = False) -> dict[str, Any]:
    """TLS + token authentication; without ``own_credentials`` the broker has no
    ``broker_client_authentication_*`` (the standalone mints its own token)."""
    table = sec.node_table(superuser_roles=(ADMIN,))
    if not own_credentials:
        for key in CLIENT_KEYS:
            del table[key]
    return table


@asynccontextmanager
async def standalone(tmp_path: Path, table: dict[str, Any]) -> AsyncIterator[tuple[Any, str]]:
    """run_standalone on loopback TCP with these ``[broker]`` settings: (service, the
    bookie's address)."""
    bookie_port = free_port()
    broker_config = BrokerConfig(port=0, http_port=-1, **table)
    bookie_config = BookieConfig(port=bookie_port, fsync="never")
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            service = await nursery.start(
                functools.partial(run_standalone, tmp_path / "data", broker_config, bookie_config)
            )
            try:
                yield service, f"{HOST}:{bookie_port}"
            finally:
                nursery.cancel_scope.cancel()


async def produce_raw(host: str, port: int, token: str, topic: str, n: int) -> list[Any]:
    """Send ``n`` batches as role of ``token`` over the native protocol; their receipts
    (each one an entry the broker stored on its bookie)."""
    async with trio.open_nursery() as nursery:
        conn, _info = await connect_tcp(
            host, port, BrokerFrame, nursery, authentication=AuthenticationToken(token)
        )
        await conn.request(
            "createProducer",
            {"producerId": 1, "topic": topic, "producerName": "p"},
            expect="producerCreated",
        )
        receipts = [
            await conn.request(
                "send",
                {"producerId": 1, "sequenceId": seq, "numMessages": 1},
                payload=batch_of([b"m%d" % seq], "p", seq),
                expect="sendReceipt",
            )
            for seq in range(n)
        ]
        conn.close()
        nursery.cancel_scope.cancel()
    return receipts


async def bookie_read(address: str, **client: Any) -> None:
    """A read off the bookie at ``address``; raises what the bookie refused it with."""
    bookies = BookieClient(name="test", **client)
    error: BaseException | None = None
    async with trio.open_nursery() as nursery:
        await nursery.start(bookies.run)
        try:
            await bookies.read_entries(address, 1, 0, 0)
        except Exception as exc:
            error = exc
        finally:
            bookies.close()
            nursery.cancel_scope.cancel()
    if error is not None:
        raise error


async def assert_bookie_closed_to_others(sec: SecurityFiles, bookie: str) -> None:
    """The bookie port: TLS only, authentication required, clients' roles refused."""
    tls = sec.client_tls_context()
    with pytest.raises(TlsError, match="takes TLS only"):
        await bookie_read(bookie, authentication=AuthenticationToken(sec.token(ADMIN)))
    with pytest.raises(AuthenticationError, match="authentication is required"):
        await bookie_read(bookie, tls=tls)
    with pytest.raises(AuthorizationError, match="role 'app' may not use a bookie"):
        await bookie_read(bookie, tls=tls, authentication=AuthenticationToken(sec.token("app")))


async def test_the_standalone_mints_its_bookie_token_and_the_bookie_serves_no_one_else(
    tmp_path: Path, sec: SecurityFiles, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG):
        async with standalone(tmp_path, broker_table(sec)) as (service, bookie):
            host, port = service.address
            topic = "persistent://public/default/secure"
            receipts = await produce_raw(host, port, sec.token(ADMIN), topic, 3)
            assert [r["sequenceId"] for r in receipts] == [0, 1, 2]
            metrics = "".join(render() for render in service.extra_metrics)
            assert 'link="in_process"} 1' in metrics and 'link="tcp"} 0' in metrics
            await assert_bookie_closed_to_others(sec, bookie)
    # the minted tokens are never logged (nor any other token: they all start "eyJ")
    assert "eyJ" not in caplog.text


async def test_the_standalone_presents_configured_credentials(
    tmp_path: Path, sec: SecurityFiles
) -> None:
    """With broker_client_authentication_* the broker presents that role (a superuser),
    and no pigeon-standalone role exists."""
    table = broker_table(sec, own_credentials=True)
    bookie_config, tls, auth = standalone_bookie_security(BrokerConfig(**table), BookieConfig())
    assert STANDALONE_ROLE not in bookie_config.superuser_roles
    assert bookie_config.superuser_roles == [NODE_ROLE, ADMIN]
    assert tls is not None and auth is not None
    async with standalone(tmp_path, table) as (service, bookie):
        host, port = service.address
        receipts = await produce_raw(host, port, sec.token(ADMIN), "t", 2)
        assert len(receipts) == 2
        with pytest.raises(AuthorizationError):  # the minted role is no superuser here
            await bookie_read(
                bookie,
                tls=sec.client_tls_context(),
                authentication=AuthenticationToken(sec.token(STANDALONE_ROLE)),
            )


def test_the_minted_role_is_a_superuser_of_the_bookie_only(sec: SecurityFiles) -> None:
    broker = BrokerConfig(**broker_table(sec))
    bookie_config, tls, auth = standalone_bookie_security(broker, BookieConfig())
    assert bookie_config.superuser_roles == [NODE_ROLE, ADMIN, STANDALONE_ROLE]
    assert STANDALONE_ROLE not in broker.superuser_roles
    assert bookie_config.tls_certificate_file == broker.tls_certificate_file
    assert bookie_config.authentication_enabled and bookie_config.token_secret_key
    assert tls is not None and not tls.check_hostname
    assert "eyJ" not in repr(auth)


def test_without_security_the_bookie_link_stays_plain() -> None:
    bookie_config, tls, auth = standalone_bookie_security(BrokerConfig(), BookieConfig())
    assert (tls, auth) == (None, None)
    assert not bookie_config.authentication_enabled and not bookie_config.tls_certificate_file


def test_a_public_key_alone_needs_configured_credentials(tmp_path: Path) -> None:
    _private, public = create_key_pair()
    (tmp_path / "public.pem").write_bytes(public)
    broker = BrokerConfig(
        authentication_enabled=True,
        token_public_key=f"file://{tmp_path / 'public.pem'}",
        superuser_roles=[ADMIN],
    )
    with pytest.raises(ConfigError, match="only a 'token_public_key'") as info:
        standalone_bookie_security(broker, BookieConfig())
    assert "\n" not in str(info.value)


def test_security_keys_in_the_bookie_table_are_refused(sec: SecurityFiles) -> None:
    bookie = BookieConfig(tls_certificate_file=str(sec.certificate_file), tls_key_file="k")
    with pytest.raises(ConfigError, match="move 'tls_certificate_file' out of \\[bookie\\]"):
        standalone_bookie_security(BrokerConfig(), bookie)


def test_security_keys_load_from_broker_toml_and_environment(
    tmp_path: Path, sec: SecurityFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_toml(tmp_path / "c.toml", {"broker": broker_table(sec)})
    monkeypatch.setenv("PIGEON_SUPERUSER_ROLES", "ops, admin")
    monkeypatch.setenv("PIGEON_AUTHENTICATION_PROVIDERS", "token,tls")
    config = _broker_config(str(path), kafka_port=None, kafka_default=-1)
    assert config.tls_certificate_file == str(sec.certificate_file)
    assert config.token_secret_key == sec.secret_key_url
    assert config.superuser_roles == ["ops", "admin"]
    assert config.authentication_providers == ["token", "tls"]


def run_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*server_command(), *args],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        check=False,
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tls_certificate_file": "/nonexistent/cert.pem"}, "cannot read '/nonexistent/cert.pem'"),
        ({"token_secret_key": "file:///nonexistent/secret.key"}, "cannot read the key file"),
        ({"authentication_providers": ["kerberos"]}, "unknown authentication provider"),
    ],
)
@pytest.mark.parametrize("command", ["standalone", "bookie"])
def test_bad_security_settings_are_one_line(
    tmp_path: Path, sec: SecurityFiles, change: dict[str, Any], message: str, command: str
) -> None:
    table = broker_table(sec) | change
    if command == "standalone":
        path = write_toml(tmp_path / "c.toml", {"broker": table})
        args = ["standalone", "--data-dir", str(tmp_path / "d"), "--config", str(path)]
        args += ["--port", "0", "--bookie-port", "0", "--http-port", "-1", "--kafka-port", "-1"]
    else:
        table["superuser_roles"] = [NODE_ROLE]
        path = write_toml(tmp_path / "c.toml", {"bookie": table})
        args = ["bookie", "--metadata", f"embedded://{tmp_path / 'm'}", "--port", "0"]
        args += ["--data-dir", str(tmp_path / "b"), "--config", str(path)]
    done = run_cli(*args)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ConfigError:"), done.stderr
    if command == "standalone" or "cert" not in message:
        assert message in lines[0]


def test_a_real_standalone_with_tls_and_tokens_serves_and_closes_its_bookie_port(
    tmp_path: Path, sec: SecurityFiles
) -> None:
    server = Standalone(tmp_path / "data", config={"broker": broker_table(sec)}, fsync=None)
    server.start()
    try:

        async def check() -> None:
            with trio.fail_after(TIMEOUT):
                receipts = await produce_raw(HOST, server.port, sec.token(ADMIN), "t", 3)
                assert len(receipts) == 3
                await assert_bookie_closed_to_others(sec, f"{HOST}:{server.bookie_port}")

        trio.run(check)
        started = time.monotonic()
        assert server.terminate() == 0
        assert time.monotonic() - started < 15
    finally:
        server.close()
    log = server.log_text()
    assert "eyJ" not in log
    assert "pigeon standalone ready" in log


# ------------------------------------------------------------------ a cluster's nodes


@asynccontextmanager
async def secure_cluster(
    tmp_path: Path, sec: SecurityFiles, replication: str, **broker: Any
) -> AsyncIterator[tuple[Any, list[Any]]]:
    """A broker (``run_broker``) and two bookies in this trio run, TLS + tokens on every
    link (``broker``: more of the broker's keys); yields (the broker's service, bookies)."""
    from pigeon.bookie import BookieServer
    from pigeon.broker import run_broker
    from pigeon.core import PluginManager
    from pigeon.core.metadata import EmbeddedMetadataStore

    plugins = PluginManager()
    if replication not in plugins.replication_policies:
        pytest.skip(f"the {replication} plugin is not installed")
    store = EmbeddedMetadataStore(tmp_path / "metadata")
    bookies = [
        BookieServer(
            BookieConfig(
                port=0, fsync="never", data_dir=str(tmp_path / f"b{i}"), **sec.node_table()
            ),
            metadata=store,
            plugins=plugins,
        )
        for i in range(2)
    ]
    config = BrokerConfig(
        port=0,
        http_port=-1,
        replication=replication,
        ensemble_size=2,
        write_quorum=2,
        ack_quorum=2,
        **{**sec.node_table(superuser_roles=(ADMIN,)), **broker},
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        for bookie in bookies:
            await nursery.start(bookie.run)
        service = await nursery.start(
            functools.partial(run_broker, config, store=store, plugins=plugins)
        )
        yield service, bookies
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("replication", ["quorum", "leader-follower"])
async def test_a_broker_writes_to_secure_bookies_with_its_own_role(
    tmp_path: Path, sec: SecurityFiles, replication: str
) -> None:
    """``pigeon broker`` + two ``pigeon bookie`` nodes, TLS + tokens on every link: the
    broker dials the bookies with its own role (quorum: both; leader-follower: the
    leader, which forwards to the follower with the bookie's own role)."""
    with trio.fail_after(TIMEOUT):
        async with secure_cluster(tmp_path, sec, replication) as (service, bookies):
            host, port = service.address
            receipts = await produce_raw(host, port, sec.token(ADMIN), "t", 3)
            assert len(receipts) == 3
            # every entry is on both bookies (write quorum 2)
            written = [b.store.statistics().bytes_written for b in bookies]
            assert all(w > 0 for w in written), written
            forwarded = sum(b.forwarder.forwarded for b in bookies)
            assert forwarded >= (3 if replication == "leader-follower" else 0)


@pytest.mark.parametrize("replication", ["quorum", "leader-follower"])
async def test_a_bookie_link_refused_by_tls_fails_the_write_not_the_broker(
    tmp_path: Path, sec: SecurityFiles, replication: str
) -> None:
    """The broker does not trust its bookies' certificate (a CA rotated on one side
    only): producers are refused with an error, the broker keeps serving (a lookup still
    answers), and nothing ends its process."""
    untrusting = {"broker_client_trust_certs_file_path": str(sec.other_ca_file)}
    with trio.fail_after(TIMEOUT):
        async with (
            secure_cluster(tmp_path, sec, replication, **untrusting) as (service, _),
            trio.open_nursery() as inner,
        ):
            host, port = service.address
            conn, _ = await connect_tcp(
                host,
                port,
                BrokerFrame,
                inner,
                authentication=AuthenticationToken(sec.token(ADMIN)),
            )
            with pytest.raises(PigeonError):
                await conn.request(
                    "createProducer",
                    {"producerId": 1, "topic": "t", "producerName": "p"},
                    expect="producerCreated",
                )
                await conn.request(
                    "send",
                    {"producerId": 1, "sequenceId": 0, "numMessages": 1},
                    payload=batch_of([b"m"], "p", 0),
                    expect="sendReceipt",
                )
            # the broker is still there and answers on the same connection
            assert await conn.request("lookup", {"topic": "t"}) is not None
            conn.close()
            inner.cancel_scope.cancel()
