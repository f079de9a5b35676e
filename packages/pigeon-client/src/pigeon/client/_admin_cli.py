"""``pigeon admin``: the broker's admin REST API from the command line.

    pigeon admin health
    pigeon admin topics stats events --json
    pigeon admin subscriptions reset events sub-1 --time 10m

Every command prints a table or plain text, or the API's JSON with ``--json`` (before or
after the subcommand).  ``--url`` (default ``http://127.0.0.1:8080``, environment
``PIGEON_ADMIN_URL``) names the broker's HTTP port.  Exit codes: 0 success; 1 the API
refused (not found, conflict, bad value, unavailable — its JSON error is printed on
stderr) or the broker could not be reached; 2 a usage error.

:class:`AdminClient` is the small HTTP client underneath (standard library only); it
raises :class:`AdminError` carrying the HTTP status and the API's JSON error.
"""

from __future__ import annotations

from pigeon.client._admin_base import admin_cmd
from pigeon.client._admin_client import DEFAULT_URL, AdminClient, AdminError, InvalidNamespace
from pigeon.client._admin_cluster import bookies_cmd, brokers_cmd, parse_time, subscriptions_cmd
from pigeon.client._admin_schemas import schemas_cmd
from pigeon.client._admin_topics import namespaces_cmd, tenants_cmd, topics_cmd

__all__ = [
    "DEFAULT_URL",
    "AdminClient",
    "AdminError",
    "InvalidNamespace",
    "admin_cmd",
    "main",
    "parse_time",
]

for _cmd in (
    tenants_cmd,
    namespaces_cmd,
    topics_cmd,
    subscriptions_cmd,
    schemas_cmd,
    brokers_cmd,
    bookies_cmd,
):
    admin_cmd.add_command(_cmd)


def main() -> None:
    """Run ``pigeon admin`` on its own (``python -m``-style entry for scripts)."""
    admin_cmd(prog_name="pigeon admin")
