"""Credentials and TLS options of the ``pigeon`` format (issue 15): Pulsar's client names
in snake_case (and camelCase, as Pulsar's connector spells them), passed to the client;
the token never shows in a repr or an error."""

from __future__ import annotations

from pathlib import Path

import pytest

from pigeon.core.auth import AuthenticationToken
from pigeon.spark._clients import client_for, close_clients
from pigeon.spark._options import (
    ClientSecurity,
    OptionError,
    parse_sink_options,
    parse_source_options,
)

TLS_URL = "pigeon+ssl://127.0.0.1:6651"


def test_read_options_carry_the_token_and_trust_file() -> None:
    opts = parse_source_options(
        {
            "service_url": TLS_URL,
            "topic": "events",
            "auth_token": "s3cret-token",
            "tls_trust_certs_file_path": "/etc/ca.pem",
        }
    )
    assert opts.service_url == TLS_URL
    assert opts.security.auth_token == "s3cret-token"
    assert opts.security.tls_trust_certs_file_path == "/etc/ca.pem"
    assert "s3cret-token" not in repr(opts)
    keywords = opts.security.client_keywords()
    assert isinstance(keywords["authentication"], AuthenticationToken)
    assert keywords["authentication"].auth_data() == b"s3cret-token"
    assert keywords["tls_trust_certs_file_path"] == "/etc/ca.pem"


def test_camel_case_names_as_spark_lower_cases_them(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    opts = parse_sink_options(
        {
            "service_url": TLS_URL,
            "topic": "events",
            "authtokenfile": str(token_file),  # Spark hands names lower-cased
            "tlsAllowInsecureConnection": "true",
        }
    )
    assert opts.security == ClientSecurity(
        auth_token_file=str(token_file), tls_allow_insecure_connection=True
    )
    auth = opts.security.client_keywords()["authentication"]
    assert auth.auth_data() == b"from-file"


def test_token_and_token_file_conflict_without_showing_the_token() -> None:
    with pytest.raises(OptionError, match="not both") as info:
        parse_source_options(
            {"service_url": TLS_URL, "topic": "t", "auth_token": "s3cret", "auth_token_file": "f"}
        )
    assert "s3cret" not in str(info.value)


def test_each_security_setting_gets_its_own_client() -> None:
    url = "pigeon://127.0.0.1:1"
    try:
        plain = client_for(url)
        alice = client_for(url, ClientSecurity(auth_token="alice"))
        assert alice is not plain
        assert client_for(url, ClientSecurity(auth_token="alice")) is alice
        assert alice.engine.authentication is not None
        assert alice.engine.authentication.auth_data() == b"alice"
    finally:
        close_clients()
