"""A credential given in the wrong shape is refused without being echoed."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from pigeon.core.config import SecurityConfig, load_config
from pigeon.core.errors import ConfigError
from pigeon.core.tokens import create_secret_key, create_token, load_key


def test_a_key_pasted_in_place_of_a_path_is_not_echoed() -> None:
    pasted = base64.b64encode(create_secret_key()).decode()
    with pytest.raises(ConfigError) as caught:
        load_key(pasted)
    assert pasted not in str(caught.value)
    assert "file:///path or data:;base64" in str(caught.value)


def test_a_missing_key_file_url_is_still_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"missing\.key"):
        load_key(f"file://{tmp_path / 'missing.key'}")


@pytest.mark.parametrize(
    "key",
    ["token_secret_key", "broker_client_authentication_parameters"],
)
def test_a_badly_typed_secret_setting_is_not_echoed(tmp_path: Path, key: str) -> None:
    secret = create_token("broker", create_secret_key())
    path = tmp_path / "pigeon.toml"
    path.write_text(f'[broker]\n{key} = {{ token = "{secret}" }}\n')
    with pytest.raises(ConfigError) as caught:
        load_config(SecurityConfig, path=path, section="broker", env={})
    message = str(caught.value)
    assert secret not in message
    assert f"bad value for {key!r}" in message and "expected a string" in message
