"""A PigeonMQ cluster of real processes: bookies and brokers on one metadata URL.

Every process is started on free loopback ports in the test's temporary directory and
stopped by PID; readiness waits and stops are bounded in time and fail with the log tail.
``Cluster(..., config={"broker": {...}, "bookie": {...}})`` gives every node those TOML
tables (``--config``), e.g. ``SecurityFiles.node_table()`` of
:mod:`pigeon.core.testing.servers` for TLS and tokens on every link.

``Cluster(..., security=SecurityFiles.create(dir))`` secures every link: bookies serve
TLS and admit only the nodes' role, brokers dial them (and leader-follower bookies each
other) over TLS with that role's token, every broker serves the native protocol on a TLS
port of its own (``Node.tls_port``; ``service_url`` is then ``pigeon+ssl://``) and the
admin API over HTTPS (``Node.https_port``), with token authentication and authorization
on (``superuser_roles``: the nodes' role and ``admin_roles``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from pigeon.core.testing.servers import (
    HOST,
    NODE_ROLE,
    SecurityFiles,
    clean_env,
    free_ports,
    merge_tables,
    port_open,
    server_command,
    write_toml,
)

__all__ = ["Cluster", "Node"]

#: how long a node gets to open its ports (imports alone take 10-20 s on a loaded
#: 2-core machine)
READY_TIMEOUT = 60.0


def bookie_args(metadata: str, port: int, data_dir: Path, *extra: str) -> list[str]:
    """``pigeon bookie`` arguments for a node on ``port`` storing in ``data_dir`` (with the
    ledger storage ``PIGEON_TEST_LEDGER_STORAGE`` names, when set: the storage axis of
    ``nox -s cluster``)."""
    storage = os.environ.get("PIGEON_TEST_LEDGER_STORAGE", "")
    chosen = ["--storage", storage] if storage else []
    return [
        "--metadata",
        metadata,
        "--port",
        str(port),
        "--data-dir",
        str(data_dir),
        *chosen,
        *extra,
    ]


def broker_args(
    metadata: str, port: int, http_port: int, replication: str, *extra: str
) -> list[str]:
    """``pigeon broker`` arguments for a node on ``port`` (admin API on ``http_port``)."""
    return [
        "--metadata",
        metadata,
        "--port",
        str(port),
        "--http-port",
        str(http_port),
        "--replication",
        replication,
        *extra,
    ]


class Node:
    """One ``pigeon bookie`` or ``pigeon broker`` process."""

    def __init__(
        self,
        kind: str,
        args: list[str],
        port: int,
        log_path: Path,
        *,
        tls_port: int | None = None,
        https_port: int | None = None,
    ) -> None:
        self.kind = kind
        self.args = args
        self.port = port
        #: a secured broker's native TLS port and HTTPS admin port (waited for at start)
        self.tls_port = tls_port
        self.https_port = https_port
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def tls_address(self) -> str:
        """``host:port`` of the native TLS listener (a secured broker's)."""
        assert self.tls_port is not None, "this node has no TLS port"
        return f"{HOST}:{self.tls_port}"

    def start(self) -> Node:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [*server_command(), self.kind, *self.args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=clean_env(),
        )
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.kind} exited during start:\n{self.log_tail()}")
            if all(port_open(p, 0.2) for p in self._ports()):
                return self
            time.sleep(0.05)
        raise AssertionError(f"{self.kind} not ready in {READY_TIMEOUT}s:\n{self.log_tail()}")

    def _ports(self) -> list[int]:
        return [p for p in (self.port, self.tls_port, self.https_port) if p is not None]

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._close_log()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


class Cluster:
    """Bookies and brokers sharing one metadata store URL."""

    def __init__(
        self,
        root: Path,
        metadata: str,
        replication: str = "quorum",
        *,
        config: Mapping[str, Mapping[str, Any]] | None = None,
        security: SecurityFiles | None = None,
        admin_roles: tuple[str, ...] = (),
    ) -> None:
        self.root = root
        self.metadata = metadata
        self.replication = replication
        #: TLS + tokens + authorization on every link (see the module doc)
        self.security = security
        if security is not None:
            table = security.node_table(role=NODE_ROLE, superuser_roles=admin_roles)
            table["authorization_enabled"] = True
            config = merge_tables({"broker": table, "bookie": table}, config)
        #: TOML tables every node is given (``--config``), unless a node names its own
        self.config = {k: dict(v) for k, v in (config or {}).items()}
        self.bookies: list[Node] = []
        self.brokers: list[Node] = []

    def _config_args(self, extra: tuple[str, ...]) -> tuple[str, ...]:
        if not self.config or "--config" in extra:
            return extra
        path = write_toml(self.root / "cluster.toml", self.config)
        return (*extra, "--config", str(path))

    def add_bookie(self, *extra: str) -> Node:
        (port,) = free_ports(1)
        i = len(self.bookies)
        data = self.root / f"bookie-{i}"
        extra = self._config_args(extra)
        node = Node(
            "bookie",
            bookie_args(self.metadata, port, data, *extra),
            port,
            self.root / f"bookie-{i}.log",
        )
        self.bookies.append(node)
        return node.start()

    def add_broker(self, *extra: str) -> Node:
        port, http_port, tls_port, https_port = free_ports(4)
        i = len(self.brokers)
        if self.security is not None:
            # a TLS port of its own per broker: its own file on top of the shared tables
            own = merge_tables(
                self.config,
                {
                    "broker": {
                        "broker_service_port_tls": tls_port,
                        "web_service_port_tls": https_port,
                    }
                },
            )
            if "--config" in extra:
                raise ValueError("a secured cluster writes each broker's --config itself")
            extra = (*extra, "--config", str(write_toml(self.root / f"broker-{i}.toml", own)))
        else:
            extra = self._config_args(extra)
        secured = self.security is not None
        node = Node(
            "broker",
            broker_args(self.metadata, port, http_port, self.replication, *extra),
            port,
            self.root / f"broker-{i}.log",
            tls_port=tls_port if secured else None,
            https_port=https_port if secured else None,
        )
        self.brokers.append(node)
        return node.start()

    @property
    def service_url(self) -> str:
        if self.security is not None:
            return "pigeon+ssl://" + ",".join(b.tls_address for b in self.brokers)
        return "pigeon://" + ",".join(b.address for b in self.brokers)

    def stop(self) -> None:
        for node in [*self.brokers, *self.bookies]:
            node.stop()

    def kill_all(self) -> None:
        for node in [*self.brokers, *self.bookies]:
            node.kill9()
