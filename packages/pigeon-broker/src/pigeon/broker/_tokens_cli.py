"""``pigeon tokens``: create keys and tokens, validate tokens (Pulsar's ``pulsar tokens``).

Keys are read from ``file:///path`` or ``data:;base64,...`` and tokens from a file or
standard input, so that secrets need not appear in ``ps`` output; a key written to a file
is made readable by its owner only.
"""

from __future__ import annotations

import base64
import os
import sys
from pathlib import Path

import click

from pigeon.core.tokens import (
    KEY_PAIR_ALGORITHMS,
    create_key_pair,
    create_secret_key,
    create_token,
    load_key,
    parse_duration,
    validate_token,
)

__all__ = ["tokens_cmd"]


def _write_secret(path: str, data: bytes) -> None:
    """Write a key readable by its owner only (created so, never widened)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


@click.group("tokens")
def tokens_cmd() -> None:
    """Keys and tokens for token authentication (JWT; the subject is the role)."""


@tokens_cmd.command("create-secret-key")
@click.option("--output", type=click.Path(dir_okay=False), help="Write the key to this file.")
@click.option("--base64", "as_base64", is_flag=True, help="Print the key base64-encoded.")
def create_secret_key_cmd(output: str | None, as_base64: bool) -> None:
    """A new secret key for HS256 tokens (to a file, or printed with --base64)."""
    key = create_secret_key()
    if output:
        _write_secret(output, key)
        click.echo(f"secret key written to {output}", err=True)
    elif as_base64:
        click.echo(base64.b64encode(key).decode())
    else:
        raise click.UsageError("give --output FILE, or --base64 to print the key")


@tokens_cmd.command("create-key-pair")
@click.option(
    "--algorithm", type=click.Choice(KEY_PAIR_ALGORITHMS), default="RS256", show_default=True
)
@click.option("--output-private-key", required=True, type=click.Path(dir_okay=False))
@click.option("--output-public-key", required=True, type=click.Path(dir_okay=False))
def create_key_pair_cmd(algorithm: str, output_private_key: str, output_public_key: str) -> None:
    """A key pair for RS256/ES256 tokens: brokers hold the public key only."""
    private_pem, public_pem = create_key_pair(algorithm)
    _write_secret(output_private_key, private_pem)
    Path(output_public_key).write_bytes(public_pem)
    click.echo(
        f"{algorithm} key pair written: private {output_private_key}, public {output_public_key}",
        err=True,
    )


@tokens_cmd.command("create")
@click.option("--subject", required=True, help="The role the token grants.")
@click.option("--secret-key", help="file:///path or data:;base64,... (HS256).")
@click.option("--private-key", help="file:///path or data:;base64,... (RS256/ES256).")
@click.option(
    "--expiry",
    "--expiry-time",
    "expiry",
    help="Lifetime, e.g. 30m, 12h, 1d, 1y (default: never expires; Pulsar: --expiry-time).",
)
def create_cmd(
    subject: str, secret_key: str | None, private_key: str | None, expiry: str | None
) -> None:
    """Print a new token for ROLE."""
    key = _one_key(secret_key, private_key, "--private-key")
    click.echo(create_token(subject, key, expiry_s=parse_duration(expiry) if expiry else None))


@tokens_cmd.command("validate")
@click.option("--secret-key", help="file:///path or data:;base64,... (HS256).")
@click.option("--public-key", help="file:///path or data:;base64,... (RS256/ES256).")
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False, exists=True),
    help="Read the token from this file (default: standard input).",
)
def validate_cmd(secret_key: str | None, public_key: str | None, token_file: str | None) -> None:
    """Check a token and print its role; one line saying why (exit status 2) if it is not."""
    key = _one_key(secret_key, public_key, "--public-key")
    token = Path(token_file).read_text() if token_file else sys.stdin.read()
    if not token.strip():
        raise click.UsageError("no token given (on standard input or with --token-file)")
    click.echo(validate_token(token, key))


def _one_key(secret: str | None, pair: str | None, pair_flag: str) -> bytes:
    if (secret is None) == (pair is None):
        raise click.UsageError(f"give exactly one of --secret-key and {pair_flag}")
    return load_key(secret if secret is not None else pair)  # type: ignore[arg-type]
