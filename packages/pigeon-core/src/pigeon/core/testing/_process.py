"""What the server helpers of :mod:`pigeon.core.testing.servers` share: loopback ports,
signals by PID, log tails."""

from __future__ import annotations

import collections
import contextlib
import os
import random
import socket
import subprocess
from pathlib import Path

__all__ = ["HOST", "POLL", "free_port", "free_ports", "log_tail", "port_open", "send_signal"]

#: Every test server listens on loopback only.
HOST = "127.0.0.1"
#: How often a wait for a server looks again (seconds).
POLL = 0.05


#: Where the kernel's ephemeral ports (``bind(port 0)``, outgoing connections) come from.
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: The lowest port handed to a test server.
LOWEST_TEST_PORT = 10000
_ports = random.Random(os.urandom(16))  # private: tests may seed the global ``random``
#: How many of the ports handed out last are not handed out again: a server may not have
#: bound the port it was given yet when the next test server's port is picked.
RECENT_PORTS = 2000
_recent: collections.deque[int] = collections.deque(maxlen=RECENT_PORTS)


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default where it cannot be read)."""
    try:
        low, high = (int(x) for x in EPHEMERAL_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports that were free on 127.0.0.1 a moment ago.

    They lie below the kernel's ephemeral range. A client that outlives its test keeps
    reconnecting to its dead server's port; were that port ephemeral, the kernel could
    hand it to another program's listener (Spark's JVM binds port 0 for each Python
    worker to connect back to), which would then take the stray client's bytes for its
    own handshake and fail. A port this process handed out among the last
    :data:`RECENT_PORTS` is not handed out again (its server may not listen yet)."""
    low = LOWEST_TEST_PORT
    high = ephemeral_range()[0] - 1
    socks: list[socket.socket] = []
    try:
        for _ in range(200 * n):
            if len(socks) == n:
                break
            port = _ports.randint(low, high) if high - low >= 2 * RECENT_PORTS else 0
            if port in _recent:
                continue
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((HOST, port))
            except OSError:
                s.close()
                continue
            socks.append(s)
        if len(socks) < n:
            raise OSError(f"no {n} free ports on {HOST} in {low}..{high}")
        ports = [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()
    _recent.extend(ports)
    return ports


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
