"""Run ``pigeon standalone`` as a real subprocess for integration tests.

:class:`Standalone` owns one server process: it picks free loopback ports, keeps the data
directory, and can kill (-9), terminate (SIGTERM) and restart the server on the same data
directory and ports.  Every wait is bounded in time and fails with the tail of the
server's log (stderr), so a test never hangs on a dead or stuck server.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from pigeon.core.testing._process import HOST, POLL, free_ports, port_open, send_signal
from pigeon.core.testing._security import write_toml

__all__ = [
    "STANDALONE_READY_TIMEOUT",
    "Standalone",
    "StandaloneError",
    "clean_env",
    "pigeon_command",
    "server_command",
]

#: Longest wait for ``pigeon standalone`` to accept connections.
STANDALONE_READY_TIMEOUT = 20.0
STOP_TIMEOUT = 15.0


def pigeon_command() -> list[str]:
    """The ``pigeon`` console script of the running interpreter's environment."""
    script = Path(sys.executable).with_name("pigeon")
    if script.exists():
        return [str(script)]
    return server_command()


def server_command() -> list[str]:
    """How servers are started: ``pigeon``'s entry point run by this interpreter.

    Same code path as the console script, but the command line does not read
    ``pigeon standalone``, so tools on a shared machine that stop "their" servers by
    name (``pkill -f 'pigeon standalone'``) leave the test's servers alone.
    """
    return [
        sys.executable,
        "-c",
        "import sys; from pigeon.core._cli import main; sys.argv[0] = 'pigeon'; main()",
    ]


def clean_env() -> dict[str, str]:
    """The test's environment without ``PIGEON_*`` settings (they would change the config)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIGEON_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


class StandaloneError(AssertionError):
    """The server did not start or stop as expected (carries its log tail)."""


class Standalone:
    """One ``pigeon standalone`` process with its data directory and ports.

    ``config``: TOML tables (``{"broker": {...}, "bookie": {...}, "kafka": {...}}``)
    written to ``standalone.toml`` in the log directory and passed as ``--config``, e.g.
    :meth:`SecurityFiles.node_table` for TLS and token authentication on every link
    (the ports stay the helper's: flags win over the file).  ``storage``: the bookie's
    ledger storage backend (``--storage``; None: the default, ``segment-files``).
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        log_dir: Path | None = None,
        fsync: str | None = "always",
        extra_args: tuple[str, ...] = (),
        config: Mapping[str, Mapping[str, Any]] | None = None,
        storage: str | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.log_dir = Path(log_dir) if log_dir is not None else self.data_dir.parent
        self.fsync = fsync
        self.storage = storage
        self.extra_args = tuple(extra_args)
        self.config = {k: dict(v) for k, v in (config or {}).items()}
        self.port = 0
        self.bookie_port = 0
        self.http_port = 0
        #: the Kafka listener's port
        self.kafka_port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.runs = 0
        self.log_path: Path | None = None
        self._log: IO[bytes] | None = None

    # ------------------------------------------------------------------ info

    @property
    def url(self) -> str:
        return f"pigeon://{HOST}:{self.port}"

    @property
    def kafka_bootstrap(self) -> str:
        """``host:port`` of the Kafka listener (Kafka clients' ``bootstrap.servers``)."""
        return f"{HOST}:{self.kafka_port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "standalone was never started"
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_text(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    # ------------------------------------------------------------------ lifecycle

    def command(self) -> list[str]:
        cmd = [
            *server_command(),
            "standalone",
            "--data-dir",
            str(self.data_dir),
            "--host",
            HOST,
            "--port",
            str(self.port),
            "--bookie-port",
            str(self.bookie_port),
        ]
        if not any(a == "--http-port" for a in self.extra_args):
            cmd += ["--http-port", str(self.http_port)]
        if not any(a == "--kafka-port" for a in self.extra_args):
            cmd += ["--kafka-port", str(self.kafka_port)]
        if self.fsync:
            cmd += ["--fsync", self.fsync]
        if self.storage:
            cmd += ["--storage", self.storage]
        if self.config and "--config" not in self.extra_args:
            cmd += ["--config", str(self.config_path)]
        return cmd + list(self.extra_args)

    @property
    def config_path(self) -> Path:
        """Where ``config`` is written (at each start)."""
        return self.log_dir / "standalone.toml"

    def start(self, timeout: float = STANDALONE_READY_TIMEOUT) -> Standalone:
        """Start on fresh free ports (retrying if another process took one meanwhile)."""
        assert not self.running, "standalone is already running"
        for attempt in range(3):
            self.port, self.bookie_port, self.http_port, self.kafka_port = free_ports(4)
            try:
                self._launch(timeout)
                return self
            except StandaloneError:
                if attempt == 2 or "Address already in use" not in self.log_text():
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def restart(self, timeout: float = STANDALONE_READY_TIMEOUT) -> Standalone:
        """Start again on the same data directory and ports (after kill9/terminate)."""
        assert self.port, "restart() needs a previous start()"
        if self.running:
            self.terminate()
        self._launch(timeout)
        return self

    def _launch(self, timeout: float) -> None:
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._close_log()
        if self.config:
            write_toml(self.config_path, self.config)
        self.log_path = self.log_dir / f"standalone-{self.runs}.log"
        self.runs += 1
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in _close_log
        self.proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=clean_env(),
            cwd=str(self.log_dir),
            start_new_session=True,  # a Ctrl-C of the test run is not delivered to it
        )
        self.wait_ready(timeout)

    def wait_ready(self, timeout: float = STANDALONE_READY_TIMEOUT) -> None:
        """Poll a TCP connect to the broker port until it succeeds (bounded)."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None
            code = self.proc.poll()
            if code is not None:
                self._reap()
                raise StandaloneError(
                    f"pigeon standalone exited with {code} before it was ready; log:\n"
                    + self.log_tail()
                )
            if port_open(self.port):
                return
            if time.monotonic() >= deadline:
                self.kill9()
                raise StandaloneError(
                    f"pigeon standalone not ready on port {self.port} after {timeout}s; log:\n"
                    + self.log_tail()
                )
            time.sleep(POLL)

    def kill9(self) -> None:
        """SIGKILL the server (by PID) and reap it."""
        if self.proc is None:
            return
        send_signal(self.proc, signal.SIGKILL)
        try:
            self.proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise StandaloneError(f"pid {self.proc.pid} survived SIGKILL") from None
        self._close_log()

    def terminate(self, timeout: float = STOP_TIMEOUT) -> int:
        """SIGTERM the server (by PID) and wait for it; returns the exit code.

        Raises if it does not exit within ``timeout`` (it is then killed).
        """
        assert self.proc is not None, "standalone was never started"
        send_signal(self.proc, signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill9()
            raise StandaloneError(
                f"pigeon standalone did not exit within {timeout}s of SIGTERM; log:\n"
                + self.log_tail()
            ) from None
        self._close_log()
        return code

    def close(self) -> None:
        """Make sure the process is gone (fixture teardown)."""
        try:
            self.kill9()
        finally:
            self._close_log()

    def _reap(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=STOP_TIMEOUT)
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
