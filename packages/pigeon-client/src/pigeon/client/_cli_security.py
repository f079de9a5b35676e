"""The credentials and TLS options every client command takes (``pigeon produce``,
``consume``, ``perf``, ``admin``), with Pulsar's meanings.

:func:`security_options` adds ``--auth-token`` / ``--auth-token-file`` /
``--tls-trust-certs-file`` / ``--tls-allow-insecure`` (each with its ``PIGEON_*``
variable) to a click command; :func:`client_security` turns their values into the
``Client`` keywords (``authentication``, ``tls_trust_certs_file_path``,
``tls_allow_insecure_connection``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from pigeon.client._admin_client import F
from pigeon.core.auth import AuthenticationToken

__all__ = ["SECURITY_KEYS", "client_security", "security_options"]

#: the keyword names the options give the command function
SECURITY_KEYS = ("auth_token", "auth_token_file", "tls_trust_certs_file", "tls_allow_insecure")


def security_options(f: F) -> F:
    """Add the four options (see module doc) to a click command."""
    options = [
        click.option(
            "--auth-token",
            envvar="PIGEON_AUTH_TOKEN",
            show_envvar=True,
            metavar="TOKEN",
            help=(
                "Token to authenticate with. Prefer the PIGEON_AUTH_TOKEN variable or"
                " --auth-token-file: a command line is visible to other users (ps)."
            ),
        ),
        click.option(
            "--auth-token-file",
            envvar="PIGEON_AUTH_TOKEN_FILE",
            show_envvar=True,
            type=click.Path(dir_okay=False),
            help="File holding the token; read again for each new connection (rotation).",
        ),
        click.option(
            "--tls-trust-certs-file",
            envvar="PIGEON_TLS_TRUST_CERTS_FILE",
            show_envvar=True,
            type=click.Path(dir_okay=False),
            help="CA certificates (PEM) that sign the brokers' certificates (pigeon+ssl://,"
            " https://); the system's CAs without it.",
        ),
        click.option(
            "--tls-allow-insecure",
            is_flag=True,
            default=False,
            help="Accept any server certificate (tests and debugging only).",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def client_security(values: dict[str, Any], *, pop: bool = False) -> dict[str, Any]:
    """The ``Client`` keywords for the options' values in ``values`` (removed from it
    with ``pop``).  Both a token and a token file: a usage error."""
    get = values.pop if pop else values.get
    token, token_file = get("auth_token", None), get("auth_token_file", None)
    trust, insecure = get("tls_trust_certs_file", None), get("tls_allow_insecure", False)
    if token and token_file:
        raise click.UsageError("give --auth-token or --auth-token-file, not both")
    authentication = None
    if token_file:
        authentication = AuthenticationToken(Path(token_file).absolute())
    elif token:
        authentication = AuthenticationToken(token)
    return {
        "authentication": authentication,
        "tls_trust_certs_file_path": trust or None,
        "tls_allow_insecure_connection": bool(insecure),
    }
