"""Token keys and tokens (``pigeon.core.tokens``) and the ``pigeon tokens`` command."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import stat
import time
from pathlib import Path

import jwt
import pytest
from click.testing import CliRunner

from pigeon.core._cli import make_cli
from pigeon.core.errors import AuthenticationError, ConfigError
from pigeon.core.tokens import (
    create_key_pair,
    create_secret_key,
    create_token,
    load_key,
    parse_duration,
    validate_token,
)


@pytest.mark.parametrize("kind", ["secret", "RS256", "ES256"])
def test_a_token_names_its_role_and_only_the_right_key_accepts_it(kind: str) -> None:
    if kind == "secret":
        sign = check = create_secret_key()
        other = create_secret_key()
    else:
        sign, check = create_key_pair(kind)
        other = create_key_pair(kind)[1]
    token = create_token("app-1", sign)
    assert jwt.get_unverified_header(token)["alg"] == ("HS256" if kind == "secret" else kind)
    assert validate_token(token, check) == "app-1"
    with pytest.raises(AuthenticationError, match="signature does not match"):
        validate_token(token, other)


def test_expired_tokens_are_refused_and_unexpired_ones_accepted() -> None:
    key = create_secret_key()
    assert validate_token(create_token("r", key, expiry_s=3600), key) == "r"
    expired = jwt.encode({"sub": "r", "exp": int(time.time()) - 10}, key, algorithm="HS256")
    with pytest.raises(AuthenticationError, match="expired"):
        validate_token(expired, key)


@pytest.mark.parametrize(
    ("token", "why"),
    [
        ("garbage", "not valid"),
        ("", "not valid"),
        ("a.b.c", "not valid"),
    ],
)
def test_garbage_is_an_authentication_error_that_does_not_echo_the_token(
    token: str, why: str
) -> None:
    with pytest.raises(AuthenticationError, match=why) as refused:
        validate_token(token + "SECRETPART", create_secret_key())
    assert "SECRETPART" not in str(refused.value)


def test_a_token_without_subject_or_with_another_algorithm_is_refused() -> None:
    key = create_secret_key()
    with pytest.raises(AuthenticationError, match="no subject"):
        validate_token(jwt.encode({"x": 1}, key, algorithm="HS256"), key)
    private, public = create_key_pair("RS256")

    # a token signed HS256 with the public key as its secret (the algorithm-confusion
    # attack): refused, a public key only checks the pair's algorithm
    def b64(data: bytes) -> bytes:
        return base64.urlsafe_b64encode(data).rstrip(b"=")

    signing_input = b64(b'{"alg":"HS256","typ":"JWT"}') + b"." + b64(b'{"sub":"admin"}')
    mac = hmac.new(public, signing_input, hashlib.sha256).digest()
    forged = (signing_input + b"." + b64(mac)).decode()
    with pytest.raises(AuthenticationError, match="not signed with RS256"):
        validate_token(forged, public)
    assert validate_token(create_token("admin", private), public) == "admin"


def test_keys_load_from_files_and_data_urls(tmp_path: Path) -> None:
    key = create_secret_key()
    (tmp_path / "k").write_bytes(key)
    assert load_key(f"file://{tmp_path / 'k'}") == key
    assert load_key(str(tmp_path / "k")) == key
    assert load_key("data:;base64," + base64.b64encode(key).decode()) == key
    with pytest.raises(ConfigError, match="cannot read the key file"):
        load_key(f"file://{tmp_path / 'missing'}")
    with pytest.raises(ConfigError, match="base64"):
        load_key("data:;base64,***")


@pytest.mark.parametrize(("text", "seconds"), [("30", 30), ("15m", 900), ("1d", 86400)])
def test_durations(text: str, seconds: int) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "-1d", "1 fortnight", "1.5h"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ConfigError, match="positive duration"):
        parse_duration(text)


def test_the_tokens_command_round_trip(tmp_path: Path) -> None:
    runner = CliRunner()
    cli = make_cli()
    secret = tmp_path / "secret.key"
    made = runner.invoke(cli, ["tokens", "create-secret-key", "--output", str(secret)])
    assert made.exit_code == 0, made.output
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    created = runner.invoke(
        cli,
        ["tokens", "create", "--subject", "billing", "--secret-key", f"file://{secret}"],
    )
    assert created.exit_code == 0, created.output
    token = created.stdout.strip()
    checked = runner.invoke(
        cli, ["tokens", "validate", "--secret-key", f"file://{secret}"], input=token
    )
    assert (checked.exit_code, checked.stdout.strip()) == (0, "billing")

    private, public = tmp_path / "private.pem", tmp_path / "public.pem"
    pair = runner.invoke(
        cli,
        [
            "tokens",
            "create-key-pair",
            "--algorithm",
            "ES256",
            "--output-private-key",
            str(private),
            "--output-public-key",
            str(public),
        ],
    )
    assert pair.exit_code == 0, pair.output
    signed = runner.invoke(
        cli,
        ["tokens", "create", "--subject", "ops", "--private-key", str(private), "--expiry", "1d"],
    )
    (tmp_path / "token").write_text(signed.stdout)
    checked = runner.invoke(
        cli,
        [
            "tokens",
            "validate",
            "--public-key",
            str(public),
            "--token-file",
            str(tmp_path / "token"),
        ],
    )
    assert (checked.exit_code, checked.stdout.strip()) == (0, "ops")


def test_the_tokens_command_refuses_in_one_line(tmp_path: Path) -> None:
    runner = CliRunner()
    cli = make_cli()
    key = tmp_path / "k"
    key.write_bytes(create_secret_key())
    wrong = runner.invoke(
        cli, ["tokens", "validate", "--secret-key", str(key)], input="not-a-token"
    )
    assert wrong.exit_code == 2
    assert wrong.stderr.strip().splitlines() == [
        "error: AuthenticationError: the token is not valid: Not enough segments"
    ]
    both = runner.invoke(cli, ["tokens", "create", "--subject", "x"])
    assert both.exit_code == 2 and "exactly one of --secret-key and --private-key" in both.output
