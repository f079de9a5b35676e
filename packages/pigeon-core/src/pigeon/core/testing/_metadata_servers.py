"""Real ZooKeeper and etcd servers for tests, on free loopback ports in temp dirs.

Plain classes and context managers, usable from any pytest fixture (sync or trio)::

    with zookeeper_server(tmp_path / "zk") as zk:
        url = zk.url("/pigeon")          # zk://127.0.0.1:PORT/pigeon
        ...
        zk.restart()                     # same data dir, same port
    with etcd_server(tmp_path / "etcd") as etcd:
        url = etcd.url("/pigeon")        # etcd://127.0.0.1:PORT/pigeon

Each server is one child process started with the commands of ``shared/SERVERS.md``,
its output in ``<dir>/server.log``.  Every wait is bounded (:data:`READY_TIMEOUT`,
:data:`STOP_TIMEOUT`) and fails with :class:`ServerError` carrying the log's tail.
Servers are stopped by PID: SIGTERM, wait, then SIGKILL.

A missing binary (``java`` plus ``/usr/share/java/zookeeper.jar``, or ``etcd``) raises
:class:`ServerError` naming the Debian package to install: tests that need a server
fail, they are not skipped (CI installs ``zookeeper`` and ``etcd-server``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import TypeVar

from pigeon.core.metadata import MetadataStore
from pigeon.core.testing._metadata_helpers import ServerRestart
from pigeon.core.testing._process import HOST, POLL, free_port, log_tail, send_signal

__all__ = [
    "READY_TIMEOUT",
    "STOP_TIMEOUT",
    "EtcdServer",
    "MotoS3Server",
    "ServerError",
    "ZooKeeperServer",
    "etcd_server",
    "moto_s3_server",
    "zookeeper_server",
]

#: Longest wait for a server to answer after it was launched.
READY_TIMEOUT = 30.0
#: Longest wait for a server to exit after SIGTERM (then it gets SIGKILL).
STOP_TIMEOUT = 10.0
ZOOKEEPER_JAR = Path("/usr/share/java/zookeeper.jar")


class ServerError(RuntimeError):
    """A test server is missing, did not start, or did not stop."""


def _require(path: str | None, what: str, package: str) -> str:
    if path is None or not os.path.exists(path):
        raise ServerError(
            f"{what} not found: install the Debian package {package!r} "
            f"(apt-get install -y --no-install-recommends {package})"
        )
    return path


class _Server:
    """One server process with a data directory, a port and a log file."""

    name = "server"
    #: the scheme of the metadata store URL that reaches this server
    scheme = "server"

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.log_path = self.directory / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = free_port()

    # subclasses provide these
    def _command(self) -> list[str]:
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    def __repr__(self) -> str:
        pid = self.proc.pid if self.proc else None
        return f"<{type(self).__name__} {HOST}:{self.port} pid={pid}>"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def url(self, path: str = "/pigeon", **options: object) -> str:
        """``SCHEME://127.0.0.1:PORT/path?option=value...`` for the metadata store (the
        path is ZooKeeper's chroot, etcd's key prefix)."""
        query = "&".join(f"{k}={v}" for k, v in options.items())
        return f"{self.scheme}://{self.address}{path}" + (f"?{query}" if query else "")

    def restartable(self, new_store: Callable[[str], MetadataStore]) -> ServerRestart:
        """``(stores, restart)`` for the contract suite's ``restartable_server``: stores
        made by ``new_store(address)``; ``restart()`` kills the server (-9) and starts it
        again on the same data after half a second."""
        return (lambda: new_store(self.address)), partial(self.restart, kill=True, downtime=0.5)

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def start(self) -> _Server:
        """Launch the server and return once it answers (at most :data:`READY_TIMEOUT`)."""
        if self.running:
            raise ServerError(f"{self!r} is already running")
        command = self._command()
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== start: {' '.join(command)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.directory,
                start_new_session=True,  # a ^C of the test run does not reach it first
            )
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise ServerError(
                    f"{self.name} exited with status {self.proc.returncode} while starting;"
                    f" log:\n{self.log_tail()}"
                )
            if self._ready():
                return self
            if time.monotonic() > deadline:
                self.stop(kill=True)
                raise ServerError(
                    f"{self.name} did not become ready in {READY_TIMEOUT}s; log:\n{self.log_tail()}"
                )
            time.sleep(POLL)

    def stop(self, *, kill: bool = False) -> None:
        """Stop the server by PID: SIGTERM (SIGKILL if ``kill``), wait, SIGKILL if it
        lingers.  Does nothing if it is not running."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            send_signal(proc, signal.SIGKILL if kill else signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                send_signal(proc, signal.SIGKILL)
                try:
                    proc.wait(timeout=STOP_TIMEOUT)
                except subprocess.TimeoutExpired:
                    raise ServerError(f"{self!r} did not die after SIGKILL") from None
        self.proc = None

    def restart(self, *, kill: bool = False, downtime: float = 0.0) -> _Server:
        """Stop the server (SIGKILL if ``kill``), stay down ``downtime`` seconds, and
        start it again on the same port and data directory."""
        self.stop(kill=kill)
        if downtime > 0:
            time.sleep(downtime)
        return self.start()

    def __enter__(self) -> _Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ZooKeeperServer(_Server):
    """A standalone ZooKeeper 3.8 (Debian ``zookeeper``), ``tickTime`` 500 ms by default
    so that sessions may be as short as 1 s (ZooKeeper allows 2 to 20 ticks)."""

    name = "ZooKeeper"
    scheme = "zk"

    def __init__(self, directory: Path, *, tick_time_ms: int = 500) -> None:
        super().__init__(directory)
        self.tick_time_ms = tick_time_ms
        self.data_dir = self.directory / "data"
        self.conf_dir = self.directory / "conf"

    def _command(self) -> list[str]:
        java = _require(shutil.which("java"), "java", "default-jre-headless")
        _require(str(ZOOKEEPER_JAR), str(ZOOKEEPER_JAR), "zookeeper")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.conf_dir.mkdir(parents=True, exist_ok=True)
        (self.conf_dir / "zoo.cfg").write_text(
            f"tickTime={self.tick_time_ms}\n"
            f"dataDir={self.data_dir}\n"
            f"clientPort={self.port}\n"
            f"clientPortAddress={HOST}\n"
            "admin.enableServer=false\n"
            "4lw.commands.whitelist=ruok,srvr,stat,mntr\n"
            "maxClientCnxns=0\n"
        )
        return [
            java,
            "-Xmx256m",
            "-XX:+UseSerialGC",
            "-Dzookeeper.admin.enableServer=false",
            "-cp",
            f"{self.conf_dir}:{ZOOKEEPER_JAR}",
            "org.apache.zookeeper.server.quorum.QuorumPeerMain",
            str(self.conf_dir / "zoo.cfg"),
        ]

    def four_letter(self, command: str, timeout: float = 1.0) -> str:
        """Send a four-letter command (``ruok``, ``srvr``, ``stat``, ``mntr``)."""
        with socket.create_connection((HOST, self.port), timeout=timeout) as sock:
            sock.sendall(command.encode())
            chunks = []
            while chunk := sock.recv(4096):
                chunks.append(chunk)
        return b"".join(chunks).decode(errors="replace")

    def _ready(self) -> bool:
        try:
            return "Mode:" in self.four_letter("srvr")
        except OSError:
            return False


class EtcdServer(_Server):
    """A single-member etcd 3.4 (Debian ``etcd-server``)."""

    name = "etcd"
    scheme = "etcd"

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.peer_port = free_port()
        self.metrics_port = free_port()
        self.data_dir = self.directory / "data"

    def _command(self) -> list[str]:
        etcd = _require(shutil.which("etcd"), "etcd", "etcd-server")
        client = f"http://{HOST}:{self.port}"
        peer = f"http://{HOST}:{self.peer_port}"
        return [
            etcd,
            "--name",
            "n1",
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"n1={peer}",
            "--initial-cluster-state",
            "new",
            "--listen-metrics-urls",
            f"http://{HOST}:{self.metrics_port}",
            "--log-level",
            "warn",
            "--logger",
            "zap",
        ]

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{HOST}:{self.port}/health", timeout=1.0) as r:
                return bool(json.loads(r.read()).get("health") == "true")
        except (OSError, ValueError):
            return False


class MotoS3Server(_Server):
    """An S3-compatible store: moto's server mode (``pip install "moto[server]"``).

    Its state is in memory: a restart starts empty (``create_bucket`` again).
    :meth:`env` gives the AWS variables an S3 client needs (dummy credentials).
    """

    name = "moto-s3"
    scheme = "http"

    def _command(self) -> list[str]:
        try:
            import moto.server  # noqa: F401
        except ImportError:
            raise ServerError("moto's server mode is missing: pip install 'moto[server]'") from None
        return [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(self.port)]

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint}/", timeout=1.0) as r:
                return bool(r.status == 200)
        except (OSError, ValueError):
            return False

    def create_bucket(self, bucket: str) -> None:
        request = urllib.request.Request(f"{self.endpoint}/{bucket}", method="PUT")
        with urllib.request.urlopen(request, timeout=10.0) as r:
            if r.status != 200:
                raise ServerError(f"cannot create bucket {bucket}: HTTP {r.status}")

    def objects(self, bucket: str) -> list[str]:
        """The keys in ``bucket`` (ListObjectsV2, first 1000)."""
        url = f"{self.endpoint}/{bucket}?list-type=2"
        with urllib.request.urlopen(url, timeout=10.0) as r:
            text = r.read().decode()
        return re.findall(r"<Key>([^<]*)</Key>", text)

    @staticmethod
    def env() -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_REGION": "us-east-1",
        }


def moto_s3_server(directory: Path) -> contextlib.AbstractContextManager[MotoS3Server]:
    """A started :class:`MotoS3Server` (its log in ``directory``); stopped on exit."""
    return _running(MotoS3Server(directory))


_S = TypeVar("_S", bound=_Server)


@contextlib.contextmanager
def _running(server: _S) -> Iterator[_S]:
    try:
        server.start()
        yield server
    finally:
        server.stop()


def zookeeper_server(
    directory: Path, *, tick_time_ms: int = 500
) -> contextlib.AbstractContextManager[ZooKeeperServer]:
    """A started :class:`ZooKeeperServer` in ``directory``; stopped on exit."""
    return _running(ZooKeeperServer(directory, tick_time_ms=tick_time_ms))


def etcd_server(directory: Path) -> contextlib.AbstractContextManager[EtcdServer]:
    """A started :class:`EtcdServer` in ``directory``; stopped on exit."""
    return _running(EtcdServer(directory))
