"""The ``pigeon`` command answers a user's mistake in one line: ``error: …`` naming what to
do, never a traceback (``--debug`` prints it); ``pigeon admin`` prints text a person reads
(words and units, no JSON unless ``--json``).  Through the real command in subprocesses,
against one ``pigeon standalone`` started for the whole module; every run is bounded.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _kafka import Tansu, require_tansu

from pigeon.client._admin_client import AdminClient
from pigeon.core.testing.servers import (
    HOST,
    SecurityFiles,
    Standalone,
    clean_env,
    free_port,
    free_ports,
    pigeon_command,
)

pytestmark = pytest.mark.integration

RUN_TIMEOUT = 60.0  # a bound, not an expectation: each run takes a few seconds


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standalone]:
    root = tmp_path_factory.mktemp("cli-errors")
    standalone = Standalone(root / "data", log_dir=root).start()
    try:
        yield standalone
    finally:
        standalone.close()


def start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*pigeon_command(), *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=clean_env(),
    )


def finish(proc: subprocess.Popen[str]) -> tuple[int, list[str]]:
    """Exit status and stderr's lines of a run (killed if it outlives RUN_TIMEOUT)."""
    try:
        _, err = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"{proc.args} still running after {RUN_TIMEOUT}s: {err}") from None
    return proc.returncode, err.strip().splitlines()


def one_line(proc: subprocess.Popen[str], *needles: str) -> str:
    """The run failed with exactly one stderr line, ``error: …`` holding every needle."""
    code, lines = finish(proc)
    assert code == 2, lines
    assert len(lines) == 1, "\n".join(lines)
    assert lines[0].startswith("error: "), lines
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_a_client_on_a_wrong_port_is_told_which_port_to_use(server: Standalone) -> None:
    # the three runs at once: each is a fresh interpreter
    admin = start("produce", "-u", f"pigeon://{HOST}:{server.http_port}", "t", "x")
    bookie = start("produce", "-u", f"pigeon://{HOST}:{server.bookie_port}", "t", "x")
    kafka = start("consume", "-u", f"pigeon://{HOST}:{server.kafka_port}", "-s", "s", "t")
    # the admin port never answers the handshake: asked over HTTP, its answer names the
    # broker's service URL (without that the client waited 10 s and said "Timeout")
    one_line(admin, f"port {server.http_port}", "admin HTTP port", f"use {server.url}")
    one_line(bookie, "ProtocolError", "bookie port, not a broker port", "pigeon://")
    one_line(kafka, "ProtocolError", "Kafka protocol", "broker port")
    # the bookie answered the client's frame with a typed error and logged one line
    log = server.log_text()
    assert "Traceback" not in log
    refused = [line for line in log.splitlines() if "handshake refused" in line]
    assert len(refused) == 1, refused
    assert "bookie port, not a broker port" in refused[0], refused


def test_a_client_on_a_kafka_broker_that_is_not_ours_is_told_so(tmp_path: Path) -> None:
    # Tansu, a Kafka-protocol broker of another project: it never answers our handshake
    # (it reads our frame's length as a 1.6 GB Kafka request and goes silent); an
    # ApiVersions request on a second connection tells what it is, from its answer alone
    tansu = Tansu(require_tansu(), tmp_path)
    try:
        began = time.monotonic()
        line = one_line(
            start("produce", "-u", f"pigeon://{HOST}:{tansu.port}", "t", "x"),
            f"port {tansu.port} speaks the Kafka protocol",
            "use a Kafka client or pigeon's service port",
        )
        assert time.monotonic() - began < 8, line  # an interpreter's start + ~1 s, no 10 s wait
    finally:
        tansu.close()


def test_the_wrong_tls_scheme_is_named_in_one_line_at_once(tmp_path: Path) -> None:
    # a broker with a plaintext port and a TLS port (broker_service_port_tls)
    certs = SecurityFiles.create(tmp_path / "certs")
    tls_port = free_port()
    broker = {
        "tls_certificate_file": str(certs.certificate_file),
        "tls_key_file": str(certs.key_file),
        "broker_service_port_tls": tls_port,
    }
    server = Standalone(
        tmp_path / "data", log_dir=tmp_path, config={"broker": broker}, fsync=None
    ).start()
    try:
        began = time.monotonic()
        trust = ("--tls-trust-certs-file", str(certs.ca_file))
        ssl_on_plain = start(
            "produce", "-u", f"pigeon+ssl://{HOST}:{server.port}", *trust, "t", "x"
        )
        plain_on_tls = start("produce", "-u", f"pigeon://{HOST}:{tls_port}", "t", "x")
        one_line(
            ssl_on_plain, "TlsError", f"{HOST}:{server.port}", "plaintext port", "use pigeon://"
        )
        one_line(plain_on_tls, "TlsError", f"{HOST}:{tls_port}", "takes TLS only", "pigeon+ssl://")
        # two interpreters' start and an answer each, not a 10 s handshake timeout
        assert time.monotonic() - began < 8
        assert "Traceback" not in server.log_text()
    finally:
        server.close()


def test_a_second_standalone_on_the_same_data_dir_or_port_says_which(
    server: Standalone, tmp_path: Path
) -> None:
    ports = [str(p) for p in free_ports(4)]

    def standalone(data_dir: Path, port: str, bookie_port: str) -> subprocess.Popen[str]:
        return start(
            "standalone",
            "--data-dir",
            str(data_dir),
            "--host",
            HOST,
            "--port",
            port,
            "--bookie-port",
            bookie_port,
            "--http-port",
            ports[2],
            "--kafka-port",
            ports[3],
        )

    same_dir = standalone(server.data_dir, ports[0], ports[1])
    same_port = standalone(tmp_path / "a", str(server.port), ports[1])
    same_bookie_port = standalone(tmp_path / "b", ports[0], str(server.bookie_port))
    one_line(same_dir, "DataDirLocked", str(server.data_dir), f"pid {server.pid}", "--data-dir")
    one_line(same_port, f"port {server.port} is already in use (--port)")
    one_line(same_bookie_port, f"port {server.bookie_port} is already in use (--bookie-port)")
    assert server.running


def test_a_bad_flag_is_one_line_and_debug_shows_the_traceback(server: Standalone) -> None:
    bad_flag = start("produce", "--bogus", "t")
    debug = start("--debug", "produce", "-u", f"pigeon://{HOST}:{server.bookie_port}", "t", "x")
    one_line(bad_flag, "No such option '--bogus'", "'pigeon produce --help'")
    code, lines = finish(debug)
    assert code == 2
    assert lines[0].startswith("Traceback"), lines
    assert lines[-1].startswith("error: ProtocolError: "), lines


# ------------------------------------------------------- pigeon admin: text a person reads


def admin(server: Standalone, *args: str) -> subprocess.Popen[str]:
    return start("admin", "--url", f"http://{HOST}:{server.http_port}", *args)


def output(proc: subprocess.Popen[str]) -> str:
    """stdout of a run that succeeded."""
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError(f"{proc.args} still running after {RUN_TIMEOUT}s") from None
    assert proc.returncode == 0, err
    return out


def refused(proc: subprocess.Popen[str], *needles: str) -> str:
    """The API refused the call: exit 1, one ``error: …`` line holding every needle and
    none of pydantic's regex text."""
    code, lines = finish(proc)
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith("error: "), lines
    assert "pattern" not in lines[0] and "String should" not in lines[0], lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_admin_refuses_a_bad_name_with_the_rule(server: Standalone) -> None:
    # (the length rule and the other kinds: packages/pigeon-core/tests/test_topic.py)
    runs = [
        (admin(server, "tenants", "create", "café"), "invalid tenant name 'café'"),
        (admin(server, "subscriptions", "create", "t", "my sub"), "invalid subscription name"),
    ]
    for proc, needle in runs:
        refused(proc, needle, "may only hold ASCII letters, digits and _ . - = :")
    dots = [
        (admin(server, "tenants", "create", "."), "invalid tenant name '.'"),
        (admin(server, "namespaces", "create", "public/.."), "invalid namespace name '..'"),
    ]
    for proc, needle in dots:
        line = refused(proc, needle, "may not be . or ..")
        assert "metadata path" not in line, line


def test_admin_tables_and_nested_stats_read_as_text(server: Standalone) -> None:
    # every table goes through one function (pigeon.client._admin_base.table): a few
    # commands show it; packages/pigeon-client/tests/test_units.py checks each heading
    topic = "persistent://public/default/admin-text"
    api = AdminClient(f"http://{HOST}:{server.http_port}")  # in this process: cheaper
    api.create_topic(topic, 0)
    api.create_subscription(topic, "s", "earliest")
    runs = {
        "bookies": admin(server, "bookies", "list"),
        "throughput": admin(server, "brokers", "throughput"),
        "stats": admin(server, "topics", "stats", topic),
        "internal": admin(server, "topics", "internal-stats", topic),
        "health": admin(server, "health"),
        "internal json": admin(server, "--json", "topics", "internal-stats", topic),
    }
    out = {name: output(proc) for name, proc in runs.items()}
    tables = [
        line
        for name in ("bookies", "throughput", "stats", "internal")
        for line in out[name].splitlines()
        if line.isupper()
    ]
    assert len(tables) == 5, out  # stats and internal-stats have a second table
    for header in tables:
        assert "_" not in header, header  # words, not JSON field names
    assert "FREE DISK" in out["bookies"] and "BYTES" not in out["bookies"], out["bookies"]
    assert "WRITE RATE" in out["bookies"] and " GB" in out["bookies"], out["bookies"]
    # the throughput samples' time is a clock time, not 1,795,759,189,649
    sample = out["throughput"].splitlines()[1].split()
    assert sample[0].count(":") == 2 and "," not in sample[0], sample
    # a topic that is not partitioned says so
    assert "partitions     not partitioned" in out["stats"], out["stats"]
    # nested values inlined as words, not JSON
    for name in ("internal", "health"):
        assert "{" not in out[name] and "[" not in out[name], out[name]
    assert "hits 0, misses" in out["internal"], out["internal"]
    assert "latency" in out["health"] and "ensemble size 1" in out["health"], out["health"]
    # --json keeps the API's JSON, nested as it is
    internal = json.loads(out["internal json"])
    assert isinstance(internal["cache"], dict) and "s" in internal["cursors"], internal
