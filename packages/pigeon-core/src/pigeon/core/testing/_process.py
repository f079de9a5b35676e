"""What the server helpers of :mod:`pigeon.core.testing.servers` share: loopback ports,
signals by PID, log tails."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
from pathlib import Path

__all__ = ["HOST", "POLL", "free_port", "free_ports", "log_tail", "port_open", "send_signal"]

#: Every test server listens on loopback only.
HOST = "127.0.0.1"
#: How often a wait for a server looks again (seconds).
POLL = 0.05


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports that were free on 127.0.0.1 a moment ago."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((HOST, 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    return free_ports(1)[0]


def port_open(port: int, timeout: float = 0.5) -> bool:
    """Whether something accepts TCP connections on ``127.0.0.1:port``."""
    try:
        with socket.create_connection((HOST, port), timeout=timeout):
            return True
    except OSError:
        return False


def send_signal(proc: subprocess.Popen[bytes], signum: int) -> None:
    """Signal a child by its PID if it still runs (it may exit meanwhile)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signum)


def log_tail(path: Path | None, lines: int) -> str:
    """The last ``lines`` lines of a server's log (``"(no log)"`` if there is none)."""
    try:
        text = path.read_text(errors="replace") if path is not None else None
    except OSError:
        text = None
    if text is None:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])
