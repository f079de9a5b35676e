"""The ``pigeon`` command as an operator runs it (``pigeon admin ...`` against a real
standalone's admin API), in a subprocess bounded in time."""

from __future__ import annotations

import json
import subprocess
from typing import Any

from pigeon.core.testing.servers import HOST, Standalone, clean_env, pigeon_command


def pigeon(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``pigeon ARGS...`` (a minute at most); its exit code and output."""
    return subprocess.run(
        [*pigeon_command(), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean_env(), **(env or {})},
        stdin=subprocess.DEVNULL,
    )


def admin_url(server: Standalone) -> str:
    """The address of ``server``'s admin API."""
    return f"http://{HOST}:{server.http_port}"


def admin_json(url: str, *args: str) -> Any:
    """``pigeon admin --url URL --json ARGS...``, which must succeed; its JSON answer."""
    done = pigeon("admin", "--url", url, "--json", *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)
